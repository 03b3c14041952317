"""Every task's gradient of the shared parameters from one forward and one backward over a mixed-task batch.

Where examples do not interact (BERT), a shared weight's per-task gradient is a sum over that task's rows
(``dW_t = dY_t^T X_t``): the shared Linear / LayerNorm / Embedding modules run through
:mod:`fastpals.surgery.layer_grads`, whose backward writes them into the buffer's rows. Not covered:
``torch.compile``, ZeRO-3, other modules holding shared parameters.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fastpals.data.layout import BatchLayout
from fastpals.surgery.buffer import TaskGradientBuffer
from fastpals.surgery.layer_grads import (
    EmbeddingFrame,
    RowTasks,
    embedding_forward,
    layer_norm_forward,
    linear_forward,
)
from fastpals_kernels.padding import lengths_to_cu_seqlens


def cu_seqlens_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` right-padded attention mask (1 = token) -> ``cu_seqlens [B+1]`` int32 (packed token offsets)."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, L], got shape {list(attention_mask.shape)}")
    return lengths_to_cu_seqlens(attention_mask.to(torch.bool).sum(1))


def task_mean_loss(losses: torch.Tensor, task_ids: torch.Tensor, num_tasks: int) -> torch.Tensor:
    """``sum_t mean_{b in task t} losses[b]``: one backward gives every task's gradient. ``losses [B]`` float,
    ``task_ids [B]`` int64 -> a scalar in the losses' dtype; a task without examples adds nothing."""
    if losses.dim() != 1 or task_ids.shape != losses.shape:
        raise ValueError(
            f"losses [B] and task_ids [B] expected, got {list(losses.shape)} and {list(task_ids.shape)}"
        )
    counts = torch.bincount(task_ids, minlength=num_tasks).to(losses.dtype)
    sums = torch.zeros(num_tasks, dtype=losses.dtype, device=losses.device).index_add(0, task_ids, losses)
    return (sums / counts.clamp_min(1)).sum()


