# ruff: noqa: ANN001, ANN202 - Triton kernel parameters and the custom ops' hooks mirror their schemas
"""The PAL op: the Projected Attention Layer ``residual + act(V^D_t · MHA_t(V^E_t · h))`` of a mixed-task batch,
each example using the weights of its task ``t`` (``act``: exact GELU or the identity; MHA without an output
projection).

Shapes: ``B`` examples, ``L`` padded length, ``N`` packed rows, ``d`` model width, ``T`` tasks, ``d_s`` PAL
width, ``H`` heads, ``Dh = d_s / H``. Weights, one slice per task: ``enc_weight [T, d_s, d]``, ``enc_bias
[T, d_s]`` (V^E); ``qkv_weight [T, 3 d_s, d_s]``, ``qkv_bias [T, 3 d_s]`` (rows Q, K, V); ``dec_weight
[T, d, d_s]``, ``dec_bias [T, d]`` (V^D).

- :func:`run_pal` (what the model calls): a registered backend, ``torch.ops.fastpals.pal`` / ``pal_varlen``
  (under ``torch.compile`` / fake tensors; backward recomputes the forward), or :func:`pal_eager`;
- references: :func:`pal_reference`, :func:`pal_varlen_reference`, :func:`packed_pal_reference` (grouped
  GEMMs on the packed rows, attention over length buckets: the CPU training path);
- Triton: :func:`pal` / :func:`pal_varlen` run the grouped V^E and QKV GEMMs (:class:`EncQKVFunction`), the
  flash-style :func:`pal_attention` / :func:`pal_attention_varlen` for small head dims, and the grouped V^D GEMM
  with bias, GELU and the residual as its epilogue. Internally every head is zero-padded to a multiple of 8 and
  ``s`` to a multiple of 16 columns (:func:`pal_layout`), so 16-bit loads are 16-byte aligned and vectorised;
  the pads are zero and add nothing.

The attention kernels stream key blocks with an online fp32 softmax and save the row max and normaliser; the
backward recomputes the probabilities (``delta = rowsum(dO * O)``, one kernel for dK/dV per key block, one for
dQ per query block; no atomics). Padded keys get ``finfo(float32).min`` added, as BERT's additive mask.
Dropout keeps entry (b, h, i, j) when ``tl.rand(seed, ((b * H + h) * S + i) * S + j) >= p`` (``S``: ``L`` or
``max_seqlen``), so the backward regenerates the forward's mask and a packed batch drops what the padded one
does (:func:`pal_attention_dropout_mask`).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

from fastpals_kernels.attention_varlen import attention_reference, attention_sdpa, attention_with_key_bias
from fastpals_kernels.backends import backend, registered, require_triton, use_library
from fastpals_kernels.common import (
    ROW_ALIGN,
    TaskRowPlan,
    TritonKernel,
    aligned_rows,
    aot_mode,
    autocast_dtype,
    autograd_vjp,
    cast_floats,
    cdiv,
    check_cu_seqlens,
    cu_seqlens_int32,
    device_context,
    dot_flags,
    last_dim_contiguous,
    next_power_of_2,
    per_sample_vmap,
    seed_for,
    seeded,
    target_arch,
    task_row_plan,
)
from fastpals_kernels.grouped_linear import (
    grouped_linear_reference,
    grouped_linear_rows,
    grouped_mm_rows,
    grouped_wgrad_rows,
    row_block,
    segment_linear,
    target_class,
)
from fastpals_kernels.padding import AttentionPlan, bucketed_attention, pad_packed_index
from fastpals_kernels.tl_helpers import cast_rne, mm

if TYPE_CHECKING:
    import triton.language as tl

__all__ = [
    "HEAD_ALIGN",
    "MAX_HEAD_DIM",
    "EncQKVFunction",
    "PALAttentionFunction",
    "PALAttentionVarlenFunction",
    "PALLayout",
    "PALWeights",
    "PackedSegments",
    "attention_config",
    "packed_pal_reference",
    "pal",
    "pal_attention",
    "pal_attention_dropout_mask",
    "pal_attention_varlen",
    "pal_eager",
    "pal_layout",
    "pal_reference",
    "pal_varlen",
    "pal_varlen_reference",
    "run_pal",
]


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
    """``residual + PAL(h)`` (just ``PAL(h)`` without a residual) on the backend :func:`backend` picks.

    h: ``[B, L, d]`` with ``mask [B, L]``, or packed rows ``[N, d]`` with ``cu_seqlens [B+1]`` and
    ``max_seqlen`` (computed once per forward by the caller); args: ``(task_ids, enc_weight, enc_bias,
    qkv_weight, qkv_bias, dec_weight, dec_bias, num_heads, gelu, dropout_p)`` as in
    :func:`pal_reference`. ``segments`` (packed rows, reference backend): a
    :class:`PackedSegments` of host facts that let the reference skip the padded PAL work. The Triton kernel adds
    the residual in its epilogue. Under ``torch.compile`` on a GPU (or ``$FASTPALS_KERNELS=...,library``) the call is
    ``torch.ops.fastpals.pal`` / ``pal_varlen``.
    """
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
    """The weights and options of one PAL op call (what :class:`fastpals.encoder.bert.PALLayer` hands to the op).

    Weights as in the module docstring, one slice per task (all of one dtype and device):
    ``enc_weight [T, d_s, d]``, ``enc_bias [T, d_s]``, ``qkv_weight [T, 3 d_s, d_s]``, ``qkv_bias [T, 3 d_s]``,
    ``dec_weight [T, d, d_s]``, ``dec_bias [T, d]``; ``num_heads`` (H, divides d_s), ``gelu`` (exact GELU after
    V^D, else the identity) and ``dropout_p`` (attention-probability dropout of this call, 0.0 in eval).
    The op's kernels (``fastpals_kernels``) take these positionally: :meth:`as_args` gives that tuple.
    """

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
        """The positional form ``(task_ids, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias,
        num_heads, gelu, dropout_p)`` that :func:`run_pal`, :func:`pal_reference` and
        :func:`pal_varlen_reference` take after their inputs; ``task_ids [B]`` int64 (one task per sequence)."""
        return (
            task_ids, self.enc_weight, self.enc_bias, self.qkv_weight, self.qkv_bias, self.dec_weight,
            self.dec_bias, self.num_heads, self.gelu, self.dropout_p,
        )  # fmt: skip


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
    """The task-specific PAL output ``TS_t(h)`` for a mixed-task padded batch.

    h: ``[B, L, d]``; attention_mask: ``[B, L]`` (1 = token) or None; task_ids: ``[B]`` int64 (validated by
    the caller with :func:`check_task_ids`); weights as in the module docstring; attention: ``"reference"``
    (:func:`attention_reference`) or ``"sdpa"`` (:func:`attention_sdpa`, the same result through PyTorch's
    fused attention). Returns ``[B, L, d]``.
    """
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
    """Packed form of :func:`pal_reference`: h ``[N, d]``, cu_seqlens ``[B+1]`` int32 or int64, task_ids
    ``[B]``. Returns ``[N, d]``.
    """
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
    """The eager backends of :func:`run_pal` (also what ``torch.ops.fastpals.pal`` / ``pal_varlen`` run): the
    Triton PAL (its attention dropout drawn from ``generator_seed`` when given), or the reference with the
    reference or SDPA attention (the packed reference over ``segments`` when given). ``choice``: the backend, as
    :func:`backend` gives it for ``h`` when None."""
    choice = backend("pal", h) if choice is None else choice
    if choice == "triton":
        if cu_seqlens is not None:
            return pal_varlen(
                h, cu_seqlens, max_seqlen, *args, residual=residual, generator_seed=generator_seed
            )
        return pal(h, mask, *args, residual=residual, generator_seed=generator_seed)
    attention = "sdpa" if choice == "sdpa" else "reference"
    if attention == "reference" and cu_seqlens is not None and segments is not None:
        ts = packed_pal_reference(h, args, segments)
    elif cu_seqlens is not None:
        ts = pal_varlen_reference(h, cu_seqlens, max_seqlen, *args, attention=attention)
    else:
        ts = pal_reference(h, mask, *args, attention=attention)
    return ts if residual is None else residual + ts


class PackedSegments(NamedTuple):
    """Host facts of a packed batch that the reference PAL uses to skip padded work: ``row_task_ids [N]`` int64
    (each row's task), ``counts`` (rows per task when rows are grouped by task, else None) and the attention
    ``plan`` (:class:`~fastpals_kernels.padding.AttentionPlan`)."""

    row_task_ids: torch.Tensor
    counts: list[int] | None
    plan: AttentionPlan


def packed_pal_reference(h: torch.Tensor, args: tuple, segments: PackedSegments) -> torch.Tensor:
    """:func:`pal_varlen_reference` composed of the same reference ops, with the
    grouped linears on the packed tokens only (one GEMM per task slice when rows are grouped by task) and the
    attention over length buckets. ``h [N, d]`` → ``[N, d]``."""
    _, enc_w, enc_b, qkv_w, qkv_b, dec_w, dec_b, num_heads, gelu, dropout_p = args
    tasks, counts = segments.row_task_ids, segments.counts

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if counts is not None:
            return segment_linear(x, counts, weight, bias)
        return grouped_linear_reference(x, tasks, weight, bias)

    s = linear(h, enc_w, enc_b)  # [N, d_s]
    n, d_s = s.shape
    q, k, v = linear(s, qkv_w, qkv_b).view(n, 3, num_heads, d_s // num_heads).unbind(1)
    ctx = bucketed_attention(
        q, k, v, segments.plan,
        lambda qb, kb, vb, b: attention_with_key_bias(qb, kb, vb, b.key_bias, dropout_p),
    )  # fmt: skip
    y = linear(ctx.reshape(n, d_s), dec_w, dec_b)
    return F.gelu(y) if gelu else y


# ================================================================================================================
# Triton: the fused PAL
# ================================================================================================================
#: inside the fused PAL every head is zero-padded to a multiple of this many elements (16 bytes of 16-bit data)
HEAD_ALIGN = 8


def _round_up(n: int, multiple: int) -> int:
    return cdiv(n, multiple) * multiple


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
    ``generator_seed``, see :func:`pal_attention_dropout_mask`); residual:
    ``[B, L, d]`` added to the PAL output in the same kernel, or None.
    Returns ``[B, L, d]`` in h's dtype, differentiable in h, the six weights and biases, and residual.
    Under ``torch.autocast`` h and the weights are cast to the autocast dtype first (like ``F.linear``); a
    residual of another dtype is then added outside the kernel (the result dtype is promoted).
    """
    require_triton("pal")
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
    require_triton("pal_varlen")
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


# ================================================================================================================
# Triton: the PAL attention (host side)
# ================================================================================================================
MAX_HEAD_DIM = 128
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SEED_LIMIT = 2**63


def _interpreting() -> bool:
    """True when Triton defines (or defined) the attention kernels for its CPU interpreter."""
    kernel = _pal_attn_fwd_kernel
    kernel = kernel.jit() if isinstance(kernel, TritonKernel) else kernel
    return type(kernel).__name__ == "InterpretedFunction"


class _Layout(NamedTuple):
    """How the kernels address one call's tokens (see the kernels below)."""

    is_varlen: bool
    batch: int
    seq: int  # L (padded) or max_seqlen (varlen)
    heads: int
    head_dim: int
    rows: int  # B * L (padded) or N (varlen): rows of the fp32 statistics
    stat_stride_b: int  # L (padded) or 0 (varlen)
    mask: torch.Tensor | None  # [B, L] integer view of key_padding_mask
    cu_seqlens: torch.Tensor | None


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int


def _strides(x: torch.Tensor, is_varlen: bool) -> tuple[int, int, int]:
    """(batch, token, head) element strides; varlen tensors have no batch dim (stride 0)."""
    if is_varlen:
        return 0, x.stride(0), x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _clamp_block(block: int, seq: int) -> int:
    return max(16, min(block, next_power_of_2(max(seq, 1))))


# GPU launch configurations (block_m = queries, block_n = keys, warps, stages) per kernel, "fp32 or 16-bit" and
# padded head dim; sm_75 takes one stage (see attention_config). Chosen so that the ahead-of-time compile of every
# launch fits each target's shared memory and the 16-bit kernels do not spill on sm_80/sm_90 (tests/test_aot.py
# asserts both; the spills of the alternatives are in docs/measurements.md).
_BASE_CONFIGS: dict[tuple[str, bool, int], tuple[int, int, int, int]] = {
    # 16-bit (tensor-core mma / wgmma)
    ("fwd", False, 32): (64, 32, 4, 2),
    ("fwd", False, 64): (64, 32, 4, 2),
    ("fwd", False, 128): (32, 32, 4, 2),
    ("dkdv", False, 32): (64, 32, 8, 2),
    ("dkdv", False, 64): (64, 32, 8, 2),
    ("dkdv", False, 128): (16, 32, 4, 2),
    ("dq", False, 32): (64, 32, 4, 2),
    ("dq", False, 64): (64, 32, 4, 2),
    ("dq", False, 128): (32, 32, 4, 2),
    # fp32 (IEEE products on CUDA cores): smaller tiles, the operands take twice the registers
    ("fwd", True, 32): (32, 32, 4, 2),
    ("fwd", True, 64): (32, 32, 4, 2),
    ("fwd", True, 128): (16, 32, 4, 2),
    ("dkdv", True, 32): (32, 32, 4, 2),
    ("dkdv", True, 64): (32, 32, 4, 2),
    ("dkdv", True, 128): (16, 32, 4, 2),
    ("dq", True, 32): (32, 32, 4, 2),
    ("dq", True, 64): (32, 32, 4, 2),
    ("dq", True, 128): (16, 32, 4, 2),
}
_INTERPRETER_BLOCK = 16  # small tiles keep the CPU interpreter fast; never autotuned there


def attention_config(target: str, kernel: str, fp32: bool, block_d: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, warps, stages) of ``kernel`` ("fwd", "dkdv", "dq") on ``target`` ("sm75", "sm80",
    "sm90") for fp32 or 16-bit inputs and a padded head dim ``block_d`` (16 is launched as 32). sm_75 (64 KiB of
    shared memory per block) runs one stage."""
    block_m, block_n, warps, stages = _BASE_CONFIGS[(kernel, fp32, max(32, block_d))]
    return block_m, block_n, warps, 1 if target == "sm75" else stages


def _launch_config(kernel: str, layout: _Layout, q: torch.Tensor) -> _Config:
    """Tile sizes of ``kernel`` ("fwd", "dkdv", "dq") for this call; tiles never exceed the sequence (>= 16)."""
    block_d = max(16, next_power_of_2(layout.head_dim))
    if _interpreting():
        block = _clamp_block(_INTERPRETER_BLOCK, layout.seq)
        return _Config(block, block, block_d, 4, 1)
    target = target_class(target_arch(q))
    block_m, block_n, warps, stages = attention_config(target, kernel, q.dtype == torch.float32, block_d)
    return _Config(
        _clamp_block(block_m, layout.seq), _clamp_block(block_n, layout.seq), block_d, warps, stages
    )


def _check_qkv(q: object, k: object, v: object, ndim: int, form: str) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != ndim:
            raise ValueError(f"{name} must have shape {form}, got {list(x.shape)} ({x.dim()} dims)")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {list(q.shape)}, got {list(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but q has {q.dtype}; q, k and v must share one dtype"
            )
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    head_dim = q.shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (last dim of q) must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if q.device.type != "cuda" and not _interpreting() and not aot_mode():
        raise RuntimeError(
            f"q is on {q.device}: the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set before their "
            "first launch (CPU interpreter); use fastpals.functional.attention_reference on CPU"
        )


def _check_common(dropout_p: object, softmax_scale: object, generator_seed: object) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(float(softmax_scale)):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if generator_seed is not None:
        if isinstance(generator_seed, bool) or not isinstance(generator_seed, numbers.Integral):
            raise TypeError(f"generator_seed must be an int or None, got {type(generator_seed).__name__}")
        if not 0 <= int(generator_seed) < _SEED_LIMIT:
            raise ValueError(f"generator_seed must be in [0, 2**63), got {generator_seed}")


_MAX_SEQ = 65535 * 16  # grid axis 1 (blocks of >= 16 rows) is limited to 65535 on CUDA


def _check_grid_rows(seq: int, name: str) -> None:
    if seq > _MAX_SEQ:
        raise ValueError(f"{name} = {seq} exceeds the longest supported sequence ({_MAX_SEQ} tokens)")


def _padded_layout(q: torch.Tensor, key_padding_mask: object) -> _Layout:
    batch, length, heads, head_dim = q.shape
    mask = None
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(
                f"key_padding_mask must be a torch.Tensor or None, got {type(key_padding_mask).__name__}"
            )
        if key_padding_mask.shape != (batch, length):
            raise ValueError(
                f"key_padding_mask must have shape [B, L] = [{batch}, {length}], got {list(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")
        if key_padding_mask.dtype == torch.bool:
            mask = key_padding_mask.view(torch.uint8)
        elif key_padding_mask.is_floating_point() or key_padding_mask.is_complex():
            raise TypeError(
                f"key_padding_mask must be bool or integer (1 = token, 0 = padding), got {key_padding_mask.dtype}; "
                "an additive float mask is not accepted (convert it with `mask == 0`)"
            )
        else:
            mask = key_padding_mask
    _check_grid_rows(length, "L (q.shape[1])")
    return _Layout(False, batch, length, heads, head_dim, batch * length, length, mask, None)


def _varlen_layout(q: torch.Tensor, cu_seqlens: object, max_seqlen: object) -> _Layout:
    total, heads, head_dim = q.shape
    # The shared rule (int32 or int64, 0 first, non-decreasing, N last, max_seqlen >= longest): one host read
    # per cu_seqlens tensor, not per call, so the PAL of every layer of one forward syncs once.
    batch = check_cu_seqlens(cu_seqlens, total, q.device, max_seqlen=max_seqlen)
    _check_grid_rows(int(max_seqlen), "max_seqlen")
    return _Layout(
        True, batch, int(max_seqlen), heads, head_dim, total, 0, None, cu_seqlens_int32(cu_seqlens)
    )


def _draw_seed(dropout_p: float, generator_seed: int | None) -> int:
    """The Philox seed: ``generator_seed``, else one draw from torch's default (CPU) generator; 0 without dropout.

    Drawing on the CPU generator costs no device sync, follows ``torch.manual_seed`` and is replayed by
    ``torch.utils.checkpoint`` (which restores the CPU RNG state before recomputing).
    """
    if dropout_p == 0.0:
        return 0
    if generator_seed is not None:
        return int(generator_seed)
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _head_align(head_dim: int, *tensors: torch.Tensor) -> int:
    """The kernels' ALIGN hint: 16 or 8 when the head dim and every tensor's head stride are multiples of it (8
    elements are 16 bytes in 16-bit: the fused PAL pads its heads so), else 1 (no hint)."""
    for align in (16, 8):
        if head_dim % align == 0 and all(t.stride(-2) % align == 0 for t in tensors):
            return align
    return 1


def _flags(layout: _Layout, dtype: torch.dtype, dropout_p: float, *tensors: torch.Tensor) -> dict:
    return {
        "IS_VARLEN": layout.is_varlen,
        "HAS_MASK": layout.mask is not None,
        "HAS_DROPOUT": dropout_p > 0.0,
        "ALIGN": _head_align(layout.head_dim, *tensors),
        **dot_flags(dtype),
    }


def _attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: _Layout,
    dropout_p: float,
    scale: float,
    seed: int,
    aligned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns (out like q but contiguous, or with 16-element-aligned rows when
    ``aligned``; stat_m [rows, H]; stat_l [rows, H])."""
    if aligned:  # rows of H * Dh values at a 16-element stride (the PAL's V^D reads them as [R, d_s])
        out = aligned_rows(layout.rows, layout.heads * layout.head_dim, q.dtype, q.device).view(q.shape)
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    stat_m = torch.empty(layout.rows, layout.heads, dtype=torch.float32, device=q.device)
    stat_l = torch.empty_like(stat_m)
    if out.numel() == 0 or layout.seq == 0:
        return out, stat_m, stat_l
    cfg = _launch_config("fwd", layout, q)
    mask = layout.mask if layout.mask is not None else q
    cu = layout.cu_seqlens if layout.cu_seqlens is not None else q
    mask_strides = (mask.stride(0), mask.stride(1)) if layout.mask is not None else (0, 0)
    dropout_scale = 1.0 / (1.0 - dropout_p)
    grid = (layout.batch * layout.heads, cdiv(layout.seq, cfg.block_m))
    with device_context(q):
        _pal_attn_fwd_kernel[grid](
            q, k, v, out, stat_m, stat_l, mask, cu,
            seed, dropout_p, dropout_scale, scale,
            *_strides(q, layout.is_varlen), *_strides(k, layout.is_varlen), *_strides(v, layout.is_varlen),
            *_strides(out, layout.is_varlen), *mask_strides, layout.stat_stride_b,
            layout.heads, layout.seq, layout.head_dim,
            **_flags(layout, q.dtype, dropout_p, q, k, v, out),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out, stat_m, stat_l


def _attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stat_m: torch.Tensor,
    stat_l: torch.Tensor,
    layout: _Layout,
    dropout_p: float,
    scale: float,
    seed: int,
    need_dq: bool,
    need_dkdv: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Launch delta, dK/dV and dQ kernels; gradients come back contiguous in q's dtype."""
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dq else None
    dk = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dkdv else None
    dv = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dkdv else None
    if q.numel() == 0 or layout.seq == 0:
        return dq, dk, dv
    cfg_kv = _launch_config("dkdv", layout, q)
    cfg_q = _launch_config("dq", layout, q)
    mask = layout.mask if layout.mask is not None else q
    cu = layout.cu_seqlens if layout.cu_seqlens is not None else q
    mask_strides = (mask.stride(0), mask.stride(1)) if layout.mask is not None else (0, 0)
    varlen = layout.is_varlen
    delta = torch.empty_like(stat_m)
    dropout_scale = 1.0 / (1.0 - dropout_p)
    bh = layout.batch * layout.heads
    grads = [g for g in (dq, dk, dv) if g is not None]
    flags = _flags(layout, q.dtype, dropout_p, q, k, v, out, dout, *grads)
    # dq, dk and dv share one contiguous layout; any of them gives the strides.
    grad_strides = _strides(grads[0], varlen)
    common = (
        seed, dropout_p, dropout_scale, scale,
        *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(dout, varlen),
        *grad_strides, *mask_strides, layout.stat_stride_b,
        layout.heads, layout.seq, layout.head_dim,
    )  # fmt: skip
    with device_context(q):
        _pal_attn_bwd_delta_kernel[(bh, cdiv(layout.seq, cfg_q.block_m))](
            out, dout, delta, cu,
            *_strides(out, varlen), *_strides(dout, varlen), layout.stat_stride_b,
            layout.heads, layout.seq, layout.head_dim,
            IS_VARLEN=varlen, ALIGN=flags["ALIGN"], BLOCK_M=cfg_q.block_m, BLOCK_D=cfg_q.block_d,
            num_warps=cfg_q.num_warps,
        )  # fmt: skip
        if need_dkdv:
            _pal_attn_bwd_dkdv_kernel[(bh, cdiv(layout.seq, cfg_kv.block_n))](
                q, k, v, dout, dk, dv, stat_m, stat_l, delta, mask, cu, *common, **flags,
                BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, BLOCK_D=cfg_kv.block_d,
                num_warps=cfg_kv.num_warps, num_stages=cfg_kv.num_stages,
            )  # fmt: skip
        if need_dq:
            _pal_attn_bwd_dq_kernel[(bh, cdiv(layout.seq, cfg_q.block_m))](
                q, k, v, dout, dq, stat_m, stat_l, delta, mask, cu, *common, **flags,
                BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, BLOCK_D=cfg_q.block_d,
                num_warps=cfg_q.num_warps, num_stages=cfg_q.num_stages,
            )  # fmt: skip
    return dq, dk, dv


def _run_forward(
    ctx,  # noqa: ANN001 - autograd context
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: _Layout,
    dropout_p: float,
    softmax_scale: float | None,
    generator_seed: int | None,
    aligned: bool = False,
) -> torch.Tensor:
    dropout_p = float(dropout_p)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(layout.head_dim)
    seed = _draw_seed(dropout_p, generator_seed)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    out, stat_m, stat_l = _attention_forward(q, k, v, layout, dropout_p, scale, seed, aligned)
    ctx.save_for_backward(q, k, v, out, stat_m, stat_l, layout.mask, layout.cu_seqlens)
    ctx.layout = layout._replace(mask=None, cu_seqlens=None)
    ctx.dropout_p, ctx.scale, ctx.seed = dropout_p, scale, seed
    return out


def _run_backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
    q, k, v, out, stat_m, stat_l, mask, cu_seqlens = ctx.saved_tensors
    layout = ctx.layout._replace(mask=mask, cu_seqlens=cu_seqlens)
    need_dq = ctx.needs_input_grad[0]
    need_dkdv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    if not (need_dq or need_dkdv):
        return None, None, None
    dq, dk, dv = _attention_backward(
        dout, q, k, v, out, stat_m, stat_l, layout, ctx.dropout_p, ctx.scale, ctx.seed, need_dq, need_dkdv
    )
    return dq, dk if ctx.needs_input_grad[1] else None, dv if ctx.needs_input_grad[2] else None


class PALAttentionFunction(torch.autograd.Function):
    """Autograd op behind :func:`pal_attention`.

    ``apply(q, k, v, key_padding_mask, dropout_p, softmax_scale, generator_seed)``; arguments as in
    :func:`pal_attention` (validated here too).
    """

    @staticmethod
    def forward(
        ctx,  # noqa: ANN001
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        dropout_p: float,
        softmax_scale: float | None,
        generator_seed: int | None,
        aligned_rows: bool = False,
    ) -> torch.Tensor:
        _check_qkv(q, k, v, 4, "[B, L, H, Dh]")
        _check_common(dropout_p, softmax_scale, generator_seed)
        layout = _padded_layout(q, key_padding_mask)
        return _run_forward(ctx, q, k, v, layout, dropout_p, softmax_scale, generator_seed, aligned_rows)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        return (*_run_backward(ctx, dout), None, None, None, None, None)


class PALAttentionVarlenFunction(torch.autograd.Function):
    """Autograd op behind :func:`pal_attention_varlen`.

    ``apply(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, generator_seed)``; arguments as in
    :func:`pal_attention_varlen` (validated here too).
    """

    @staticmethod
    def forward(
        ctx,  # noqa: ANN001
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        dropout_p: float,
        softmax_scale: float | None,
        generator_seed: int | None,
        aligned_rows: bool = False,
    ) -> torch.Tensor:
        _check_qkv(q, k, v, 3, "[N, H, Dh]")
        _check_common(dropout_p, softmax_scale, generator_seed)
        layout = _varlen_layout(q, cu_seqlens, max_seqlen)
        return _run_forward(ctx, q, k, v, layout, dropout_p, softmax_scale, generator_seed, aligned_rows)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        return (*_run_backward(ctx, dout), None, None, None, None, None, None)


def pal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    generator_seed: int | None = None,
    *,
    aligned_rows: bool = False,
) -> torch.Tensor:
    """Multi-head softmax attention over a padded batch; the fused form of ``attention_reference``.

    Args:
        q, k, v: ``[B, L, H, Dh]`` fp32, fp16 or bf16, one dtype and device; any strides on the first three
            dims (e.g. the ``unbind`` of a ``[B, L, 3, H, Dh]`` view of one packed QKV projection), last dim
            contiguous (otherwise copied). ``Dh <= 128``.
        key_padding_mask: ``[B, L]`` bool or integer, 1 = token, 0 = padding; None = no padding. Padded keys
            get ``finfo(float32).min`` added to their score (a sequence with no token averages all keys, as the
            reference does); padded query rows are computed too.
        dropout_p: probability in ``[0, 1)`` of zeroing an attention probability (kept ones scaled by
            ``1 / (1 - dropout_p)``); pass 0 at evaluation.
        softmax_scale: score scale; default ``1 / sqrt(Dh)``.
        generator_seed: Philox seed of the dropout mask (see :func:`pal_attention_dropout_mask`); default: one
            draw from torch's default CPU generator per call.
        aligned_rows: return the ``[B*L, H*Dh]`` rows at a stride padded to 16 elements (the fused PAL's V^D then
            reads 16-byte-aligned rows) instead of contiguous.

    Returns:
        ``[B, L, H, Dh]`` contiguous (or row-aligned), q's dtype. Differentiable in q, k and v.
    """
    require_triton("pal_attention")
    return PALAttentionFunction.apply(
        q, k, v, key_padding_mask, dropout_p, softmax_scale, generator_seed, aligned_rows
    )


def pal_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    generator_seed: int | None = None,
    *,
    aligned_rows: bool = False,
) -> torch.Tensor:
    """Packed (varlen) form of :func:`pal_attention`; the fused form of ``attention_varlen_reference``.

    Args:
        q, k, v: ``[N, H, Dh]`` with the B sequences back to back (any strides on the first two dims, last dim
            contiguous); dtypes and ``Dh`` as in :func:`pal_attention`.
        cu_seqlens: ``[B+1]`` int32 or int64 on q's device, ``cu_seqlens[0] == 0``, non-decreasing,
            ``cu_seqlens[-1] == N`` (empty sequences are allowed). Checked on the host once per tensor (see
            :func:`fastpals_kernels.common.check_cu_seqlens`): one device sync for the first call on it.
        max_seqlen: an int >= the longest sequence; it sizes the grid and the dropout counters.
        dropout_p, softmax_scale, generator_seed: as in :func:`pal_attention`. Position i, j of sequence b uses
            the same dropout counter as in a padded batch with ``L = max_seqlen``.

    Returns:
        ``[N, H, Dh]`` contiguous, q's dtype. Differentiable in q, k and v.
    """
    require_triton("pal_attention_varlen")
    return PALAttentionVarlenFunction.apply(
        q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, generator_seed, aligned_rows
    )


