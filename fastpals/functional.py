"""The reference (plain PyTorch) ops of the op library, importable from ``fastpals.functional``: each op's
reference lives in its module of ``fastpals_kernels``, beside its kernels."""

from __future__ import annotations

from fastpals_kernels.combine import check_combine_args, combine_reference
from fastpals_kernels.common import MAX_TASKS, check_task_buffer
from fastpals_kernels.gram import gram_reference
from fastpals_kernels.reference import *  # noqa: F403
from fastpals_kernels.reference import __all__ as _reference_all

__all__ = [*_reference_all, "MAX_TASKS", "check_combine_args", "check_task_buffer", "combine_reference",
           "gram_reference"]  # fmt: skip
