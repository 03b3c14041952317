# ruff: noqa: ANN001 - Triton kernel parameters are untyped by design
"""The fused Projected Attention Layer: ``residual + act(V^D_t · MHA_t(V^E_t · h))`` for a mixed-task batch.

Four launches forward, all grouped by task with one row plan built once per call:

1. :class:`EncQKVFunction`: the grouped GEMM ``s = V^E_t h + b`` (stored: the QKV weight gradient needs it),
   then the grouped GEMM ``qkv = W^{QKV}_t s + b``, both tiled in 64-wide column tiles of the PAL width (an
   earlier single kernel held ``s`` for the whole width rounded up to a power of two, which overflowed the
   shared memory of every GPU at d_s = 276);
2. :func:`fastpals_kernels.pal_attention_triton.pal_attention` (flash-style, small head dims) on strided Q/K/V views
   of the packed QKV output;
3. the grouped V^D GEMM of :mod:`fastpals_kernels.grouped_linear` with bias, exact GELU and the residual add
   (the layer's pre-LayerNorm sum) as its epilogue.

Backward: grouped input-gradient GEMMs and per-task weight-gradient GEMMs (``dW_t = dZ_tᵀ X_t``) for the
three projections, the attention kernel's own backward, the GELU derivative folded into the V^D gradients.

Internal layout (:func:`pal_layout`; parameters keep their names and shapes): every 16-bit load is 16-byte
aligned and unmasked in groups of 8, so Triton vectorises it and pipelines it with ``cp.async``. ``s`` is stored
at its row-aligned width (204 -> 208) with zero columns; each head of Q, K, V and of the attention output is
zero-padded to a multiple of 8 (34 -> 40, 17 -> 24, 46 -> 48). Each call copies the QKV weight and bias and the
V^D weight into that layout (:class:`_ZeroPadded`, the same single copy as the cast autocast does anyway; the
weights are small next to the activations); the zero rows and columns give zero Q/K/V pads, which add nothing to
``QKᵀ`` (the softmax keeps the true head dim's scale) and give zero output pads, which meet zero V^D columns.
The weight gradients of the pads are dropped on the way back to the parameters' shapes.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from fastpals_kernels.common import (
    ROW_ALIGN,
    TaskRowPlan,
    autocast_dtype,
    cast_floats,
    task_row_plan,
)
from fastpals_kernels.grouped_linear import (
    grouped_linear_rows,
    grouped_mm_rows,
    grouped_wgrad_rows,
    row_block,
)
from fastpals_kernels.pal_attention_triton import pal_attention, pal_attention_varlen

__all__ = ["HEAD_ALIGN", "EncQKVFunction", "PALLayout", "pal", "pal_layout", "pal_varlen"]

#: inside the fused PAL every head is zero-padded to a multiple of this many elements (16 bytes of 16-bit data)
HEAD_ALIGN = 8


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class PALLayout(NamedTuple):
    """The fused PAL's internal (zero-padded) widths for a PAL width ``d_s`` and ``heads`` heads."""

    heads: int
    head_dim: int  # d_s / heads: the softmax scale is 1 / sqrt(head_dim)
    head_dim_pad: int  # head_dim rounded up to HEAD_ALIGN: Q, K, V and the attention output per head
    s_width: int  # V^E output ``s``: d_s rounded up to ROW_ALIGN, the pad columns zero

    @property
    def qkv_width(self) -> int:
        return 3 * self.heads * self.head_dim_pad

    @property
    def ctx_width(self) -> int:
        return self.heads * self.head_dim_pad


def pal_layout(d_s: int, heads: int) -> PALLayout:
    """:class:`PALLayout` of a PAL of width ``d_s`` with ``heads`` heads (``heads`` divides ``d_s``)."""
    head_dim = d_s // heads
    return PALLayout(heads, head_dim, _round_up(head_dim, HEAD_ALIGN), _round_up(d_s, ROW_ALIGN))


