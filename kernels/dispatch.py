"""The old import path of the dispatching functions and the switch, kept for one release: each op now lives in
its module (:mod:`fastpals_kernels.pal`, ``attention_varlen``, ``grouped_linear``, ``gram``, ``combine``) and the
switch in :mod:`fastpals_kernels.backends`; import them from there."""
# ruff: noqa: F401, F403

from __future__ import annotations

from fastpals_kernels.attention_varlen import attention_varlen, attention_varlen_eager, padded_attention
from fastpals_kernels.backends import *
from fastpals_kernels.backends import __all__ as _switch_names
from fastpals_kernels.combine import combine
from fastpals_kernels.gram import gram
from fastpals_kernels.grouped_linear import grouped_wgrad, grouped_wgrad_into
from fastpals_kernels.pal import PackedSegments, packed_pal_reference, pal_eager, run_pal

__all__ = [*_switch_names, "PackedSegments", "attention_varlen", "attention_varlen_eager", "combine", "gram",
           "grouped_wgrad", "grouped_wgrad_into", "packed_pal_reference", "padded_attention", "pal_eager",
           "run_pal"]  # fmt: skip