def pal_attention_dropout_mask(
    batch: int, num_heads: int, seqlen: int, dropout_p: float, seed: int, device: torch.device | str
) -> torch.Tensor:
    """The exact keep mask the kernels use for ``generator_seed=seed`` (for tests and debugging).

    ``seqlen`` is ``L`` for :func:`pal_attention` and ``max_seqlen`` for :func:`pal_attention_varlen`.
    Returns bool ``[batch, num_heads, seqlen, seqlen]`` indexed (b, h, query, key); True = kept. The
    reference output is ``softmax(scores) * keep / (1 - dropout_p) @ v``.
    """
    for name, value in (("batch", batch), ("num_heads", num_heads), ("seqlen", seqlen)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    _check_common(dropout_p, None, seed)
    _check_grid_rows(int(seqlen), "seqlen")
    device = torch.device(device)
    if device.type != "cuda" and not _interpreting() and not aot_mode():
        raise RuntimeError(f"device {device} needs TRITON_INTERPRET=1 (CPU interpreter) or a CUDA device")
    keep = torch.empty(batch, num_heads, seqlen, seqlen, dtype=torch.int8, device=device)
    if keep.numel() == 0:
        return keep.bool()
    block = 16 if _interpreting() else 64
    grid = (batch * num_heads, cdiv(seqlen, block), cdiv(seqlen, block))
    with device_context(keep):
        _pal_attn_dropout_mask_kernel[grid](
            keep, int(seed), float(dropout_p), num_heads, seqlen, BLOCK_M=block, BLOCK_N=block
        )
    return keep.bool()


# ================================================================================================================
# Triton: the PAL attention kernels
# ================================================================================================================
# ----------------------------------------------------------------------------------------------------------------
# Triton building blocks
# ----------------------------------------------------------------------------------------------------------------


@TritonKernel
def _program(CU, H, SEQ, IS_VARLEN: tl.constexpr):
    """This program's (batch x head, batch as int64, head, first token row, sequence length): the sequence
    bounds come from ``cu_seqlens`` (varlen) or are ``(0, L)`` (padded)."""
    bh = tl.program_id(0)
    b = bh // H
    if IS_VARLEN:
        start = tl.load(CU + b)
        seqlen = tl.load(CU + b + 1) - start
    else:
        start = b * 0
        seqlen = b * 0 + SEQ
    return bh, b.to(tl.int64), bh % H, start, seqlen


@TritonKernel
def _rows(first, start, seqlen, BLOCK: tl.constexpr):
    """Positions ``first .. first + BLOCK - 1`` of a sequence: (positions, inside the sequence, token rows)."""
    offs = first + tl.arange(0, BLOCK)
    return offs, offs < seqlen, (start + offs).to(tl.int64)


@TritonKernel
def _key_bias(MASK, b64, offs_n, valid_n, stride_mb, stride_ml, HAS_MASK: tl.constexpr):
    """Additive fp32 score bias per key: 0 for a token, finfo.min for padding, -inf past the sequence end."""
    if HAS_MASK:
        keep = tl.load(MASK + b64 * stride_mb + offs_n.to(tl.int64) * stride_ml, mask=valid_n, other=1)
        bias = tl.where(keep != 0, 0.0, -3.4028234663852886e38)
    else:
        bias = tl.zeros_like(offs_n).to(tl.float32)
    return tl.where(valid_n, bias, float("-inf"))


@TritonKernel
def _dropout_keep(seed, bh, q_idx, k_idx, SEQ, dropout_p):
    """Keep decision of the probabilities at (query q_idx, key k_idx) of batch x head ``bh`` (broadcast 2-D).

    One Philox counter per (batch, head, query, key), so forward, backward and the debug helper agree.
    """
    offsets = (bh.to(tl.int64) * SEQ + q_idx.to(tl.int64)) * SEQ + k_idx.to(tl.int64)
    return tl.rand(seed, offsets) >= dropout_p


@TritonKernel
def _head_ptr(PTR, b64, h, stride_b, stride_h, ALIGN: tl.constexpr):
    """``PTR`` advanced to (batch b, head h). ``ALIGN > 1``: the host checked that ``stride_h`` and the head dim
    are multiples of ALIGN elements (the fused PAL's zero-padded heads), the hint that lets the loads and stores
    along the head dim use 16-byte vectors and ``cp.async`` (Triton only infers divisibility by 16 itself)."""
    off = h * stride_h
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return PTR + b64 * stride_b + off


@TritonKernel
def _tile_ptrs(PTR, b64, h, tok, offs_d, stride_b, stride_l, stride_h, ALIGN: tl.constexpr):
    """Pointers to the ``[len(tok), BLOCK_D]`` tile of token rows ``tok`` of (batch b, head h)."""
    return _head_ptr(PTR, b64, h, stride_b, stride_h, ALIGN) + tok[:, None] * stride_l + offs_d[None, :]


@TritonKernel
def _load_rows(base, tok, stride_l, offs_d, mask):
    """The ``[len(tok), BLOCK_D]`` tile at token rows ``tok`` of a (batch, head) ``base``; zeros where masked."""
    return tl.load(base + tok[:, None] * stride_l + offs_d[None, :], mask=mask, other=0.0)


@TritonKernel
def _dim_mask(offs_d, HEAD_DIM, ALIGN: tl.constexpr):
    """``offs_d < HEAD_DIM``, constant over groups of ALIGN columns when the host checked HEAD_DIM % ALIGN == 0."""
    valid = offs_d < HEAD_DIM
    if ALIGN > 1:
        valid = tl.max_constancy(valid, [ALIGN])
    return valid


@TritonKernel
def _row_stats(STAT_M, STAT_L, DELTA, b64, tok, h, valid, H, stat_stride_b):
    """The saved softmax max ``m`` and normaliser ``l`` and the backward's ``delta`` of rows ``tok``, head h."""
    stat = (b64 * stat_stride_b + tok) * H + h
    m = tl.load(STAT_M + stat, mask=valid, other=0.0)
    l_row = tl.load(STAT_L + stat, mask=valid, other=1.0)
    delta = tl.load(DELTA + stat, mask=valid, other=0.0)
    return m, l_row, delta


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


@TritonKernel
def _pal_attn_fwd_kernel(
    Q, K, V, Out, STAT_M, STAT_L, MASK, CU,
    seed, dropout_p, dropout_scale, softmax_scale,
    stride_qb, stride_ql, stride_qh,
    stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh,
    stride_ob, stride_ol, stride_oh,
    stride_mb, stride_ml, stat_stride_b,
    H, SEQ, HEAD_DIM,
    IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, INTERP_BF16: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Output and softmax statistics of one query block (online softmax over the key blocks)."""
    bh, b64, h, start, seqlen = _program(CU, H, SEQ, IS_VARLEN)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M < seqlen:
        offs_m, valid_m, tok_m = _rows(pid_m * BLOCK_M, start, seqlen, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        valid_d = _dim_mask(offs_d, HEAD_DIM, ALIGN)
        q_mask = valid_m[:, None] & valid_d[None, :]
        q = _load_rows(_head_ptr(Q, b64, h, stride_qb, stride_qh, ALIGN), tok_m, stride_ql, offs_d, q_mask)
        k_base = _head_ptr(K, b64, h, stride_kb, stride_kh, ALIGN)
        v_base = _head_ptr(V, b64, h, stride_vb, stride_vh, ALIGN)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, seqlen, BLOCK_N):
            offs_n, valid_n, tok_n = _rows(start_n, start, seqlen, BLOCK_N)
            kv_mask = valid_n[:, None] & valid_d[None, :]
            k = _load_rows(k_base, tok_n, stride_kl, offs_d, kv_mask)
            v = _load_rows(v_base, tok_n, stride_vl, offs_d, kv_mask)
            bias = _key_bias(MASK, b64, offs_n, valid_n, stride_mb, stride_ml, HAS_MASK)
            s = mm(q, tl.trans(k), IEEE, INTERP_BF16) * softmax_scale + bias[None, :]
            # every tile holds at least one key inside the sequence, so m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], SEQ, dropout_p)
                p = tl.where(keep, p * dropout_scale, 0.0)
            acc = acc * alpha[:, None] + mm(cast_rne(p, v.dtype, INTERP_BF16), v, IEEE, INTERP_BF16)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(
            _tile_ptrs(Out, b64, h, tok_m, offs_d, stride_ob, stride_ol, stride_oh, ALIGN),
            cast_rne(acc, Out.dtype.element_ty, INTERP_BF16),
            mask=q_mask,
        )
        stat = (b64 * stat_stride_b + tok_m) * H + h
        tl.store(STAT_M + stat, m_i, mask=valid_m)
        tl.store(STAT_L + stat, l_i, mask=valid_m)


@TritonKernel
def _pal_attn_bwd_delta_kernel(
    Out, DO, DELTA, CU,
    stride_ob, stride_ol, stride_oh,
    stride_dob, stride_dol, stride_doh,
    stat_stride_b,
    H, SEQ, HEAD_DIM,
    IS_VARLEN: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``delta = rowsum(dO * O)`` of one query block."""
    bh, b64, h, start, seqlen = _program(CU, H, SEQ, IS_VARLEN)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M < seqlen:
        offs_m, valid_m, tok_m = _rows(pid_m * BLOCK_M, start, seqlen, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask = valid_m[:, None] & _dim_mask(offs_d, HEAD_DIM, ALIGN)[None, :]
        o = _load_rows(_head_ptr(Out, b64, h, stride_ob, stride_oh, ALIGN), tok_m, stride_ol, offs_d, mask)
        do = _load_rows(_head_ptr(DO, b64, h, stride_dob, stride_doh, ALIGN), tok_m, stride_dol, offs_d, mask)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + (b64 * stat_stride_b + tok_m) * H + h, delta, mask=valid_m)


@TritonKernel
def _pal_attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, STAT_M, STAT_L, DELTA, MASK, CU,
    seed, dropout_p, dropout_scale, softmax_scale,
    stride_qb, stride_ql, stride_qh,
    stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh,
    stride_dob, stride_dol, stride_doh,
    stride_gb, stride_gl, stride_gh,
    stride_mb, stride_ml, stat_stride_b,
    H, SEQ, HEAD_DIM,
    IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, INTERP_BF16: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block (transposed tiles: keys on rows, queries on columns)."""
    bh, b64, h, start, seqlen = _program(CU, H, SEQ, IS_VARLEN)
    pid_n = tl.program_id(1)
    if pid_n * BLOCK_N < seqlen:
        offs_n, valid_n, tok_n = _rows(pid_n * BLOCK_N, start, seqlen, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        valid_d = _dim_mask(offs_d, HEAD_DIM, ALIGN)
        kv_mask = valid_n[:, None] & valid_d[None, :]
        k = _load_rows(_head_ptr(K, b64, h, stride_kb, stride_kh, ALIGN), tok_n, stride_kl, offs_d, kv_mask)
        v = _load_rows(_head_ptr(V, b64, h, stride_vb, stride_vh, ALIGN), tok_n, stride_vl, offs_d, kv_mask)
        bias = _key_bias(MASK, b64, offs_n, valid_n, stride_mb, stride_ml, HAS_MASK)
        q_base = _head_ptr(Q, b64, h, stride_qb, stride_qh, ALIGN)
        do_base = _head_ptr(DO, b64, h, stride_dob, stride_doh, ALIGN)

        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for start_m in range(0, seqlen, BLOCK_M):
            offs_m, valid_m, tok_m = _rows(start_m, start, seqlen, BLOCK_M)
            q_mask = valid_m[:, None] & valid_d[None, :]
            q = _load_rows(q_base, tok_m, stride_ql, offs_d, q_mask)
            do = _load_rows(do_base, tok_m, stride_dol, offs_d, q_mask)
            m, l_row, delta = _row_stats(STAT_M, STAT_L, DELTA, b64, tok_m, h, valid_m, H, stat_stride_b)

            s_t = mm(k, tl.trans(q), IEEE, INTERP_BF16) * softmax_scale + bias[:, None]
            p_t = tl.exp(s_t - m[None, :]) / l_row[None, :]
            dp_t = mm(v, tl.trans(do), IEEE, INTERP_BF16)
            if HAS_DROPOUT:
                keep_t = _dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], SEQ, dropout_p)
                pd_t = tl.where(keep_t, p_t * dropout_scale, 0.0)
                dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
            else:
                pd_t = p_t
            dv += mm(cast_rne(pd_t, do.dtype, INTERP_BF16), do, IEEE, INTERP_BF16)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += mm(cast_rne(ds_t, q.dtype, INTERP_BF16), q, IEEE, INTERP_BF16)
        dk = dk * softmax_scale
        dk_ptrs = _tile_ptrs(DK, b64, h, tok_n, offs_d, stride_gb, stride_gl, stride_gh, ALIGN)
        dv_ptrs = _tile_ptrs(DV, b64, h, tok_n, offs_d, stride_gb, stride_gl, stride_gh, ALIGN)
        tl.store(dk_ptrs, cast_rne(dk, DK.dtype.element_ty, INTERP_BF16), mask=kv_mask)
        tl.store(dv_ptrs, cast_rne(dv, DV.dtype.element_ty, INTERP_BF16), mask=kv_mask)


@TritonKernel
def _pal_attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, STAT_M, STAT_L, DELTA, MASK, CU,
    seed, dropout_p, dropout_scale, softmax_scale,
    stride_qb, stride_ql, stride_qh,
    stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh,
    stride_dob, stride_dol, stride_doh,
    stride_gb, stride_gl, stride_gh,
    stride_mb, stride_ml, stat_stride_b,
    H, SEQ, HEAD_DIM,
    IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, INTERP_BF16: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dQ of one query block."""
    bh, b64, h, start, seqlen = _program(CU, H, SEQ, IS_VARLEN)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M < seqlen:
        offs_m, valid_m, tok_m = _rows(pid_m * BLOCK_M, start, seqlen, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        valid_d = _dim_mask(offs_d, HEAD_DIM, ALIGN)
        q_mask = valid_m[:, None] & valid_d[None, :]
        q = _load_rows(_head_ptr(Q, b64, h, stride_qb, stride_qh, ALIGN), tok_m, stride_ql, offs_d, q_mask)
        do = _load_rows(
            _head_ptr(DO, b64, h, stride_dob, stride_doh, ALIGN), tok_m, stride_dol, offs_d, q_mask
        )
        m, l_row, delta = _row_stats(STAT_M, STAT_L, DELTA, b64, tok_m, h, valid_m, H, stat_stride_b)
        k_base = _head_ptr(K, b64, h, stride_kb, stride_kh, ALIGN)
        v_base = _head_ptr(V, b64, h, stride_vb, stride_vh, ALIGN)

        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, seqlen, BLOCK_N):
            offs_n, valid_n, tok_n = _rows(start_n, start, seqlen, BLOCK_N)
            kv_mask = valid_n[:, None] & valid_d[None, :]
            k = _load_rows(k_base, tok_n, stride_kl, offs_d, kv_mask)
            v = _load_rows(v_base, tok_n, stride_vl, offs_d, kv_mask)
            bias = _key_bias(MASK, b64, offs_n, valid_n, stride_mb, stride_ml, HAS_MASK)
            s = mm(q, tl.trans(k), IEEE, INTERP_BF16) * softmax_scale + bias[None, :]
            p = tl.exp(s - m[:, None]) / l_row[:, None]
            dp = mm(do, tl.trans(v), IEEE, INTERP_BF16)
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], SEQ, dropout_p)
                dp = tl.where(keep, dp * dropout_scale, 0.0)
            ds = p * (dp - delta[:, None])
            dq += mm(cast_rne(ds, k.dtype, INTERP_BF16), k, IEEE, INTERP_BF16)
        dq = dq * softmax_scale
        tl.store(
            _tile_ptrs(DQ, b64, h, tok_m, offs_d, stride_gb, stride_gl, stride_gh, ALIGN),
            cast_rne(dq, DQ.dtype.element_ty, INTERP_BF16),
            mask=q_mask,
        )


