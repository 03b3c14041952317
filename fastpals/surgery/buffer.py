"""The flat per-task gradient buffer: capture one task's gradient at a time, then Gram -> weights -> combine.

Usage from any training loop (one forward + backward per task, the graph freed each time)::

    buf = TaskGradientBuffer(shared_params, num_tasks=T, task_params=task_specific_params)
    optimizer.zero_grad(set_to_none=True)
    for t in range(T):
        loss_t = model_loss(batch[t], task=t)
        loss_t.backward()          # shared grads land in .grad, task-specific grads accumulate
        buf.capture(t)             # copies the shared grads into row t and clears them
    result = buf.apply(pcgrad_weights, generator=g)   # writes sum_t w_t g_t into the shared .grad
    if not result.skipped:
        optimizer.step()

Memory: the rows are :data:`NUM_CHUNKS` flat ``[T, P_c]`` tensors (``P`` = shared parameter elements split into
runs of consecutive parameters, their sizes doubling in the backward's write order, last parameters first;
``dtype`` float32, bfloat16 or float16; by default the parameters' dtype, i.e. the training precision), each made
at its first write in a step and given up by :meth:`apply`; each shared parameter's ``[T, numel]`` block is a
column view of its chunk. The rows grow with the backward while activations are freed, and no row outlives the
step: ``T * P * bytes(dtype)`` above plain training. Where the rows have the gradients' dtype, :meth:`apply`
writes the update in one pass over each chunk's last row, and the shared parameters' ``.grad`` are views of it (the rows
live as long as those ``.grad``); otherwise parameter by parameter into a ``[numel]`` tensor of ``grad_dtype``
handed to ``grad_setter`` as soon as it is made (under DeepSpeed the setter copies it into the fp32 gradient
partition that the optimizer reads): no ``[P]`` copy of the update besides the gradient the optimizer reads. The Gram is summed
in float32. Time: one copy of the shared gradients per task (or none, with
:func:`fastpals.surgery.per_task_gradients`), one launch of the Gram kernel and one of the combine kernel per
chunk whatever the number of parameter tensors, and one device-to-host sync (the finite check).

Task-specific parameters (a task's PAL slice, its head) are not in the buffer: their gradients accumulate
normally over the per-task backwards, so each receives its own task's gradient unchanged (for stacked per-task
weights ``[T, ...]`` each task's backward only fills its own slice). Pass them as ``task_params`` so that they
take part in the finite check and in the data-parallel average, and so that :attr:`task_param_tasks` records
which tasks touched each of them. A shared parameter that no task touched keeps ``grad = None``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastpals.functional import MAX_TASKS
from fastpals_kernels.dispatch import combine, gram

__all__ = ["NUM_CHUNKS", "SurgeryResult", "TaskGradientBuffer", "default_grad_getter", "default_grad_setter"]

#: Flat ``[T, P_c]`` tensors the rows are split into (fewer when there are fewer shared parameters): the Gram and
#: the combine take this many launches whatever the number of parameter tensors.
NUM_CHUNKS = 6

GradGetter = Callable[[torch.nn.Parameter], "torch.Tensor | None"]
GradSetter = Callable[[torch.nn.Parameter, "torch.Tensor | None"], None]
Aggregator = Callable[..., torch.Tensor]


def default_grad_getter(p: torch.nn.Parameter) -> torch.Tensor | None:
    """``p.grad``."""
    return p.grad


def default_grad_setter(p: torch.nn.Parameter, value: torch.Tensor | None) -> None:
    """``p.grad = value`` (``None`` clears it)."""
    p.grad = value


class SurgeryResult:
    """What :meth:`TaskGradientBuffer.apply` did.

    - ``skipped``: True when a gradient was non-finite; the optimizer must not step.
    - ``weights [T]`` (device; None when skipped): the update is ``sum_t weights[t] * g_t``.
    - ``gram [T, T]`` float32 (device): the Gram matrix of the (globally averaged) task gradients.
    - ``nonfinite_tasks``: rows whose gradient held inf/nan (or whose squared norm overflowed fp32).
    - ``nonfinite_task_params``: True when a task-specific gradient was non-finite.
    - ``ok``: 0-dim bool device tensor, True when nothing was non-finite (None for host-checked results).

    A result of ``apply(..., sync=False)`` holds its flags on the device: ``skipped`` and the other host fields
    read them on first access (one read), so a caller can instead stack ``ok`` with its own per-update values
    and read everything at once.
    """

    def __init__(
        self,
        skipped: bool | None,
        weights: torch.Tensor | None,
        gram: torch.Tensor,
        nonfinite_tasks: Sequence[int] = (),
        nonfinite_task_params: bool = False,
        *,
        flags: torch.Tensor | None = None,
        on_skip: Callable[[], None] | None = None,
    ) -> None:
        self._skipped = skipped
        self._weights = weights
        self.gram = gram
        self._nonfinite_tasks = list(nonfinite_tasks)
        self._nonfinite_task_params = nonfinite_task_params
        self._flags = flags  # [T + 1] bool on the device: per row finite, then the task-specific check
        self._on_skip = on_skip
        self.ok = None if flags is None else flags.all()

    @property
    def flags(self) -> torch.Tensor | None:
        """``[T + 1]`` bool on the device (deferred results): each row's finite flag, then the task-specific
        gradients' one; read them with other values and pass them to :meth:`resolve`."""
        return self._flags

    def resolve(self, host: Sequence[float | bool]) -> None:
        """Settle a deferred result with its ``flags`` read on the host by the caller (no read here)."""
        if self._skipped is None:
            host = [bool(f) for f in host]
            if len(host) != self._flags.shape[0]:
                raise ValueError(f"resolve needs the {self._flags.shape[0]} flags, got {len(host)}")
            self._skipped = not all(host)
            self._nonfinite_tasks = [t for t, f in enumerate(host[:-1]) if not f]
            self._nonfinite_task_params = not host[-1]
            if self._skipped:
                self._weights = None
                if self._on_skip is not None:
                    self._on_skip()

    def _resolve(self) -> None:
        if self._skipped is None:
            self.resolve(self._flags.tolist())  # the one host read of a deferred result

    @property
    def skipped(self) -> bool:
        self._resolve()
        return bool(self._skipped)

    @property
    def weights(self) -> torch.Tensor | None:
        if self._skipped is None:  # pending: the device weights (to be dropped if the flags say skip)
            return self._weights
        return None if self._skipped else self._weights

    @property
    def nonfinite_tasks(self) -> list[int]:
        self._resolve()
        return self._nonfinite_tasks

    @property
    def nonfinite_task_params(self) -> bool:
        self._resolve()
        return self._nonfinite_task_params

    def __repr__(self) -> str:
        state = "pending" if self._skipped is None else f"skipped={self._skipped}"
        return f"SurgeryResult({state}, nonfinite_tasks={self._nonfinite_tasks})"


