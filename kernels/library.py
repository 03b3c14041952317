"""Every ``torch.ops.fastpals`` custom op, by name (each op module defines its ops beside its kernels)."""

from __future__ import annotations

from fastpals_kernels.attention_varlen import attention_varlen_backward_op, attention_varlen_op
from fastpals_kernels.combine import combine_op, combine_out_op, combine_row_op
from fastpals_kernels.common import draw_seed
from fastpals_kernels.gram import gram_op
from fastpals_kernels.grouped_linear import grouped_wgrad_op, grouped_wgrad_out_op
from fastpals_kernels.pal import pal_backward_op, pal_op, pal_varlen_backward_op, pal_varlen_op
from fastpals_kernels.stream_linear import stream_linear_combine, stream_linear_gram

__all__ = ["OPS", "draw_seed"]

OPS = {
    op._name: op
    for op in (
        pal_op,
        pal_varlen_op,
        pal_backward_op,
        pal_varlen_backward_op,
        attention_varlen_op,
        attention_varlen_backward_op,
        grouped_wgrad_op,
        grouped_wgrad_out_op,
        gram_op,
        combine_op,
        combine_out_op,
        combine_row_op,
        stream_linear_gram,
        stream_linear_combine,
    )
}
