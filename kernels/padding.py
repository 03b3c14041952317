"""Pad, unpad and ``cu_seqlens`` helpers (the role of flash-attention's ``bert_padding.py``) between *packed*
(``[N, d]`` rows, ``cu_seqlens [B+1]`` int32) and *padded* (``[B, L, d]``, a ``[B, L]`` mask) batches, and
packed attention over padded blocks of similar lengths (the CPU path). No host read unless a docstring says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "AttentionBucket",
    "AttentionPlan",
    "attention_plan",
    "bucketed_attention",
    "check_packed",
    "cu_seqlens_to_mask",
    "key_mask_bias",
    "lengths_to_cu_seqlens",
    "packed_position_ids",
    "pad_packed",
    "pad_packed_index",
    "pool_packed",
    "unpad",
]


def lengths_to_cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """Sequence lengths ``[B]`` (int) → ``cu_seqlens [B+1]`` int32 (0, then the running sums)."""
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


def key_mask_bias(key_padding_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Key padding mask [B, L] (1 = token, 0 = padding) -> additive [B, 1, 1, L] (0 or the dtype's most negative value)."""
    keep = key_padding_mask.to(torch.bool)[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def cu_seqlens_to_mask(cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """``cu_seqlens [B+1]`` → right-padded mask ``[B, max_seqlen]`` bool (True = token)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.arange(max_seqlen, device=cu_seqlens.device)[None, :] < lengths[:, None]


def packed_position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token inside its own sequence: int64 ``[N]`` (``N = total = cu_seqlens[-1]``)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def unpad(x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-padded ``x [B, L, ...]`` with ``attention_mask [B, L]`` (1 = token) → ``(packed [N, ...],
    cu_seqlens [B+1] int32, max_seqlen)``. Reads the mask on the host (validation: raises ``ValueError`` if a
    mask row is not ``1...1 0...0``)."""
    mask = attention_mask.to(torch.bool)
    lengths = mask.sum(1)
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]):
        raise ValueError("attention_mask rows must be right-padded (1...1 0...0) to be packed")
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return x[mask], lengths_to_cu_seqlens(lengths), max_seqlen


def pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, value: float = 0) -> torch.Tensor:
    """Packed ``x [N, ...]`` → right-padded ``[B, max_seqlen, ...]`` filled with ``value`` (inverse of :func:`unpad`)."""
    mask = cu_seqlens_to_mask(cu_seqlens, max_seqlen)
    out = x.new_full((mask.shape[0], max_seqlen, *x.shape[1:]), value)
    out[mask] = x
    return out


