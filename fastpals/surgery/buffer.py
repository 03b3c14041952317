"""The flat per-task gradient buffer: ``[T, P]`` rows of the shared parameters' gradients, made at their first
write in a step and given up by ``apply`` (where the rows have the gradients' dtype, ``.grad`` are views of
the update written over each chunk's last row)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastpals.surgery.core import TaskGradients
from fastpals_kernels.dispatch import combine, gram

#: flat ``[T, P_c]`` tensors the rows are split into: the Gram and the combine take this many launches
NUM_CHUNKS = 6


def chunk_bounds(numels: Sequence[int], num_chunks: int = NUM_CHUNKS) -> list[tuple[int, int]]:
    """Parameter index ranges ``[(a, b), ...]`` of the chunks, sizes doubling from the last parameter back."""
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


class TaskGradientBuffer(TaskGradients):
    """Per-task gradients of the shared parameters in :data:`NUM_CHUNKS` flat ``[num_tasks, P_c]`` tensors.

    ``dtype``: the rows' (float32, bfloat16 or float16; default the parameters' if 16-bit, else float32); the
    Gram and the update accumulate in float32. The other arguments:
    :class:`~fastpals.surgery.core.TaskGradients`.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        num_tasks: int,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, num_tasks, **kwargs)
        dtypes = {p.dtype for p in self.params}
        if dtype is None:
            only = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
            dtype = only if only in (torch.bfloat16, torch.float16) else torch.float32
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
        self.dtype = dtype
        # per shared parameter its [T, numel_k] rows: column views of its chunk, made on first use in a step
        self._bounds = chunk_bounds(self.numels)
        self._chunks: list[torch.Tensor | None] = [None] * len(self._bounds)
        self._chunk_of = [c for c, (a, b) in enumerate(self._bounds) for _ in range(a, b)]
        self._offsets = [sum(self.numels[a:k]) for a, b in self._bounds for k in range(a, b)]
        self._blocks: list[torch.Tensor | None] = [None] * len(self.params)
        self._captured = [False] * num_tasks
        self._task_state: list[tuple[int, int] | None] = [None] * len(self.task_params)

    def _task_grad_state(self, p: torch.nn.Parameter) -> tuple[int, int] | None:
        g = self.grad_getter(p)
        return None if g is None else (id(g), g._version)

    def capture(self, task: int, accumulate: bool = False) -> None:
        """Move the shared gradients into row ``task`` (``accumulate``: add, micro-batches of one task)."""
        if not isinstance(task, int) or not 0 <= task < self.num_tasks:
            raise ValueError(f"task must be an int in [0, {self.num_tasks}), got {task!r}")
        if self._captured[task] and not accumulate:
            raise ValueError(f"task {task} was already captured since the last apply() (use accumulate=True)")
        fresh = not self._captured[task]
        dst_some, src_some, dst_none = [], [], []
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
            self._touched[task][k] = True
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
        """Record which tasks touched each task parameter (and with ``capture_task_params`` take the
        gradients)."""
        for k, p in enumerate(self.task_params):
            if self.capture_task_params:
                g = self.grad_getter(p)
                if g is not None:
                    self._take_task_grad(k, g)
                    self.task_param_tasks[k].update(tasks)
                continue
            state = self._task_grad_state(p)
            if state is not None and state != self._task_state[k]:
                self.task_param_tasks[k].update(tasks)
            self._task_state[k] = state

    def captured_tasks(self) -> list[bool]:
        """Which rows hold a gradient captured since the last :meth:`apply` (the others count as zero)."""
        return list(self._captured)

    def _new_block(self, k: int) -> torch.Tensor:
        """Parameter ``k``'s columns of its chunk (counted by the memory planner as the surgery buffer's)."""
        c = self._chunk_of[k]
        if self._chunks[c] is None:  # uninitialised: every row is written or zeroed before it is read
            a, b = self._bounds[c]
            self._chunks[c] = torch.empty(
                (self.num_tasks, sum(self.numels[a:b])), dtype=self.dtype, device=self.device
            )
        block = self._chunks[c][:, self._offsets[k] : self._offsets[k] + self.numels[k]]
        if any(self._captured):
            block.zero_()
        return block

    def block(self, k: int) -> torch.Tensor:
        """Every task's row of shared parameter ``k``, ``[T, numel_k]`` (made on first use in a step)."""
        if self._blocks[k] is None:
            self._blocks[k] = self._new_block(k)
        return self._blocks[k]

    def param_row(self, task: int, k: int) -> torch.Tensor:
        """Row ``task`` of shared parameter ``k`` as a view shaped like the parameter (write into it)."""
        return self.block(k)[task].view(self.params[k].shape)

    def param_rows(self, k: int) -> torch.Tensor:
        """Every task's row of shared parameter ``k``: a ``[T, *shape]`` view of its block."""
        return self.block(k).view(self.num_tasks, *self.params[k].shape)

    def capture_written(self, tasks: Sequence[int], written: Sequence[Sequence[bool]]) -> None:
        """Record the rows :func:`~fastpals.surgery.per_task_gradients` wrote for ``tasks``."""
        tasks = list(tasks)
        for t in tasks:
            if not 0 <= t < self.num_tasks:
                raise ValueError(f"task {t} out of range [0, {self.num_tasks})")
            stale = []
            for k in range(len(self.params)):
                if written[t][k]:
                    self._touched[t][k] = True
                elif not self._captured[t] and self._blocks[k] is not None:
                    stale.append(self._blocks[k][t])
            if stale:
                torch._foreach_zero_(stale)
            self._captured[t] = True
        if tasks:
            self._capture_task_params(tasks)

    def drop_task_grads(self) -> None:
        """Forget the task-specific gradients of this step so far (GEM, after the episodic-memory
        backwards)."""
        for k, p in enumerate(self.task_params):
            self.grad_setter(p, None)
            self._task_seen[k] = False
        self._task_state = [self._task_grad_state(p) for p in self.task_params]

    def _finish_gram(self) -> torch.Tensor:
        """``[T, T]`` float32 Gram of the rows (absent ones zeroed), one launch per chunk."""
        absent = [t for t in range(self.num_tasks) if not self._captured[t]]
        if absent and any(c is not None for c in self._chunks):
            torch._foreach_zero_([c[t] for c in self._chunks if c is not None for t in absent])
        if self.all_reduce:
            unmade = [k for k in range(len(self.params)) if self._blocks[k] is None]
            for k in unmade:  # every rank reduces every block (zeros where it wrote none)
                self._blocks[k] = self.block(k)
            if unmade:
                torch._foreach_zero_([self._blocks[k] for k in unmade])
            for chunk in self._chunks:
                chunk.div_(dist.get_world_size(self.process_group))
                dist.all_reduce(chunk, group=self.process_group)
        made = [c for c in self._chunks if c is not None]
        if not made:
            return torch.zeros((self.num_tasks, self.num_tasks), dtype=torch.float32, device=self.device)
        unwritten = [
            self._chunks[c][:, o : o + n]
            for b, c, o, n in zip(self._blocks, self._chunk_of, self._offsets, self.numels)
            if b is None and self._chunks[c] is not None
        ]
        if unwritten:
            torch._foreach_zero_(unwritten)
        if len(made) == 1:
            return gram(made[0])[0]
        return torch.stack([gram(c)[0] for c in made]).sum(0)

    def _task_rows(self) -> torch.Tensor:
        """The ``[T, P]`` rows as :meth:`_finish_gram` left them (zeros for a chunk nobody wrote)."""
        t, dtype = self.num_tasks, self.dtype
        zeros = [
            torch.zeros(t, sum(self.numels[a:b]), dtype=dtype, device=self.device) for a, b in self._bounds
        ]
        return torch.cat([c if c is not None else z for c, z in zip(self._chunks, zeros)], dim=1)

    def _end_step(self) -> None:
        super()._end_step()
        self._task_seen = [False] * len(self.task_params)
        self._captured = [False] * self.num_tasks
        self._touched = [[False] * len(self.params) for _ in range(self.num_tasks)]
        self._task_state = [self._task_grad_state(p) for p in self.task_params]
        self._blocks = [None] * len(self.params)
        self._chunks = [None] * len(self._bounds)

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

    @property
    def data(self) -> torch.Tensor:
        """A ``[T, P]`` copy of the rows captured since the last :meth:`apply` (for inspection)."""
        zeros = [torch.zeros((self.num_tasks, n), dtype=self.dtype, device=self.device) for n in self.numels]
        out = torch.cat([b if b is not None else z for b, z in zip(self._blocks, zeros)], dim=1)
        out[[not c for c in self._captured]] = 0
        return out

    def row(self, task: int) -> torch.Tensor:
        """A copy of row ``task``, ``[P]``."""
        return self.data[task]

    _repr_fields = ("dtype",)


def parameters_reached(loss: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[bool]:
    """Which of ``params`` the autograd graph of ``loss`` reaches (a walk over ``grad_fn``)."""
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
