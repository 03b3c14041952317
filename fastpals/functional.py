"""The reference (plain PyTorch) ops of the op library, importable from ``fastpals.functional``: each op's
reference lives in its module of ``fastpals_kernels``, beside its kernels."""

from __future__ import annotations

from fastpals_kernels.attention_varlen import (
    attention_reference,
    attention_sdpa,
    attention_varlen_reference,
    attention_with_key_bias,
    key_mask_bias,
)
from fastpals_kernels.combine import check_combine_args, combine_reference
from fastpals_kernels.common import MAX_TASKS, check_task_buffer, check_task_ids
from fastpals_kernels.dropout import Dropout, dropout, dropout_add
from fastpals_kernels.gram import gram_reference
from fastpals_kernels.grouped_linear import grouped_linear_reference, segment_linear
from fastpals_kernels.padding import pad_packed_index as pad_packed
from fastpals_kernels.pal import PALWeights, pal_reference, pal_varlen_reference

__all__ = [
    "MAX_TASKS",
    "Dropout",
    "PALWeights",
    "attention_reference",
    "attention_sdpa",
    "attention_varlen_reference",
    "attention_with_key_bias",
    "check_combine_args",
    "check_task_buffer",
    "check_task_ids",
    "combine_reference",
    "dropout",
    "dropout_add",
    "gram_reference",
    "grouped_linear_reference",
    "key_mask_bias",
    "pad_packed",
    "pal_reference",
    "pal_varlen_reference",
    "segment_linear",
]