class _ZeroPadded(torch.autograd.Function):
    """``x`` cast to ``dtype`` in the leading corner of a zero tensor of shape ``shape``; backward: the corner of
    the gradient, cast back to x's dtype (the pads' gradient is dropped). One copy each way, fused with the cast."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, shape: tuple, dtype: torch.dtype
    ) -> torch.Tensor:
        ctx.corner = tuple(slice(0, n) for n in x.shape)
        ctx.x_dtype = x.dtype
        out = x.new_zeros(shape, dtype=dtype)
        out[ctx.corner].copy_(x)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        corner = grad[ctx.corner]
        return torch.empty(corner.shape, dtype=ctx.x_dtype, device=grad.device).copy_(corner), None, None


def _zero_padded(x: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """:class:`_ZeroPadded`, or just the cast when there is nothing to pad."""
    if tuple(x.shape) == tuple(shape):
        return x.to(dtype)
    return _ZeroPadded.apply(x, tuple(shape), dtype)


def _padded_weights(
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dec_weight: torch.Tensor,
    lay: PALLayout,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The QKV weight ``[T, qkv_width, s_width]``, QKV bias ``[T, qkv_width]`` and V^D weight
    ``[T, d, ctx_width]`` in the kernels' layout (see the module docstring), in ``dtype``, differentiable."""
    num_tasks, d = dec_weight.shape[:2]
    heads, hd, hdp = lay.heads, lay.head_dim, lay.head_dim_pad
    d_s = heads * hd
    wq = _zero_padded(
        qkv_weight.reshape(num_tasks, 3, heads, hd, d_s), (num_tasks, 3, heads, hdp, lay.s_width), dtype
    )
    bq = _zero_padded(qkv_bias.reshape(num_tasks, 3, heads, hd), (num_tasks, 3, heads, hdp), dtype)
    wd = _zero_padded(dec_weight.reshape(num_tasks, d, heads, hd), (num_tasks, d, heads, hdp), dtype)
    return (
        wq.view(num_tasks, lay.qkv_width, lay.s_width),
        bq.view(num_tasks, lay.qkv_width),
        wd.view(num_tasks, d, lay.ctx_width),
    )


def _enc_qkv_forward(
    x: torch.Tensor,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    plan: TaskRowPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x V^E_t^T + b^E_t`` (rounded to x's dtype, as the reference does) and ``qkv = s W^QKV_t^T +
    b^QKV_t``: two grouped GEMMs whose output tiles cut the PAL width (204, 276, 720, 864, ...) into 64-wide
    column tiles, so no width is rounded up to a power of two and every tile fits the shared memory of
    sm_75/sm_80/sm_90 (see tests/test_aot.py). ``s`` is written at the padded QKV weight's width (zero
    columns past d_s) and kept for the QKV weight gradient."""
    s, _ = grouped_mm_rows(
        x, enc_weight, plan, bias=enc_bias, aligned_out=True, out_width=qkv_weight.shape[2]
    )
    qkv, _ = grouped_mm_rows(s, qkv_weight, plan, bias=qkv_bias, aligned_out=True)
    return s, qkv


class EncQKVFunction(torch.autograd.Function):
    """``qkv = (x V^E_tᵀ + b^E_t) W^{QKV}_tᵀ + b^{QKV}_t`` over row-major ``x [R, d]`` with a task plan.

    ``qkv_weight [T, N, K]`` may be wider than ``s`` (``K >= d_s``, the extra columns zero): ``s`` is then
    stored ``K`` wide with zero columns, so every GEMM reads it at an aligned width."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        enc_weight: torch.Tensor,
        enc_bias: torch.Tensor,
        qkv_weight: torch.Tensor,
        qkv_bias: torch.Tensor,
        plan: TaskRowPlan,
    ) -> torch.Tensor:
        s, qkv = _enc_qkv_forward(x, enc_weight, enc_bias, qkv_weight, qkv_bias, plan)
        ctx.save_for_backward(x, enc_weight, qkv_weight, s)
        ctx.plan = plan
        return qkv

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, dqkv: torch.Tensor) -> tuple:
        x, enc_weight, qkv_weight, s = ctx.saved_tensors
        plan = ctx.plan
        dqkv = dqkv.contiguous()
        need_x, need_we, need_be, need_wq, need_bq = ctx.needs_input_grad[:5]
        dx = dwe = dbe = dwq = dbq = None
        if need_wq or need_bq:
            dwq, dbq = grouped_wgrad_rows(dqkv, s, plan, qkv_weight.dtype, with_bias=True)
        if need_x or need_we or need_be:
            # ds's columns past d_s meet the zero columns of the QKV weight: zeros, read at the aligned width
            ds, _ = grouped_mm_rows(dqkv, qkv_weight, plan, transpose_weight=True, aligned_out=True)
            if need_x:
                dx, _ = grouped_mm_rows(ds, enc_weight, plan, transpose_weight=True)
            if need_we or need_be:
                dwe, dbe = grouped_wgrad_rows(
                    ds, x, plan, enc_weight.dtype, with_bias=True, out_rows=enc_weight.shape[1]
                )
        return (
            dx,
            dwe if need_we else None,
            dbe if need_be else None,
            dwq if need_wq else None,
            dbq if need_bq else None,
            None,
        )


#: operands cast under autocast by their re-layout copy (:func:`_padded_weights`), not beforehand
_CAST_BY_RELAYOUT = ("qkv_weight", "qkv_bias", "dec_weight")


