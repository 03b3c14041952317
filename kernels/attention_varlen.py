# ruff: noqa: ANN001, ANN202 - the custom ops' fake and autograd hooks mirror their schemas
"""The attention op: BERT's multi-head softmax self-attention over packed rows (``q, k, v [N, H, Dh]``), its
custom op ``torch.ops.fastpals.attention_varlen``, and the attention references the PAL builds on. Softmax in
fp32; padded keys get the dtype's most negative score (BERT's additive mask)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastpals_kernels import backends
from fastpals_kernels.backends import backend, registered, use_library
from fastpals_kernels.common import recompute_ops, seed_for, seeded
from fastpals_kernels.dropout import dropout
from fastpals_kernels.padding import AttentionPlan, bucketed_attention, key_mask_bias, pad_packed_index

__all__ = [
    "attention_reference",
    "attention_sdpa",
    "attention_varlen",
    "attention_varlen_eager",
    "attention_varlen_reference",
    "attention_with_key_bias",
    "key_mask_bias",
    "padded_attention",
]


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """BERT's self-attention over packed rows: ``q, k, v [N, H, Dh]``, ``cu_seqlens [B+1]`` → ``[N, H, Dh]``,
    each sequence attending to its own keys; ``plan``: length buckets from
    :func:`fastpals_kernels.padding.attention_plan`."""
    choice = backend("bert_attention_varlen", q)
    ext = registered("bert_attention_varlen", choice)
    if ext is not None:
        return ext.impl(q, k, v, cu_seqlens, max_seqlen, dropout_p, plan)
    if use_library("reference" if q.device.type == "cpu" else choice, q):
        return torch.ops.fastpals.attention_varlen(
            q, k, v, cu_seqlens, max_seqlen, dropout_p, seed_for(dropout_p)
        )
    return attention_varlen_eager(q, k, v, cu_seqlens, max_seqlen, dropout_p, plan)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Multi-head softmax attention in flash-attn's layout: q, k, v ``[B, L, H, Dh]``, key_padding_mask ``[B, L]``
    (1 = token) or None → ``[B, L, H, Dh]``; every query row is computed, dropout on the probabilities."""
    bias = None if key_padding_mask is None else key_mask_bias(key_padding_mask, torch.float32)
    return attention_with_key_bias(q, k, v, bias, dropout_p, softmax_scale)


def attention_with_key_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor | None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`attention_reference` with the key mask as its additive fp32 bias ``key_bias [B, 1, 1, L]``
    (:func:`key_mask_bias`, built once per block) or None: scores in q's dtype, then fp32 scale, bias and
    softmax, probabilities cast back, dropout, then ``probs @ v``."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, Dh]
    scores = torch.matmul(qh, kh.transpose(-1, -2)).float().mul_(scale)
    if key_bias is not None:
        scores = scores.add_(key_bias)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = dropout(probs, dropout_p)
    return torch.matmul(probs, vh).transpose(1, 2)


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`attention_reference` through ``F.scaled_dot_product_attention``, the head dim zero-padded to a
    multiple of 8 for the fused SDPA backends. Dropout draws its own mask."""
    head_dim = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    pad = (-head_dim) % 8
    qh, kh, vh = (F.pad(t, (0, pad)).transpose(1, 2) if pad else t.transpose(1, 2) for t in (q, k, v))
    bias = None if key_padding_mask is None else key_mask_bias(key_padding_mask, q.dtype)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    return out.transpose(1, 2)[..., :head_dim]


def attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Packed form of :func:`attention_reference`: q, k, v ``[N, H, Dh]``, cu_seqlens ``[B+1]`` int32/int64 →
    ``[N, H, Dh]``."""
    padded, mask, index = pad_packed_index(torch.stack((q, k, v)), cu_seqlens, max_seqlen)
    out = attention_reference(padded[0], padded[1], padded[2], mask, dropout_p, softmax_scale)
    return out.flatten(0, 1).index_select(0, index)


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    dropout_p: float,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """BERT's attention on padded blocks: ``q, k, v [B, L, H, Dh]``, key ``mask [B, L]`` bool → ``[B, L, H, Dh]``.
    On CPU :func:`attention_with_key_bias` (faster there than SDPA's backward on short rows; ``key_bias``: the
    mask's bias when built already), elsewhere ``F.scaled_dot_product_attention`` with the boolean mask."""
    if q.device.type == "cpu":
        if key_bias is None:
            key_bias = key_mask_bias(mask, torch.float32)
        return attention_with_key_bias(q, k, v, key_bias, dropout_p)
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
    """The eager backends of :func:`attention_varlen`: flash-attn's varlen kernel where it serves ``q`` (CUDA
    sm_80+, fp16/bf16, installed), else :func:`padded_attention` over ``plan``'s length buckets or over every
    sequence padded to ``max_seqlen``."""
    if backends.flash_varlen_ok(q):  # looked up on the module: tests stand in for flash-attn
        from flash_attn import flash_attn_varlen_func  # optional

        cu = cu_seqlens.to(torch.int32)
        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p)
    if plan is not None:
        attend = lambda qb, kb, vb, b: padded_attention(qb, kb, vb, b.mask, dropout_p, key_bias=b.key_bias)
        return bucketed_attention(q, k, v, plan, attend)
    padded, mask, index = pad_packed_index(torch.stack((q, k, v)), cu_seqlens, max_seqlen)
    ctx = padded_attention(padded[0], padded[1], padded[2], mask, dropout_p)
    return ctx.flatten(0, 1).index_select(0, index)


def _attention_run(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed) -> torch.Tensor:
    """:func:`attention_varlen_eager` with dropout seeded from ``seed``."""
    with seeded(seed, q.device, dropout_p):
        return attention_varlen_eager(q, k, v, cu_seqlens, max_seqlen, dropout_p)


attention_varlen_op, attention_varlen_backward_op = recompute_ops(
    "attention_varlen",
    "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, float dropout_p, Tensor seed",
    _attention_run,
    (0, 1, 2),
    lambda q, *args: torch.empty_like(q, memory_format=torch.contiguous_format),
)
