"""The registry of fastpals' ``torch.library`` custom ops (``torch.ops.fastpals.<name>``): each op module of
this package defines its ops (schema, fake, autograd, vmap rule) beside its kernels; this module imports them all
so that one place lists them."""

from __future__ import annotations

from fastpals_kernels.attention_varlen import attention_varlen_backward_op, attention_varlen_op
from fastpals_kernels.combine import combine_op, combine_out_op, combine_row_op
from fastpals_kernels.common import draw_seed
from fastpals_kernels.gram import gram_op
from fastpals_kernels.grouped_linear import grouped_wgrad_op, grouped_wgrad_out_op
from fastpals_kernels.pal import pal_backward_op, pal_op, pal_varlen_backward_op, pal_varlen_op
from fastpals_kernels.stream_linear import stream_linear_combine, stream_linear_gram

__all__ = ["OPS", "draw_seed"]

#: every op of the library, by name (``torch.ops.fastpals.<name>``)
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