def pad_packed_index(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> tuple[torch.Tensor, ...]:
    """Scatter packed rows ``x [N, *rest]`` (or stacked ``[S, N, H, Dh]``) into a padded batch: ``(padded
    [(S,) B, max_seqlen, *rest], mask [B, max_seqlen], index [N])``, index: each row's place in the flat batch."""
    mask = cu_seqlens_to_mask(cu_seqlens, max_seqlen)
    batch, dim = mask.shape[0], int(x.dim() >= 4)  # the row dim: [3, N, H, Dh] vs [N, ...]
    total = x.shape[dim]
    example = torch.repeat_interleave(torch.arange(batch, device=x.device), mask.sum(1), output_size=total)
    index = example * max_seqlen + packed_position_ids(cu_seqlens, total)
    flat = x.new_zeros(*x.shape[:dim], batch * max_seqlen, *x.shape[dim + 1 :]).index_copy_(dim, index, x)
    return flat.view(*x.shape[:dim], batch, max_seqlen, *x.shape[dim + 1 :]), mask, index


def check_packed(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None, max_positions: int
) -> np.ndarray:
    """Validate packed tensors handed over without a layout and return their lengths ``[B]`` int64 on the host
    (one host read): ``input_ids [N]``; ``cu_seqlens [B+1]`` int32 on its device from 0 to N, no empty sequence;
    ``max_seqlen`` an int from the longest sequence to ``max_positions``."""
    if input_ids.dim() != 1:
        raise ValueError(
            f"packed input_ids must be [N] (cu_seqlens given), got shape {list(input_ids.shape)}"
        )
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [B+1] with B >= 1")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 (flash-attn's layout), got {cu_seqlens.dtype}")
    if cu_seqlens.device != input_ids.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but input_ids on {input_ids.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be an int with packed inputs, got {max_seqlen!r}")
    cu = np.asarray(cu_seqlens.tolist(), dtype=np.int64)  # the one host read
    lengths = cu[1:] - cu[:-1]
    if cu[0] != 0 or cu[-1] != input_ids.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to N = {input_ids.shape[0]}, got {cu[0]} .. {cu[-1]}")
    if int(lengths.min()) < 1:
        raise ValueError("cu_seqlens holds an empty sequence: every packed sequence needs at least one token")
    if not int(lengths.max()) <= max_seqlen <= max_positions:
        raise ValueError(
            f"max_seqlen {max_seqlen} must be >= the longest sequence ({int(lengths.max())}) and <= {max_positions}"
        )
    return lengths


def pool_packed(hidden: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool packed token states ``hidden [N, d]`` per sequence → ``[B, d]`` (same dtype), as the masked pooling of
    the padded batch: ``mode`` ``"first"`` (the [CLS] token), ``"mean"`` or ``"max"`` (element-wise)."""
    starts = cu_seqlens[:-1].long()
    if mode == "first":
        return hidden.index_select(0, starts)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(
        torch.arange(lengths.shape[0], device=hidden.device), lengths, output_size=hidden.shape[0]
    )
    index = segment[:, None].expand_as(hidden)
    if mode == "mean":
        total = hidden.new_zeros(lengths.shape[0], hidden.shape[1]).index_add(0, segment, hidden)
        return total / lengths.clamp_min(1).to(hidden.dtype)[:, None]
    if mode == "max":
        init = hidden.new_full((lengths.shape[0], hidden.shape[1]), torch.finfo(hidden.dtype).min)
        return init.scatter_reduce(0, index, hidden, reduce="amax", include_self=False)
    raise ValueError(f"pooling mode {mode!r}: choose first, mean or max")


@dataclass(frozen=True)
class AttentionBucket:
    """Sequences of similar length attended together in one padded block ``[size, length]``: ``mask [size, length]``
    bool (True = token) and its additive fp32 ``key_bias [size, 1, 1, length]``, built once for every layer."""

    mask: torch.Tensor
    size: int
    length: int
    key_bias: torch.Tensor = field(repr=False, default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.key_bias is None:
            object.__setattr__(self, "key_bias", key_mask_bias(self.mask, torch.float32))


@dataclass(frozen=True)
class AttentionPlan:
    """How :func:`bucketed_attention` splits a packed batch: ``buckets``, laid out back to back in one padded
    buffer of ``sum(size * length)`` slots, ``slots [N]`` int64: the buffer slot of every packed token, and
    ``blocks [B, 2]`` int64 on the host: each sequence's bucket and its block in that bucket."""

    buckets: list[AttentionBucket]
    slots: torch.Tensor
    blocks: np.ndarray


def attention_plan(
    cu_seqlens: torch.Tensor | np.ndarray | Sequence[int], ratio: float = 0.5, device: Any = None
) -> AttentionPlan:
    """Group the sequences of ``cu_seqlens [B+1]`` by length for attention over padded blocks: longest first, a
    sequence joins the current block while it is at least ``ratio`` times the block's longest (at most
    ``1 - ratio`` padding per block). ``cu_seqlens``: host values (the plan goes on ``device``) or a tensor (read
    on the host once; the plan goes on its device)."""
    if isinstance(cu_seqlens, torch.Tensor):
        device = cu_seqlens.device if device is None else device
        cu = np.asarray(cu_seqlens.tolist(), dtype=np.int64)
    else:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = cu[1:] - cu[:-1]
    order = np.argsort(-lengths, kind="stable")
    groups: list[list[int]] = []
    for s in order:
        if groups and lengths[s] >= ratio * lengths[groups[-1][0]]:
            groups[-1].append(int(s))
        else:
            groups.append([int(s)])
    buckets = []
    slots = np.empty(int(cu[-1]), dtype=np.int64)
    blocks = np.empty((len(lengths), 2), dtype=np.int64)
    offset = 0
    for index, group in enumerate(groups):
        blocks[group, 0], blocks[group, 1] = index, np.arange(len(group))
        length = int(lengths[group[0]])
        tokens = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in group])
        local = np.concatenate([j * length + np.arange(lengths[s]) for j, s in enumerate(group)])
        slots[tokens] = offset + local
        offset += len(group) * length
        mask = np.arange(length)[None, :] < lengths[group][:, None]
        buckets.append(
            AttentionBucket(mask=torch.as_tensor(mask, device=device), size=len(group), length=length)
        )
    return AttentionPlan(buckets=buckets, slots=torch.as_tensor(slots, device=device), blocks=blocks)


def bucketed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBucket], torch.Tensor],
) -> torch.Tensor:
    """Packed attention block by block: ``q, k, v [N, H, Dh]`` → ``[N, H, Dh]``, ``attend(q, k, v, bucket)`` being
    padded attention on ``[size, length, H, Dh]`` with the bucket's key mask. The tokens enter one buffer of all
    blocks with one scatter and leave with one gather, so the backward adds no per-block full-size gradients."""
    qkv = torch.stack((q, k, v), 1)  # [N, 3, H, Dh]
    sizes = [b.size * b.length for b in plan.buckets]
    padded = qkv.new_zeros(sum(sizes), *qkv.shape[1:]).index_copy(0, plan.slots, qkv)
    pieces = []
    for b, block in zip(plan.buckets, padded.split(sizes)):
        qb, kb, vb = block.view(b.size, b.length, *qkv.shape[1:]).unbind(2)
        ctx = attend(qb, kb, vb, b)
        pieces.append(ctx.reshape(b.size * b.length, *ctx.shape[2:]))
    return torch.cat(pieces).index_select(0, plan.slots)