@TritonKernel
def _pal_attn_dropout_mask_kernel(
    KEEP, seed, dropout_p, H, SEQ, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """The dropout keep mask ``[B, H, SEQ, SEQ]`` int8 of one (query block, key block) tile."""
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], SEQ, dropout_p)
    out = (bh.to(tl.int64) * SEQ + offs_m[:, None].to(tl.int64)) * SEQ + offs_n[None, :]
    tl.store(KEEP + out, keep.to(tl.int8), mask=(offs_m[:, None] < SEQ) & (offs_n[None, :] < SEQ))


# ================================================================================================================
# torch.ops.fastpals.pal, pal_varlen and their backward ops
# ================================================================================================================
def _pal_eager(
    h: torch.Tensor,
    where: dict,
    task_ids: torch.Tensor,
    weights: Sequence[torch.Tensor],
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
) -> torch.Tensor:
    """``residual + PAL(h)`` on the backend the dispatch picks for ``h`` (differentiable where its inputs are),
    its dropout drawn from ``seed``."""
    args = (task_ids, *weights, num_heads, gelu, dropout_p)
    generator_seed = int(seed.reshape(-1)[0]) if dropout_p > 0.0 else None
    with seeded(seed, h.device, dropout_p):
        return pal_eager(h, args, mask=where.get("mask"), cu_seqlens=where.get("cu_seqlens"),
                                  max_seqlen=where.get("max_seqlen", 0), residual=residual,
                                  generator_seed=generator_seed)  # fmt: skip


