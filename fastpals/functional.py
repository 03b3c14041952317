"""The reference (plain PyTorch) ops, as :mod:`fastpals_kernels.reference` defines them.

fastpals builds on its op library: the references live there, beside the fused kernels they define. This module
keeps the names importable from ``fastpals.functional``.
"""

from __future__ import annotations

from fastpals_kernels.reference import *  # noqa: F403
from fastpals_kernels.reference import __all__ as _reference_all

__all__ = list(_reference_all)
