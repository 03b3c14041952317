# ruff: noqa: ANN001, ANN202 - Triton kernel parameters and the custom ops' fake hooks mirror their schemas
"""The grouped linear op ``y = residual + act(x @ weight[task].T + bias[task])`` of a mixed-task batch: the
PyTorch reference (one GEMM per task), the Triton grouped GEMMs over row tiles that never straddle tasks, and
the per-task weight gradients as ops (:func:`grouped_wgrad`). fp32 accumulation, IEEE fp32 dots (no TF32)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

from fastpals_kernels.backends import backend, registered, require_triton
from fastpals_kernels.common import (
    BUFFER_DTYPES,
    TaskRowPlan,
    TritonKernel,
    aligned_rows,
    autocast_dtype,
    cdiv,
    check_like,
    device_context,
    dot_flags,
    last_dim_contiguous,
    next_power_of_2,
    per_sample_vmap,
    plan_row_tasks,
    target_arch,
    task_row_plan,
)
from fastpals_kernels.tl_helpers import cast_rne, dot_acc, gelu_grad

if TYPE_CHECKING:
    import triton.language as tl

__all__ = [
    "grouped_linear",
    "grouped_linear_reference",
    "grouped_linear_varlen",
    "grouped_wgrad",
    "grouped_wgrad_into",
    "segment_linear",
]


def grouped_linear_reference(
    x: torch.Tensor, task_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``y[b] = x[b] @ weight[task_ids[b]].T + bias[task_ids[b]]``: x ``[B, ..., K]``, task_ids ``[B]`` int64,
    weight ``[T, M, K]``, bias ``[T, M]`` or None → ``[B, ..., M]`` in x's dtype; under ``torch.compile`` one
    batched matmul against each example's gathered weight (no host read of the per-task counts)."""
    if torch.compiler.is_compiling():
        w = weight.index_select(0, task_ids)  # [B, M, K]
        rows = x.reshape(x.shape[0], -1, x.shape[-1])  # [B, R, K]
        y = torch.bmm(rows, w.transpose(1, 2))
        if bias is not None:
            y = y + bias.index_select(0, task_ids)[:, None, :]
        return y.reshape(*x.shape[:-1], weight.shape[1])
    counts = torch.bincount(task_ids, minlength=weight.shape[0]).tolist()  # one host sync
    if x.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[1])
    order = torch.argsort(task_ids, stable=True)
    x_sorted = x.index_select(0, order)
    per_example = x[0].numel() // x.shape[-1]  # rows of one example
    y = segment_linear(x_sorted.reshape(-1, x.shape[-1]), [n * per_example for n in counts], weight, bias)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y.view(*x.shape[:-1], weight.shape[1]).index_select(0, inverse)


def segment_linear(
    x: torch.Tensor, counts: list[int], weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """:func:`grouped_linear_reference` for rows already grouped by task: ``x [N, K]`` holds ``counts[0]``
    rows of task 0, then ``counts[1]`` of task 1, ...; ``weight [T, M, K]``, ``bias [T, M]`` or None → ``[N,
    M]``. One GEMM per task written straight into the output and, in the backward, into one input gradient and
    weight row t (``F.linear`` on slices would add T zero-padded gradients)."""
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"segment_linear: counts {counts} must have one entry per task ({weight.shape[0]}) "
            f"and sum to the rows of x ({x.shape[0]})"
        )
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"segment_linear: x {list(x.shape)} must be [N, K] and weight {list(weight.shape)} [T, M, K]"
        )
    cast = autocast_dtype(x)  # follow torch.autocast as F.linear does: operands cast (differentiably) first
    if cast is not None:
        x, weight = x.to(cast), weight.to(cast)
        bias = None if bias is None else bias.to(cast)
    with torch.autocast(x.device.type, enabled=False):
        return _SegmentLinear.apply(x, weight, bias, tuple(int(n) for n in counts))


