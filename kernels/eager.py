"""The eager implementations of the dispatching ops that have more than one backend: BERT's attention over
padded blocks or packed rows, and the PAL (Triton, or the reference with the reference or SDPA attention).

:mod:`fastpals_kernels.dispatch` calls them outside ``torch.compile``, and the custom ops of
:mod:`fastpals_kernels.library` run them as their kernels, so both import this module and it imports neither.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fastpals_kernels import backends
from fastpals_kernels import reference as functional
from fastpals_kernels.common import cu_seqlens_int32
from fastpals_kernels.padding import AttentionPlan, bucketed_attention, pad_packed_index

__all__ = [
    "PackedSegments",
    "attention_varlen_eager",
    "packed_pal_reference",
    "padded_attention",
    "pal_eager",
]


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    dropout_p: float,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """BERT's attention on padded blocks: ``q, k, v [B, L, H, Dh]``, key ``mask [B, L]`` bool → ``[B, L, H, Dh]``.
    ``key_bias`` (optional): the mask's fp32 bias ``[B, 1, 1, L]`` when the caller has it built (CPU path only).

    On CPU the matmul + fp32 softmax reference op: torch's CPU flash-attention backward spends ~15 us per
    (sequence, head) on BERT's short rows (23% of a `make train` update in the profile). Paired on the same
    batches, SDPA with ``F.dropout`` made the update 1.32x as long as this attention with
    :func:`fastpals_kernels.reference.dropout` (0.503 s against 0.380 s median).
    Elsewhere ``F.scaled_dot_product_attention`` with the boolean mask.
    """
    if q.device.type == "cpu":
        if key_bias is None:
            key_bias = functional.key_mask_bias(mask, torch.float32)
        return functional.attention_with_key_bias(q, k, v, key_bias, dropout_p)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    ctx = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None, None, :], dropout_p=dropout_p)
    return ctx.transpose(1, 2)


def attention_varlen_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """The eager backends of :func:`attention_varlen` (also what ``torch.ops.fastpals.attention_varlen`` runs):
    flash-attn's varlen kernel where it serves ``q``, else padded attention over ``plan``'s length buckets or
    over every sequence padded to ``max_seqlen``."""
    if backends.flash_varlen_ok(q):
        from flash_attn import flash_attn_varlen_func  # optional

        cu = cu_seqlens_int32(cu_seqlens)
        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p)
    if plan is not None:

        def attend(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, bucket: Any) -> torch.Tensor:
            return padded_attention(qb, kb, vb, bucket.mask, dropout_p, key_bias=bucket.key_bias)

        return bucketed_attention(q, k, v, plan, attend)
    padded, mask, index = pad_packed_index(torch.stack((q, k, v)), cu_seqlens, max_seqlen)
    ctx = padded_attention(padded[0], padded[1], padded[2], mask, dropout_p)
    return ctx.flatten(0, 1).index_select(0, index)


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
    choice = backends.backend("pal", h) if choice is None else choice
    if choice == "triton":
        import fastpals_kernels as kernels  # the Triton ops: loaded on first use

        if cu_seqlens is not None:
            return kernels.pal_varlen(h, cu_seqlens, max_seqlen, *args, residual=residual,
                                      generator_seed=generator_seed)  # fmt: skip
        return kernels.pal(h, mask, *args, residual=residual, generator_seed=generator_seed)
    attention = "sdpa" if choice == "sdpa" else "reference"
    if attention == "reference" and cu_seqlens is not None and segments is not None:
        ts = packed_pal_reference(h, args, segments)
    elif cu_seqlens is not None:
        ts = functional.pal_varlen_reference(h, cu_seqlens, max_seqlen, *args, attention=attention)
    else:
        ts = functional.pal_reference(h, mask, *args, attention=attention)
    return ts if residual is None else residual + ts


class PackedSegments(NamedTuple):
    """Host facts of a packed batch that the reference PAL uses to skip padded work: ``row_task_ids [N]`` int64
    (each row's task), ``counts`` (rows per task when rows are grouped by task, else None) and the attention
    ``plan`` (:class:`~fastpals_kernels.padding.AttentionPlan`)."""

    row_task_ids: torch.Tensor
    counts: list[int] | None
    plan: AttentionPlan


def packed_pal_reference(h: torch.Tensor, args: tuple, segments: PackedSegments) -> torch.Tensor:
    """:func:`~fastpals_kernels.reference.pal_varlen_reference` composed of the same reference ops, with the
    grouped linears on the packed tokens only (one GEMM per task slice when rows are grouped by task) and the
    attention over length buckets. ``h [N, d]`` → ``[N, d]``."""
    _, enc_w, enc_b, qkv_w, qkv_b, dec_w, dec_b, num_heads, gelu, dropout_p = args
    tasks, counts = segments.row_task_ids, segments.counts

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if counts is not None:
            return functional.segment_linear(x, counts, weight, bias)
        return functional.grouped_linear_reference(x, tasks, weight, bias)

    s = linear(h, enc_w, enc_b)  # [N, d_s]
    n, d_s = s.shape
    q, k, v = linear(s, qkv_w, qkv_b).view(n, 3, num_heads, d_s // num_heads).unbind(1)
    ctx = bucketed_attention(
        q, k, v, segments.plan,
        lambda qb, kb, vb, b: functional.attention_with_key_bias(qb, kb, vb, b.key_bias, dropout_p),
    )  # fmt: skip
    y = linear(ctx.reshape(n, d_s), dec_w, dec_b)
    return F.gelu(y) if gelu else y
