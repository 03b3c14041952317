"""fastpals' op library: one module per op, each holding the op's PyTorch reference, its Triton kernels
(compiled on first launch: importing loads no Triton), its ``torch.ops.fastpals`` custom ops and its public
function; the switch ``$FASTPALS_KERNELS`` in :mod:`~fastpals_kernels.backends`."""

from __future__ import annotations

from fastpals_kernels import library  # noqa: F401 - imports every op module: registers torch.ops.fastpals
from fastpals_kernels.backends import available, backend, decide, kernel_mode, use_triton
from fastpals_kernels.combine import combine
from fastpals_kernels.gram import gram
from fastpals_kernels.grouped_linear import grouped_linear, grouped_linear_varlen
from fastpals_kernels.pal import pal, pal_varlen
from fastpals_kernels.pal_attention import pal_attention, pal_attention_varlen

__all__ = [
    "available",
    "backend",
    "combine",
    "decide",
    "gram",
    "grouped_linear",
    "grouped_linear_varlen",
    "kernel_mode",
    "pal",
    "pal_attention",
    "pal_attention_varlen",
    "pal_varlen",
    "use_triton",
]
