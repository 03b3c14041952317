"""The old import path of the dispatching ops, kept for one release: each op now lives in its module
(:mod:`fastpals_kernels.pal`, ``attention_varlen``, ``grouped_linear``, ``gram``, ``combine``) and the switch in
:mod:`fastpals_kernels.backends`; import them from there."""

from __future__ import annotations

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
from fastpals_kernels.gram import gram
from fastpals_kernels.grouped_linear import grouped_wgrad, grouped_wgrad_into
from fastpals_kernels.pal import PackedSegments, packed_pal_reference, pal_eager, run_pal

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
