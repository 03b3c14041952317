"""The per-layer rules of :func:`fastpals.surgery.per_task_gradients`: autograd functions for the shared
``nn.Linear`` / ``nn.LayerNorm`` / ``nn.Embedding`` modules whose backward writes each task's gradient of the
module's parameters into that task's row of the :class:`~fastpals.surgery.TaskGradientBuffer`.

Rows: a module's input ``x [..., d]`` is flattened to ``[R, d]`` rows (``R = B * L`` padded, ``B`` per example,
``N`` packed tokens); :class:`RowTasks` says which task each row belongs to (built by
:meth:`~fastpals.surgery.per_task.PerTaskGradients.rows`). Per task ``t`` (its rows only):

- :func:`linear_forward`: ``dW_t = dY_t^T X_t`` (``[M, K]``), ``db_t = sum dY_t`` (``[M]``): one GEMM per task
  segment straight into the buffer row (the Triton grouped weight-gradient kernel on CUDA);
- :func:`layer_norm_forward`: ``dgamma_t = sum dY * xhat``, ``dbeta_t = sum dY`` (fp32 sums, one reduction by
  task each);
- :func:`embedding_forward`: ``dY_t`` summed at the ids, every task at once; embeddings looked up once and broadcast
  over the batch (position embeddings, :class:`EmbeddingFrame`) take the gradient of the full-batch embedding they
  are summed with, summed per task over its examples.

Each ``*_forward(state, module, input)`` is what the patched module's forward calls inside the block; the
parameters enter the graph detached (no ordinary ``.grad``); the input gradient is the ordinary one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastpals_kernels import dispatch
from fastpals_kernels.common import build_task_row_plan, build_task_row_plan_host

__all__ = [
    "STACK_TEMP_ELEMENTS",
    "EmbeddingFrame",
    "RowTasks",
    "embedding_forward",
    "layer_norm_forward",
    "linear_forward",
]

# Elements of the fp32 temporary of one output-row chunk of one task's weight gradient when the buffer holds
# another dtype (bf16 rows): 256 KiB, so the 16-bit buffer's peak stays within T * P * 2 bytes of plain training
# (a whole [T, M, K] fp32 product of MiniLM's FFN weights is 6.75 MiB at T = 3).
STACK_TEMP_ELEMENTS = 1 << 16


@dataclass
class RowTasks:
    """Which task each row of a module's flattened input ``[R, d]`` belongs to.

    - ``tasks``: the tasks with at least one row (sorted);
    - ``slices[t]``: a contiguous ``slice`` of rows (batches grouped by task) or an int64 index tensor;
    - ``row_task [R]`` int64 (device): the task of every row (for segmented sums with ``index_add``);
    - ``num_rows`` R, ``starts`` / ``lengths`` (the per-example row ranges, for the grouped kernel).
    """

    tasks: list[int]
    slices: dict[int, slice | torch.Tensor]
    row_task: torch.Tensor
    num_rows: int
    seq_len: int | None = None
    cu_seqlens: torch.Tensor | None = None
    example_tasks: torch.Tensor | None = (
        None  # [B_pass] int64 (device): the task of every example of the pass
    )
    plan: Any = None  # the grouped kernel's TaskRowPlan, built on first use
    host_examples: tuple[np.ndarray, np.ndarray] | None = None  # per example its task and rows, host values


class BlockState(Protocol):
    """What these rules need of the block's state (:class:`fastpals.surgery.per_task.PerTaskGradients`, which
    imports this module, not the other way round): the row maps and the writes into the buffer's rows."""

    anchor: torch.Tensor
    batch: int
    buffer: Any
    num_tasks: int
    task_ids: torch.Tensor | None
    use_kernels: bool | None
    forward_calls: int
    exact_pass: bool  # inside PerTaskGradients.exact_task_gradients: write nothing

    def rows(self, lead: tuple[int, ...]) -> RowTasks | None: ...
    def note_ran(self, m: nn.Module, exact: bool) -> None: ...
    def ran_exact(self, m: nn.Module) -> bool: ...
    def example_rows(self) -> RowTasks: ...
    def packed_ids(self, n: int) -> bool: ...
    def frame_of(self, m: nn.Module) -> EmbeddingFrame: ...
    def param_index(self, p: torch.Tensor) -> int: ...
    def mark_backward(self) -> None: ...
    def linear_done(self, rows: RowTasks, k_w: int, dy: torch.Tensor, x: torch.Tensor) -> None: ...
    def defers_linear_weight(self, k_w: int, rows: RowTasks) -> bool: ...
    def write(self, task: int, k: int, value: torch.Tensor) -> None: ...
    def write_mm(self, task: int, k: int, a: torch.Tensor, b: torch.Tensor) -> None: ...
    def write_stack(self, k: int, tasks: Sequence[int], values: torch.Tensor) -> None: ...
    def write_stack_chunks(
        self, k: int, tasks: Sequence[int], chunks: Iterable[tuple[int, int, torch.Tensor]]
    ) -> None: ...
    def stack_target(self, k: int, tasks: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None: ...
    def write_segment_sums(self, k: int, values: torch.Tensor, rows: RowTasks) -> None: ...
    def write_embedding(
        self, k: int, ids: torch.Tensor, grad: torch.Tensor, rows: RowTasks, padding_idx: int | None
    ) -> None: ...
    def write_broadcast_embedding(
        self, k: int, ids: torch.Tensor, sums: torch.Tensor, tasks: Sequence[int], padding_idx: int | None
    ) -> None: ...


class EmbeddingFrame:
    """One call of an embeddings block: the full-batch embedding that carries the summed gradient, and the
    broadcast embeddings (position embeddings) summed with it."""

    def __init__(self) -> None:
        self.owner_set = False
        self.broadcast: list[tuple[nn.Embedding, torch.Tensor]] = []
        self.example_rows: RowTasks | None = None  # one row per example of the pass that made this frame


def _split_rows(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


def _check_rows(state: BlockState, lead: tuple[int, ...], what: str) -> RowTasks:
    rows = state.rows(lead)
    if rows is None:
        raise ValueError(
            f"per_task_gradients: {what} got an input with leading shape {list(lead)} that does not map to the "
            f"batch's {state.batch} examples (padded [B, L, d], per-example [B, d], or packed [N, d] with "
            "cu_seqlens)"
        )
    return rows


def recomputing() -> bool:
    """True inside a backward (where activation checkpointing runs a layer's forward again)."""
    return torch._C._current_graph_task_id() != -1


def _detached_params(
    state: BlockState, m: nn.Linear | nn.LayerNorm, x: torch.Tensor, what: str
) -> tuple[RowTasks, torch.Tensor, torch.Tensor | None, int, int | None]:
    """One forward of a shared ``m`` on ``x [..., d]``: the row -> task map of ``x`` (checked), ``m``'s weight and
    bias detached, and their indices among the buffer's shared parameters (``k_w``, ``k_b``; None: no bias)."""
    if (
        recomputing()
    ):  # activation checkpointing replays the forward inside the backward: the node made by this
        # replay is never differentiated (its saved tensors fill the first forward's node, whose row map and
        # parameter indices are used), so it is not counted and its rows are not looked up (another encoder pass
        # may be current by now)
        rows = None
    else:
        rows = _check_rows(state, tuple(x.shape[:-1]), what)
        state.forward_calls += 1
    # The parameters enter the graph detached: autograd holds no gradient edge to them (no AccumulateGrad node,
    # so no gradient hook, e.g. DeepSpeed's, fires for them); the backward writes their per-task gradients.
    k_b = state.param_index(m.bias) if m.bias is not None else None
    bias = m.bias.detach() if m.bias is not None else None
    return rows, m.weight.detach(), bias, state.param_index(m.weight), k_b


# ----------------------------------------------------------------------------------------------------------------
# nn.Linear
# ----------------------------------------------------------------------------------------------------------------
def _batch_independent(state: BlockState, m: nn.Module, x: torch.Tensor) -> bool:
    """Is ``x [..., d]`` not split by example (e.g. DeBERTa's relative-position embeddings ``[2k, d]``)? Such a
    module's parameters take the exact path (:meth:`PerTaskGradients.exact_task_gradients`). A forward replayed
    by activation checkpointing repeats the first forward's answer (another encoder pass may be current)."""
    if recomputing():
        return state.ran_exact(m)
    return state.rows(tuple(x.shape[:-1])) is None


def linear_forward(state: BlockState, m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` (``x [..., K]`` -> ``[..., M]``) whose backward writes the per-task ``dW``/``db`` of ``m``."""
    if _batch_independent(
        state, m, x
    ):  # not split by example: ordinary autograd, the exact path gives each task's
        state.note_ran(m, exact=True)
        return F.linear(x, m.weight, m.bias)
    state.note_ran(m, exact=False)
    rows, weight, bias, k_w, k_b = _detached_params(state, m, x, "a shared nn.Linear")
    return _PerTaskLinear.apply(state.anchor, x, weight, bias, state, rows, k_w, k_b)


class _PerTaskLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        state: BlockState,
        rows: RowTasks,
        k_w: int,
        k_b: int | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.state, ctx.rows, ctx.k_w, ctx.k_b = state, rows, k_w, k_b
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        state: BlockState = ctx.state
        state.mark_backward()
        dx = None
        if ctx.needs_input_grad[1]:
            # one 2-D GEMM (a non-contiguous 3-D dy would make matmul batch it against an expanded weight)
            flat = torch.mm(dy.reshape(-1, dy.shape[-1]), weight.to(dy.dtype))
            dx = flat.view(*dy.shape[:-1], weight.shape[1]).to(x.dtype)
        dy2, _ = _split_rows(dy)
        x2, _ = _split_rows(x)
        if x2.dtype != dy2.dtype:  # autocast: the GEMMs run in the output gradient's dtype
            x2 = x2.to(dy2.dtype)
        if not state.exact_pass:  # the exact path's partial backwards only carry the input gradient through
            # streaming surgery may build the weight's Gram later from the kept dy and x (surgery.stream)
            weight = not state.defers_linear_weight(ctx.k_w, ctx.rows)
            _linear_weight_grads(state, ctx.rows, ctx.k_w, ctx.k_b, dy2, x2, weight)
            state.linear_done(ctx.rows, ctx.k_w, dy2, x2)  # streaming surgery keeps dy and x (surgery.stream)
        return None, dx, None, None, None, None, None, None


def _linear_weight_grads(
    state: BlockState,
    rows: RowTasks,
    k_w: int,
    k_b: int | None,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: bool = True,
) -> None:
    """``dW_t = dy_t^T x_t`` and ``db_t = sum dy_t`` per task into the buffer (``dy [R, M]``, ``x [R, K]``;
    ``k_w`` / ``k_b`` the weight's and bias's indices among the buffer's shared parameters; ``weight=False``: the
    bias only)."""
    if weight and _kernels_on(state, dy):
        _linear_weight_grads_grouped(state, rows, k_w, k_b, dy, x)
        return
    if not weight:  # the bias only: one reduction by task for all tasks
        if k_b is not None:
            state.write_segment_sums(k_b, dy, rows)
        return
    sizes = {s.stop - s.start for s in rows.slices.values() if isinstance(s, slice)}
    if len(rows.tasks) > 1 and len(sizes) == 1 and all(isinstance(s, slice) for s in rows.slices.values()):
        # Equal, contiguous task segments: one GEMM per segment straight into its buffer row. (torch.bmm over the
        # T segments splits its threads over the batch: at T = 3 on 2 cores it measured 1.13-1.5x the single
        # weight-gradient GEMM, where T GEMMs of all threads each measured 1.00-1.05x; MiniLM's shapes.)
        n = sizes.pop()
        starts = [rows.slices[t].start for t in rows.tasks]
        if starts == [starts[0] + i * n for i in range(len(starts))]:
            seg = slice(starts[0], starts[0] + n * len(starts))
            dyb = dy[seg].view(len(starts), n, dy.shape[1])
            xb = x[seg].view(len(starts), n, x.shape[1])
            out = state.stack_target(k_w, rows.tasks, dy.dtype) if weight else None
            if out is not None:  # straight into the buffer rows
                for i in range(len(starts)):
                    torch.mm(dyb[i].t(), xb[i], out=out[i])
            elif weight:  # another buffer dtype: per task, output-row chunks (a bounded temporary)
                step = max(1, STACK_TEMP_ELEMENTS // x.shape[1])
                chunks = (
                    (m0, i, torch.mm(dyb[i, :, m0 : m0 + step].t(), xb[i]))
                    for m0 in range(0, dy.shape[1], step)
                    for i in range(len(starts))
                )
                state.write_stack_chunks(k_w, rows.tasks, chunks)
            if k_b is not None:
                state.write_stack(k_b, rows.tasks, dyb.sum(1))
            return
    for t in rows.tasks:
        sel = rows.slices[t]
        dy_t = dy[sel] if isinstance(sel, slice) else dy.index_select(0, sel)
        x_t = x[sel] if isinstance(sel, slice) else x.index_select(0, sel)
        if weight:
            state.write_mm(t, k_w, dy_t.t(), x_t)
        if k_b is not None:
            state.write(t, k_b, dy_t.sum(0))


def _kernels_on(state: BlockState, t: torch.Tensor) -> bool:
    if state.use_kernels is not None:
        return state.use_kernels

    return dispatch.backend("grouped_wgrad", t) == "triton"


def row_plan(state: BlockState, rows: RowTasks) -> Any:
    """The grouped weight-gradient kernel's :class:`~fastpals_kernels.common.TaskRowPlan` of ``rows``: built on
    first use, one per row layout, shared by every Linear of that layout."""
    if rows.plan is None and rows.host_examples is not None:  # host values: one transfer
        task_ids, lengths = rows.host_examples
        rows.plan = build_task_row_plan_host(task_ids, state.num_tasks, lengths, rows.row_task.device)
    if rows.plan is None:
        example_tasks = rows.example_tasks if rows.example_tasks is not None else state.task_ids
        rows.plan = build_task_row_plan(
            example_tasks, state.num_tasks, rows.num_rows, seq_len=rows.seq_len, cu_seqlens=rows.cu_seqlens
        )
    return rows.plan


def kernels_on(state: BlockState, t: torch.Tensor) -> bool:
    """Does the block run the op library's grouped weight-gradient kernel for tensors like ``t``?"""
    return _kernels_on(state, t)


def _linear_weight_grads_grouped(
    state: BlockState,
    rows: RowTasks,
    k_w: int,
    k_b: int | None,
    dy: torch.Tensor,
    x: torch.Tensor,
) -> None:
    """All task segments in one launch of the grouped weight-gradient kernel (fp32 accumulation), straight into
    the rows when every task's rows are written here for the first time; otherwise into a ``[T, M, K]``
    temporary in the buffer's dtype, then one copy (or add) into the rows (:meth:`write_stack`)."""

    plan = row_plan(state, rows)
    dtype = torch.float32 if state.buffer.dtype == torch.float32 else dy.dtype
    dw_rows = state.stack_target(k_w, rows.tasks, dtype)
    if dw_rows is not None:
        db_rows = state.stack_target(k_b, rows.tasks, dtype) if k_b is not None else None
        if k_b is None or db_rows is not None:
            dispatch.grouped_wgrad_into(dy.contiguous(), x.contiguous(), plan, dw_rows, db_rows)
            return
        # the bias rows hold an earlier write of this step: the kernel's bias sums go through a temporary
        db_tmp = torch.empty(dw_rows.shape[:2], dtype=dtype, device=dy.device)
        dispatch.grouped_wgrad_into(dy.contiguous(), x.contiguous(), plan, dw_rows, db_tmp)
        state.write_stack(k_b, rows.tasks, db_tmp)
        return
    dw, db = dispatch.grouped_wgrad(
        dy.contiguous(),
        x.contiguous(),
        plan,
        torch.float32 if state.buffer.dtype == torch.float32 else dy.dtype,
        k_b is not None,
    )
    present = slice(None) if list(rows.tasks) == list(range(dw.shape[0])) else rows.tasks
    state.write_stack(k_w, rows.tasks, dw[present])
    if k_b is not None and db is not None:
        state.write_stack(k_b, rows.tasks, db[present])


# ----------------------------------------------------------------------------------------------------------------
# nn.LayerNorm
# ----------------------------------------------------------------------------------------------------------------
def layer_norm_forward(state: BlockState, m: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` (``x [..., d]``, normalized over the last dimension) whose backward writes the per-task
    ``dgamma``/``dbeta`` of ``m``."""
    if len(m.normalized_shape) != 1:
        raise ValueError("per_task_gradients supports LayerNorm over the last dimension only")
    if _batch_independent(state, m, x):
        state.note_ran(m, exact=True)
        return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
    state.note_ran(m, exact=False)
    rows, weight, bias, k_w, k_b = _detached_params(state, m, x, "a shared nn.LayerNorm")
    return _PerTaskLayerNorm.apply(state.anchor, x, weight, bias, m.eps, state, rows, k_w, k_b)


class _PerTaskLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
        state: BlockState,
        rows: RowTasks,
        k_w: int,
        k_b: int | None,
    ) -> torch.Tensor:
        w = weight.to(x.dtype)
        b = bias.to(x.dtype) if bias is not None else None
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), w, b, eps)
        ctx.save_for_backward(x, weight, bias if bias is not None else weight, mean, rstd)
        ctx.state, ctx.rows, ctx.has_bias, ctx.k_w, ctx.k_b = state, rows, bias is not None, k_w, k_b
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        state: BlockState = ctx.state
        state.mark_backward()
        d = x.shape[-1]
        dx = None
        if ctx.needs_input_grad[1]:
            w = weight.to(x.dtype)
            dx, _, _ = torch.ops.aten.native_layer_norm_backward(
                dy.to(x.dtype), x, [d], mean, rstd, w, bias.to(x.dtype) if ctx.has_bias else None,
                [True, False, False],
            )  # fmt: skip
        if state.exact_pass:
            return None, dx, None, None, None, None, None, None, None
        xhat = torch.native_layer_norm(x.float(), [d], None, None, ctx.eps)[0]  # the forward's, in one launch
        dy2 = dy.reshape(-1, d)
        state.write_segment_sums(ctx.k_w, dy2.float() * xhat.reshape(-1, d), ctx.rows)
        if ctx.k_b is not None:
            state.write_segment_sums(ctx.k_b, dy2, ctx.rows)
        return None, dx, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# nn.Embedding
# ----------------------------------------------------------------------------------------------------------------
def embedding_forward(state: BlockState, m: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """``m(ids)`` (``ids [B, L]``, packed ``[N]``, or broadcast ``[L]`` / ``[1, L]`` int64 -> ``[..., d]``) whose
    backward writes the per-task embedding gradient of ``m``."""
    frame = state.frame_of(m)
    state.note_ran(m, exact=False)
    state.forward_calls += 1
    rows = None
    if ids.dim() >= 2 or (ids.dim() == 1 and state.packed_ids(ids.shape[0])):
        rows = state.rows(tuple(ids.shape))
    if rows is None:  # looked up once for the batch and broadcast over it (position embeddings)
        frame.broadcast.append((m, ids))
        return _BroadcastEmbedding.apply(state.anchor, ids, m.weight.detach(), m.padding_idx, frame, state)
    owner = not frame.owner_set
    frame.owner_set = True
    if (
        owner
    ):  # the pass's examples, for the broadcast embeddings' backward (later passes may hold other rows)
        frame.example_rows = state.example_rows()
    k = state.param_index(m.weight)
    return _PerTaskEmbedding.apply(
        state.anchor, ids, m.weight.detach(), m.padding_idx, state, rows, frame if owner else None, k
    )


class _PerTaskEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        ids: torch.Tensor,
        weight: torch.Tensor,
        padding_idx: int | None,
        state: BlockState,
        rows: RowTasks,
        frame: EmbeddingFrame | None,
        k: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.state, ctx.rows, ctx.frame, ctx.padding_idx, ctx.k = state, rows, frame, padding_idx, k
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        (ids,) = ctx.saved_tensors
        state: BlockState = ctx.state
        state.mark_backward()
        if state.exact_pass:
            return None, None, None, None, None, None, None, None
        d = dy.shape[-1]
        rows: RowTasks = ctx.rows
        state.write_embedding(ctx.k, ids.reshape(-1), dy.reshape(-1, d), rows, ctx.padding_idx)
        frame: EmbeddingFrame | None = ctx.frame
        if frame is not None and frame.broadcast:
            # The broadcast embeddings were summed with this one: their gradient is this dy summed over each
            # task's examples, at their own indices.
            ex_rows = frame.example_rows if frame.example_rows is not None else state.example_rows()
            per_example = dy.reshape(ex_rows.num_rows, -1)
            sums = torch.zeros(state.num_tasks, per_example.shape[1], dtype=torch.float32, device=dy.device)
            sums.index_add_(0, ex_rows.row_task, per_example.float())
            for m, pos in frame.broadcast:
                flat = pos.reshape(-1)
                k = state.param_index(m.weight)
                if per_example.shape[1] != flat.numel() * d:
                    raise ValueError(
                        f"per_task_gradients: broadcast embedding indices {list(pos.shape)} do not match the "
                        f"batch embedding {list(dy.shape)} they are summed with"
                    )
                sums_t = sums.view(state.num_tasks, flat.numel(), d)
                state.write_broadcast_embedding(k, flat, sums_t, ex_rows.tasks, m.padding_idx)
            frame.broadcast = []
        return None, None, None, None, None, None, None, None


class _BroadcastEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        ids: torch.Tensor,
        weight: torch.Tensor,
        padding_idx: int | None,
        frame: EmbeddingFrame,
        state: BlockState,
    ) -> torch.Tensor:
        ctx.frame, ctx.state = frame, state
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        ctx.state.mark_backward()
        if not ctx.frame.owner_set:
            raise RuntimeError(
                "per_task_gradients: an embedding looked up once for the whole batch (position embeddings) is "
                "not summed with a per-example embedding of the same block: its gradient cannot be split by task"
            )
        return None, None, None, None, None, None
