"""Streaming gradient surgery (``--surgery-memory stream``): the exact Gram and update of the one-backward
capture without the ``[T, P]`` rows. Per shared parameter the smaller of: a streamed Linear weight's ``dY``
and ``X`` (Gram from per-task products ``dY_t^T X_t``, update ``(c_row * dY)^T X``), an embedding's ``dY`` and
token ids (:func:`embedding_row_gram`, update by ``index_add``), or kept ``[T, *shape]`` fp32 rows as the
buffer's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpals.surgery.core import TaskGradients
from fastpals.surgery.layer_grads import STACK_TEMP_ELEMENTS, RowTasks, kernels_on, row_plan
from fastpals.surgery.per_task import PerTaskGradients, mm_into
from fastpals_kernels.dispatch import gram as gram_op

#: ``smaller``: stream a layer where its kept output gradient is smaller than its task rows; ``stream``: all
POLICIES = ("smaller", "stream")

BUCKET_ELEMENTS = 1 << 22  # data parallel: scratch elements all-reduced in one call (16 MiB fp32)
# one rank: a streamed Linear's Gram over blocks of output rows whose fp32 products [T, rows, K] fit this
GRAM_CHUNK_BYTES = 12 << 20
# columns of one fp32 Gram product, the products summed in fp64 (the op library's Gram sums such blocks)
GRAM_COLUMNS = 1 << 16
#: kept rows of at most this many elements per task share one Gram and one combine launch
SMALL_ROW_ELEMENTS = 1 << 20


def stream_policy(policy: str, num_tasks: int, shape: Sequence[int], rows: int, embedding: bool) -> bool:
    """Is a Linear weight ``[M, K]`` (or embedding table) that ``rows`` rows run through streamed?"""
    if policy == "stream":
        return True
    if embedding:
        return num_tasks * shape[0] > rows
    m, k = shape
    return num_tasks * m * k > rows * (m + k)


def embedding_row_gram(
    ids: torch.Tensor,
    dy: torch.Tensor,
    row_task: torch.Tensor,
    num_tasks: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """The ``[T, T]`` fp32 Gram of an embedding's per-task gradients (task t's: its rows of ``dy [N, d]``
    added at ``ids [N]``, ``row_task [N]`` int64; ``padding_idx`` rows zero), with no host read."""
    t = num_tasks
    n = ids.shape[0]
    if n == 0:
        return torch.zeros(t, t, dtype=torch.float32, device=dy.device)
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    new_id = torch.ones_like(sorted_ids, dtype=torch.bool)
    new_id[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot = row_task.to(torch.int64).index_select(0, order) * n + torch.cumsum(new_id, 0) - 1
    rows = dy.index_select(0, order)
    if padding_idx is not None:
        rows = torch.where((sorted_ids == padding_idx)[:, None], 0, rows)
    d = dy.shape[1]
    step = -(-d // t)  # columns per block: a [T, N, step] table holds no more than the [N, d] rows
    parts = []
    for c0 in range(0, d, step):
        table = torch.zeros(t * n, min(step, d - c0), dtype=torch.float32, device=dy.device)
        table.index_add_(0, slot, rows[:, c0 : c0 + step].float())
        parts.append(gram_op(table.view(t, -1))[0])
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


class _StreamBlock(PerTaskGradients):
    """A :func:`~fastpals.surgery.per_task_gradients` block over a :class:`StreamingTaskGradients`."""

    buffer: StreamingTaskGradients

    def __enter__(self) -> _StreamBlock:
        self.buffer._begin_block()
        super().__enter__()
        for _, m in self.shared_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                self._handles.append(m.register_forward_pre_hook(self._count))
        return self

    def _count(self, module: nn.Module, args: tuple) -> None:
        x = args[0]
        rows = x.numel() if isinstance(module, nn.Embedding) else x.numel() // max(x.shape[-1], 1)
        buf, k_w = self.buffer, self.param_index(module.weight)
        buf._calls[k_w] = buf._calls.get(k_w, 0) + 1
        buf._row_counts[k_w] = buf._row_counts.get(k_w, 0) + rows
        if isinstance(module, nn.Linear):
            buf._linear_order.setdefault(k_w)
            if module.bias is not None:
                k_b = buf._bias_of[k_w] = self.param_index(module.bias)
                buf._weight_of[k_b] = k_w

    def write_segment_sums(self, k: int, values: torch.Tensor, rows: RowTasks) -> None:
        if self.buffer._bias_with_weight(k) and kernels_on(self, values):
            for t in rows.tasks:  # computed with its weight's (the multi-Linear ops' extra column)
                self.written[t][k] = True
            return
        super().write_segment_sums(k, values, rows)

    def linear_done(self, rows: RowTasks, k_w: int, dy: torch.Tensor, x: torch.Tensor) -> None:
        grouped = self.buffer._deferred.get(k_w, False) and kernels_on(self, dy)
        if grouped:
            row_plan(self, rows)  # the grouped kernel's plan of these rows, for the blocked Gram
        self.buffer._linear_done(rows, k_w, dy, x, self.written, grouped)

    def defers_linear_weight(self, k_w: int, rows: RowTasks) -> bool:
        if not self.buffer._defers(k_w):
            return False
        for t in rows.tasks:
            self.written[t][k_w] = True
        return True

    def write_embedding(
        self, k: int, ids: torch.Tensor, grad: torch.Tensor, rows: RowTasks, padding_idx: int | None
    ) -> None:
        if not self.buffer._streams(k, embedding=True):
            super().write_embedding(k, ids, grad, rows, padding_idx)
            return
        for t in rows.tasks:
            self.written[t][k] = True
        self.buffer._embeddings.append((k, ids, grad, rows.row_task, padding_idx))


class StreamingTaskGradients(TaskGradients):
    """The streaming counterpart of :class:`~fastpals.surgery.TaskGradientBuffer` (same ``apply`` and
    results).

    Args:
        policy: one of :data:`POLICIES`.
        keep_bytes: bytes that kept rows of Linear weights the policy would stream may add over the ``dY`` and
            ``X`` they spare, in forward order (one rank only).
        bucket_elements: data parallel, scratch elements per all-reduce.
    """

    block_class = _StreamBlock
    dtype = torch.float32  # the scratch and kept rows (the per-layer capture writes fp32 into them)

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        num_tasks: int,
        *,
        policy: str = "smaller",
        bucket_elements: int = BUCKET_ELEMENTS,
        keep_bytes: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, num_tasks, **kwargs)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not isinstance(keep_bytes, int) or keep_bytes < 0:
            raise ValueError(f"keep_bytes must be an int >= 0, got {keep_bytes!r}")
        self.policy = policy
        self.bucket_elements = bucket_elements
        self.keep_bytes = 0 if self.all_reduce else keep_bytes
        self._reset()

    def _reset(self) -> None:
        self._blocks = 0
        self._gram: torch.Tensor | None = None
        self._gram_parts: list[torch.Tensor] = []  # fp32 [T, T] Grams of the parts, summed once (fp64)
        self._rows: dict[int, torch.Tensor] = {}  # kept rows and the live scratches, [T, *shape] fp32
        self._small: tuple[list[int], torch.Tensor] | None = None  # small kept rows side by side, [T, n] fp32
        self._decided: dict[int, bool] = {}  # per parameter: streamed?
        self._calls: dict[int, int] = {}
        self._linear_order: dict[int, None] = {}  # shared Linear weights by first forward call
        self._kept_linears: set[int] | None = None
        self._row_counts: dict[int, int] = {}
        self._left: dict[int, int] = {}
        self._linears: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._deferred: dict[int, bool] = {}  # per streamed Linear weight: Gram in blocks (no scratch)?
        self._deferred_calls: dict[int, list[tuple[RowTasks, torch.Tensor, torch.Tensor]]] = {}
        # streamed Linear weights on the kernels path: the calls' rows, dy and x (one Gram, one update launch)
        self._grouped: dict[int, list[tuple[RowTasks, torch.Tensor, torch.Tensor]]] = {}
        self._bias_of: dict[int, int] = {}  # shared Linear weight -> its bias (both shared parameters)
        self._weight_of: dict[int, int] = {}
        self._embeddings: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int | None]] = []
        self._pending: list[torch.Tensor] = []  # data parallel: scratches waiting for their all-reduce
        self._pending_elements = 0
        self._touched = [[False] * len(self.params) for _ in range(self.num_tasks)]
        self._task_seen = [False] * len(self.task_params)

    def _begin_block(self) -> None:
        if self._blocks:
            raise RuntimeError(
                "StreamingTaskGradients takes one per_task_gradients block per apply() (the Gram of several "
                "micro-batches needs their cross terms): call apply() after each block, or use the "
                "TaskGradientBuffer (--surgery-memory buffer) to accumulate micro-batches"
            )
        self._blocks = 1
        self._gram = torch.zeros(self.num_tasks, self.num_tasks, dtype=torch.float64, device=self.device)

    def _add_gram(self, rows: torch.Tensor) -> None:
        """Gram += that of ``rows [T, n]`` fp32 (the op library's, as the buffer's; summed in fp64 later)."""
        self._gram_parts.append(gram_op(rows.contiguous())[0])

    def _bias_with_weight(self, k: int) -> bool:
        """Is parameter k the bias of a streamed Linear weight whose Gram is built in blocks (with the
        weight's)?"""
        return self._deferred.get(self._weight_of.get(k, -1), False)

    def _kept_by_budget(self) -> set[int]:
        """The Linear weights the policy would stream whose rows ``keep_bytes`` keeps (in forward order)."""
        if self._kept_linears is None:
            kept: set[int] = set()
            left = self.keep_bytes
            for k in self._linear_order:
                p = self.params[k]
                if not stream_policy(self.policy, self.num_tasks, p.shape, self._row_counts.get(k, 0), False):
                    continue
                m, kk = p.shape
                need = self.num_tasks * m * kk * 4 - self._row_counts.get(k, 0) * (m + kk) * p.element_size()
                if need > left:
                    break
                kept.add(k)
                left -= need
            self._kept_linears = kept
        return self._kept_linears

    def _streams(self, k: int, embedding: bool) -> bool:
        """Is shared parameter k streamed this step? Decided on its first backward."""
        if k not in self._decided:
            p = self.params[k]
            self._decided[k] = stream_policy(
                self.policy, self.num_tasks, p.shape, self._row_counts.get(k, 0), embedding
            ) and (embedding or not self.keep_bytes or k not in self._kept_by_budget())
            self._left[k] = self._calls.get(k, 1)
        return self._decided[k]

    def _defers(self, k: int) -> bool:
        """Is streamed Linear weight k's Gram built by :meth:`_blocked_gram` (one rank, rows not written)?"""
        if k not in self._deferred:
            self._deferred[k] = (
                self._streams(k, embedding=False) and not self.all_reduce and k not in self._rows
            )
        return self._deferred[k]

    def _blocked_gram(self, k: int, calls: Sequence[tuple[RowTasks, torch.Tensor, torch.Tensor]]) -> None:
        """Gram += that of Linear weight k's task gradients, in blocks within ``GRAM_CHUNK_BYTES``."""
        tasks = sorted({t for rows, _, _ in calls for t in rows.tasks})
        if not tasks:
            return
        m, kk = self.params[k].shape
        n = len(tasks)
        pos = {t: i for i, t in enumerate(tasks)}
        step = max(1, min(m, GRAM_CHUNK_BYTES // (n * kk * 4)))
        block = torch.empty(n * step * kk, dtype=torch.float32, device=self.device)
        g = torch.zeros(n, n, dtype=torch.float64, device=self.device)
        for m0 in range(0, m, step):
            mc = min(step, m - m0)
            v = block[: n * mc * kk].view(n, mc, kk)
            first = [True] * n
            for rows, dy, x in calls:
                for t in rows.tasks:
                    sel = rows.slices[t]
                    if isinstance(sel, slice):
                        a, b = dy[sel, m0 : m0 + mc].t(), x[sel]
                    else:
                        a, b = dy[:, m0 : m0 + mc].index_select(0, sel).t(), x.index_select(0, sel)
                    mm_into(v[pos[t]], a, b, first[pos[t]])  # as the scratch is written
                    first[pos[t]] = False
            flat = v.view(n, -1)
            for c0 in range(0, flat.shape[1], GRAM_COLUMNS):  # fp32 products over at most 2^16 columns
                part = flat[:, c0 : c0 + GRAM_COLUMNS]
                g.add_(torch.mm(part, part.t()))
        g = 0.5 * (g + g.t())
        if n == self.num_tasks:
            self._gram.add_(g)
        else:
            idx = torch.tensor(tasks, dtype=torch.int64, device=self.device)
            self._gram.index_put_((idx[:, None], idx[None, :]), g, accumulate=True)

    def captured_tasks(self) -> list[bool]:
        """Every block starts fresh rows (one block per apply)."""
        return [False] * self.num_tasks

    def param_rows(self, k: int) -> torch.Tensor:
        """The ``[T, *shape]`` fp32 rows of shared parameter k (kept rows or scratch), made uninitialised."""
        if k not in self._rows:
            shape = (self.num_tasks, *self.params[k].shape)
            self._rows[k] = torch.empty(shape, dtype=torch.float32, device=self.device)
        return self._rows[k]

    def param_row(self, task: int, k: int) -> torch.Tensor:
        """Row ``task`` of shared parameter k, shaped like the parameter."""
        return self.param_rows(k)[task]

    def _zero_unwritten(self, k: int, rows: torch.Tensor, written: Sequence[Sequence[bool]]) -> None:
        """Zero the rows of parameter k that no task wrote."""
        for t in range(self.num_tasks):
            if not written[t][k]:
                rows[t].zero_()

    def _linear_done(
        self,
        rows: RowTasks,
        k: int,
        dy: torch.Tensor,
        x: torch.Tensor,
        written: Sequence[Sequence[bool]],
        grouped: bool = False,
    ) -> None:
        """A call of shared Linear weight k is done: keep ``dy`` and ``x``, Gram after the last call."""
        if not self._streams(k, embedding=False):
            return
        self._left[k] -= 1
        if grouped:  # Gram and update with all streamed Linears' (_finish_gram, _write_update)
            self._grouped.setdefault(k, []).append((rows, dy, x))
            return
        self._linears.append((k, rows.row_task, dy, x))
        if self._deferred.get(k):
            self._deferred_calls.setdefault(k, []).append((rows, dy, x))
        if self._left[k] > 0:
            return
        calls = self._deferred_calls.pop(k, None)
        if calls is not None:
            self._blocked_gram(k, calls)
            return
        scratch = self._rows.pop(k, None)
        if scratch is None:
            return
        self._zero_unwritten(k, scratch, written)
        if not self.all_reduce:
            self._add_gram(scratch.view(self.num_tasks, -1))
            return
        self._pending.append(scratch.view(self.num_tasks, -1))
        self._pending_elements += scratch.numel()
        if self._pending_elements >= self.bucket_elements:
            self._flush()

    def _flush(self) -> None:
        """Data parallel: average the pending scratches over the ranks (one call) and add their Gram."""
        if not self._pending:
            return
        flat = torch.cat(self._pending, 1) if len(self._pending) > 1 else self._pending[0]
        self._pending, self._pending_elements = [], 0
        flat.div_(dist.get_world_size(self.process_group))
        dist.all_reduce(flat, group=self.process_group)
        self._add_gram(flat)

    def capture_written(self, tasks: Sequence[int], written: Sequence[Sequence[bool]]) -> None:
        """End of the block: which tasks had rows, which parameters each wrote; the task-specific gradients."""
        tasks = list(tasks)
        for t in tasks:
            self._touched[t] = [a or bool(b) for a, b in zip(self._touched[t], written[t])]
        for k, rows in self._rows.items():  # kept rows (the streamed scratches are gone)
            self._zero_unwritten(k, rows, written)
        if not tasks:
            return
        for k, p in enumerate(self.task_params):
            g = self.grad_getter(p)
            if g is None:
                continue
            self.task_param_tasks[k].update(tasks)
            if self.capture_task_params:
                self._take_task_grad(k, g)
            self._task_seen[k] = True

    def _finish_gram(self) -> torch.Tensor:
        """The streamed layers' Gram plus the kept rows' and the embeddings' (data parallel: averaged
        first)."""
        t = self.num_tasks
        if self._gram is None:
            self._gram = torch.zeros(t, t, dtype=torch.float64, device=self.device)
        for k in list(self._deferred_calls):  # a weight whose forward calls outnumber its backward calls
            self._blocked_gram(k, self._deferred_calls.pop(k))
        if self._grouped:
            from fastpals_kernels import stream_linear  # Triton: the kernels path only

            for _, args in self._grouped_problems():
                self._gram.add_(stream_linear.stream_linear_gram(*args, t))
        if self.all_reduce:
            self._flush()
            kept = [r.view(t, -1) for r in self._rows.values()]
            if kept:
                flat = torch.cat(kept, 1)
                flat.div_(dist.get_world_size(self.process_group))
                dist.all_reduce(flat, group=self.process_group)
                for r, part in zip(self._rows.values(), torch.split(flat, [x.shape[1] for x in kept], 1)):
                    r.view(t, -1).copy_(part)
        small = [k for k, r in self._rows.items() if r[0].numel() <= SMALL_ROW_ELEMENTS]
        if small:  # one Gram (and, in _write_update, one combine) over all of them
            self._small = (small, torch.cat([self._rows.pop(k).view(t, -1) for k in small], 1))
            self._add_gram(self._small[1])
        for r in self._rows.values():
            self._add_gram(r.view(t, -1))
        by_param: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]]] = {}
        for k, ids, dy, row_task, pad in self._embeddings:
            by_param.setdefault(k, []).append((ids.reshape(-1), dy.reshape(ids.numel(), -1), row_task, pad))
        # tables of one width and dtype share one Gram: ids offset by the tables before them, padding ids -1
        tables: dict[tuple[int, torch.dtype], tuple[list, list, list, list]] = {}
        for k, calls in by_param.items():
            ids, dy, row_task = (
                torch.cat(parts) if len(parts) > 1 else parts[0] for parts in list(zip(*calls))[:3]
            )
            if self.all_reduce:
                ids, dy, row_task = self._gather_rows(ids, dy, row_task)
            *columns, base = tables.setdefault((dy.shape[1], dy.dtype), ([], [], [], [0, None]))
            pad = calls[0][3]
            if base[0]:
                ids = ids + base[0]
            if pad is not None:
                ids = torch.where(ids == pad + base[0], -1, ids)
                base[1] = -1
            for column, value in zip(columns, (ids, dy, row_task)):
                column.append(value)
            base[0] += self.params[k].shape[0]
        for columns in tables.values():
            ids, dy, row_task = (torch.cat(parts) if len(parts) > 1 else parts[0] for parts in columns[:3])
            self._gram_parts.append(embedding_row_gram(ids, dy, row_task, t, columns[3][1]))
        if self._gram_parts:
            self._gram.add_(torch.stack(self._gram_parts).sum(0, dtype=torch.float64))
            self._gram_parts = []
        return self._gram.to(torch.float32)

    def _grouped_problems(self) -> list[tuple[list[int], tuple]]:
        """:attr:`_grouped` as the multi-Linear ops' problems, one group per dtype: ``(weights k, args)``."""
        groups: dict[torch.dtype, tuple[list[int], tuple[list, list, list, list, list, list]]] = {}
        for k, calls in self._grouped.items():
            keys, args = groups.setdefault(calls[0][1].dtype, ([], ([], [], [], [], [], [])))
            for rows, dy, x in calls:
                for column, value in zip(
                    args, (dy, x, rows.plan.row_index, rows.plan.task_row_offsets, len(keys))
                ):
                    column.append(value)
            args[5].append(k in self._bias_of)
            keys.append(k)
        return list(groups.values())

    def _gather_rows(
        self, ids: torch.Tensor, dy: torch.Tensor, row_task: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Data parallel: every rank's embedding rows (``dy`` over the world size), zero-padded."""
        world = dist.get_world_size(self.process_group)
        n = torch.tensor([ids.shape[0]], dtype=torch.int64, device=self.device)
        counts = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(counts, n, group=self.process_group)
        longest = max(int(c) for c in counts)  # host read: data parallel apply reads on the host anyway
        pad = longest - ids.shape[0]
        ids = torch.cat([ids, ids.new_zeros(pad)])
        row_task = torch.cat([row_task, row_task.new_zeros(pad)])
        dy = torch.cat([dy.float() / world, dy.new_zeros(pad, dy.shape[1], dtype=torch.float32)])
        out = []
        for x in (ids, dy, row_task):
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous(), group=self.process_group)
            out.append(torch.cat(parts))
        return out[0], out[1], out[2]

    def _write_update(self, weights: torch.Tensor, touched: Sequence[Sequence[Any]]) -> None:
        """``sum_t weights[t] g_t`` into the shared gradients, the kept tensors freed as they are used."""
        t = self.num_tasks
        c = weights.to(torch.float32).reshape(t)
        used = [any(touched[i][k] for i in range(t)) for k in range(len(self.params))]
        left = Counter(entry[0] for entry in (*self._linears, *self._embeddings))
        grads: dict[int, torch.Tensor] = {}
        done: set[int] = set()
        row_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # c_row [N, 1] per distinct row_task

        def c_row_of(row_task: torch.Tensor) -> torch.Tensor:
            if id(row_task) not in row_weights:
                row_weights[id(row_task)] = (row_task, c.index_select(0, row_task)[:, None])
            return row_weights[id(row_task)][1]

        def hand_over(k: int) -> None:
            g = grads.pop(k, None)
            self.grad_setter(self.params[k], g.to(self.grad_dtype) if used[k] and g is not None else None)
            done.add(k)

        def hand_over_flat(flat: torch.Tensor, keys: Iterable[int]) -> None:
            start = 0
            for k in keys:  # slices, not torch.split: a caller may scale the gradients in place
                grads[k] = flat[start : start + self.numels[k]].view(self.params[k].shape)
                start += self.numels[k]
                hand_over(k)

        if self._small is not None:
            (keys, rows), self._small = self._small, None
            update = c @ rows
            del rows
            hand_over_flat(update, keys)
        for k in list(self._rows):
            grads[k] = (c @ self._rows.pop(k).view(t, -1)).view(self.params[k].shape)
            hand_over(k)
        if self._grouped:  # one launch per dtype for all streamed Linear weights on the kernels path
            from fastpals_kernels import stream_linear  # Triton: the kernels path only

            groups = self._grouped_problems()
            self._grouped = {}
            while groups:  # each group's dy and x freed once combined
                keys, args = groups.pop(0)
                flat = stream_linear.stream_linear_combine(*args, c)
                del args
                with_bias = [(k_w, self._bias_of.get(k_w)) for k_w in keys]  # the weight's, then its bias's
                hand_over_flat(flat, [k for pair in with_bias for k in pair if k is not None])
        while self._linears:
            k, row_task, dy, x = self._linears.pop(0)
            c_row = c_row_of(row_task)
            if dy.dtype == torch.float32:  # c_row scales the narrower of dy and x
                if dy.shape[1] <= x.shape[1]:
                    prod = torch.mm((dy * c_row).t(), x.float())
                else:
                    prod = torch.mm(dy.t(), x.float() * c_row)
                grads[k] = grads[k].add_(prod) if k in grads else prod
            else:  # 16-bit dy / x: fp32 products (as the buffer's fp32 rows), in output-row chunks
                if k not in grads:
                    grads[k] = torch.zeros(self.params[k].shape, dtype=torch.float32, device=self.device)
                x32 = x.float()
                step = max(1, STACK_TEMP_ELEMENTS // max(dy.shape[0], 1))
                for m0 in range(0, dy.shape[1], step):
                    part = dy[:, m0 : m0 + step].float() * c_row
                    grads[k][m0 : m0 + step].addmm_(part.t(), x32)
                del x32
            del dy, x, row_task
            left[k] -= 1
            if not left[k] and not self.all_reduce:
                hand_over(k)
        while self._embeddings:
            k, ids, dy, row_task, pad = self._embeddings.pop(0)
            ids = ids.reshape(-1)
            dy = dy.reshape(ids.numel(), -1)
            if k not in grads:
                grads[k] = torch.zeros(self.params[k].shape, dtype=torch.float32, device=self.device)
            grads[k].index_add_(0, ids, dy.float() * c_row_of(row_task))
            if pad is not None:
                grads[k][pad].zero_()
            del dy, ids, row_task
            left[k] -= 1
            if not left[k] and not self.all_reduce:
                hand_over(k)
        if self.all_reduce and grads:
            ks = sorted(grads)
            flat = torch.cat([grads.pop(k).reshape(-1) for k in ks])
            flat.div_(dist.get_world_size(self.process_group))
            dist.all_reduce(flat, group=self.process_group)
            hand_over_flat(flat, ks)
        for k in range(len(self.params)):
            if k not in done:
                hand_over(k)

    def _end_step(self) -> None:
        super()._end_step()
        self._reset()

    _repr_fields = ("policy", "keep_bytes")