def _check_pal_weights(
    h: torch.Tensor,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dec_weight: torch.Tensor,
    dec_bias: torch.Tensor,
    num_heads: int,
    residual: torch.Tensor | None,
    cast_later: bool = False,
) -> tuple[int, int, int]:
    """Validate the PAL operands; returns ``(T, d, d_s)``. ``cast_later``: under autocast the QKV and V^D
    weights may have any floating dtype (their re-layout copy casts them)."""
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    for name, w in (("enc_weight", enc_weight), ("qkv_weight", qkv_weight), ("dec_weight", dec_weight)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise ValueError(f"{name} must be a 3-D [T, out, in] tensor, got {getattr(w, 'shape', type(w))}")
    for name, b in (("enc_bias", enc_bias), ("qkv_bias", qkv_bias), ("dec_bias", dec_bias)):
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(b).__name__}")
    num_tasks, d_s, d = enc_weight.shape
    if h.shape[-1] != d:
        raise ValueError(
            f"h has width {h.shape[-1]} but enc_weight is {list(enc_weight.shape)} ([T, d_s, d])"
        )
    if tuple(qkv_weight.shape) != (num_tasks, 3 * d_s, d_s):
        raise ValueError(
            f"qkv_weight must have shape {[num_tasks, 3 * d_s, d_s]}, got {list(qkv_weight.shape)}"
        )
    if tuple(dec_weight.shape) != (num_tasks, d, d_s):
        raise ValueError(f"dec_weight must have shape {[num_tasks, d, d_s]}, got {list(dec_weight.shape)}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or d_s % num_heads:
        raise ValueError(f"num_heads must be a positive int dividing d_s = {d_s}, got {num_heads!r}")
    if h.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"h must be float32, float16 or bfloat16, got {h.dtype}")
    expected = {
        "enc_bias": (num_tasks, d_s),
        "qkv_bias": (num_tasks, 3 * d_s),
        "dec_bias": (num_tasks, d),
        "residual": tuple(h.shape),
    }
    operands = {
        "enc_weight": enc_weight,
        "enc_bias": enc_bias,
        "qkv_weight": qkv_weight,
        "qkv_bias": qkv_bias,
        "dec_weight": dec_weight,
        "dec_bias": dec_bias,
        "residual": residual,
    }
    for name, t in operands.items():
        if t is None:
            continue
        if name in expected and tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} must have shape {list(expected[name])}, got {list(t.shape)}")
        if t.dtype != h.dtype and not (cast_later and name in _CAST_BY_RELAYOUT and t.is_floating_point()):
            raise TypeError(
                f"{name} has dtype {t.dtype} but h has {h.dtype}: all operands must share one dtype"
            )
        if t.device != h.device:
            raise ValueError(f"{name} is on {t.device} but h is on {h.device}")
    return num_tasks, d, d_s


def _pal_operands(h: torch.Tensor, weights: tuple, num_heads: int, residual: torch.Tensor | None) -> tuple:
    """Autocast and validation shared by :func:`pal` and :func:`pal_varlen`: ``(h, weights, residual, outside,
    T)``. Under ``torch.autocast``: h, the V^E weight and bias and the V^D bias in the autocast dtype (the QKV
    and V^D weights are cast by their re-layout copy), and a residual of another dtype moved out of the kernel
    (``outside``, added by the caller: the sum is promoted, as in ``residual + pal_reference``)."""
    cast = autocast_dtype(h)
    outside = None
    if cast is not None:
        enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias = weights
        h, enc_weight, enc_bias, dec_bias = cast_floats(cast, h, enc_weight, enc_bias, dec_bias)
        weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
        if residual is not None and residual.dtype != cast:
            residual, outside = None, residual
    num_tasks, _, _ = _check_pal_weights(h, *weights, num_heads, residual, cast_later=cast is not None)
    return h, weights, residual, outside, num_tasks


def _pal_rows(
    rows: torch.Tensor,
    lead: tuple[int, ...],
    plan: TaskRowPlan,
    attend: object,
    weights: tuple,
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    generator_seed: int | None,
    residual_rows: torch.Tensor | None,
) -> torch.Tensor:
    """Shared body of :func:`pal` and :func:`pal_varlen` over row-major ``rows [R, d]``; ``lead`` is the
    attention's token shape (``(B, L)`` or ``(N,)``) and ``attend(q, k, v, **options)`` its op."""
    enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias = weights
    lay = pal_layout(enc_weight.shape[1], num_heads)
    wq, bq, wd = _padded_weights(qkv_weight, qkv_bias, dec_weight, lay, rows.dtype)
    qkv = EncQKVFunction.apply(
        rows.contiguous(), enc_weight.contiguous(), enc_bias.contiguous(), wq, bq, plan
    )  # [R, qkv_width]
    q, k, v = qkv.view(*lead, 3, lay.heads, lay.head_dim_pad).unbind(len(lead))
    ctx = attend(  # zero columns in the head pads
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=1.0 / math.sqrt(lay.head_dim),
        generator_seed=generator_seed,
        aligned_rows=True,
    )
    ctx = ctx.reshape(rows.shape[0], lay.ctx_width)
    return grouped_linear_rows(ctx, plan, wd, dec_bias, "gelu" if gelu else None, residual_rows)