def _unique_params(params: Iterable[torch.nn.Parameter], name: str) -> list[torch.nn.Parameter]:
    out: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} must hold tensors (parameters), got {type(p).__name__}")
        if id(p) in seen:
            continue
        seen.add(id(p))
        out.append(p)
    return out


def task_grads_finite(grads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """``[1]`` bool on the device: every present task-specific gradient is finite (one fused norm); None when
    none is present."""
    present = [g.detach() for g in grads if g is not None]
    if not present:
        return None
    return torch.isfinite(torch.stack(torch._foreach_norm(present))).all().reshape(1)


def hand_over_task_grads(
    setter: GradSetter, params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]
) -> None:
    """The captured task-specific gradients to ``setter`` (copies in the parameter's dtype: the capture's
    accumulators are reused); an absent one (None) is left alone."""
    for p, g in zip(params, grads):
        if g is not None:
            setter(p, g.to(p.dtype) if g.dtype != p.dtype else g.clone())


def flat_task_grads(
    params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None], device: torch.device
) -> torch.Tensor:
    """The task-specific gradients as one fp32 ``[sum numel]`` vector (zeros where absent), for one all-reduce."""
    return torch.cat([
        g.detach().reshape(-1).float() if g is not None else torch.zeros(p.numel(), device=device)
        for p, g in zip(params, grads)
    ])  # fmt: skip