def _pal_grads(
    grad: torch.Tensor,
    h: torch.Tensor,
    where: dict,
    task_ids: torch.Tensor,
    weights: Sequence[torch.Tensor],
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    seed: torch.Tensor,
) -> list[torch.Tensor]:
    """Gradients of ``PAL(h)`` in h and the six weights, by recomputing the forward with autograd."""

    def forward(*inputs: torch.Tensor) -> torch.Tensor:
        return _pal_eager(inputs[0], where, task_ids, inputs[1:], num_heads, gelu, dropout_p, None, seed)

    return list(autograd_vjp(forward, (h, *weights), grad))


@torch.library.custom_op("fastpals::pal", mutates_args=())
def pal_op(
    h: torch.Tensor,
    mask: torch.Tensor | None,
    task_ids: torch.Tensor,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dec_weight: torch.Tensor,
    dec_bias: torch.Tensor,
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
) -> torch.Tensor:
    """``residual + PAL(h)``: h ``[B, L, d]``, mask ``[B, L]`` (1 = token) or None, task_ids ``[B]`` int64,
    weights as in the module docstring; returns ``[B, L, d]`` in h's dtype."""
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    with torch.no_grad():
        out = _pal_eager(h, {"mask": mask}, task_ids, weights, num_heads, gelu, dropout_p, residual, seed)
    return out.clone() if out is h or out is residual else out


