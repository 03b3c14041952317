"""Every ``torch.ops.fastpals`` custom op, by name (each op module defines its ops beside its kernels)."""

from __future__ import annotations

import torch

from fastpals_kernels import (
    attention_varlen,
    combine,
    dropout_layer_norm,
    gram,
    grouped_linear,
    pal,
    stream_linear,
)
from fastpals_kernels.common import draw_seed

__all__ = ["OPS", "draw_seed"]

OPS = {
    op._name: op
    for module in (pal, attention_varlen, grouped_linear, gram, combine, stream_linear, dropout_layer_norm)
    for op in vars(module).values()
    if isinstance(op, torch.library.CustomOpDef)
}
