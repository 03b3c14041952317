# ruff: noqa: ANN001, ANN202 - the custom ops' fake and autograd hooks mirror their schemas
"""The attention op: BERT's multi-head softmax self-attention over packed rows (``q, k, v [N, H, Dh]``), its
custom op ``torch.ops.fastpals.attention_varlen``, and the attention references the PAL builds on. Softmax in
fp32; padded keys get the dtype's most negative score (BERT's additive mask)."""

from __future__ import annotations

import math
import os
import sys
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from fastpals_kernels import backends, extension
from fastpals_kernels.backends import backend, registered, use_library
from fastpals_kernels.common import recompute_ops, seed_for, seeded
from fastpals_kernels.dropout import compiled_dropout, dropout, mask_words
from fastpals_kernels.padding import AttentionPlan, bucketed_attention, key_mask_bias, pad_packed_index

__all__ = [
    "attention_reference",
    "attention_sdpa",
    "attention_varlen",
    "attention_varlen_eager",
    "attention_varlen_reference",
    "attention_with_key_bias",
    "compiled_attention",
    "key_mask_bias",
    "packed_attention",
    "packed_attention_reference",
    "packed_words",
    "PackedWords",
    "padded_attention",
    "compiled_attention_serves",
]

_state: dict[str, bool] = {}


def compiled_attention() -> bool:
    """Whether the compiled CPU kernel of :func:`packed_attention` is there (built or loaded once per process;
    ``FASTPALS_ATTENTION=torch`` turns it off)."""
    if "ok" not in _state:
        ok = os.environ.get("FASTPALS_ATTENTION", "").lower() != "torch"
        if ok and not hasattr(torch.ops.fastpals, "packed_attention"):
            try:
                extension.build(
                    "fastpals_attention",
                    ("attention.cpp",),
                    cflags=("-O3", "-fopenmp"),
                    ldflags=("-fopenmp",),
                )
            except Exception as exc:  # no compiler, no ninja, no csrc/: the reference runs
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(
                    f"fastpals: CPU attention runs as PyTorch ops (no compiled kernel: {reason})",
                    file=sys.stderr,
                )
                ok = False
        _state["ok"] = ok
    return _state["ok"]


class PackedWords(NamedTuple):
    """The dropout of :func:`packed_attention`: the random ``words`` (int64), the ``layout [B, 2]`` int64 of each
    sequence's slices (the first slice, the row length R: head h, query i, key j at ``first + (h R + i) R + j``),
    the keep ``threshold`` and the ``scale``."""

    words: torch.Tensor
    layout: torch.Tensor
    threshold: int
    scale: float