@torch.library.custom_op("fastpals::pal_varlen", mutates_args=())
def pal_varlen_op(
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
    gelu: bool,
    dropout_p: float,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
) -> torch.Tensor:
    """Packed form of :func:`pal_op`: h ``[N, d]``, cu_seqlens ``[B+1]`` int32/int64, max_seqlen >= the longest
    sequence, task_ids ``[B]``; returns ``[N, d]``."""
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    where = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
    with torch.no_grad():
        out = _pal_eager(h, where, task_ids, weights, num_heads, gelu, dropout_p, residual, seed)
    return out.clone() if out is h or out is residual else out


@torch.library.custom_op("fastpals::pal_backward", mutates_args=())
def pal_backward_op(
    grad: torch.Tensor,
    h: torch.Tensor,
    mask: torch.Tensor | None,
    task_ids: torch.Tensor,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dec_weight: torch.Tensor,
    dec_bias: torch.Tensor,
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    seed: torch.Tensor,
) -> list[torch.Tensor]:
    """``[dh, d enc_weight, d enc_bias, d qkv_weight, d qkv_bias, d dec_weight, d dec_bias]`` of :func:`pal_op`."""
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    return _pal_grads(grad, h, {"mask": mask}, task_ids, weights, num_heads, gelu, dropout_p, seed)