class _SegmentLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, counts: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        out = x.new_empty(x.shape[0], weight.shape[1])
        for t, (a, n) in enumerate(_segments(counts)):
            if n and bias is None:
                torch.mm(x[a : a + n], weight[t].t(), out=out[a : a + n])
            elif n:
                torch.addmm(bias[t], x[a : a + n], weight[t].t(), out=out[a : a + n])
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.has_bias = counts, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        grad = grad.contiguous()
        # under torch.func.vmap (e.g. TorchJD's Jacobians) mm(out=...) has no batching rule: the pieces are
        # concatenated instead (not checked while torch.compile traces: dynamo cannot, nor is it vmapped)
        if not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(grad):
            pieces = [(grad[a : a + n], x[a : a + n], t) for t, (a, n) in enumerate(_segments(ctx.counts))]
            gx = torch.cat([g @ weight[t] for g, _, t in pieces]) if need_x else None
            gw = torch.stack([g.t() @ rows for g, rows, _ in pieces]) if need_w else None
            gb = torch.stack([g.sum(0) for g, _, _ in pieces]) if need_b else None
            return gx, gw, gb, None
        gx = x.new_empty(x.shape) if need_x else None
        gw = torch.zeros_like(weight) if need_w else None
        gb = weight.new_zeros(weight.shape[:2]) if need_b else None
        for t, (a, n) in enumerate(_segments(ctx.counts)):
            if n:
                g = grad[a : a + n]
                if gx is not None:
                    torch.mm(g, weight[t], out=gx[a : a + n])
                if gw is not None:
                    torch.mm(g.t(), x[a : a + n], out=gw[t])
                if gb is not None:
                    gb[t] = g.sum(0)
        return gx, gw, gb, None


def _segments(counts: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, count)`` of each task's rows when ``counts[t]`` rows of task t follow those of task t - 1."""
    return list(zip(itertools.accumulate(counts[:-1], initial=0), counts))


@TritonKernel
def _grouped_mm_kernel(
    a_ptr,
    z_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    pre_ptr,
    row_index_ptr,
    tile_task_ptr,
    tile_start_ptr,
    tile_end_ptr,
    N_OUT,
    K_RED,
    N_W,
    K_W,
    stride_a,
    stride_z,
    stride_wt,
    stride_wn,
    stride_wk,
    stride_bt,
    stride_res,
    stride_out,
    stride_pre,
    HAS_BIAS: tl.constexpr,
    GELU: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr,
    GELU_GRAD_PROLOGUE: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[rows] = epilogue(prologue(a[rows]) @ w[task]ᵀ)`` over one task's row tile: ``a``, ``z`` (the
    GELU'-prologue's pre-activation) ``[R, K_RED]`` read through ``row_index``; ``out``, ``res``, ``pre [R,
    N_OUT]``. ``w`` holds ``N_W <= N_OUT`` outputs and ``K_W <= K_RED`` reduction entries, the rest reading as
    zero, so a row-aligned ``a`` or ``out`` runs at its padded width (16-byte vectors, unmasked groups)."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    task = tl.load(tile_task_ptr + tile)
    if task < 0:  # unused tail of the tile list
        return
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    rows = tl.load(row_index_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    nw_mask = offs_n < N_W
    w_base = w_ptr + task.to(tl.int64) * stride_wt

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    z_ptrs = z_ptr + rows[:, None] * stride_z + offs_k[None, :]
    w_ptrs = w_base + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_RED, BLOCK_K):
        k_mask = (k0 + offs_k) < K_RED
        a_mask = m_mask[:, None] & k_mask[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if GELU_GRAD_PROLOGUE:
            z = tl.load(z_ptrs, mask=a_mask, other=0.0)
            a = cast_rne(a.to(tl.float32) * gelu_grad(z.to(tl.float32)), a_ptr.dtype.element_ty, INTERP_BF16)
            z_ptrs += BLOCK_K
        w = tl.load(w_ptrs, mask=((k0 + offs_k) < K_W)[:, None] & nw_mask[None, :], other=0.0)
        acc = dot_acc(a, w, acc, IEEE, INTERP_BF16)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        b = tl.load(bias_ptr + task.to(tl.int64) * stride_bt + offs_n, mask=nw_mask, other=0.0)
        acc += b.to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if STORE_PRE:
        tl.store(
            pre_ptr + rows[:, None] * stride_pre + offs_n[None, :],
            cast_rne(acc, pre_ptr.dtype.element_ty, INTERP_BF16),
            mask=out_mask,
        )
    if GELU:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res + offs_n[None, :], mask=out_mask, other=0.0)
        acc += r.to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_out + offs_n[None, :],
        cast_rne(acc, out_ptr.dtype.element_ty, INTERP_BF16),
        mask=out_mask,
    )


