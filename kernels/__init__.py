"""fastpals' op library: one module per op, each holding the op's PyTorch reference, its Triton kernels (compiled
on first launch: ``import fastpals_kernels`` loads no Triton), its ``torch.ops.fastpals`` custom ops and its
public function.

- :mod:`~fastpals_kernels.pal`: :func:`pal` / :func:`pal_varlen`, the fused Projected Attention Layer;
  :mod:`~fastpals_kernels.pal_attention`: :func:`pal_attention` / :func:`pal_attention_varlen`, its attention;
- :mod:`~fastpals_kernels.attention_varlen`: BERT's attention over packed rows;
- :mod:`~fastpals_kernels.grouped_linear`: :func:`grouped_linear` / :func:`grouped_linear_varlen` (Triton), the
  per-task weight gradients;
- :mod:`~fastpals_kernels.gram` / :mod:`~fastpals_kernels.combine`: :func:`gram`, :func:`combine`, the surgery
  buffer ops;
- :mod:`~fastpals_kernels.backends`: the switch ``$FASTPALS_KERNELS`` (:func:`available`, :func:`use_triton`,
  :func:`kernel_mode`, :func:`backend`, :func:`decide`) and the registry of added backends;
- :mod:`~fastpals_kernels.padding` (packed/padded conversions), :mod:`~fastpals_kernels.common` (shared host
  helpers), :mod:`~fastpals_kernels.tl_helpers` (shared Triton helpers), :mod:`~fastpals_kernels.library` (the
  custom-op registry), :mod:`~fastpals_kernels.aot` (ahead-of-time compile).
"""

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