def hand_over_flat_task_grads(
    setter: GradSetter, params: Sequence[torch.nn.Parameter], flat: torch.Tensor, used: Sequence[Any]
) -> None:
    """The all-reduced ``flat`` (:func:`flat_task_grads`) back to ``setter``, None where no rank ``used`` one."""
    for p, part, u in zip(params, torch.split(flat, [p.numel() for p in params]), used):
        setter(p, part.view_as(p).to(p.dtype) if u else None)


def weights_on_device(
    aggregator: Aggregator,
    g_mat: torch.Tensor,
    ok: torch.Tensor,
    generator: torch.Generator | None,
    aggregator_kwargs: dict[str, Any],
) -> torch.Tensor:
    """``apply(sync=False)``'s weights without a host read: the aggregator on the Gram where ``ok`` (a device
    bool), else on the identity (non-finite entries zeroed first: the weights stay finite, the caller skips)."""
    eye = torch.eye(g_mat.shape[0], dtype=g_mat.dtype, device=g_mat.device)
    safe = torch.where(ok, torch.nan_to_num(g_mat, nan=0.0, posinf=0.0, neginf=0.0), eye)
    return aggregator(safe, generator=generator, **aggregator_kwargs)


def chunk_bounds(numels: Sequence[int], num_chunks: int = NUM_CHUNKS) -> list[tuple[int, int]]:
    """Parameter index ranges ``[(a, b), ...]`` (in parameter order) of the buffer's chunks: runs of consecutive
    parameters taken from the last one back (the backward's write order), whose element counts double from one
    chunk to the next (the first written about ``P / (2^num_chunks - 1)``), so that the chunk a backward has just
    made is about as large as the rows it has written before."""
    total = sum(numels)
    bounds: list[tuple[int, int]] = []
    end, done, target = len(numels), 0, 0.0
    for c in range(num_chunks):
        if end == 0:
            break
        target += total * 2**c / (2**num_chunks - 1)
        start = end - 1
        done += numels[start]
        while start > 0 and (c == num_chunks - 1 or done + numels[start - 1] <= target):
            start -= 1
            done += numels[start]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