def pal(
    h: torch.Tensor,
    attention_mask: torch.Tensor | None,
    task_ids: torch.Tensor,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dec_weight: torch.Tensor,
    dec_bias: torch.Tensor,
    num_heads: int,
    gelu: bool = True,
    dropout_p: float = 0.0,
    residual: torch.Tensor | None = None,
    generator_seed: int | None = None,
) -> torch.Tensor:
    """Fused PAL over a padded mixed-task batch: ``residual + pal_reference(h, ...)``.

    h: ``[B, L, d]`` fp32/fp16/bf16; attention_mask: ``[B, L]`` (1 = token, 0 = padding) or None; task_ids:
    ``[B]`` int64 in ``[0, T)``; enc_weight ``[T, d_s, d]``, enc_bias ``[T, d_s]``, qkv_weight
    ``[T, 3 d_s, d_s]``, qkv_bias ``[T, 3 d_s]``, dec_weight ``[T, d, d_s]``, dec_bias ``[T, d]`` in h's dtype;
    num_heads divides d_s (head dim ``d_s / num_heads`` <= 128); gelu: exact GELU after V^D; dropout_p:
    attention-probability dropout (pass 0 at evaluation; the mask is drawn by the attention kernel from
    ``generator_seed``, see :func:`fastpals_kernels.pal_attention_triton.pal_attention_dropout_mask`); residual:
    ``[B, L, d]`` added to the PAL output in the same kernel, or None.
    Returns ``[B, L, d]`` in h's dtype, differentiable in h, the six weights and biases, and residual.
    Under ``torch.autocast`` h and the weights are cast to the autocast dtype first (like ``F.linear``); a
    residual of another dtype is then added outside the kernel (the result dtype is promoted).
    """
    if not isinstance(h, torch.Tensor) or h.dim() != 3:
        raise ValueError(f"h must be a [B, L, d] tensor, got {getattr(h, 'shape', type(h))}")
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    h, weights, residual, outside, num_tasks = _pal_operands(h, weights, num_heads, residual)
    batch, length, d = h.shape
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length):
            raise ValueError(f"attention_mask must be a [B, L] = {[batch, length]} tensor or None")
        if attention_mask.device != h.device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but h is on {h.device}")
    plan = task_row_plan(
        task_ids,
        num_tasks,
        batch * length,
        h.device,
        batch=batch,
        seq_len=length,
        block_rows=row_block(h),
    )
    attend = functools.partial(pal_attention, key_padding_mask=attention_mask)
    res_rows = None if residual is None else residual.reshape(batch * length, d)
    rows = h.reshape(batch * length, d)
    y = _pal_rows(
        rows, (batch, length), plan, attend, weights, num_heads, gelu, dropout_p, generator_seed, res_rows
    ).view(batch, length, d)
    return y if outside is None else outside + y


def pal_varlen(
    h: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    task_ids: torch.Tensor,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dec_weight: torch.Tensor,
    dec_bias: torch.Tensor,
    num_heads: int,
    gelu: bool = True,
    dropout_p: float = 0.0,
    residual: torch.Tensor | None = None,
    generator_seed: int | None = None,
) -> torch.Tensor:
    """Packed form of :func:`pal`: ``residual + pal_varlen_reference(h, cu_seqlens, max_seqlen, ...)``.

    h: ``[N, d]`` with B sequences back to back; cu_seqlens: ``[B+1]`` int32 or int64 (0 first, N last,
    non-decreasing; read on the host once per tensor, so every layer of a forward passing the same tensor syncs
    once); max_seqlen: int >= the longest sequence, computed once by the caller; task_ids: ``[B]``, one task per
    sequence; residual: ``[N, d]`` or None; the rest as in :func:`pal`. Returns ``[N, d]``.
    """
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"h must be packed rows [N, d], got {getattr(h, 'shape', type(h))}")
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    h, weights, residual, outside, num_tasks = _pal_operands(h, weights, num_heads, residual)
    plan = task_row_plan(
        task_ids, num_tasks, h.shape[0], h.device, cu_seqlens=cu_seqlens, block_rows=row_block(h)
    )
    attend = functools.partial(pal_attention_varlen, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    y = _pal_rows(
        h, (h.shape[0],), plan, attend, weights, num_heads, gelu, dropout_p, generator_seed, residual
    )
    return y if outside is None else outside + y
