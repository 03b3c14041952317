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
from fastpals_kernels.attention_varlen import attention_with_key_bias
from fastpals_kernels.padding import AttentionPlan, bucketed_attention

__all__ = [
    "PackedSegments",
    "packed_pal_reference",
    "pal_eager",
]


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
        lambda qb, kb, vb, b: attention_with_key_bias(qb, kb, vb, b.key_bias, dropout_p),
    )  # fmt: skip
    y = linear(ctx.reshape(n, d_s), dec_w, dec_b)
    return F.gelu(y) if gelu else y
