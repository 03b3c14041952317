# ruff: noqa: ANN001 - Triton kernel parameters are untyped by design
"""The fused Projected Attention Layer: ``residual + act(V^D_t · MHA_t(V^E_t · h))`` for a mixed-task batch.

Four launches forward, all grouped by task with one row plan built once per call:

1. :class:`EncQKVFunction`: the grouped GEMM ``s = V^E_t h + b`` (stored: the QKV weight gradient needs it),
   then the grouped GEMM ``qkv = W^{QKV}_t s + b``, both tiled in 64-wide column tiles of the PAL width (an
   earlier single kernel held ``s`` for the whole width rounded up to a power of two, which overflowed the
   shared memory of every GPU at d_s = 276);
2. :func:`fastpals.kernels.pal_attention_triton.pal_attention` (flash-style, small head dims) on strided Q/K/V views
   of the packed QKV output;
3. the grouped V^D GEMM of :mod:`fastpals.kernels.grouped_linear_triton` with bias, exact GELU and the residual add
   (the layer's pre-LayerNorm sum) as its epilogue.

Backward: grouped input-gradient GEMMs and per-task weight-gradient GEMMs (``dW_t = dZ_tᵀ X_t``) for the
three projections, the attention kernel's own backward, the GELU derivative folded into the V^D gradients.
"""

from __future__ import annotations

import torch

from fastpals.kernels.common import (
    TaskRowPlan,
    autocast_dtype,
    cast_floats,
    task_row_plan,
)
from fastpals.kernels.grouped_linear_triton import (
    grouped_linear_rows,
    grouped_mm_rows,
    grouped_wgrad_rows,
    row_block,
)
from fastpals.kernels.pal_attention_triton import pal_attention, pal_attention_varlen

__all__ = ["EncQKVFunction", "pal", "pal_varlen"]


