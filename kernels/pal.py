# ruff: noqa: ANN001, ANN202 - the custom ops' hooks mirror their schemas
"""The PAL op: the Projected Attention Layer ``residual + act(V^D_t · MHA_t(V^E_t · h))`` of a mixed-task batch,
each example using the weights of its task ``t`` (``act``: exact GELU or the identity; MHA without an output
projection). Shapes: ``B`` examples, ``L`` padded length, ``N`` packed rows, ``d`` model width, ``T`` tasks,
``d_s`` PAL width, ``H`` heads. Weights, one slice per task: ``enc_weight [T, d_s, d]``, ``enc_bias [T, d_s]``
(V^E); ``qkv_weight [T, 3 d_s, d_s]``, ``qkv_bias [T, 3 d_s]`` (rows Q, K, V); ``dec_weight [T, d, d_s]``,
``dec_bias [T, d]`` (V^D). :func:`run_pal` (what the model calls) runs a registered backend, the custom ops
``torch.ops.fastpals.pal`` / ``pal_varlen`` or :func:`pal_eager`: the references or the Triton :func:`pal` /
:func:`pal_varlen` (grouped GEMMs around :mod:`fastpals_kernels.pal_attention`, heads zero-padded for 16-byte
aligned loads: :func:`pal_layout`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fastpals_kernels.attention_varlen import (
    attention_reference,
    attention_sdpa,
    attention_with_key_bias,
    compiled_attention_serves,
    packed_attention,
)
from fastpals_kernels.backends import backend, registered, require_triton, use_library
from fastpals_kernels.common import (
    ROW_ALIGN,
    TaskRowPlan,
    autocast_dtype,
    cast_floats,
    cdiv,
    check_like,
    recompute_ops,
    seed_for,
    seeded,
    task_row_plan,
)
from fastpals_kernels.grouped_linear import (
    grouped_linear_reference,
    grouped_linear_rows,
    grouped_mm_rows,
    grouped_wgrad_rows,
    row_block,
    segment_linear,
)
from fastpals_kernels.padding import AttentionPlan, bucketed_attention, pad_packed_index
from fastpals_kernels.pal_attention import pal_attention, pal_attention_varlen

__all__ = [
    "PALWeights",
    "PackedSegments",
    "packed_pal_reference",
    "pal",
    "pal_eager",
    "pal_layout",
    "pal_reference",
    "pal_varlen",
    "pal_varlen_reference",
    "run_pal",
]

_WEIGHT_NAMES = ("enc_weight", "enc_bias", "qkv_weight", "qkv_bias", "dec_weight", "dec_bias")


def run_pal(
    h: torch.Tensor,
    args: tuple,
    *,
    mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
    residual: torch.Tensor | None = None,
    segments: Any = None,
) -> torch.Tensor:
    """``residual + PAL(h)`` on the backend :func:`backend` picks: h ``[B, L, d]`` with ``mask [B, L]``, or
    packed rows ``[N, d]`` with ``cu_seqlens [B+1]`` and ``max_seqlen``; args: :meth:`PALWeights.as_args`;
    ``segments``: the :class:`PackedSegments` of packed rows (reference backend)."""
    choice = backend("pal", h)
    ext = registered("pal", choice)
    if ext is not None:
        return ext.impl(h, args, mask=mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, residual=residual)
    if use_library(choice, h):
        seed = seed_for(float(args[-1]))
        if cu_seqlens is not None:
            return torch.ops.fastpals.pal_varlen(h, cu_seqlens, max_seqlen, *args, residual, seed)
        return torch.ops.fastpals.pal(h, mask, *args, residual, seed)
    return pal_eager(h, args, mask=mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, residual=residual,
                     segments=segments, choice=choice)  # fmt: skip


@dataclass(frozen=True, eq=False)
class PALWeights:
    """The weights and options of one PAL op call (what :class:`fastpals.encoder.bert.PALLayer` hands to the op):
    the six weights as in the module docstring (one dtype and device), ``num_heads`` (H, divides d_s), ``gelu``
    (exact GELU after V^D, else the identity) and ``dropout_p`` (attention-probability dropout, 0.0 in eval)."""

    enc_weight: torch.Tensor
    enc_bias: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor
    dec_weight: torch.Tensor
    dec_bias: torch.Tensor
    num_heads: int
    gelu: bool = True
    dropout_p: float = 0.0

    @property
    def num_tasks(self) -> int:
        """T, the number of task slices."""
        return self.enc_weight.shape[0]

    def as_args(self, task_ids: torch.Tensor) -> tuple:
        """``(task_ids, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias, num_heads, gelu,
        dropout_p)``, what the op's functions take after their inputs; ``task_ids [B]`` int64, one per sequence."""
        weights = (getattr(self, name) for name in _WEIGHT_NAMES)
        return task_ids, *weights, self.num_heads, self.gelu, self.dropout_p


