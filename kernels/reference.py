"""Reference (plain PyTorch) definitions of the PAL ops (the Gram and combine references are in their op modules).

These functions *define* what every fused kernel in ``fastpals_kernels`` computes. They run on any device, are
the path used on CPU, and import no Triton. Shapes use these letters:

- ``B`` examples, ``L`` padded sequence length, ``N`` packed tokens (varlen form), ``d`` model width,
- ``T`` tasks, ``d_s`` PAL width, ``H`` PAL heads, ``Dh = d_s / H`` head dim.

Weight layout (one slice per task, so a task id indexes the first dimension):

- ``enc_weight [T, d_s, d]``, ``enc_bias [T, d_s]``          (V^E: d -> d_s)
- ``qkv_weight [T, 3*d_s, d_s]``, ``qkv_bias [T, 3*d_s]``   (rows 0:d_s are Q, d_s:2d_s K, 2d_s:3d_s V)
- ``dec_weight [T, d, d_s]``, ``dec_bias [T, d]``            (V^D: d_s -> d)

The PAL output for an example of task t is ``act(V^D_t · MHA_t(V^E_t · h))`` where MHA has no output
projection and ``act`` is the exact (erf) GELU or the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastpals_kernels.attention_varlen import (
    Dropout,
    attention_reference,
    attention_sdpa,
    attention_varlen_reference,
    attention_with_key_bias,
    dropout,
    key_mask_bias,
)
from fastpals_kernels.common import check_task_ids
from fastpals_kernels.grouped_linear import grouped_linear_reference, segment_linear
from fastpals_kernels.padding import pad_packed_index as pad_packed

__all__ = [
    "Dropout",
    "PALWeights",
    "attention_reference",
    "attention_sdpa",
    "attention_varlen_reference",
    "attention_with_key_bias",
    "check_task_ids",
    "dropout",
    "grouped_linear_reference",
    "key_mask_bias",
    "pad_packed",
    "pal_reference",
    "pal_varlen_reference",
    "segment_linear",
]


@dataclass(frozen=True, eq=False)
class PALWeights:
    """The weights and options of one PAL op call (what :class:`fastpals.encoder.bert.PALLayer` hands to the op).

    Weights as in the module docstring, one slice per task (all of one dtype and device):
    ``enc_weight [T, d_s, d]``, ``enc_bias [T, d_s]``, ``qkv_weight [T, 3 d_s, d_s]``, ``qkv_bias [T, 3 d_s]``,
    ``dec_weight [T, d, d_s]``, ``dec_bias [T, d]``; ``num_heads`` (H, divides d_s), ``gelu`` (exact GELU after
    V^D, else the identity) and ``dropout_p`` (attention-probability dropout of this call, 0.0 in eval).
    The op's kernels (``fastpals_kernels``) take these positionally: :meth:`as_args` gives that tuple.
    """

    enc_weight: torch.Tensor
    enc_bias: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor
    dec_weight: torch.Tensor
    dec_bias: torch.Tensor
    num_heads: int
    gelu: bool = True
    dropout_p: float = 0.0

    @property
    def num_tasks(self) -> int:
        """T, the number of task slices."""
        return self.enc_weight.shape[0]

    def as_args(self, task_ids: torch.Tensor) -> tuple:
        """The positional form ``(task_ids, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias,
        num_heads, gelu, dropout_p)`` that :func:`fastpals_kernels.dispatch.run_pal`, :func:`pal_reference` and
        :func:`pal_varlen_reference` take after their inputs; ``task_ids [B]`` int64 (one task per sequence)."""
        return (
            task_ids, self.enc_weight, self.enc_bias, self.qkv_weight, self.qkv_bias, self.dec_weight,
            self.dec_bias, self.num_heads, self.gelu, self.dropout_p,
        )  # fmt: skip


def pal_reference(
    h: torch.Tensor,
    attention_mask: torch.Tensor | None,
    task_ids: torch.Tensor,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dec_weight: torch.Tensor,
    dec_bias: torch.Tensor,
    num_heads: int,
    gelu: bool = True,
    dropout_p: float = 0.0,
    attention: str = "reference",
) -> torch.Tensor:
    """The task-specific PAL output ``TS_t(h)`` for a mixed-task padded batch.

    h: ``[B, L, d]``; attention_mask: ``[B, L]`` (1 = token) or None; task_ids: ``[B]`` int64 (validated by
    the caller with :func:`check_task_ids`); weights as in the module docstring; attention: ``"reference"``
    (:func:`attention_reference`) or ``"sdpa"`` (:func:`attention_sdpa`, the same result through PyTorch's
    fused attention). Returns ``[B, L, d]``.
    """
    attend = {"reference": attention_reference, "sdpa": attention_sdpa}.get(attention)
    if attend is None:
        raise ValueError(f"attention must be 'reference' or 'sdpa', got {attention!r}")
    batch, length, _ = h.shape
    d_s = enc_weight.shape[1]
    s = grouped_linear_reference(h, task_ids, enc_weight, enc_bias)  # [B, L, d_s]
    qkv = grouped_linear_reference(s, task_ids, qkv_weight, qkv_bias)  # [B, L, 3 d_s]
    q, k, v = qkv.view(batch, length, 3, num_heads, d_s // num_heads).unbind(2)
    ctx = attend(q, k, v, attention_mask, dropout_p).reshape(batch, length, d_s)
    y = grouped_linear_reference(ctx, task_ids, dec_weight, dec_bias)
    return F.gelu(y) if gelu else y


def pal_varlen_reference(
    h: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    task_ids: torch.Tensor,
    enc_weight: torch.Tensor,
    enc_bias: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dec_weight: torch.Tensor,
    dec_bias: torch.Tensor,
    num_heads: int,
    gelu: bool = True,
    dropout_p: float = 0.0,
    attention: str = "reference",
) -> torch.Tensor:
    """Packed form of :func:`pal_reference`: h ``[N, d]``, cu_seqlens ``[B+1]`` int32 or int64, task_ids
    ``[B]``. Returns ``[N, d]``.
    """
    padded, mask, index = pad_packed(h, cu_seqlens, max_seqlen)
    out = pal_reference(
        padded, mask, task_ids, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias,
        num_heads, gelu, dropout_p, attention,
    )  # fmt: skip
    return out.flatten(0, 1).index_select(0, index)
