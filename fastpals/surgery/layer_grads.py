"""The per-layer rules of :func:`fastpals.surgery.per_task_gradients`: autograd functions for the shared
``nn.Linear`` / ``nn.LayerNorm`` / ``nn.Embedding`` whose backward writes each task's gradient of the module's
(detached) parameters, over its rows of the input (:class:`RowTasks`), into its buffer row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastpals_kernels import dispatch
from fastpals_kernels.common import build_task_row_plan, build_task_row_plan_host

# elements of the fp32 temporary of one output-row chunk of a weight gradient written into 16-bit rows
STACK_TEMP_ELEMENTS = 1 << 16


@dataclass
class RowTasks:
    """The task of each row of a flattened input ``[R, d]``: per task a ``slice`` or an int64 index tensor."""

    tasks: list[int]
    slices: dict[int, slice | torch.Tensor]
    row_task: torch.Tensor
    num_rows: int
    seq_len: int | None = None
    cu_seqlens: torch.Tensor | None = None
    example_tasks: torch.Tensor | None = None  # [B_pass] int64 (device): the task of every example
    plan: Any = None  # the grouped kernel's TaskRowPlan, built on first use
    host_examples: tuple[np.ndarray, np.ndarray] | None = None  # per example its task and rows, host values


BlockState = Any  # a fastpals.surgery.per_task.PerTaskGradients (which imports this module)


@dataclass(eq=False)
class EmbeddingFrame:
    """One call of an embeddings block: its per-example embedding ran?, the broadcast ones summed with it."""

    owner_set: bool = False
    broadcast: list[tuple[nn.Embedding, torch.Tensor]] = field(default_factory=list)
    example_rows: RowTasks | None = None


def _per_task_args(state: BlockState, m: nn.Linear | nn.LayerNorm, x: torch.Tensor) -> tuple | None:
    """``(weight, bias, state, rows, k_w, k_b)`` of a forward of ``m`` on ``x``; None for the exact path."""
    # a forward replayed by activation checkpointing (inside the backward) repeats the first one's answer
    replay = torch._C._current_graph_task_id() != -1
    rows = None if replay else state.rows(tuple(x.shape[:-1]))
    exact = state.ran_exact(m) if replay else rows is None
    state.note_ran(m, exact=exact)
    if exact:
        return None
    if not replay:
        state.forward_calls += 1
    k_b = state.param_index(m.bias) if m.bias is not None else None
    bias = m.bias.detach() if m.bias is not None else None
    return m.weight.detach(), bias, state, rows, state.param_index(m.weight), k_b


def linear_forward(state: BlockState, m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` (``x [..., K]`` -> ``[..., M]``) whose backward writes the per-task ``dW``/``db`` of ``m``."""
    args = _per_task_args(state, m, x)
    if args is None:
        return F.linear(x, m.weight, m.bias)
    return _PerTaskLinear.apply(state.anchor, x, *args)


class _PerTaskLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """``args``: :func:`_per_task_args`' ``(weight, bias, state, rows, k_w, k_b)``."""
        weight, bias, ctx.state, ctx.rows, ctx.k_w, ctx.k_b = args
        ctx.save_for_backward(x, weight)
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
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).to(
            dy2.dtype
        )  # autocast: the GEMMs run in the output gradient's dtype
        if not state.exact_pass:  # the exact path's partial backwards only carry the input gradient through
            # streaming surgery may build the weight's Gram later from the dy and x it keeps
            weight = not state.defers_linear_weight(ctx.k_w, ctx.rows)
            _linear_weight_grads(state, ctx.rows, ctx.k_w, ctx.k_b, dy2, x2, weight)
            state.linear_done(ctx.rows, ctx.k_w, dy2, x2)
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
    """``dW_t = dy_t^T x_t``, ``db_t = sum dy_t`` per task (``dy [R, M]``, ``x [R, K]``) into the rows."""
    if weight and kernels_on(state, dy):
        _linear_weight_grads_grouped(state, rows, k_w, k_b, dy, x)
        return
    if not weight:  # the bias only: one reduction by task for all tasks
        if k_b is not None:
            state.write_segment_sums(k_b, dy, rows)
        return
    sizes = {s.stop - s.start for s in rows.slices.values() if isinstance(s, slice)}
    if len(rows.tasks) > 1 and len(sizes) == 1 and all(isinstance(s, slice) for s in rows.slices.values()):
        # equal, contiguous task segments: one GEMM per segment into its row (faster than bmm on the CPU)
        n = sizes.pop()
        starts = [rows.slices[t].start for t in rows.tasks]
        if starts == [starts[0] + i * n for i in range(len(starts))]:
            seg = slice(starts[0], starts[0] + n * len(starts))
            dyb = dy[seg].view(len(starts), n, dy.shape[1])
            xb = x[seg].view(len(starts), n, x.shape[1])
            out = state.stack_target(k_w, rows.tasks, dy.dtype)
            if out is not None:  # straight into the buffer rows
                for i in range(len(starts)):
                    torch.mm(dyb[i].t(), xb[i], out=out[i])
            else:  # another buffer dtype: per task, output-row chunks (a bounded temporary)
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
        state.write_mm(t, k_w, dy_t.t(), x_t)
        if k_b is not None:
            state.write(t, k_b, dy_t.sum(0))