@torch.library.custom_op("fastpals::pal_varlen_backward", mutates_args=())
def pal_varlen_backward_op(
    grad: torch.Tensor,
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
    gelu: bool,
    dropout_p: float,
    seed: torch.Tensor,
) -> list[torch.Tensor]:
    """The gradients of :func:`pal_varlen_op`, as :func:`pal_backward_op`."""
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    where = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
    return _pal_grads(grad, h, where, task_ids, weights, num_heads, gelu, dropout_p, seed)


def _pal_out_fake(h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    dtype = h.dtype if residual is None else torch.promote_types(h.dtype, residual.dtype)
    return h.new_empty(h.shape, dtype=dtype)


@pal_op.register_fake
def _(h, mask, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, residual, seed):
    return _pal_out_fake(h, residual)


@pal_varlen_op.register_fake
def _(h, cu, max_seqlen, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, residual, seed):
    return _pal_out_fake(h, residual)


def _grads_fake(h: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in (h, *weights)]


@pal_backward_op.register_fake
def _(grad, h, mask, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, seed):
    return _grads_fake(h, ew, eb, qw, qb, dw, db)


@pal_varlen_backward_op.register_fake
def _(grad, h, cu, max_seqlen, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, seed):
    return _grads_fake(h, ew, eb, qw, qb, dw, db)


def _pal_setup(ctx, inputs, output) -> None:
    """torch.Tensors (and None) through ``save_for_backward``, the scalars as attributes."""
    ctx.save_for_backward(*[x if x is None or isinstance(x, torch.Tensor) else None for x in inputs])
    ctx.scalars = [None if x is None or isinstance(x, torch.Tensor) else x for x in inputs]


def _saved_inputs(ctx) -> list:
    return [s if t is None else t for t, s in zip(ctx.saved_tensors, ctx.scalars)]


def _pal_grad_outputs(
    ctx, grads: list[torch.Tensor], residual: torch.Tensor | None, grad: torch.Tensor, lead: int
) -> tuple:
    """The per-input gradient tuple: ``lead`` non-differentiable inputs after h, then the six weights."""
    out = [None] * len(ctx.scalars)
    out[0] = grads[0]
    for i, g in enumerate(grads[1:]):
        out[lead + 1 + i] = g
    if residual is not None:
        out[-2] = grad.to(residual.dtype)
    return tuple(out)


def _pal_backward_formula(ctx, grad: torch.Tensor) -> tuple:
    h, mask, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, residual, seed = _saved_inputs(ctx)
    grads = torch.ops.fastpals.pal_backward(grad, h, mask, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu,
                                            dropout_p, seed)  # fmt: skip
    return _pal_grad_outputs(ctx, grads, residual, grad, lead=2)


def _pal_varlen_backward_formula(ctx, grad: torch.Tensor) -> tuple:
    h, cu, max_seqlen, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, residual, seed = (
        _saved_inputs(ctx)
    )
    grads = torch.ops.fastpals.pal_varlen_backward(grad, h, cu, max_seqlen, task_ids, ew, eb, qw, qb, dw, db,
                                                   num_heads, gelu, dropout_p, seed)  # fmt: skip
    return _pal_grad_outputs(ctx, grads, residual, grad, lead=3)


pal_op.register_autograd(_pal_backward_formula, setup_context=_pal_setup)
pal_varlen_op.register_autograd(_pal_varlen_backward_formula, setup_context=_pal_setup)


for _op in (pal_op, pal_varlen_op, pal_backward_op, pal_varlen_backward_op):
    _op.register_vmap(per_sample_vmap(_op))