class PerTaskGradients:
    """The state of one :func:`per_task_gradients` block: row maps and writes into the buffer's rows."""

    def __init__(
        self,
        model: nn.Module,
        buffer: TaskGradientBuffer,
        layout: BatchLayout | torch.Tensor,
        cu_seqlens: torch.Tensor | Sequence[torch.Tensor] | None = None,
        use_kernels: bool | None = None,
        pass_task_ids: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        block_class = PerTaskGradients if isinstance(buffer, TaskGradientBuffer) else None
        if getattr(buffer, "block_class", block_class) is not type(self):
            raise TypeError(
                f"buffer must be a TaskGradientBuffer or a StreamingTaskGradients, got {type(buffer).__name__}"
            )
        self.model, self.buffer, self.num_tasks, self.device = model, buffer, buffer.num_tasks, buffer.device
        self._adopts_layout = self._takes_layout = False
        if isinstance(layout, BatchLayout):
            if cu_seqlens is not None or pass_task_ids is not None:
                raise ValueError(
                    "per_task_gradients: cu_seqlens / pass_task_ids go with task_ids, not a layout"
                )
            if max(layout.num_tasks, 1) > self.num_tasks:
                raise ValueError(
                    f"the batch's layout has {layout.num_tasks} tasks but the buffer {self.num_tasks} rows"
                )
            self._layouts = [layout] + ([layout.second] if layout.second is not None else [])
        else:
            warnings.warn(
                "per_task_gradients(model, buffer, task_ids): pass the batch's BatchLayout instead "
                "(model_inputs(batch, device)['layout']); task ids will not be accepted in the next release",
                DeprecationWarning,
                stacklevel=4,
            )
            self._given = (layout, cu_seqlens, pass_task_ids)
            self._layouts = None  # on first use: the layout the model's forward gets, else read on the host
            # the layout a model that packs batches itself builds replaces the task ids' one
            self._adopts_layout = callable(getattr(model, "batch_layout", None))
            # a model whose forward takes the layout: its tensors name it (no host read)
            self._takes_layout = "layout" in inspect.signature(model.forward).parameters
        self._pass_key: int | None = None
        if not self._takes_layout:
            self._use_pass(0)
        self.use_kernels = use_kernels
        self._cache: dict[tuple, RowTasks] = {}
        self.passes = 0  # calls of the embeddings block(s): the encoder pass
        self._frames: dict[int, EmbeddingFrame] = {}
        self._index = {id(p): k for k, p in enumerate(buffer.params)}
        # per task, its row holds no earlier capture (the first write overwrites); per (task, parameter): written
        self.fresh = [not c for c in buffer.captured_tasks()]
        self.written = [[False] * len(buffer.params) for _ in range(self.num_tasks)]
        self.forward_calls = 0
        self.backward_calls = 0
        self._ran: dict[int, bool] = {}  # id(module) -> ran on a batch-independent input (exact path)
        self._exact_done = False
        self.exact_pass = False
        self._handles: list[Any] = []
        # passed to every rule: their backward runs even where no input requires grad (detached tables)
        self.anchor = torch.zeros((), device=self.device, requires_grad=True)
        self._patched: list[nn.Module] = []

    def _host_layouts(
        self,
        task_ids: object,
        cu_seqlens: torch.Tensor | Sequence[torch.Tensor] | None,
        pass_task_ids: Sequence[torch.Tensor] | None,
    ) -> list[BatchLayout]:
        """The deprecated call: per encoder pass, the layout of ``task_ids`` (and ``cu_seqlens``), read
        once."""
        if not isinstance(task_ids, torch.Tensor) or task_ids.dim() != 1 or task_ids.dtype.is_floating_point:
            raise ValueError("task_ids must be an integer tensor [B] (one task per example)")
        hosts = [np.asarray(task_ids.tolist(), dtype=np.int64)]  # the one host read of the block
        hosts += [np.asarray(torch.as_tensor(t).tolist(), dtype=np.int64) for t in (pass_task_ids or [])[1:]]
        for k, h in enumerate(hosts):
            if h.ndim != 1 or (h.size and (int(h.min()) < 0 or int(h.max()) >= self.num_tasks)):
                raise ValueError(
                    f"task_ids must lie in [0, {self.num_tasks}) (the buffer's num_tasks), got "
                    f"[{int(h.min())}, {int(h.max())}]"
                    if k == 0
                    else f"pass_task_ids[{k}] must be a 1-D tensor of task ids in [0, {self.num_tasks})"
                )
        cu_list = [cu_seqlens] if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens or [])
        for k, cu in enumerate(cu_list):
            n = hosts[min(k, len(hosts) - 1)].size
            if not isinstance(cu, torch.Tensor) or cu.shape != (n + 1,):
                raise ValueError(f"cu_seqlens[{k}] must be a tensor [B+1] = [{n + 1}] (that pass's examples)")
        layouts = []
        for k in range(max(len(hosts), len(cu_list), 1)):
            ids = hosts[min(k, len(hosts) - 1)]
            if cu_list:
                cu = np.asarray(cu_list[min(k, len(cu_list) - 1)].tolist(), dtype=np.int64)
                lay = BatchLayout.from_lengths(cu[1:] - cu[:-1], ids, self.num_tasks, self.device)
            else:
                lay = BatchLayout(
                    batch=int(ids.size), length=1, packed=False, lengths=np.ones(ids.size, dtype=np.int64),
                    host_task_ids=ids, num_tasks=self.num_tasks, device=self.device,
                    task_ids=torch.as_tensor(ids, device=self.device),
                )  # fmt: skip
            layouts.append(lay)
        return layouts

    @property
    def present(self) -> list[int]:
        """The tasks with rows in the batch."""
        return list(self._all_layouts()[0].present)

    def _all_layouts(self) -> list[BatchLayout]:
        self._layouts = self._layouts or self._host_layouts(*self._given)
        return self._layouts

    def _take_layout(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """The deprecated call: the layout the model's forward gets when the task ids are its own tensors."""
        task_ids, cu_seqlens, pass_task_ids = self._given
        lay = kwargs.get("layout")
        if (
            self._layouts is None
            and isinstance(lay, BatchLayout)
            and lay.task_ids is task_ids
            and (cu_seqlens is None or cu_seqlens is lay.cu_seqlens)
            and pass_task_ids is None
        ):
            self._layouts = [lay] + ([lay.second] if lay.second is not None else [])
        if self._pass_key is None:
            self._use_pass(0)

    def _use_pass(self, k: int) -> None:
        """Make pass ``k``'s layout the one rows map to (the last one for later passes)."""
        layouts = self._all_layouts()
        self._pass_key = min(k, len(layouts) - 1)
        self.layout = layouts[self._pass_key]
        self.batch = self.layout.batch
        self.task_ids = self.layout.task_ids

    def rows(self, lead: tuple[int, ...]) -> RowTasks | None:
        """The row -> task map of an input of leading shape ``lead``; None for a broadcast input."""
        lay = self.layout
        b = lay.batch
        if lay.packed and len(lead) == 1 and lead[0] == lay.total and lead[0] != b:
            key = ("packed", self._pass_key, None)
        elif len(lead) >= 1 and lead[0] == b and b > 0:
            key = ("padded", self._pass_key, math.prod(lead) // b)
        else:
            return None
        if key not in self._cache:
            self._cache[key] = (
                self._build_packed(lay) if key[0] == "packed" else self._build_padded(lay, key[2])
            )
        return self._cache[key]

    def _build_padded(self, lay: BatchLayout, per: int) -> RowTasks:
        row_task = lay.task_ids.repeat_interleave(per) if per > 1 else lay.task_ids
        slices: dict[int, slice | torch.Tensor] = {}
        for t in lay.present:
            if lay.example_ranges is not None:
                a, b = lay.example_ranges[t]
                slices[t] = slice(a * per, b * per)
            else:
                ex = np.flatnonzero(lay.host_task_ids == t)
                slices[t] = torch.as_tensor(
                    (ex[:, None] * per + np.arange(per)[None, :]).reshape(-1), device=self.device
                )
        host = None if lay.host_task_ids is None else (lay.host_task_ids, np.full(lay.batch, per))
        return RowTasks(
            lay.present, slices, row_task, lay.batch * per, seq_len=per, example_tasks=lay.task_ids,
            host_examples=host,
        )  # fmt: skip

    def _build_packed(self, lay: BatchLayout) -> RowTasks:
        slices: dict[int, slice | torch.Tensor] = {}
        for t in lay.present:
            if lay.token_ranges is not None:
                slices[t] = slice(*lay.token_ranges[t])
            else:
                ex = np.flatnonzero(lay.host_task_ids == t)
                idx = np.concatenate([np.arange(lay.cu_host[e], lay.cu_host[e + 1]) for e in ex])
                slices[t] = torch.as_tensor(idx, device=self.device)
        return RowTasks(
            lay.present,
            slices,
            lay.row_task_ids,
            lay.total,
            cu_seqlens=lay.cu_seqlens,
            example_tasks=lay.task_ids,
            host_examples=None if lay.host_task_ids is None else (lay.host_task_ids, lay.lengths),
        )

    def packed_ids(self, n: int) -> bool:
        """Is a 1-D index tensor of length n this pass's packed tokens?"""
        return self.layout.packed and self.layout.total == n

    def example_rows(self) -> RowTasks:
        return self.rows((self.batch,))  # type: ignore[return-value]

    def param_index(self, p: torch.Tensor) -> int:
        return self._index[id(p)]

    def write(self, task: int, k: int, value: torch.Tensor) -> None:
        """Add ``value`` (shaped like shared parameter k) to row ``task`` (overwrite on the first write)."""
        dst = self.buffer.param_row(task, k)
        _put(dst, value.reshape(dst.shape), self._first(task, k))

    def _first(self, task: int, k: int) -> bool:
        flags = self.written[task]
        first = self.fresh[task] and not flags[k]
        flags[k] = True
        return first

    def _all_tasks(self, tasks: Sequence[int]) -> bool:
        return list(tasks) == list(range(self.num_tasks))

    def stack_target(self, k: int, tasks: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """The ``[T, *shape]`` rows of parameter k if every task is written here first in ``dtype``."""
        if not self._all_tasks(tasks) or self.buffer.dtype != dtype:
            return None
        if not all(self.fresh[t] and not self.written[t][k] for t in tasks):
            return None
        for t in tasks:
            self.written[t][k] = True
        return self.buffer.param_rows(k)

    def write_stack(self, k: int, tasks: Sequence[int], values: torch.Tensor) -> None:
        """Row ``tasks[i]`` of shared parameter k (+)= ``values[i]`` (one op where possible)."""
        if self._all_tasks(tasks):
            firsts = [self.fresh[t] and not self.written[t][k] for t in tasks]
            if all(firsts) or not any(firsts):
                rows = self.buffer.param_rows(k)
                _put(rows, values.reshape(rows.shape), all(firsts))
                for t in tasks:
                    self.written[t][k] = True
                return
        for i, t in enumerate(tasks):
            self.write(t, k, values[i])

    def write_stack_chunks(
        self, k: int, tasks: Sequence[int], chunks: Iterable[tuple[int, int, torch.Tensor]]
    ) -> None:
        """:meth:`write_stack` from output-row chunks ``(m0, i, values [mc, K])`` (bounded temporaries)."""
        firsts = [self._first(t, k) for t in tasks]
        rows = [self.buffer.param_row(t, k) for t in tasks]
        for m0, i, values in chunks:
            _put(rows[i][m0 : m0 + values.shape[0]], values, firsts[i])

    def write_mm(self, task: int, k: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Row ``task`` of shared weight k (+)= ``a [M, R] @ b [R, K]`` (straight into the buffer if dtypes
        allow)."""
        dst = self.buffer.param_row(task, k)
        mm_into(dst, a, b, self._first(task, k))

    def write_segment_sums(self, k: int, values: torch.Tensor, rows: RowTasks) -> None:
        """Per task, the fp32 sum of its rows of ``values [R, n]`` into its row of shared parameter k."""
        index = rows.row_task[:, None].expand(-1, values.shape[1])
        target = self.stack_target(k, rows.tasks, torch.float32)
        if target is not None:
            target = target.view(self.num_tasks, -1)
            target.scatter_reduce_(0, index, values.float(), "sum", include_self=False)
            return
        sums = torch.zeros(self.num_tasks, values.shape[1], dtype=torch.float32, device=values.device)
        sums.index_add_(0, rows.row_task, values.float())
        self.write_stack(k, rows.tasks, sums if self._all_tasks(rows.tasks) else sums[rows.tasks])

    def write_embedding(
        self, k: int, ids: torch.Tensor, grad: torch.Tensor, rows: RowTasks, padding_idx: int | None
    ) -> None:
        """Every task's rows of ``grad [R, d]`` added at ``ids [R]`` into its row of embedding k."""
        dst = self._embedding_rows(k, rows.tasks)
        if compacts_embedding_rows(grad.device):
            vocab = self.buffer.params[k].shape[0]
            run_keys, values = _sum_by_key(torch.add(ids, rows.row_task, alpha=vocab), grad)
            index = (torch.div(run_keys, vocab, rounding_mode="floor"), torch.remainder(run_keys, vocab))
        else:
            index, values = (rows.row_task, ids), grad
        dst.index_put_(index, values.to(dst.dtype), accumulate=True)
        if padding_idx is not None:
            dst[:, padding_idx].zero_()

    def write_broadcast_embedding(
        self, k: int, ids: torch.Tensor, sums: torch.Tensor, tasks: Sequence[int], padding_idx: int | None
    ) -> None:
        """Position embeddings looked up once: ``sums [T, L, d]`` added at ``ids [L]``."""
        dst = self._embedding_rows(k, tasks)
        dst.index_add_(1, ids, sums.to(dst.dtype))
        if padding_idx is not None:
            dst[:, padding_idx].zero_()

    def _embedding_rows(self, k: int, tasks: Sequence[int]) -> torch.Tensor:
        """Embedding k's ``[T, V, d]`` rows, those of ``tasks`` written here first zeroed and marked
        written."""
        rows = self.buffer.param_rows(k)
        firsts = [t for t in tasks if self._first(t, k)]
        if len(firsts) == self.num_tasks:
            rows.zero_()
        elif firsts:
            torch._foreach_zero_([rows[t] for t in firsts])
        return rows

    def mark_backward(self) -> None:
        self.backward_calls += 1

    def note_ran(self, m: nn.Module, exact: bool) -> None:
        """A patched module's forward ran (``exact``: on an input not split by example)."""
        self._ran[id(m)] = self._ran.get(id(m), False) or exact

    def ran_exact(self, m: nn.Module) -> bool:
        """Did ``m``'s forward in this block run on an input not split by example?"""
        return self._ran.get(id(m), False)

    def exact_parameters(self, unused: bool = True) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` one backward cannot split by task (modules run off the per-task path)."""
        out = []
        for name, m in self._modules:
            ran = self._ran.get(id(m))
            if ran or (unused and ran is None and self.forward_calls):
                out += [(f"{name}.{n}" if name else n, p) for n, p in m.named_parameters(recurse=False)]
        return out

    def exact_task_gradients(self, task_losses: Sequence[tuple[int, torch.Tensor]]) -> list[str]:
        """Per ``(t, L_t)``, ``autograd.grad(L_t, exact_parameters())`` into row t; returns their names."""
        named = self.exact_parameters()
        self._exact_done = True
        if not named:
            return []
        params = [p for _, p in named]
        self.exact_pass = True  # the per-layer rules on the way carry input gradients only (no row writes)
        try:
            for t, loss in task_losses:
                grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
                for p, g in zip(params, grads):
                    self.write(t, self.param_index(p), torch.zeros_like(p) if g is None else g)
        finally:
            self.exact_pass = False
        self._exact = params
        return [n for n, _ in named]

    def linear_done(self, rows: RowTasks, k_w: int, dy: torch.Tensor, x: torch.Tensor) -> None:
        """A shared Linear's backward has written its task rows (the streaming block keeps ``dy`` and
        ``x``)."""

    def defers_linear_weight(self, k_w: int, rows: RowTasks) -> bool:
        """Skip the per-task rows of shared Linear weight ``k_w`` (the streaming block may)?"""
        return False

    def shared_modules(self) -> list[tuple[str, nn.Module]]:
        """The ``nn.Linear`` / ``nn.LayerNorm`` / ``nn.Embedding`` modules that hold the shared parameters."""
        shared = set(self._index)
        found: list[tuple[str, nn.Module]] = []
        covered: set[int] = set()
        owners: dict[int, str] = {}
        for name, m in self.model.named_modules():
            direct = [(n, p) for n, p in m.named_parameters(recurse=False)]
            ids = [id(p) for _, p in direct if id(p) in shared]
            for n, p in direct:
                owners.setdefault(id(p), f"{name}.{n}" if name else n)
            if not ids:
                continue
            kind = type(m)
            if kind not in (nn.Linear, nn.LayerNorm, nn.Embedding):
                bad = [f"{name}.{n}" for n, p in direct if id(p) in shared]
                raise TypeError(
                    f"per_task_gradients: shared parameter(s) {bad} belong to a {kind.__name__}; only "
                    "nn.Linear, nn.LayerNorm and nn.Embedding modules can be split by task (make these "
                    "parameters task-specific, or leave them out of the buffer)"
                )
            if len(ids) != len(direct):
                part = [f"{name}.{n}" for n, p in direct if id(p) not in shared]
                raise ValueError(
                    f"per_task_gradients: module {name!r} mixes shared and non-shared parameters ({part} "
                    "are not in the buffer)"
                )
            if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.scale_grad_by_freq or m.sparse):
                raise ValueError(
                    f"per_task_gradients: embedding {name!r} uses max_norm/scale_grad_by_freq/sparse"
                )
            covered.update(ids)
            found.append((name, m))
        missing = [
            owners.get(id(p), f"#{k}") for k, p in enumerate(self.buffer.params) if id(p) not in covered
        ]
        if missing:
            raise ValueError(
                f"per_task_gradients: shared parameters {missing[:5]} are not parameters of a module of model"
            )
        return found

    def __enter__(self) -> PerTaskGradients:
        modules = self._modules = self.shared_modules()
        self._exact: list[torch.Tensor] = []
        parents: dict[int, nn.Module] = {}
        name_to_module = dict(self.model.named_modules())
        shared_embeddings = {id(m) for _, m in modules if isinstance(m, nn.Embedding)}
        # every embeddings block counts encoder passes, frozen ones too
        for name, m in name_to_module.items():
            if isinstance(m, nn.Embedding):
                parent = name_to_module[name.rsplit(".", 1)[0]] if "." in name else self.model
                parents[id(parent)] = parent
                if id(m) in shared_embeddings:
                    object.__setattr__(m, "_fastpals_parent", id(parent))
        for parent in parents.values():
            self._handles.append(parent.register_forward_pre_hook(self._enter_embeddings))
        if self._takes_layout:
            self._handles.append(self.model.register_forward_pre_hook(self._take_layout, with_kwargs=True))
        if self._adopts_layout:
            self.model.__dict__["batch_layout"] = self._adopting(self.model.batch_layout)
        try:
            for _, m in modules:
                if "forward" in m.__dict__:
                    raise RuntimeError(f"module {m!r} already has an instance-level forward (nested block?)")
                m.forward = functools.partial(_RULES[type(m)], self, m)
                self._patched.append(m)
        except BaseException:
            self._restore()
            raise
        return self

    def _adopting(self, batch_layout: Any) -> Any:
        def adopt(*args: Any, **kwargs: Any) -> BatchLayout:
            layout = batch_layout(*args, **kwargs)
            if not np.array_equal(layout.host_task_ids, self._all_layouts()[0].host_task_ids):
                raise ValueError("per_task_gradients: the model's batch holds other task ids than task_ids")
            self._layouts = [layout] + ([layout.second] if layout.second is not None else [])
            self._cache.clear()
            self._use_pass(0)
            return layout

        return adopt

    def _enter_embeddings(self, module: nn.Module, args: tuple) -> None:
        self.passes += 1
        self._use_pass(self.passes - 1)
        self._frames[id(module)] = EmbeddingFrame()

    def frame_of(self, m: nn.Module) -> EmbeddingFrame:
        return self._frames.setdefault(m.__dict__.get("_fastpals_parent"), EmbeddingFrame())

    def _restore(self) -> None:
        self.model.__dict__.pop("batch_layout", None)
        for m in self._patched:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_fastpals_parent", None)
        self._patched.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._restore()
        if exc_type is not None:
            return
        for p in self._exact:  # their rows came from the exact path; the backward's summed gradient goes
            p.grad = None
        if not self._exact_done and self.exact_parameters(unused=False):
            names = [n for n, _ in self.exact_parameters(unused=False)]
            raise RuntimeError(
                f"per_task_gradients: shared parameters {names[:6]} cannot be split by task from one backward "
                "(their module ran on an input not split by example, or the weight was read outside the module's "
                "forward): call block.exact_task_gradients([(task, task_loss), ...]) between the forward and "
                "the backward"
            )
        if self.forward_calls and not self.backward_calls and self.present:
            raise RuntimeError(
                "per_task_gradients: the forward ran inside the block but no backward did; run loss.backward() "
                "(or engine.backward(loss)) inside the with-block"
            )
        self.buffer.capture_written(self.present, self.written)


_RULES = {nn.Linear: linear_forward, nn.LayerNorm: layer_norm_forward, nn.Embedding: embedding_forward}


def _put(dst: torch.Tensor, value: torch.Tensor, first: bool) -> None:
    """``dst = value`` on a row's first write, else ``dst += value`` (in ``dst``'s dtype)."""
    if first:
        dst.copy_(value)
    else:
        dst.add_(value.to(dst.dtype))


def mm_into(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``dst (+)= a @ b`` (overwrite on ``first``), straight into ``dst`` when the dtypes allow it."""
    if dst.dtype != a.dtype or a.dtype != b.dtype:
        _put(dst, torch.mm(a, b.to(a.dtype)), first)
    elif first:
        torch.mm(a, b, out=dst)
    else:
        dst.addmm_(a, b)


def compacts_embedding_rows(device: torch.device) -> bool:
    """Sum per-task embedding rows by ``(task, id)`` before ``index_put_`` (the CPU adds row by row)?"""
    return device.type == "cpu"


def _sum_by_key(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(run_keys [R], sums [R, d] fp32)``: ``values [R, d]`` summed by ``keys [R]`` (no host read)."""
    sorted_keys, order = torch.sort(keys, stable=True)
    new_run = torch.ones_like(sorted_keys, dtype=torch.bool)
    new_run[1:] = sorted_keys[1:] != sorted_keys[:-1]
    run = torch.cumsum(new_run, 0) - 1
    sums = torch.zeros(keys.shape[0], values.shape[1], dtype=torch.float32, device=values.device)
    sums.index_add_(0, run, values.index_select(0, order).float())
    return torch.zeros_like(sorted_keys).scatter_(0, run, sorted_keys), sums


@contextlib.contextmanager
def per_task_gradients(
    model: nn.Module,
    buffer: TaskGradientBuffer | Any,
    layout: BatchLayout | torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[torch.Tensor] | None = None,
    use_kernels: bool | None = None,
    pass_task_ids: Sequence[torch.Tensor] | None = None,
) -> Iterator[PerTaskGradients]:
    """Run the forward and the backward of one mixed-task batch (loss: :func:`task_mean_loss`) inside this
    block: the per-task gradients of the buffer's shared parameters go into its rows, not into ``.grad``.

    ``buffer``: a :class:`TaskGradientBuffer` or a :class:`~fastpals.surgery.StreamingTaskGradients` (one
    block per ``apply``); ``layout``: the batch's :class:`~fastpals.data.layout.BatchLayout` (deprecated:
    ``task_ids [B]``, with ``cu_seqlens`` and ``pass_task_ids`` per encoder pass); ``use_kernels``: the
    grouped Triton weight-gradient kernel (default: on CUDA).
    """
    block = getattr(buffer, "block_class", PerTaskGradients)  # StreamingTaskGradients: its streaming block
    with block(model, buffer, layout, cu_seqlens, use_kernels, pass_task_ids) as state:
        yield state