def _enc_qkv_forward(
    x: torch.Tensor,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    plan: TaskRowPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x V^E_t^T + b^E_t`` (rounded to x's dtype, as the reference does) and ``qkv = s W^QKV_t^T +
    b^QKV_t``: two grouped GEMMs whose output tiles cut the PAL width (204, 276, 612, 828, ...) into 64-wide
    column tiles, so no width is rounded up to a power of two and every tile fits the shared memory of
    sm_75/sm_80/sm_90 (see tests/test_aot.py). ``s`` is kept for the QKV weight gradient."""
    s, _ = grouped_mm_rows(x, enc_weight, plan, bias=enc_bias, aligned_out=True)
    qkv, _ = grouped_mm_rows(s, qkv_weight, plan, bias=qkv_bias, aligned_out=True)
    return s, qkv


class EncQKVFunction(torch.autograd.Function):
    """``qkv = (x V^E_tᵀ + b^E_t) W^{QKV}_tᵀ + b^{QKV}_t`` over row-major ``x [R, d]`` with a task plan."""

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
            ds, _ = grouped_mm_rows(dqkv, qkv_weight, plan, transpose_weight=True, aligned_out=True)
            if need_x:
                dx, _ = grouped_mm_rows(ds, enc_weight, plan, transpose_weight=True)
            if need_we or need_be:
                dwe, dbe = grouped_wgrad_rows(ds, x, plan, enc_weight.dtype, with_bias=True)
        return (
            dx,
            dwe if need_we else None,
            dbe if need_be else None,
            dwq if need_wq else None,
            dbq if need_bq else None,
            None,
        )


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
) -> tuple[int, int, int]:
    """Validate the PAL operands; returns ``(T, d, d_s)``."""
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
        if t.dtype != h.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but h has {h.dtype}: all operands must share one dtype"
            )
        if t.device != h.device:
            raise ValueError(f"{name} is on {t.device} but h is on {h.device}")
    return num_tasks, d, d_s


def _pal_rows(
    rows: torch.Tensor,
    plan: TaskRowPlan,
    attend: object,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dec_weight: torch.Tensor,
    dec_bias: torch.Tensor,
    gelu: bool,
    residual_rows: torch.Tensor | None,
) -> torch.Tensor:
    """Shared body of :func:`pal` and :func:`pal_varlen` over row-major ``rows [R, d]``."""
    qkv = EncQKVFunction.apply(
        rows.contiguous(),
        enc_weight.contiguous(),
        enc_bias.contiguous(),
        qkv_weight.contiguous(),
        qkv_bias.contiguous(),
        plan,
    )  # [R, 3 d_s]
    ctx = attend(qkv)  # [R, d_s]
    return grouped_linear_rows(ctx, plan, dec_weight, dec_bias, "gelu" if gelu else None, residual_rows)


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
    ``generator_seed``, see :func:`fastpals.kernels.pal_attention_triton.pal_attention_dropout_mask`); residual:
    ``[B, L, d]`` added to the PAL output in the same kernel, or None.
    Returns ``[B, L, d]`` in h's dtype, differentiable in h, the six weights and biases, and residual.
    Under ``torch.autocast`` h and the weights are cast to the autocast dtype first (like ``F.linear``); a
    residual of another dtype is then added outside the kernel (the result dtype is promoted).
    """
    if not isinstance(h, torch.Tensor) or h.dim() != 3:
        raise ValueError(f"h must be a [B, L, d] tensor, got {getattr(h, 'shape', type(h))}")
    cast = autocast_dtype(h)
    if cast is not None:
        h, *weights = cast_floats(cast, h, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
        if (
            residual is not None and residual.dtype != cast
        ):  # the sum is promoted, as in ``residual + pal_reference``
            return residual + pal(
                h, attention_mask, task_ids, *weights, num_heads, gelu, dropout_p, None, generator_seed
            )
        enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias = weights
    num_tasks, d, d_s = _check_pal_weights(
        h, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias, num_heads, residual
    )
    batch, length, _ = h.shape
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
    head_dim = d_s // num_heads

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.view(batch, length, 3, num_heads, head_dim).unbind(2)
        out = pal_attention(
            q, k, v, attention_mask, dropout_p, generator_seed=generator_seed, aligned_rows=True
        )
        return out.reshape(batch * length, d_s)

    res_rows = None if residual is None else residual.reshape(batch * length, d)
    y = _pal_rows(
        h.reshape(batch * length, d), plan, attend, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight,
        dec_bias, gelu, res_rows,
    )  # fmt: skip
    return y.view(batch, length, d)


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
    once); max_seqlen: int >= the longest sequence, computed once by the caller; task_ids: ``[B]``, one task per sequence; residual: ``[N, d]`` or
    None; the rest as in :func:`pal`. Returns ``[N, d]``.
    """
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"h must be packed rows [N, d], got {getattr(h, 'shape', type(h))}")
    cast = autocast_dtype(h)
    if cast is not None:
        h, *weights = cast_floats(cast, h, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
        if residual is not None and residual.dtype != cast:
            out = pal_varlen(
                h,
                cu_seqlens,
                max_seqlen,
                task_ids,
                *weights,
                num_heads,
                gelu,
                dropout_p,
                None,
                generator_seed,
            )
            return residual + out
        enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias = weights
    num_tasks, d, d_s = _check_pal_weights(
        h, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias, num_heads, residual
    )
    plan = task_row_plan(
        task_ids, num_tasks, h.shape[0], h.device, cu_seqlens=cu_seqlens, block_rows=row_block(h)
    )
    head_dim = d_s // num_heads
    num_rows = h.shape[0]

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.view(num_rows, 3, num_heads, head_dim).unbind(1)
        out = pal_attention_varlen(
            q, k, v, cu_seqlens, max_seqlen, dropout_p, generator_seed=generator_seed, aligned_rows=True
        )
        return out.reshape(num_rows, d_s)

    return _pal_rows(
        h, plan, attend, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias, gelu, residual
    )