@TritonKernel
def _grouped_wgrad_kernel(
    dy_ptr,
    z_ptr,
    x_ptr,
    dw_ptr,
    db_ptr,
    row_index_ptr,
    task_row_offsets_ptr,
    M,
    K,
    M_OUT,
    stride_dy,
    stride_z,
    stride_x,
    stride_dw,
    stride_db,
    GELU_GRAD_PROLOGUE: tl.constexpr,
    HAS_BIAS_GRAD: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``dw[t] = dz[rows of t]ᵀ x[rows of t]``, ``db[t] = sum of dz[rows of t]`` (fp32 acc): ``dy``, ``z``
    ``[R, M]``, ``x [R, K]``, ``dw [T, M_OUT, K]`` (each task's block row-major, task stride ``stride_dw``),
    ``db [T, M_OUT]``; ``M_OUT <= M``: ``dy`` read at its row-aligned width. A task without rows stores 0."""
    task = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(task_row_offsets_ptr + task)
    end = tl.load(task_row_offsets_ptr + task + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    k_mask = offs_k < K

    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < end
        rows = tl.load(row_index_ptr + offs_r, mask=r_mask, other=0).to(tl.int64)
        g_mask = r_mask[:, None] & m_mask[None, :]
        g = tl.load(dy_ptr + rows[:, None] * stride_dy + offs_m[None, :], mask=g_mask, other=0.0)  # [R, M]
        if GELU_GRAD_PROLOGUE:
            z = tl.load(z_ptr + rows[:, None] * stride_z + offs_m[None, :], mask=g_mask, other=0.0)
            g = cast_rne(g.to(tl.float32) * gelu_grad(z.to(tl.float32)), dy_ptr.dtype.element_ty, INTERP_BF16)
        xt = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [R, K]
        acc = dot_acc(tl.trans(g), xt, acc, IEEE, INTERP_BF16)
        if HAS_BIAS_GRAD:
            db_acc += tl.sum(g.to(tl.float32), axis=0)

    task64 = task.to(tl.int64)
    out_mask = offs_m < M_OUT
    dw_ptrs = dw_ptr + task64 * stride_dw + offs_m[:, None] * K + offs_k[None, :]
    tl.store(
        dw_ptrs, cast_rne(acc, dw_ptr.dtype.element_ty, INTERP_BF16), mask=out_mask[:, None] & k_mask[None, :]
    )
    if HAS_BIAS_GRAD:
        if pid_k == 0:
            tl.store(
                db_ptr + task64 * stride_db + offs_m,
                cast_rne(db_acc, db_ptr.dtype.element_ty, INTERP_BF16),
                mask=out_mask,
            )


def target_class(arch: int | None) -> str:
    """``"sm75"`` / ``"sm80"`` / ``"sm90"`` for a compute capability ``major*10+minor``; ``"interp"`` for None."""
    if arch is None:
        return "interp"
    return "sm75" if arch < 80 else "sm80" if arch < 90 else "sm90"


def grouped_config(dtype: torch.dtype, arch: int | None) -> tuple[int, int, int, int, int]:
    """(rows per tile, N-tile cap, K-tile cap, warps, stages) of the grouped kernels for ``dtype`` on ``arch``
    (None: the interpreter), within shared memory and without 16-bit spills on sm_75/80/90
    (tests/test_aot.py)."""
    if arch is None:
        return 64, 64, 64, 4, 1
    return 32 if dtype == torch.float32 else 64, 64, 32, 8, 2


def row_block(x: torch.Tensor) -> int:
    """Rows per tile of the task plan for operands like ``x`` on the target it compiles for."""
    return grouped_config(x.dtype, target_arch(x))[0]


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """``t``, or for an absent optional operand a ``placeholder`` pointer the kernel does not read."""
    return placeholder if t is None else t


def _row_stride(t: torch.Tensor | None) -> int:
    """``t``'s row stride, 0 for an absent optional operand."""
    return 0 if t is None else t.stride(0)


def _block(n: int, cap: int = 64) -> int:
    """Power-of-two tile edge for a dimension of size n: at least 16 (tl.dot's minimum), at most ``cap``."""
    return max(16, min(cap, next_power_of_2(max(n, 1))))


def grouped_mm_rows(
    a: torch.Tensor,
    weight: torch.Tensor,
    plan: TaskRowPlan,
    transpose_weight: bool = False,
    bias: torch.Tensor | None = None,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
    store_pre: bool = False,
    gelu_grad_pre: torch.Tensor | None = None,
    aligned_out: bool = False,
    out_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The grouped GEMM on row-major ``a [R, K_red]`` → ``(out [R, out_width or N], pre or None)``: ``a @
    weight[t].T`` for weight ``[T, N, K_w]``, or ``a @ weight[t]`` for ``[T, K_w, N]`` with
    ``transpose_weight``; columns beyond ``K_w`` / ``N`` meet zero weights; ``gelu_grad_pre``: ``a`` times
    GELU'(pre) while loading; ``aligned_out``: rows of ``out`` and ``pre`` 16-element aligned
    (:func:`aligned_rows`)."""
    num_rows, k_red = a.shape
    if transpose_weight:
        n_w, k_w = weight.shape[2], weight.shape[1]
        stride_wn, stride_wk = weight.stride(2), weight.stride(1)
    else:
        n_w, k_w = weight.shape[1], weight.shape[2]
        stride_wn, stride_wk = weight.stride(1), weight.stride(2)
    n_out = n_w if out_width is None else out_width
    if k_w > k_red or n_w > n_out:
        raise ValueError(
            f"grouped GEMM: weight extents (N {n_w}, K {k_w}) exceed the operands' ({n_out}, {k_red})"
        )
    alloc = aligned_rows if aligned_out else lambda r, n, dt, dev: torch.empty(r, n, dtype=dt, device=dev)
    out = alloc(num_rows, n_out, a.dtype, a.device)
    pre = alloc(num_rows, n_out, a.dtype, a.device) if store_pre else None
    if num_rows == 0 or n_out == 0:
        return out, pre
    if k_red == 0:
        raise ValueError("grouped linear with an empty reduction dimension (K = 0) is not supported")
    _, cap_n, cap_k, warps, stages = grouped_config(a.dtype, target_arch(a))
    block_n = _block(n_out, cap_n)
    block_k = _block(k_red, cap_k)
    grid = (plan.num_tiles, cdiv(n_out, block_n))
    with device_context(a):
        _grouped_mm_kernel[grid](
            a,
            _or(gelu_grad_pre, a),
            weight,
            _or(bias, weight),
            _or(residual, out),
            out,
            _or(pre, out),
            plan.row_index,
            plan.tile_task,
            plan.tile_start,
            plan.tile_end,
            n_out,
            k_red,
            n_w,
            k_w,
            a.stride(0),
            _row_stride(gelu_grad_pre),
            weight.stride(0),
            stride_wn,
            stride_wk,
            _row_stride(bias),
            _row_stride(residual),
            out.stride(0),
            _row_stride(pre),
            HAS_BIAS=bias is not None,
            GELU=gelu,
            HAS_RESIDUAL=residual is not None,
            STORE_PRE=store_pre,
            GELU_GRAD_PROLOGUE=gelu_grad_pre is not None,
            **dot_flags(a.dtype),
            BLOCK_M=plan.block_rows,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=warps,
            num_stages=stages,
        )
    return out, pre


def grouped_wgrad_rows(
    dy: torch.Tensor,
    x: torch.Tensor,
    plan: TaskRowPlan,
    weight_dtype: torch.dtype,
    with_bias: bool,
    gelu_grad_pre: torch.Tensor | None = None,
    out_rows: int | None = None,
    dw: torch.Tensor | None = None,
    db: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-task ``dW [T, M, K]``, ``db [T, M]`` from ``dy [R, M]`` and ``x [R, K]``; ``out_rows``: only the
    first ``out_rows <= M`` rows (``dy`` read at its aligned width); ``dw`` / ``db``: written into (each
    task's block contiguous, any task stride) instead of new tensors."""
    m, k = dy.shape[1], x.shape[1]
    m_out = m if out_rows is None else out_rows
    if dw is None:
        dw = torch.empty(plan.num_tasks, m_out, k, dtype=weight_dtype, device=dy.device)
    if db is None and with_bias:
        db = torch.empty(plan.num_tasks, m_out, dtype=weight_dtype, device=dy.device)
    if m == 0 or k == 0:
        if db is not None:
            db.zero_()
        return dw.zero_(), db
    _, cap_n, cap_k, warps, stages = grouped_config(dy.dtype, target_arch(dy))
    block_m = _block(m, cap_n)
    block_k = _block(k, cap_k)
    grid = (plan.num_tasks, cdiv(m, block_m), cdiv(k, block_k))
    with device_context(dy):
        _grouped_wgrad_kernel[grid](
            dy,
            _or(gelu_grad_pre, dy),
            x,
            dw,
            _or(db, dw),
            plan.row_index,
            plan.task_row_offsets,
            m,
            k,
            m_out,
            dy.stride(0),
            _row_stride(gelu_grad_pre),
            x.stride(0),
            dw.stride(0),
            _row_stride(db),
            GELU_GRAD_PROLOGUE=gelu_grad_pre is not None,
            HAS_BIAS_GRAD=with_bias,
            **dot_flags(dy.dtype),
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            BLOCK_R=plan.block_rows,
            num_warps=warps,
            num_stages=stages,
        )
    return dw, db


class GroupedLinearFunction(torch.autograd.Function):
    """Autograd op over row-major activations: ``x [R, K]`` -> ``[R, M]`` with a prebuilt task plan."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, plan: TaskRowPlan, activation: str | None) -> torch.Tensor:
        gelu = activation == "gelu"
        y, pre = grouped_mm_rows(x, weight, plan, bias=bias, gelu=gelu, residual=residual, store_pre=gelu)
        ctx.save_for_backward(x, weight, pre)
        ctx.plan, ctx.has_bias, ctx.has_residual = plan, bias is not None, residual is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
        x, weight, pre = ctx.saved_tensors
        dy = dy.contiguous()
        plan = ctx.plan
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx, _ = grouped_mm_rows(dy, weight, plan, transpose_weight=True, gelu_grad_pre=pre)
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            dw, db = grouped_wgrad_rows(dy, x, plan, weight.dtype, ctx.has_bias, gelu_grad_pre=pre)
            dw = dw if ctx.needs_input_grad[1] else None
        dres = dy if ctx.has_residual and ctx.needs_input_grad[3] else None
        return dx, dw, db, dres, None, None


def _autocast(x, weight, bias, residual) -> tuple:
    """Under ``torch.autocast``: (x, weight, bias) in the autocast dtype, and a residual of another dtype moved
    out of the kernel (returned last, to be added by the caller). Outside autocast: the inputs unchanged."""
    cast = autocast_dtype(x) if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) else None
    if cast is None:
        return x, weight, bias, residual, None
    bias = bias.to(cast) if isinstance(bias, torch.Tensor) else bias
    outside = residual if isinstance(residual, torch.Tensor) and residual.dtype != cast else None
    return x.to(cast), weight.to(cast), bias, residual if outside is None else None, outside


def grouped_linear_rows(
    x: torch.Tensor,
    plan: TaskRowPlan,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped linear on row-major ``x [R, K]`` with a plan from :func:`~fastpals_kernels.common.task_row_plan`
    (reused across several layers of one batch, as the fused PAL does). Operands must already be validated."""
    x, bias = last_dim_contiguous(x), None if bias is None else bias.contiguous()
    residual = None if residual is None else last_dim_contiguous(residual)
    return GroupedLinearFunction.apply(x, weight.contiguous(), bias, residual, plan, activation)


def grouped_linear(
    x: torch.Tensor,
    task_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``residual + act(grouped_linear_reference(x, task_ids, weight, bias))`` of a mixed-task batch.

    x: ``[B, L, K]`` or ``[B, K]`` fp32/fp16/bf16; task_ids: ``[B]`` integer in ``[0, T)``; weight: ``[T, M,
    K]``; bias: ``[T, M]`` or None; activation: None or ``"gelu"`` (exact erf); residual: the output's shape
    or None. Returns ``[B, L, M]`` (or ``[B, M]``) in x's dtype. Under autocast the operands are cast like
    ``F.linear``'s and a residual of another dtype is added outside the kernel."""
    return _grouped_linear(x, None, task_ids, weight, bias, activation, residual)


def grouped_linear_varlen(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    task_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed form of :func:`grouped_linear`: x ``[N, K]``, cu_seqlens ``[B+1]`` int32/int64, task_ids
    ``[B]``, residual ``[N, M]`` or None → ``[N, M]``."""
    return _grouped_linear(x, cu_seqlens, task_ids, weight, bias, activation, residual)


def _grouped_linear(x, cu_seqlens, task_ids, weight, bias, activation, residual) -> torch.Tensor:
    """:func:`grouped_linear` (``cu_seqlens`` None) or :func:`grouped_linear_varlen`."""
    packed = cu_seqlens is not None
    require_triton("grouped_linear_varlen" if packed else "grouped_linear")
    x, weight, bias, residual, outside = _autocast(x, weight, bias, residual)
    if outside is not None:
        return outside + _grouped_linear(x, cu_seqlens, task_ids, weight, bias, activation, None)
    out_shape = (x.shape[0], weight.shape[1]) if packed else (*x.shape[:-1], weight.shape[1])
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"weight must be a [T, M, K] tensor, got {getattr(weight, 'shape', type(weight))}")
    if weight.shape[0] < 1:
        raise ValueError("weight must hold at least one task (weight.shape[0] >= 1)")
    if x.dtype not in BUFFER_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[-1] != weight.shape[2]:
        raise ValueError(
            f"x has {x.shape[-1]} features but weight is {list(weight.shape)} ([T, M, K], K must match)"
        )
    check_like("x", x, weight=weight, bias=bias, residual=residual)
    if bias is not None and tuple(bias.shape) != (weight.shape[0], weight.shape[1]):
        raise ValueError(f"bias must have shape {[weight.shape[0], weight.shape[1]]}, got {list(bias.shape)}")
    if residual is not None and tuple(residual.shape) != out_shape:
        raise ValueError(
            f"residual must have the output's shape {list(out_shape)}, got {list(residual.shape)}"
        )
    if activation not in (None, "gelu"):
        raise ValueError(f"activation must be None or 'gelu', got {activation!r}")
    if packed and x.dim() != 2:
        raise ValueError(f"x must be packed rows [N, K], got {list(x.shape)}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [B, L, K] or [B, K], got {list(x.shape)}")
    seq_len = x.shape[1] if x.dim() == 3 else 1
    rows = x.reshape(x.shape[0] * seq_len, x.shape[-1])
    batch, seq_len = (None, None) if packed else (x.shape[0], seq_len)
    plan = task_row_plan(
        task_ids, weight.shape[0], rows.shape[0], x.device, batch, seq_len, cu_seqlens, row_block(x)
    )
    res_rows = None if residual is None else residual.reshape(rows.shape[0], weight.shape[1])
    return grouped_linear_rows(rows, plan, weight, bias, activation, res_rows).view(out_shape)


#: the task plan's fields as the ops' arguments (:func:`_plan_args`)
_PLAN_SCHEMA = (
    "Tensor row_index, Tensor task_row_offsets, Tensor tile_task, Tensor tile_start, Tensor tile_end, "
    "SymInt num_tasks, SymInt block_rows"
)


def _plan_args(plan: TaskRowPlan) -> tuple:
    return (
        plan.row_index,
        plan.task_row_offsets,
        plan.tile_task,
        plan.tile_start,
        plan.tile_end,
        plan.num_tasks,
        plan.block_rows,
    )


def _wgrad_outputs(dy, x, num_tasks: int, with_bias: bool, dtype: torch.dtype) -> tuple:
    """New ``dw [T, M, K]`` and ``db [T, M]`` (``[0]`` without bias) for ``dy [R, M]``, ``x [R, K]``."""
    dw = dy.new_empty(num_tasks, dy.shape[1], x.shape[1], dtype=dtype)
    return dw, dy.new_empty((num_tasks, dy.shape[1]) if with_bias else (0,), dtype=dtype)


def _grouped_wgrad_out(
    dy, x, row_index, offsets, tile_task, tile_start, tile_end, num_tasks, block_rows, dw, db
):
    """Per-task ``dW_t = dY_tᵀ X_t`` and ``db_t = Σ dY_t`` (fp32 accumulation) of ``dy [R, M]``, ``x [R,
    K]`` written into ``dw [T, M, K]`` and ``db [T, M]`` (``[0]``: no bias gradient) in their dtype; each
    ``dw[t]``, ``db[t]`` contiguous, any task stride (e.g. the rows of a surgery buffer)."""
    with_bias = db.numel() > 0
    if backend("grouped_wgrad", dy) == "triton":
        plan = TaskRowPlan(
            row_index, offsets, tile_task, tile_start, tile_end, dy.shape[0], num_tasks, block_rows
        )
        grouped_wgrad_rows(
            dy.contiguous(), x.contiguous(), plan, dw.dtype, with_bias, dw=dw, db=db if with_bias else None
        )
        return
    # the reference: each row's task from the plan (no host read), then one masked fp32 GEMM per task
    row_task = plan_row_tasks(row_index, offsets, dy.shape[0])
    dyf, xf = dy.float(), x.float()
    for t in range(num_tasks):
        dyt = dyf * (row_task == t)[:, None]
        dw[t] = dyt.T @ xf
        if with_bias:
            db[t] = dyt.sum(0)


def _grouped_wgrad(dy, x, *args):
    *plan, with_bias, out_dtype = args
    dw, db = _wgrad_outputs(dy, x, plan[5], with_bias, out_dtype)
    _grouped_wgrad_out(dy, x, *plan, dw, db)
    return dw, db


grouped_wgrad_op = torch.library.custom_op(
    "fastpals::grouped_wgrad",
    _grouped_wgrad,
    mutates_args=(),
    schema=f"(Tensor dy, Tensor x, {_PLAN_SCHEMA}, bool with_bias, ScalarType out_dtype) -> (Tensor, Tensor)",
)
grouped_wgrad_op.register_fake(lambda dy, x, *args: _wgrad_outputs(dy, x, args[5], *args[7:]))
grouped_wgrad_op.register_vmap(per_sample_vmap(grouped_wgrad_op))
grouped_wgrad_out_op = torch.library.custom_op(
    "fastpals::grouped_wgrad_out",
    _grouped_wgrad_out,
    mutates_args=("dw", "db"),
    schema=f"(Tensor dy, Tensor x, {_PLAN_SCHEMA}, Tensor(a!) dw, Tensor(b!) db) -> ()",
)
grouped_wgrad_out_op.register_fake(lambda *args: None)


def grouped_wgrad(
    dy: torch.Tensor, x: torch.Tensor, plan: TaskRowPlan, out_dtype: torch.dtype, with_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-task weight gradients from one backward's rows (``torch.ops.fastpals.grouped_wgrad``): ``dy [R, M]``,
    ``x [R, K]``, ``plan`` a :class:`~fastpals_kernels.common.TaskRowPlan` of the R rows → ``(dW [T, M, K],
    db [T, M] or None)`` in ``out_dtype``, fp32 accumulation."""
    ext = registered("grouped_wgrad", backend("grouped_wgrad", dy))
    if ext is not None:
        return ext.impl(dy, x, plan, out_dtype, with_bias)
    dw, db = torch.ops.fastpals.grouped_wgrad(dy, x, *_plan_args(plan), with_bias, out_dtype)
    return dw, (db if with_bias else None)


def grouped_wgrad_into(
    dy: torch.Tensor, x: torch.Tensor, plan: TaskRowPlan, dw: torch.Tensor, db: torch.Tensor | None
) -> None:
    """:func:`grouped_wgrad` written into ``dw [T, M, K]`` and ``db [T, M]`` (None: no bias gradient) in their
    dtype (``torch.ops.fastpals.grouped_wgrad_out``): each ``dw[t]`` / ``db[t]`` contiguous, any stride between
    tasks (e.g. the rows of a surgery buffer), so no ``[T, M, K]`` temporary is made."""
    ext = registered("grouped_wgrad", backend("grouped_wgrad", dy))
    if ext is not None:
        got_dw, got_db = ext.impl(dy, x, plan, dw.dtype, db is not None)
        dw.copy_(got_dw)
        if db is not None:
            db.copy_(got_db)
        return
    torch.ops.fastpals.grouped_wgrad_out(dy, x, *_plan_args(plan), dw, dw.new_empty(0) if db is None else db)
