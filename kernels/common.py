"""Host-side helpers shared by the op modules: the lazy :class:`TritonKernel`, argument checks, the task plan
(:class:`TaskRowPlan`: rows grouped by task through an index array, row tiles that never straddle tasks, as in
Punica's SGMV), launch flags, and the custom ops' seed, recompute and vmap helpers. No Triton import at load.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def interpret_mode() -> bool:
    """True when ``TRITON_INTERPRET=1`` (Triton's CPU interpreter) is set."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs linear layers in on ``tensor``'s device (the fused ops cast their floating
    operands to it differentiably, as ``F.linear`` does), or None outside autocast."""
    device_type = tensor.device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def check_task_ids(
    task_ids: object, num_tasks: int, batch: int, device: torch.device, check_values: bool = True
) -> torch.Tensor:
    """Validate ``task_ids [batch]`` (one integer task per example) and return it as int64. The range check (a
    host read: no kernel may index a weight out of bounds) is skipped with ``check_values=False``, for callers
    that check the host values they hold."""
    if not isinstance(task_ids, torch.Tensor):
        raise TypeError(f"task_ids must be a torch.Tensor of integer task ids, got {type(task_ids).__name__}")
    if task_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"task_ids must have an integer dtype, got {task_ids.dtype}")
    if task_ids.dim() != 1 or task_ids.shape[0] != batch:
        raise ValueError(
            f"task_ids must have shape [{batch}] (one task per example), got {list(task_ids.shape)}"
        )
    if task_ids.device != device:
        raise ValueError(f"task_ids is on {task_ids.device} but the inputs are on {device}")
    if batch > 0 and check_values:
        lo, hi = int(task_ids.min()), int(task_ids.max())
        if lo < 0 or hi >= num_tasks:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"task_ids contains {bad}, outside [0, {num_tasks}) for a model with {num_tasks} tasks"
            )
    return task_ids.long()


def check_like(ref_name: str, ref: torch.Tensor, dtype: bool = True, **operands: torch.Tensor | None) -> None:
    """One-line errors for the ``operands`` (None skipped) whose device, or dtype when ``dtype``, is not
    ``ref``'s."""
    for name, t in operands.items():
        if t is not None and dtype and t.dtype != ref.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}: all operands must share one "
                "dtype"
            )
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