def pal_reference(
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
    attention: str = "reference",
) -> torch.Tensor:
    """The task-specific PAL output ``TS_t(h)`` ``[B, L, d]`` of a padded mixed-task batch: h ``[B, L, d]``,
    attention_mask ``[B, L]`` (1 = token) or None, task_ids ``[B]`` int64; attention: ``"reference"``
    (:func:`attention_reference`) or ``"sdpa"`` (:func:`attention_sdpa`)."""
    attend = {"reference": attention_reference, "sdpa": attention_sdpa}.get(attention)
    if attend is None:
        raise ValueError(f"attention must be 'reference' or 'sdpa', got {attention!r}")
    batch, length, _ = h.shape
    d_s = enc_weight.shape[1]
    s = grouped_linear_reference(h, task_ids, enc_weight, enc_bias)  # [B, L, d_s]
    qkv = grouped_linear_reference(s, task_ids, qkv_weight, qkv_bias)  # [B, L, 3 d_s]
    q, k, v = qkv.view(batch, length, 3, num_heads, d_s // num_heads).unbind(2)
    ctx = attend(q, k, v, attention_mask, dropout_p).reshape(batch, length, d_s)
    y = grouped_linear_reference(ctx, task_ids, dec_weight, dec_bias)
    return F.gelu(y) if gelu else y


def pal_varlen_reference(
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
    attention: str = "reference",
) -> torch.Tensor:
    """Packed form of :func:`pal_reference`: h ``[N, d]``, cu_seqlens ``[B+1]`` int32/int64. Returns ``[N, d]``."""
    padded, mask, index = pad_packed_index(h, cu_seqlens, max_seqlen)
    out = pal_reference(
        padded, mask, task_ids, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias,
        num_heads, gelu, dropout_p, attention,
    )  # fmt: skip
    return out.flatten(0, 1).index_select(0, index)


def pal_eager(
    h: torch.Tensor,
    args: tuple,
    *,
    mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
    residual: torch.Tensor | None = None,
    segments: Any = None,
    generator_seed: int | None = None,
    choice: str | None = None,
) -> torch.Tensor:
    """The eager backends of :func:`run_pal` and of the custom ops: the Triton PAL (dropout drawn from
    ``generator_seed`` when given) or the reference with the reference or SDPA attention (the packed reference
    over ``segments`` when given); ``choice``: the backend, :func:`backend`'s for ``h`` when None."""
    choice = backend("pal", h) if choice is None else choice
    if choice == "triton":
        if cu_seqlens is not None:
            return pal_varlen(
                h, cu_seqlens, max_seqlen, *args, residual=residual, generator_seed=generator_seed
            )
        return pal(h, mask, *args, residual=residual, generator_seed=generator_seed)
    attention = "sdpa" if choice == "sdpa" else "reference"
    if attention == "reference" and cu_seqlens is not None and segments is not None:
        ts = packed_pal_reference(h, args, segments, cu_seqlens)
    elif cu_seqlens is not None:
        ts = pal_varlen_reference(h, cu_seqlens, max_seqlen, *args, attention=attention)
    else:
        ts = pal_reference(h, mask, *args, attention=attention)
    return ts if residual is None else residual + ts


class PackedSegments(NamedTuple):
    """Host facts of a packed batch that let the reference PAL skip padded work: ``row_task_ids [N]`` int64,
    ``counts`` (rows per task when rows are grouped by task, else None) and the attention ``plan``."""

    row_task_ids: torch.Tensor
    counts: list[int] | None
    plan: AttentionPlan


def packed_pal_reference(
    h: torch.Tensor, args: tuple, segments: PackedSegments, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`pal_varlen_reference` with the grouped linears on the packed rows only (one GEMM per task when rows
    are grouped by task) and the attention over length buckets (on CPU without their padding where the compiled
    :func:`packed_attention` serves, given ``cu_seqlens``). ``h [N, d]`` → ``[N, d]``."""
    _, enc_w, enc_b, qkv_w, qkv_b, dec_w, dec_b, num_heads, gelu, dropout_p = args
    tasks, counts = segments.row_task_ids, segments.counts

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if counts is not None:
            return segment_linear(x, counts, weight, bias)
        return grouped_linear_reference(x, tasks, weight, bias)

    s = linear(h, enc_w, enc_b)  # [N, d_s]
    n, d_s = s.shape
    q, k, v = linear(s, qkv_w, qkv_b).view(n, 3, num_heads, d_s // num_heads).unbind(1)
    if cu_seqlens is not None and compiled_attention_serves(q, k, v):
        ctx = packed_attention(q, k, v, cu_seqlens, dropout_p, plan=segments.plan)
    else:
        ctx = bucketed_attention(
            q, k, v, segments.plan,
            lambda qb, kb, vb, b: attention_with_key_bias(qb, kb, vb, b.key_bias, dropout_p),
        )  # fmt: skip
    y = linear(ctx.reshape(n, d_s), dec_w, dec_b)
    return F.gelu(y) if gelu else y


#: inside the fused PAL every head is zero-padded to a multiple of this many elements (16 bytes of 16-bit data)
HEAD_ALIGN = 8


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
    return PALLayout(
        heads, head_dim, cdiv(head_dim, HEAD_ALIGN) * HEAD_ALIGN, cdiv(d_s, ROW_ALIGN) * ROW_ALIGN
    )


class _ZeroPadded(torch.autograd.Function):
    """``x`` cast to ``dtype`` in the leading corner of a zero tensor of shape ``shape``; backward: the corner of
    the gradient, cast back to x's dtype (the pads' gradient is dropped). One copy each way, fused with the cast."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
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


def _padded_weights(qkv_weight, qkv_bias, dec_weight, lay: PALLayout, dtype: torch.dtype) -> tuple:
    """The QKV weight ``[T, qkv_width, s_width]``, QKV bias ``[T, qkv_width]`` and V^D weight
    ``[T, d, ctx_width]`` in the kernels' layout (see the module docstring), in ``dtype``, differentiable."""
    num_tasks, d = dec_weight.shape[:2]
    heads, hd, hdp = lay.heads, lay.head_dim, lay.head_dim_pad
    padded = []
    for x, shape, padded_shape, width in (
        (qkv_weight, (3, heads, hd, heads * hd), (3, heads, hdp, lay.s_width), (lay.qkv_width, lay.s_width)),
        (qkv_bias, (3, heads, hd), (3, heads, hdp), (lay.qkv_width,)),
        (dec_weight, (d, heads, hd), (d, heads, hdp), (d, lay.ctx_width)),
    ):
        x = x.reshape(num_tasks, *shape)
        if shape == padded_shape:
            x = x.to(dtype)
        else:
            x = _ZeroPadded.apply(x, (num_tasks, *padded_shape), dtype)
        padded.append(x.view(num_tasks, *width))
    return tuple(padded)


class EncQKVFunction(torch.autograd.Function):
    """``qkv = (x V^E_tᵀ + b^E_t) W^{QKV}_tᵀ + b^{QKV}_t`` over row-major ``x [R, d]`` with a task plan, ``s``
    rounded to x's dtype as the reference does and stored as wide as ``qkv_weight [T, N, K]`` (``K >= d_s``,
    the extra columns zero) so that every GEMM reads it at an aligned width."""

    @staticmethod
    def forward(ctx, x, enc_weight, enc_bias, qkv_weight, qkv_bias, plan: TaskRowPlan) -> torch.Tensor:
        s, _ = grouped_mm_rows(
            x, enc_weight, plan, bias=enc_bias, aligned_out=True, out_width=qkv_weight.shape[2]
        )
        qkv, _ = grouped_mm_rows(s, qkv_weight, plan, bias=qkv_bias, aligned_out=True)
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
        grads = (dx, dwe, dbe, dwq, dbq)
        return *(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None


def _check_pal_weights(h: torch.Tensor, weights: tuple, num_heads: int, residual, cast_later: bool) -> int:
    """Validate the PAL operands; returns T. ``cast_later``: under autocast the QKV and V^D weights may have any
    floating dtype (their re-layout copy casts them)."""
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    for name, t in zip(_WEIGHT_NAMES, weights):
        if name.endswith("weight") and (not isinstance(t, torch.Tensor) or t.dim() != 3):
            raise ValueError(f"{name} must be a 3-D [T, out, in] tensor, got {getattr(t, 'shape', type(t))}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    num_tasks, d_s, d = weights[0].shape
    if h.shape[-1] != d:
        raise ValueError(
            f"h has width {h.shape[-1]} but enc_weight is {list(weights[0].shape)} ([T, d_s, d])"
        )
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or d_s % num_heads:
        raise ValueError(f"num_heads must be a positive int dividing d_s = {d_s}, got {num_heads!r}")
    if h.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"h must be float32, float16 or bfloat16, got {h.dtype}")
    shapes = ((d_s, d), (d_s,), (3 * d_s, d_s), (3 * d_s,), (d, d_s), (d,))
    expected = {name: (num_tasks, *shape) for name, shape in zip(_WEIGHT_NAMES, shapes)}
    expected["residual"] = tuple(h.shape)
    for name, t in zip((*_WEIGHT_NAMES, "residual"), (*weights, residual)):
        if t is None:
            continue
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} must have shape {list(expected[name])}, got {list(t.shape)}")
        # under autocast the QKV and V^D weights are cast by their re-layout copy (_padded_weights)
        relaid = cast_later and name in ("qkv_weight", "qkv_bias", "dec_weight") and t.is_floating_point()
        check_like("h", h, not relaid, **{name: t})
    return num_tasks


def _fused_pal(h, form: tuple[int, ...], plan_options: dict, attend, args: tuple, residual, generator_seed):
    """The body of :func:`pal` and :func:`pal_varlen`: h ``[*form, d]`` (``form``: ``(B, L)`` or ``(N,)``)
    through ``attend(q, k, v, **options)``; ``args`` as in :func:`pal_reference` after its inputs. Under
    autocast the QKV and V^D weights are cast by their re-layout copy, and a residual of another dtype is
    added outside the kernel (the sum promoted, as in ``residual + pal_reference``)."""
    task_ids, *weights, num_heads, gelu, dropout_p = args
    cast = autocast_dtype(h)
    outside = None
    if cast is not None:
        h, weights[0], weights[1], weights[5] = cast_floats(cast, h, weights[0], weights[1], weights[5])
        if residual is not None and residual.dtype != cast:
            residual, outside = None, residual
    num_tasks = _check_pal_weights(h, weights, num_heads, residual, cast_later=cast is not None)
    enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias = weights
    rows = h.reshape(-1, h.shape[-1])
    plan = task_row_plan(
        task_ids, num_tasks, rows.shape[0], h.device, block_rows=row_block(h), **plan_options
    )
    lay = pal_layout(enc_weight.shape[1], num_heads)
    wq, bq, wd = _padded_weights(qkv_weight, qkv_bias, dec_weight, lay, rows.dtype)
    qkv = EncQKVFunction.apply(
        rows.contiguous(), enc_weight.contiguous(), enc_bias.contiguous(), wq, bq, plan
    )
    q, k, v = qkv.view(*form, 3, lay.heads, lay.head_dim_pad).unbind(len(form))
    scale = 1.0 / math.sqrt(lay.head_dim)
    ctx = attend(
        q, k, v, dropout_p=dropout_p, softmax_scale=scale, generator_seed=generator_seed, aligned_rows=True
    )
    res_rows = None if residual is None else residual.reshape(rows.shape)
    y = grouped_linear_rows(
        ctx.reshape(rows.shape[0], lay.ctx_width), plan, wd, dec_bias, "gelu" if gelu else None, res_rows
    )
    y = y.view(h.shape)
    return y if outside is None else outside + y


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
    """Fused PAL over a padded mixed-task batch: ``residual + pal_reference(h, ...)`` ``[B, L, d]``.

    h: ``[B, L, d]`` fp32/fp16/bf16; attention_mask: ``[B, L]`` (1 = token) or None; task_ids: ``[B]`` int64
    in ``[0, T)``; weights as in the module docstring, in h's dtype (cast like ``F.linear`` under autocast);
    num_heads divides d_s (head dim <= 128); dropout_p: its mask drawn from ``generator_seed``
    (:func:`~fastpals_kernels.pal_attention.pal_attention_dropout_mask`); residual: ``[B, L, d]`` or None."""
    require_triton("pal")
    if not isinstance(h, torch.Tensor) or h.dim() != 3:
        raise ValueError(f"h must be a [B, L, d] tensor, got {getattr(h, 'shape', type(h))}")
    batch, length, _ = h.shape
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length):
            raise ValueError(f"attention_mask must be a [B, L] = {[batch, length]} tensor or None")
        check_like("h", h, dtype=False, attention_mask=attention_mask)
    args = (task_ids, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias, num_heads, gelu,
            dropout_p)  # fmt: skip
    attend = functools.partial(pal_attention, key_padding_mask=attention_mask)
    plan_options = {"batch": batch, "seq_len": length}
    return _fused_pal(h, (batch, length), plan_options, attend, args, residual, generator_seed)


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
    """Packed form of :func:`pal`: ``residual + pal_varlen_reference(h, cu_seqlens, max_seqlen, ...)`` ``[N,
    d]``. h: ``[N, d]``; cu_seqlens: ``[B+1]`` int32/int64 (read on the host once per tensor); max_seqlen: an
    int >= the longest sequence; task_ids: ``[B]``; residual: ``[N, d]`` or None; the rest as in :func:`pal`.
    """
    require_triton("pal_varlen")
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"h must be packed rows [N, d], got {getattr(h, 'shape', type(h))}")
    args = (task_ids, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias, num_heads, gelu,
            dropout_p)  # fmt: skip
    attend = functools.partial(pal_attention_varlen, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    return _fused_pal(h, (h.shape[0],), {"cu_seqlens": cu_seqlens}, attend, args, residual, generator_seed)


_ARGS_SCHEMA = ", ".join(["Tensor task_ids", *(f"Tensor {n}" for n in _WEIGHT_NAMES)])
_ARGS_SCHEMA += ", SymInt num_heads, bool gelu, float dropout_p"


def _define_ops(name: str, where: tuple[str, ...], where_schema: str) -> tuple:
    """``fastpals::<name>(h, <where>, task_ids, <six weights>, num_heads, gelu, dropout_p, residual, seed)``:
    ``residual + PAL(h)`` on the backend the dispatch picks for h, its dropout drawn from ``seed``, and its
    backward op (:func:`~fastpals_kernels.common.recompute_ops`). ``where``: the arguments that place the
    tokens (``mask [B, L]`` of h ``[B, L, d]``, or ``cu_seqlens [B+1], max_seqlen`` of h ``[N, d]``)."""
    n = len(where)

    def run(h, *inputs):
        args, residual, seed = inputs[n:-2], inputs[-2], inputs[-1]
        generator_seed = int(seed.reshape(-1)[0]) if args[-1] > 0.0 else None
        with seeded(seed, h.device, args[-1]):
            return pal_eager(h, tuple(args), residual=residual, generator_seed=generator_seed,
                             **{"mask": None, **dict(zip(where, inputs[:n]))})  # fmt: skip

    def fake(h, *inputs):
        residual = inputs[-2]
        dtype = h.dtype if residual is None else torch.promote_types(h.dtype, residual.dtype)
        return h.new_empty(h.shape, dtype=dtype)

    schema = f"Tensor h, {where_schema}, {_ARGS_SCHEMA}, Tensor? residual, Tensor seed"
    return recompute_ops(name, schema, run, (0, *range(n + 2, n + 8)), fake, residual=n + 11)


pal_op, pal_backward_op = _define_ops("pal", ("mask",), "Tensor? mask")
pal_varlen_op, pal_varlen_backward_op = _define_ops(
    "pal_varlen", ("cu_seqlens", "max_seqlen"), "Tensor cu_seqlens, SymInt max_seqlen"
)