class TaskGradientBuffer:
    """Per-task gradients of the shared parameters in :data:`NUM_CHUNKS` flat ``[num_tasks, P_c]`` tensors.

    Args:
        params: the parameters shared by the tasks (the Gram is over them). All on one device, one dtype.
        num_tasks: rows of the buffer, ``1 <= num_tasks <= MAX_TASKS`` (128: 64 tasks with GEM's
            episodic memory, which uses ``2 T`` rows).
        dtype: row dtype, ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``; default (None) the
            parameters' dtype (bf16 rows for a bf16 module), float32 for any other. The Gram is always accumulated
            in float32, the update combined in float32.
        task_params: task-specific parameters (see the module docstring); optional.
        grad_getter / grad_setter: how gradients are read and written; default ``p.grad``. Under DeepSpeed
            ZeRO-1/2 pass ``deepspeed.utils.safe_get_full_grad`` and a setter built on ``safe_set_full_grad``
            (see :mod:`fastpals.surgery`). A setter receiving ``None`` must clear the gradient.
        grad_dtype: dtype of the combined gradient written back (default: the parameters' dtype).
        process_group: data parallel: when given (or ``all_reduce=True`` with the default group), the buffer
            is averaged over the ranks before the Gram, so that surgery acts on the global per-task gradients.
            Communication per step: ``T * P`` buffer elements plus the task-specific gradients and a few flags.
        all_reduce: average over the default process group (``torch.distributed`` must be initialised).
        capture_task_params: also take the task-specific gradients out at each :meth:`capture` (through
            ``grad_getter``, summed into a float32 copy, cleared with ``grad_setter``) and write them back in
            :meth:`apply`. Needed where successive backwards do not accumulate gradients, as under DeepSpeed
            ZeRO-1/2 (measured with 0.19.8: each ``engine.backward`` replaces the reduced gradients).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        num_tasks: int,
        dtype: torch.dtype | None = None,
        *,
        task_params: Iterable[torch.nn.Parameter] | None = None,
        grad_getter: GradGetter | None = None,
        grad_setter: GradSetter | None = None,
        grad_dtype: torch.dtype | None = None,
        process_group: Any = None,
        all_reduce: bool = False,
        capture_task_params: bool = False,
    ) -> None:
        self.params = _unique_params(params, "params")
        if not self.params:
            raise ValueError("params is empty: the buffer needs at least one shared parameter")
        if not isinstance(num_tasks, int) or not 1 <= num_tasks <= MAX_TASKS:
            raise ValueError(f"num_tasks must be an int in [1, {MAX_TASKS}], got {num_tasks!r}")
        devices = {p.device for p in self.params}
        dtypes = {p.dtype for p in self.params}
        if dtype is None:
            only = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
            dtype = only if only in (torch.bfloat16, torch.float16) else torch.float32
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
        if len(devices) != 1:
            raise ValueError(f"params must all be on one device, got {sorted(map(str, devices))}")
        if len(dtypes) != 1 and grad_dtype is None:
            raise ValueError(f"params have several dtypes {sorted(map(str, dtypes))}: pass grad_dtype")
        shared_ids = {id(p) for p in self.params}
        self.task_params = [
            p for p in _unique_params(task_params or [], "task_params") if id(p) not in shared_ids
        ]
        if len(self.task_params) != len(_unique_params(task_params or [], "task_params")):
            raise ValueError("a parameter cannot be both shared (params) and task-specific (task_params)")
        self.device = devices.pop()
        self.num_tasks = num_tasks
        self.dtype = dtype
        self.grad_dtype = grad_dtype or next(iter(dtypes))
        self.grad_getter = grad_getter or default_grad_getter
        self.grad_setter = grad_setter or default_grad_setter
        self.process_group = process_group
        self.all_reduce = all_reduce or process_group is not None
        self.numels = [p.numel() for p in self.params]
        self.num_elements = sum(self.numels)
        # per shared parameter its [T, numel_k] rows: column views of its chunk's [T, P_c] tensor, made at the
        # chunk's first write in a step, each marked as made on first use within the step
        self._bounds = chunk_bounds(self.numels)
        self._chunks: list[torch.Tensor | None] = [None] * len(self._bounds)
        self._chunk_of = [c for c, (a, b) in enumerate(self._bounds) for _ in range(a, b)]
        self._offsets = [sum(self.numels[a:k]) for a, b in self._bounds for k in range(a, b)]
        self._blocks: list[torch.Tensor | None] = [None] * len(self.params)
        self._captured = [False] * num_tasks
        self._touched = [[False] * len(self.params) for _ in range(num_tasks)]
        self._task_state: list[tuple[int, int] | None] = [None] * len(self.task_params)
        self.task_param_tasks: list[set[int]] = [set() for _ in self.task_params]
        self.capture_task_params = capture_task_params
        self._task_acc: list[torch.Tensor | None] = [None] * len(self.task_params)
        self._task_seen = [False] * len(self.task_params)
        self.skipped_steps = 0
        self.steps = 0

    # ------------------------------------------------------------------------------------------------------------
    def _task_grad_state(self, p: torch.nn.Parameter) -> tuple[int, int] | None:
        g = self.grad_getter(p)
        return None if g is None else (id(g), g._version)

    def capture(self, task: int, accumulate: bool = False) -> None:
        """Copy the current gradients of the shared parameters into row ``task`` and clear them.

        Call it after the backward of task ``task``. A parameter with no gradient contributes zeros and counts as
        not touched by that task. ``accumulate=True`` adds to the row instead (several micro-batches of one task);
        otherwise capturing a task twice before :meth:`apply` is an error.
        """
        if not isinstance(task, int) or not 0 <= task < self.num_tasks:
            raise ValueError(f"task must be an int in [0, {self.num_tasks}), got {task!r}")
        if self._captured[task] and not accumulate:
            raise ValueError(f"task {task} was already captured since the last apply() (use accumulate=True)")
        fresh = not self._captured[task]
        dst_some: list[torch.Tensor] = []
        src_some: list[torch.Tensor] = []
        dst_none: list[torch.Tensor] = []
        touched = self._touched[task]
        for k, p in enumerate(self.params):
            g = self.grad_getter(p)
            if g is None:
                if fresh and self._blocks[k] is not None:
                    dst_none.append(self._blocks[k][task])
                continue
            if g.shape != p.shape:
                raise ValueError(
                    f"gradient of shared parameter {k} has shape {list(g.shape)}, expected {list(p.shape)}"
                )
            if g.is_sparse:
                raise ValueError(f"gradient of shared parameter {k} is sparse; dense gradients are required")
            touched[k] = True
            dst_some.append(self.block(k)[task])
            src_some.append(g.detach().reshape(-1))
        if dst_some:
            if fresh:
                torch._foreach_copy_(dst_some, src_some)
            else:
                torch._foreach_add_(dst_some, [s.to(self.dtype) for s in src_some])
        if dst_none:
            torch._foreach_zero_(dst_none)
        for p in self.params:
            self.grad_setter(p, None)
        self._captured[task] = True
        self._capture_task_params([task])

    def _capture_task_params(self, tasks: Sequence[int]) -> None:
        """The task-specific half of a capture: record which tasks touched each task parameter and, with
        ``capture_task_params``, take their gradients out (summed into float32 copies)."""
        for k, p in enumerate(self.task_params):
            if self.capture_task_params:
                g = self.grad_getter(p)
                if g is not None:
                    if self._task_acc[k] is None:
                        self._task_acc[k] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    acc = self._task_acc[k]
                    if not self._task_seen[k]:
                        acc.zero_()
                    acc.add_(g.detach())
                    self._task_seen[k] = True
                    self.task_param_tasks[k].update(tasks)
                    self.grad_setter(p, None)
                continue
            state = self._task_grad_state(p)
            if state is not None and state != self._task_state[k]:
                self.task_param_tasks[k].update(tasks)
            self._task_state[k] = state

    # --- rows written in place (one backward for every task: fastpals.surgery.per_task) -------------------------
    def captured_tasks(self) -> list[bool]:
        """Which rows hold a gradient captured since the last :meth:`apply` (the others count as zero)."""
        return list(self._captured)

    def release_update(self) -> None:
        """Kept for callers of earlier versions: :meth:`apply` now gives up every row block itself (the update
        lives in the ``.grad`` tensors only), so there is nothing left to release."""

    def _chunk(self, c: int) -> torch.Tensor:
        """Chunk ``c``'s ``[T, P_c]`` tensor, made uninitialised at its first use in a step."""
        chunk = self._chunks[c]
        if chunk is None:
            a, b = self._bounds[c]
            chunk = self._chunks[c] = torch.empty(
                (self.num_tasks, sum(self.numels[a:b])), dtype=self.dtype, device=self.device
            )
        return chunk

    def _new_block(self, k: int) -> torch.Tensor:
        """The ``[T, numel_k]`` block of rows of shared parameter ``k``: its columns of its chunk (made by the
        chunk's first write in the step), zeroed when some row already holds an earlier capture of this step (a
        later write may add to it); otherwise every row is written, or zeroed by the capture or by :meth:`apply`,
        before it is read. The memory planner counts what this makes as the surgery buffer's."""
        chunk = self._chunk(self._chunk_of[k])
        block = chunk[:, self._offsets[k] : self._offsets[k] + self.numels[k]]
        if any(self._captured):
            block.zero_()
        return block

    def block(self, k: int) -> torch.Tensor:
        """Every task's row of shared parameter ``k``, ``[T, numel_k]`` (made on first use in a step)."""
        b = self._blocks[k]
        if b is None:
            b = self._blocks[k] = self._new_block(k)
        return b

    def param_row(self, task: int, k: int) -> torch.Tensor:
        """Row ``task`` of shared parameter ``k`` as a view shaped like the parameter (write into it)."""
        return self.block(k)[task].view(self.params[k].shape)

    def param_rows(self, k: int) -> torch.Tensor:
        """Every task's row of shared parameter ``k``: a ``[T, *shape]`` view of its block."""
        return self.block(k).view(self.num_tasks, *self.params[k].shape)

    def capture_written(self, tasks: Sequence[int], written: Sequence[Sequence[bool]]) -> None:
        """Record rows written in place by :func:`fastpals.surgery.per_task_gradients`: ``tasks`` had rows in the
        batch; ``written[t][k]`` says that shared parameter k's part of row t was written. Rows captured since
        the last :meth:`apply` accumulate; in a fresh row the parts nobody wrote are zeroed (not touched). Then
        the task-specific gradients are handled as in :meth:`capture` (their tasks: all of ``tasks``)."""
        tasks = list(tasks)
        for t in tasks:
            if not 0 <= t < self.num_tasks:
                raise ValueError(f"task {t} out of range [0, {self.num_tasks})")
            fresh = not self._captured[t]
            stale = []
            for k in range(len(self.params)):
                if written[t][k]:
                    self._touched[t][k] = True
                elif fresh and self._blocks[k] is not None:
                    stale.append(self._blocks[k][t])
            if stale:
                torch._foreach_zero_(stale)
            self._captured[t] = True
        if tasks:
            self._capture_task_params(tasks)

    def drop_task_grads(self) -> None:
        """Forget the task-specific gradients of this step so far (clear them through ``grad_setter`` and, with
        ``capture_task_params``, the captured copies). GEM uses it after the episodic-memory backwards, whose
        gradients only constrain the update."""
        for k, p in enumerate(self.task_params):
            self.grad_setter(p, None)
            self._task_seen[k] = False
        self._task_state = [self._task_grad_state(p) for p in self.task_params]

    def _task_grads(self) -> list[torch.Tensor | None]:
        if self.capture_task_params:
            return [acc if seen else None for acc, seen in zip(self._task_acc, self._task_seen)]
        return [self.grad_getter(p) for p in self.task_params]

    # ------------------------------------------------------------------------------------------------------------
    def _reduce(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Average the buffer and the task-specific gradients over the process group, and OR the touched flags.

        Returns ``(flags, task_flat)`` on the device, without a host sync: ``flags`` holds the ``T x n_shared``
        shared-touched flags then the ``n_task`` task-specific-used flags (> 0 where some rank touched it),
        ``task_flat`` the averaged task-specific gradients (zeros where a rank had none), or None.
        """
        world = dist.get_world_size(self.process_group)
        task_grads = self._task_grads()
        flags = torch.tensor(
            [x for row in self._touched for x in row] + [g is not None for g in task_grads],
            dtype=torch.float32,
            device=self.device,
        )
        dist.all_reduce(flags, group=self.process_group)
        unmade = [k for k in range(len(self.params)) if self._blocks[k] is None]
        for k in unmade:  # every rank reduces every block (zeros where it wrote none)
            self._blocks[k] = self.block(k)
        if unmade:
            torch._foreach_zero_([self._blocks[k] for k in unmade])
        for chunk in self._chunks:
            chunk.div_(world)
            dist.all_reduce(chunk, group=self.process_group)
        if not self.task_params:
            return flags, None
        flat = flat_task_grads(self.task_params, task_grads, self.device)
        flat.div_(world)
        dist.all_reduce(flat, group=self.process_group)
        return flags, flat

    def apply(
        self,
        aggregator: Aggregator,
        generator: torch.Generator | None = None,
        *,
        sync: bool = True,
        **aggregator_kwargs: Any,
    ) -> SurgeryResult:
        """Gram -> ``aggregator(gram, generator=generator, **aggregator_kwargs)`` -> ``sum_t w_t g_t`` into .grad.

        Rows not captured since the last call count as zero gradients (a task absent from this step). One
        device-to-host sync: the finite check of every task gradient (fused into the Gram kernel) and of the
        task-specific gradients (and, data parallel, the touched flags of all ranks). When something is
        non-finite the step is skipped: the shared gradients stay ``None``, :attr:`skipped_steps` grows, and the
        result says which tasks were at fault; the aggregator is not called.

        ``sync=False`` (one rank, no all-reduce): no host read at all. The finite flags stay on the device
        (``result.ok``); the aggregator runs on the Gram with non-finite entries replaced by the identity and the
        update is written as usual (non-finite where a row was). The caller reads the flags once before stepping
        (``result.skipped``, or ``result.ok`` stacked with its own values) and must not step when one is false.
        """
        absent = [t for t in range(self.num_tasks) if not self._captured[t]]
        if absent and any(c is not None for c in self._chunks):
            torch._foreach_zero_([c[t] for c in self._chunks if c is not None for t in absent])
        n_shared, n_task = len(self.params), len(self.task_params)
        checks: list[torch.Tensor] = []
        task_flat: torch.Tensor | None = None
        if self.all_reduce:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("all_reduce/process_group given but torch.distributed is not initialised")
            flags_dev, task_flat = self._reduce()
            if task_flat is not None:
                checks.append(torch.isfinite(task_flat.norm()).reshape(1))
        else:
            local_task_grads = self._task_grads()
            finite_tasks = task_grads_finite(local_task_grads)
            if finite_tasks is not None:
                checks.append(finite_tasks)
        g_mat, finite = self._gram()
        if not sync:
            return self._apply_on_device(aggregator, generator, g_mat, finite, checks, aggregator_kwargs)
        parts = [finite] + checks + ([flags_dev > 0] if self.all_reduce else [])
        host = torch.cat(parts).tolist()  # the one device-to-host read of the step (the skip decision)
        task_ok = bool(host[self.num_tasks]) if checks else True
        if self.all_reduce:
            flat_flags = host[self.num_tasks + len(checks) :]
            touched = [flat_flags[t * n_shared : (t + 1) * n_shared] for t in range(self.num_tasks)]
            task_used = flat_flags[self.num_tasks * n_shared : self.num_tasks * n_shared + n_task]
            if task_flat is not None:
                hand_over_flat_task_grads(self.grad_setter, self.task_params, task_flat, task_used)
        else:
            touched = self._touched
            if self.capture_task_params:
                hand_over_task_grads(self.grad_setter, self.task_params, local_task_grads)
        self._end_step()
        if not (all(host[: self.num_tasks]) and task_ok):
            self.skipped_steps += 1
            self._blocks = [None] * len(self.params)  # nothing applied: the rows go
            self._chunks = [None] * len(self._bounds)
            bad = [t for t in range(self.num_tasks) if not host[t]]
            return SurgeryResult(True, None, g_mat, bad, not task_ok)
        weights = aggregator(g_mat, generator=generator, **aggregator_kwargs)
        self._write_update(weights, touched)
        return SurgeryResult(False, weights, g_mat)

    def _gram(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gram [T, T] float32, finite [T] bool)`` of the rows: one pass over each chunk made in the step
        (an unmade chunk's rows are zero), whose columns of blocks nobody wrote are zeroed first."""
        made = [c for c in self._chunks if c is not None]
        if not made:
            g_mat = torch.zeros((self.num_tasks, self.num_tasks), dtype=torch.float32, device=self.device)
            return g_mat, torch.ones(self.num_tasks, dtype=torch.bool, device=self.device)
        unwritten = [
            self._chunks[c][:, o : o + n]
            for b, c, o, n in zip(self._blocks, self._chunk_of, self._offsets, self.numels)
            if b is None and self._chunks[c] is not None
        ]
        if unwritten:
            torch._foreach_zero_(unwritten)
        if len(made) == 1:
            return gram(made[0])
        parts = [gram(c) for c in made]
        return torch.stack([g for g, _ in parts]).sum(0), torch.stack([f for _, f in parts]).all(0)

    def _end_step(self) -> None:
        """Forget this step's captures (the next one starts fresh rows)."""
        self._task_seen = [False] * len(self.task_params)
        self.steps += 1
        self._captured = [False] * self.num_tasks
        self._touched = [[False] * len(self.params) for _ in range(self.num_tasks)]
        self._task_state = [self._task_grad_state(p) for p in self.task_params]

    def _write_update(self, weights: torch.Tensor, touched: Sequence[Sequence[bool]]) -> None:
        """``sum_t weights[t] g_t`` into the shared parameters' gradients (None where no task touched one)."""
        alias = self.grad_dtype == self.dtype
        last: list[torch.Tensor | None] = [None] * len(self._chunks)
        if alias:  # one pass over each chunk's rows, the update over its last row
            last = [c if c is None else combine(c, weights, out_row=self.num_tasks - 1) for c in self._chunks]
        self._chunks = [None] * len(self._bounds)  # the .grad views keep the rows alive as long as they live
        for k, p in enumerate(self.params):
            b, self._blocks[k] = self._blocks[k], None  # the buffer keeps no row past the step
            if b is None or not any(touched[t][k] for t in range(self.num_tasks)):
                self.grad_setter(p, None)
                continue
            if alias:  # .grad is a view of its chunk's update row, no extra tensor
                update = last[self._chunk_of[k]][self._offsets[k] : self._offsets[k] + self.numels[k]]
            else:  # one parameter's update, handed over at once (the block is freed with b)
                update = combine(
                    b, weights, out=torch.empty(b.shape[1], dtype=self.grad_dtype, device=b.device)
                )
            del b
            self.grad_setter(p, update.view_as(p))

    def _apply_on_device(
        self,
        aggregator: Aggregator,
        generator: torch.Generator | None,
        g_mat: torch.Tensor,
        finite: torch.Tensor,
        checks: list[torch.Tensor],
        aggregator_kwargs: dict[str, Any],
    ) -> SurgeryResult:
        """The rest of ``apply(sync=False)``: no host read; flags returned on the device."""
        if self.all_reduce:
            raise ValueError(
                "apply(sync=False) is for one-rank buffers (the all-reduced flags are read on the host)"
            )
        task_ok = checks[0] if checks else torch.ones(1, dtype=torch.bool, device=finite.device)
        flags = torch.cat([finite.to(torch.bool), task_ok.to(torch.bool).reshape(1)])
        weights = weights_on_device(aggregator, g_mat, flags.all(), generator, aggregator_kwargs)
        touched = self._touched
        if self.capture_task_params:
            hand_over_task_grads(self.grad_setter, self.task_params, self._task_grads())
        self._end_step()
        self._write_update(weights, touched)

        def count_skip() -> None:
            self.skipped_steps += 1

        return SurgeryResult(None, weights, g_mat, flags=flags, on_skip=count_skip)

    # ------------------------------------------------------------------------------------------------------------
    @property
    def data(self) -> torch.Tensor:
        """A ``[T, P]`` copy of the rows captured since the last :meth:`apply` (the shared parameters' blocks side
        by side, zeros for a block not written yet): for inspection and tests; :meth:`apply` reads the blocks."""
        out = torch.cat(
            [
                b if b is not None else torch.zeros((self.num_tasks, n), dtype=self.dtype, device=self.device)
                for b, n in zip(self._blocks, self.numels)
            ],
            dim=1,
        )
        for t in range(self.num_tasks):
            if not self._captured[t]:
                out[t].zero_()
        return out

    def row(self, task: int) -> torch.Tensor:
        """A copy of row ``task``, ``[P]`` (the flattened gradient of the shared parameters; see :attr:`data`)."""
        return self.data[task]

    def __repr__(self) -> str:
        return (
            f"TaskGradientBuffer(num_tasks={self.num_tasks}, shared_elements={self.num_elements}, "
            f"dtype={self.dtype}, task_params={len(self.task_params)}, all_reduce={self.all_reduce})"
        )


def parameters_reached(loss: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[bool]:
    """Which of ``params`` the autograd graph of ``loss`` reaches (a walk over ``grad_fn``; no gradient is
    computed). Used to split parameters into shared, task-specific and unused ones."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a tensor, got {type(loss).__name__}")
    index = {id(p): k for k, p in enumerate(params)}
    reached = [False] * len(params)
    if loss.grad_fn is None:
        if loss.requires_grad and id(loss) in index:
            reached[index[id(loss)]] = True
        return reached
    stack = [loss.grad_fn]
    seen = {loss.grad_fn}
    while stack:
        node = stack.pop()
        var = getattr(node, "variable", None)
        if var is not None:
            k = index.get(id(var))
            if k is not None:
                reached[k] = True
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return reached