def packed_words(
    cu_seqlens: torch.Tensor,
    heads: int,
    dropout_p: float,
    plan: AttentionPlan | None = None,
    compiled: bool = True,
) -> PackedWords:
    """Draw the dropout words of :func:`packed_attention` (``dropout_p > 0``) as the bucketed attention over
    ``plan`` draws them: one call of :func:`~fastpals_kernels.dropout.mask_words` per bucket ``[size, H, length,
    length]``, in the plan's order, each sequence's slices where its padded block has them. Without a plan, one
    block ``[H, L, L]`` per sequence, back to back."""
    if plan is None:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
        per_sequence = heads * lengths.square()
        layout = torch.stack((per_sequence.cumsum(0) - per_sequence, lengths), 1)
        total = int(per_sequence.sum())
    else:  # from the plan's host facts: no read of a tensor
        sizes = np.array([b.size for b in plan.buckets], dtype=np.int64)
        rows = np.array([b.length for b in plan.buckets], dtype=np.int64)
        draws = -(-(sizes * heads * rows**2) // 4) * 4  # each bucket's draw: whole words
        bucket, block = plan.blocks[:, 0], plan.blocks[:, 1]
        first = (np.cumsum(draws) - draws)[bucket] + block * heads * rows[bucket] ** 2
        layout = torch.from_numpy(np.stack((first, rows[bucket]), 1))
        total = int(draws.sum())
    words, threshold, scale = mask_words(total, dropout_p, compiled and compiled_dropout())
    return PackedWords(words, layout, threshold, scale)


def packed_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    words: PackedWords | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """What :func:`packed_attention` computes, in PyTorch ops one sequence at a time: q, k, v ``[N, H, Dh]``,
    ``cu_seqlens [B+1]`` → ``[N, H, Dh]``; scores in q's dtype, fp32 scale and softmax, probabilities cast back,
    dropout with the keep mask of :class:`PackedWords` (``words``; drawn by :func:`packed_words` over ``plan``
    when None), then ``probs @ v``."""
    _check_dropout(dropout_p)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if dropout_p > 0.0 and words is None:
        words = packed_words(cu_seqlens, q.shape[1], dropout_p, plan, compiled=False)
    slices = words.words.view(torch.int16) if dropout_p > 0.0 else None
    heads, out = q.shape[1], []
    bounds = zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
    for s, (a, b) in enumerate(bounds):
        qh, kh, vh = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, L, Dh]
        probs = torch.softmax(torch.matmul(qh, kh.transpose(1, 2)).float().mul_(scale), dim=-1).to(q.dtype)
        if slices is not None and b > a:
            first, row = words.layout[s].tolist()
            block = slices[first : first + heads * row * row].view(heads, row, row)
            probs = (probs * (block[:, : b - a, : b - a] >= words.threshold)).mul_(words.scale)
        out.append(torch.matmul(probs, vh).transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros(q.shape)


class _PackedAttention(torch.autograd.Function):
    """The compiled kernel with its gradient (the probabilities recomputed from each row's saved softmax max and
    sum, the same dropout words)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, words, layout, threshold, drop_scale, scale):
        out, stats = torch.ops.fastpals.packed_attention(
            q, k, v, cu_seqlens, words, layout, threshold, drop_scale, scale
        )
        ctx.save_for_backward(q, k, v, cu_seqlens, words, layout, stats)
        ctx.options = threshold, drop_scale, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, cu_seqlens, words, layout, stats = ctx.saved_tensors
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        dq, dk, dv = torch.ops.fastpals.packed_attention_backward(
            grad, q, k, v, cu_seqlens, words, layout, *ctx.options, stats
        )
        return dq, dk, dv, None, None, None, None, None, None


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """BERT's attention over packed CPU rows without padding: q, k, v ``[N, H, Dh]`` (bf16 or fp32, unit stride
    along Dh), ``cu_seqlens [B+1]`` → ``[N, H, Dh]``, the dropout mask that of the bucketed attention over ``plan``
    (:func:`packed_words`). The compiled kernel (``csrc/attention.cpp``) where it builds, else
    :func:`packed_attention_reference`."""
    _check_dropout(dropout_p)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if compiled_attention_serves(q, k, v):
        if dropout_p == 0.0:
            return _PackedAttention.apply(q, k, v, cu_seqlens, None, None, 0, 1.0, scale)
        w = packed_words(cu_seqlens, q.shape[1], dropout_p, plan)
        return _PackedAttention.apply(q, k, v, cu_seqlens, w.words, w.layout, w.threshold, w.scale, scale)
    return packed_attention_reference(q, k, v, cu_seqlens, dropout_p, scale, plan=plan)


def compiled_attention_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Does the compiled kernel run :func:`packed_attention` on q, k, v: plain CPU tensors (no fake or traced
    tensor, no dispatch mode: the op reads the host's sequence lengths), all bf16 or all fp32, unit stride along
    the head dim, and the kernel built?"""
    return (
        not torch.compiler.is_compiling()
        and all(type(t) is torch.Tensor and t.device.type == "cpu" and t.stride(-1) == 1 for t in (q, k, v))
        and q.dtype in (torch.bfloat16, torch.float32)
        and q.dtype == k.dtype == v.dtype
        and not torch._C._len_torch_dispatch_stack()
        and compiled_attention()
    )


def _check_dropout(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {p}")


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
    if compiled_attention_serves(q, k, v):  # the bucketed path's dropout mask, without its padding
        return packed_attention(q, k, v, cu_seqlens, dropout_p, plan=plan)
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