class TritonKernel:
    """A ``@triton.jit`` function made on its first launch, so that importing an op module loads no Triton. That
    launch binds ``triton`` and ``tl`` in the kernel's module and replaces every :class:`TritonKernel` there by its
    ``triton.jit`` function (kernels call each other by name); ``TRITON_INTERPRET`` is read then."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.kernel: Any = None

    def __getitem__(self, grid: Any) -> Any:
        return self.jit()[grid]

    def jit(self) -> Any:
        """The ``triton.jit`` function (Triton imported here)."""
        if self.kernel is None:
            load_triton(self.fn.__globals__)
        return self.kernel


def load_triton(namespace: dict) -> None:
    """Bind ``triton`` and ``tl`` in ``namespace`` (a module's globals) and replace its :class:`TritonKernel`
    values by their ``triton.jit`` functions."""
    import triton  # Triton: optional
    import triton.language as tl

    namespace.setdefault("triton", triton)
    namespace.setdefault("tl", tl)
    for name, value in list(namespace.items()):
        if isinstance(value, TritonKernel):
            if value.kernel is None:
                if value.fn.__globals__ is not namespace:
                    load_triton(value.fn.__globals__)
                else:
                    value.kernel = triton.jit(value.fn)
            namespace[name] = value.kernel


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def aot_mode() -> bool:
    """True inside the ahead-of-time compile harness (CPU tensors stand for GPU ones, launches only compile)."""
    return os.environ.get("FASTPALS_AOT", "0") == "1"


def target_arch(tensor: torch.Tensor) -> int | None:
    """The compute capability (``major * 10 + minor``) the kernels on ``tensor`` compile for: its CUDA device's,
    or the AOT harness's target; None under Triton's CPU interpreter."""
    if tensor.is_cuda:
        major, minor = torch.cuda.get_device_capability(tensor.device)
        return major * 10 + minor
    if aot_mode():
        from triton.runtime.driver import driver  # Triton: optional

        return int(driver.active.get_current_target().arch)
    return None


class _RecentTensors:
    """The last few values computed from tensors, keyed on the tensors' identity and in-place version and on
    ``meta``: every layer of one forward passes the same tensors, so the work (a host read, small launches) runs
    once per forward. An in-place change or a new tensor misses."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.entries: list[tuple[tuple, tuple, Any, Any]] = []  # (weak refs, versions, meta, value)

    def get(self, tensors: tuple, meta: Any) -> Any:
        for refs, versions, entry_meta, value in self.entries:
            if entry_meta == meta and all(
                (r is None and t is None) or (r is not None and r() is t and t._version == v)
                for r, v, t in zip(refs, versions, tensors)
            ):
                return value
        return None

    def put(self, tensors: tuple, meta: Any, value: Any) -> None:
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        versions = tuple(None if t is None else t._version for t in tensors)
        self.entries = [e for e in self.entries if all(r is None or r() is not None for r in e[0])]
        self.entries.insert(0, (refs, versions, meta, value))
        del self.entries[self.size :]


_CHECKED_CU = _RecentTensors()
_PLAN_CACHE = _RecentTensors()


def check_cu_seqlens(
    cu_seqlens: object, num_rows: int, device: torch.device, max_seqlen: int | None = None
) -> int:
    """Validate packed-sequence boundaries and return B, the number of sequences: ``cu_seqlens [B+1]`` int32 or
    int64 on ``device``, 0 first, non-decreasing, ``num_rows`` last; ``max_seqlen`` (when given) at least the
    longest sequence. One host read per tensor (unchanged in place, it is not read again)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must have shape [B+1], got {list(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the inputs are on {device}")
    if max_seqlen is not None and (
        isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral)
    ):
        raise TypeError(f"max_seqlen must be an int, got {type(max_seqlen).__name__}")
    cached = _CHECKED_CU.get((cu_seqlens,), num_rows)
    if cached is None:
        values = cu_seqlens.tolist()
        if values[0] != 0 or values[-1] != num_rows:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at the number of packed rows {num_rows}, got {values}"
            )
        lengths = [b - a for a, b in zip(values[:-1], values[1:])]
        if any(n < 0 for n in lengths):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {values}")
        cached = (len(values) - 1, max(lengths, default=0))
        _CHECKED_CU.put((cu_seqlens,), num_rows, cached)
    batch, longest = cached
    if max_seqlen is not None and int(max_seqlen) < longest:
        raise ValueError(
            f"max_seqlen = {int(max_seqlen)} is shorter than the longest sequence ({longest} tokens)"
        )
    return batch


@dataclass(frozen=True)
class TaskRowPlan:
    """Rows of a mixed-task batch grouped by task: ``row_index [R] int32`` (task 0's rows in stable order,
    then task 1's, ...), task t owning ``row_index[task_row_offsets[t]:task_row_offsets[t+1]]``; and the row
    tiles ``tile_task / tile_start / tile_end [ceil(R / block_rows) + T] int32`` (a bound: no host sync), the
    unused tail with ``tile_task = -1``."""

    row_index: torch.Tensor
    task_row_offsets: torch.Tensor
    tile_task: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    num_rows: int
    num_tasks: int
    block_rows: int

    @property
    def num_tiles(self) -> int:
        return self.tile_task.shape[0]


def build_task_row_plan(
    task_ids: torch.Tensor,
    num_tasks: int,
    num_rows: int,
    seq_len: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    block_rows: int = 64,
) -> TaskRowPlan:
    """Group the rows of a batch by task, on ``task_ids``' device with no host read: ``task_ids [B]`` int64
    (validated), example b owning rows ``b*seq_len ..`` of the padded batch, or with ``cu_seqlens [B+1]`` the
    packed rows ``cu_seqlens[b] .. cu_seqlens[b+1] - 1``."""
    device = task_ids.device
    order = torch.argsort(task_ids, stable=True)
    if cu_seqlens is None:
        if seq_len is None:
            raise ValueError("build_task_row_plan needs seq_len (padded rows) or cu_seqlens (packed rows)")
        cu_seqlens = torch.arange(task_ids.shape[0] + 1, device=device, dtype=torch.long) * seq_len
    cu = cu_seqlens.long()
    lengths, starts = cu[1:] - cu[:-1], cu[:-1]
    lengths_sorted = lengths[order]
    seg_offsets = torch.cumsum(lengths_sorted, 0) - lengths_sorted  # each sorted example's start in row_index
    seg_of_row = torch.repeat_interleave(
        torch.arange(order.shape[0], device=device), lengths_sorted, output_size=num_rows
    )
    pos = torch.arange(num_rows, device=device, dtype=torch.long)
    row_index = (starts[order][seg_of_row] + pos - seg_offsets[seg_of_row]).to(torch.int32)

    rows_per_task = torch.zeros(num_tasks, dtype=torch.long, device=device)
    rows_per_task.index_add_(0, task_ids, lengths)
    task_row_offsets = torch.zeros(num_tasks + 1, dtype=torch.long, device=device)
    task_row_offsets[1:] = torch.cumsum(rows_per_task, 0)

    tiles_per_task = (rows_per_task + block_rows - 1) // block_rows
    tile_ends_cum = torch.cumsum(tiles_per_task, 0)  # [T]
    num_tiles = (num_rows + block_rows - 1) // block_rows + num_tasks
    tile = torch.arange(num_tiles, device=device, dtype=torch.long)
    task_of_tile = torch.searchsorted(tile_ends_cum, tile, right=True)  # T for the unused tail
    valid = task_of_tile < num_tasks
    safe_task = task_of_tile.clamp(max=num_tasks - 1)
    local = tile - (tile_ends_cum[safe_task] - tiles_per_task[safe_task])
    tile_start = task_row_offsets[safe_task] + local * block_rows
    tile_end = torch.minimum(tile_start + block_rows, task_row_offsets[safe_task + 1])
    tiles = [torch.where(valid, t, fill) for t, fill in ((task_of_tile, -1), (tile_start, 0), (tile_end, 0))]
    int32 = (t.to(torch.int32) for t in (task_row_offsets, *tiles))
    return TaskRowPlan(row_index.contiguous(), *int32, num_rows, num_tasks, block_rows)


def device_context(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on ``tensor``'s CUDA device (Triton launches on the current device); a no-op elsewhere."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def dot_flags(dtype: torch.dtype) -> dict[str, bool]:
    """Constexpr flags of the kernels' ``dot_acc``: IEEE fp32 products for fp32 (and for upcast bf16 tiles);
    INTERP_BF16 bf16 tiles to fp32 under the interpreter, whose bf16 ``tl.dot`` is wrong."""
    upcast = dtype == torch.bfloat16 and interpret_mode()
    return {"IEEE": dtype == torch.float32 or upcast, "INTERP_BF16": upcast}


def task_row_plan(
    task_ids: object,
    num_tasks: int,
    num_rows: int,
    device: torch.device,
    batch: int | None = None,
    seq_len: int | None = None,
    cu_seqlens: object = None,
    block_rows: int = 64,
) -> TaskRowPlan:
    """Validate ``task_ids`` (and ``cu_seqlens``) and return the batch's :class:`TaskRowPlan` (cached for the
    same unchanged tensors and sizes): padded rows with ``batch * seq_len == num_rows``, or packed rows with
    ``cu_seqlens [B+1]``."""
    tensors = (task_ids, cu_seqlens)
    meta = (num_tasks, num_rows, batch, seq_len, block_rows, str(device))
    if isinstance(task_ids, torch.Tensor):
        plan = _PLAN_CACHE.get(tensors, meta)
        if plan is not None:
            return plan
    if cu_seqlens is None:
        if batch is None or seq_len is None or batch * seq_len != num_rows:
            raise ValueError(
                "task_row_plan needs batch and seq_len with batch * seq_len == num_rows, or cu_seqlens"
            )
    else:
        batch = check_cu_seqlens(cu_seqlens, num_rows, device)
    ids = check_task_ids(task_ids, num_tasks, batch, device)
    plan = build_task_row_plan(
        ids, num_tasks, num_rows, seq_len=seq_len, cu_seqlens=cu_seqlens, block_rows=block_rows
    )
    _PLAN_CACHE.put(tensors, meta, plan)
    return plan


ROW_ALIGN = 16


def aligned_rows(num_rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised ``[num_rows, width]`` view with the row stride rounded up to a multiple of 16 elements:
    rows start 16-byte aligned and Triton specialises the stride, so loads of odd widths can be vectorised."""
    stride = -(-width // ROW_ALIGN) * ROW_ALIGN
    return torch.empty(num_rows, stride, dtype=dtype, device=device)[:, :width]


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has unit stride (the kernels take every other stride), else a copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def cast_floats(dtype: torch.dtype, *tensors: object) -> list:
    """Floating tensors cast to ``dtype`` (differentiably), the rest (task ids, masks, None) unchanged."""
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors]


def build_task_row_plan_host(
    task_ids: np.ndarray,
    num_tasks: int,
    lengths: np.ndarray,
    device: torch.device | str,
    block_rows: int = 64,
) -> TaskRowPlan:
    """:func:`build_task_row_plan` from host values ``task_ids [B]`` and ``lengths [B]`` int (example b owns the
    ``lengths[b]`` rows after those of examples ``0 .. b-1``): built with numpy, not torch ops (so no tensor
    op or host read is dispatched), and copied to ``device`` in one transfer (views of one int32 tensor)."""
    task_ids = np.asarray(task_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    num_rows = int(lengths.sum())
    order = np.argsort(task_ids, kind="stable")
    row_index = np.concatenate(
        [np.zeros(0, np.int64), *(np.arange(starts[e], starts[e] + lengths[e]) for e in order)]
    )
    rows_per_task = np.bincount(task_ids, weights=lengths, minlength=num_tasks).astype(np.int64)
    task_row_offsets = np.concatenate([[0], np.cumsum(rows_per_task)]).astype(np.int64)
    tiles_per_task = (rows_per_task + block_rows - 1) // block_rows
    tile_ends_cum = np.cumsum(tiles_per_task)
    tile = np.arange((num_rows + block_rows - 1) // block_rows + num_tasks)
    task_of_tile = np.searchsorted(tile_ends_cum, tile, side="right")
    valid = task_of_tile < num_tasks
    safe = np.minimum(task_of_tile, num_tasks - 1)
    tile_start = task_row_offsets[safe] + (tile - (tile_ends_cum[safe] - tiles_per_task[safe])) * block_rows
    tile_end = np.minimum(tile_start + block_rows, task_row_offsets[safe + 1])
    parts = [
        row_index,
        task_row_offsets,
        np.where(valid, task_of_tile, -1),
        np.where(valid, tile_start, 0),
        np.where(valid, tile_end, 0),
    ]
    flat = torch.from_numpy(np.concatenate(parts).astype(np.int32)).to(device)
    views = torch.split(flat, [p.size for p in parts])
    return TaskRowPlan(*views, num_rows=num_rows, num_tasks=num_tasks, block_rows=block_rows)


def plan_row_tasks(row_index: torch.Tensor, task_row_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The task of each of ``num_rows`` rows from a plan's ``row_index`` and ``task_row_offsets`` (int64
    ``[num_rows]``, -1 for rows the plan leaves out), with no host read."""
    positions = torch.arange(row_index.shape[0], device=row_index.device)
    row_task = torch.full((num_rows,), -1, dtype=torch.long, device=row_index.device)
    row_task[row_index.long()] = torch.searchsorted(task_row_offsets[1:].long(), positions, right=True)
    return row_task


#: most task rows a ``[T, P]`` task-gradient buffer may have: 64 tasks, and GEM's episodic memory (2 T rows) for
#: them; the Gram kernel pads T to a power of two and tiles it in 32 x 32 blocks
MAX_TASKS = 128
BUFFER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_task_buffer(buf: object) -> torch.Tensor:
    """Validate a per-task gradient buffer: ``[T, P]`` float32/float16/bfloat16, ``1 <= T <= MAX_TASKS``,
    ``P >= 1``, unit stride along P (rows may be strided)."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"buf must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dim() != 2:
        raise ValueError(f"buf must have shape [T, P], got {list(buf.shape)}")
    t, p = buf.shape
    if not 1 <= t <= MAX_TASKS:
        raise ValueError(f"buf has T = {t} rows; 1 <= T <= {MAX_TASKS} is supported")
    if p < 1:
        raise ValueError(f"buf has P = {p} columns; at least 1 is needed")
    if buf.dtype not in BUFFER_DTYPES:
        raise TypeError(f"buf must be float32, float16 or bfloat16, got {buf.dtype}")
    if buf.stride(1) != 1 or buf.stride(0) < p:
        raise ValueError(f"buf must be contiguous along P (strides {buf.stride()})")
    return buf


def per_sample_vmap(op: Any) -> Callable:
    """A ``torch.func.vmap`` rule for the custom op ``op``: the op on each sample in turn, the results stacked
    along dim 0 (exact for every backend, and every sample sees the unbatched call's dropout mask). Suits the
    few Jacobian rows of TorchJD's ``mtl_backward``."""

    def rule(info: Any, in_dims: tuple, *args: Any) -> tuple:
        outs = [op(*[a if d is None else a.select(d, i) for a, d in zip(args, in_dims)])
                for i in range(info.batch_size)]  # fmt: skip
        return _stack_outputs(outs)

    return rule


def _stack_outputs(items: list) -> tuple:
    """Per-sample outputs (a tensor, None, or a tuple/list of them) stacked along dim 0: ``(value, out_dims)``."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(items), 0
    if first is None:
        return None, None
    parts = [_stack_outputs([item[k] for item in items]) for k in range(len(first))]
    return type(first)(v for v, _ in parts), type(first)(d for _, d in parts)


def draw_seed() -> torch.Tensor:
    """A dropout seed for the custom ops: one int64 drawn from torch's default CPU generator (no device read)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64)


@contextlib.contextmanager
def seeded(seed: torch.Tensor, device: torch.device, dropout_p: float) -> Iterator[None]:
    """Run the block with torch's generators (CPU, and ``device``'s when CUDA) seeded from ``seed``, restored
    afterwards; a no-op without dropout."""
    if dropout_p <= 0.0:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(int(seed.reshape(-1)[0]))
        yield


def seed_for(dropout_p: float) -> torch.Tensor:
    """:func:`draw_seed` with dropout, else a zero seed (no draw from the generator)."""
    return draw_seed() if dropout_p > 0.0 else torch.zeros(1, dtype=torch.int64)


def recompute_ops(
    name: str,
    schema: str,
    run: Callable,
    grad_inputs: Sequence[int],
    fake: Callable,
    residual: int | None = None,
) -> tuple:
    """The custom op ``fastpals::<name>(<schema>) -> Tensor``, ``run(*inputs)`` without autograd, and its
    backward ``fastpals::<name>_backward(Tensor grad, <schema>) -> Tensor[]``: the gradients in the (not None)
    inputs at ``grad_inputs``, by recomputing ``run`` with autograd; with fakes (``fake(*inputs)``, the
    forward's), autograd and vmap rules. ``residual``: the index of an optional input that ``run`` adds to its
    output; its gradient is ``grad`` itself, so the recompute leaves it out. Returns the two ops."""

    def given(inputs: Sequence) -> list[int]:
        return [i for i in grad_inputs if inputs[i] is not None]

    def forward(*inputs: Any) -> torch.Tensor:
        with torch.no_grad():
            out = run(*inputs).contiguous()
        return out.clone() if any(out is x for x in inputs) else out

    def backward(grad: torch.Tensor, *inputs: Any) -> list[torch.Tensor]:
        """Recompute ``run`` with autograd (switched back on: an op's kernel runs below the autograd keys)."""
        args = list(inputs)
        if residual is not None:
            args[residual] = None
        leaves = [inputs[i].detach().requires_grad_(True) for i in given(inputs)]
        for i, leaf in zip(given(inputs), leaves):
            args[i] = leaf
        with contextlib.ExitStack() as stack:
            for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
                stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
            stack.enter_context(torch.enable_grad())
            grads = torch.autograd.grad(run(*args), leaves, grad, allow_unused=True)
        # outputs may not alias each other or grad (e.g. the unbound views of one stacked gradient)
        return [
            torch.zeros_like(x) if g is None else g.clone() if g._base is not None or g is grad else g
            for g, x in zip(grads, leaves)
        ]

    op = torch.library.custom_op(
        f"fastpals::{name}", forward, mutates_args=(), schema=f"({schema}) -> Tensor"
    )
    backward_op = torch.library.custom_op(
        f"fastpals::{name}_backward", backward, mutates_args=(), schema=f"(Tensor grad, {schema}) -> Tensor[]"
    )
    op.register_fake(fake)
    backward_op.register_fake(lambda grad, *inputs: [torch.empty_like(inputs[i]) for i in given(inputs)])

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        """Tensors (and None) through ``save_for_backward``, the scalars as attributes."""
        ctx.save_for_backward(*[x if x is None or isinstance(x, torch.Tensor) else None for x in inputs])
        ctx.scalars = [None if x is None or isinstance(x, torch.Tensor) else x for x in inputs]

    def grad_formula(ctx: Any, grad: torch.Tensor) -> tuple:
        inputs = [s if t is None else t for t, s in zip(ctx.saved_tensors, ctx.scalars)]
        grads = [None] * len(inputs)
        for i, g in zip(given(inputs), backward_op(grad, *inputs)):
            grads[i] = g
        if residual is not None and inputs[residual] is not None:
            grads[residual] = grad.to(inputs[residual].dtype)
        return tuple(grads)

    op.register_autograd(grad_formula, setup_context=setup_context)
    for o in (op, backward_op):
        o.register_vmap(per_sample_vmap(o))
    return op, backward_op
