"""The dispatching ops of :mod:`fastpals_kernels`: each call goes to a registered backend, the custom op of
:mod:`fastpals_kernels.library` (``torch.ops.fastpals.*``: under ``torch.compile``, fake tensors or
``$FASTPALS_KERNELS=...,library``), or the eager implementation of :mod:`fastpals_kernels.eager`, as
:mod:`fastpals_kernels.backends` decides. The names of those two modules are re-exported here.
"""

from __future__ import annotations

from typing import Any

import torch

from fastpals_kernels.attention_varlen import attention_varlen, attention_varlen_eager, padded_attention
from fastpals_kernels.backends import (
    BACKENDS_ENV,
    KERNELS_ENV,
    OPS,
    OPS_ENV,
    Backend,
    Decision,
    available,
    backend,
    capability_of,
    decide,
    flash_attn_installed,
    flash_varlen_ok,
    forced_backends,
    kernel_mode,
    library_mode,
    register_backend,
    registered,
    unregister_backend,
    use_library,
    use_triton,
)
from fastpals_kernels.combine import combine
from fastpals_kernels.common import seed_for
from fastpals_kernels.eager import PackedSegments, packed_pal_reference, pal_eager
from fastpals_kernels.gram import gram
from fastpals_kernels.grouped_linear import grouped_wgrad, grouped_wgrad_into

__all__ = [
    "BACKENDS_ENV",
    "KERNELS_ENV",
    "OPS",
    "OPS_ENV",
    "Backend",
    "Decision",
    "PackedSegments",
    "attention_varlen",
    "attention_varlen_eager",
    "available",
    "backend",
    "capability_of",
    "combine",
    "decide",
    "flash_attn_installed",
    "flash_varlen_ok",
    "forced_backends",
    "gram",
    "grouped_wgrad",
    "grouped_wgrad_into",
    "kernel_mode",
    "library_mode",
    "packed_pal_reference",
    "padded_attention",
    "pal_eager",
    "register_backend",
    "registered",
    "run_pal",
    "unregister_backend",
    "use_library",
    "use_triton",
]


# ----------------------------------------------------------------------------------------------------------------
# Dispatching ops
# ----------------------------------------------------------------------------------------------------------------
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
    :func:`fastpals_kernels.reference.pal_reference`. ``segments`` (packed rows, reference backend): a
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