def kernels_on(state: BlockState, t: torch.Tensor) -> bool:
    """Does the block run the op library's grouped weight-gradient kernel for tensors like ``t``?"""
    if state.use_kernels is not None:
        return state.use_kernels
    return dispatch.backend("grouped_wgrad", t) == "triton"


def row_plan(state: BlockState, rows: RowTasks) -> Any:
    """The grouped weight-gradient kernel's plan of ``rows``, built on first use (shared by every Linear)."""
    if rows.plan is None and rows.host_examples is not None:  # host values: one transfer
        task_ids, lengths = rows.host_examples
        rows.plan = build_task_row_plan_host(task_ids, state.num_tasks, lengths, rows.row_task.device)
    if rows.plan is None:
        example_tasks = rows.example_tasks if rows.example_tasks is not None else state.task_ids
        rows.plan = build_task_row_plan(
            example_tasks, state.num_tasks, rows.num_rows, seq_len=rows.seq_len, cu_seqlens=rows.cu_seqlens
        )
    return rows.plan


def _linear_weight_grads_grouped(
    state: BlockState,
    rows: RowTasks,
    k_w: int,
    k_b: int | None,
    dy: torch.Tensor,
    x: torch.Tensor,
) -> None:
    """All task segments in one launch of the grouped weight-gradient kernel."""
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
    dw, db = dispatch.grouped_wgrad(dy.contiguous(), x.contiguous(), plan, dtype, k_b is not None)
    present = slice(None) if list(rows.tasks) == list(range(dw.shape[0])) else rows.tasks
    state.write_stack(k_w, rows.tasks, dw[present])
    if k_b is not None and db is not None:
        state.write_stack(k_b, rows.tasks, db[present])


def layer_norm_forward(state: BlockState, m: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` (``x [..., d]``) whose backward writes the per-task ``dgamma`` / ``dbeta`` of ``m``."""
    if len(m.normalized_shape) != 1:
        raise ValueError("per_task_gradients supports LayerNorm over the last dimension only")
    args = _per_task_args(state, m, x)
    if args is None:
        return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
    return _PerTaskLayerNorm.apply(state.anchor, x, *args, m.eps)


class _PerTaskLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """``args``: :func:`_per_task_args`' ``(weight, bias, state, rows, k_w, k_b)`` and ``eps``."""
        weight, bias, ctx.state, ctx.rows, ctx.k_w, ctx.k_b, ctx.eps = args
        w = weight.to(x.dtype)
        b = bias.to(x.dtype) if bias is not None else None
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), w, b, ctx.eps)
        ctx.save_for_backward(x, weight, bias if bias is not None else weight, mean, rstd)
        ctx.has_bias = bias is not None
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


def embedding_forward(state: BlockState, m: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """``m(ids)`` (``[B, L]``, packed ``[N]`` or broadcast ``[L]``) writing ``m``'s per-task rows."""
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
    if owner:  # the pass's examples, for the broadcast embeddings' backward (later passes may hold others)
        frame.example_rows = state.example_rows()
    k = state.param_index(m.weight)
    return _PerTaskEmbedding.apply(
        state.anchor, ids, m.weight.detach(), m.padding_idx, state, rows, frame if owner else None, k
    )


class _PerTaskEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, *args: Any
    ) -> torch.Tensor:
        """``args``: ``(padding_idx, state, rows, frame, k)``, ``frame`` None unless this call owns its frame."""
        ctx.padding_idx, ctx.state, ctx.rows, ctx.frame, ctx.k = args
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight, ctx.padding_idx)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        (ids,) = ctx.saved_tensors
        state: BlockState = ctx.state
        state.mark_backward()
        if state.exact_pass:
            return None, None, None, None, None, None, None, None
        d = dy.shape[-1]
        state.write_embedding(ctx.k, ids.reshape(-1), dy.reshape(-1, d), ctx.rows, ctx.padding_idx)
        frame: EmbeddingFrame | None = ctx.frame
        if frame is not None and frame.broadcast:
            # broadcast embeddings summed with this one: dy summed over each task's examples, at their ids
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
        ctx: Any, anchor: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, *args: Any
    ) -> torch.Tensor:
        """``args``: ``(padding_idx, frame, state)``."""
        padding_idx, ctx.frame, ctx.state = args
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
