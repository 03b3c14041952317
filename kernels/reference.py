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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def key_mask_bias(key_padding_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Key padding mask [B, L] (1 = token, 0 = padding) -> additive [B, 1, 1, L] (0 or the dtype's most negative value)."""
    keep = key_padding_mask.to(torch.bool)[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Inverted dropout: each element of ``x`` (any shape, float dtype) is zeroed with probability ``p`` and the
    others are scaled by ``1 / (1 - p)``; identity when ``training`` is False or ``p == 0``.

    On CPU the keep mask comes from 16-bit slices of 64-bit words drawn from torch's default CPU generator, so
    ``p`` is rounded to a multiple of 1/65536 (the scale uses the rounded value, so the output stays unbiased).
    torch's ``F.dropout`` draws one Bernoulli variate per element, which measured about 2x slower here (12.4 ms
    against 6.6 ms forward + backward on 900 x 1536 bf16, 2-core AVX-512 CPU). Other devices, and code under
    ``torch.compile``, use ``F.dropout``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling():  # the compiler traces F.dropout's mask
        return F.dropout(x, p=p, training=True)
    n = x.numel()
    drop = round(p * 65536)  # a slice below -32768 + drop is dropped: probability drop / 65536
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    slices = words.view(torch.int16)[:n].view(x.shape)
    keep = slices >= drop - 32768
    # the scale is applied in the op's fp32 math: one rounding, as F.dropout
    return (x * keep).mul_(65536.0 / (65536 - drop))


class Dropout(torch.nn.Dropout):
    """``nn.Dropout`` computed by :func:`dropout` (the same module type, state and ``p``; a faster mask on CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Multi-head softmax attention, flash-attn layout.

    q, k, v: ``[B, L, H, Dh]``; key_padding_mask: ``[B, L]`` (1 = token, 0 = padding) or None.
    Padded keys get the dtype's most negative score (BERT's additive mask); every query row, padded or not,
    is computed. Softmax in fp32; dropout (``dropout_p``) on the probabilities. Returns ``[B, L, H, Dh]``.
    """
    bias = None if key_padding_mask is None else key_mask_bias(key_padding_mask, torch.float32)
    return attention_with_key_bias(q, k, v, bias, dropout_p, softmax_scale)


def attention_with_key_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor | None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`attention_reference` with the key mask given as its additive fp32 bias ``key_bias [B, 1, 1, L]``
    (from :func:`key_mask_bias`, so callers that attend over one block many times build it once), or None.

    q, k, v: ``[B, L, H, Dh]`` → ``[B, L, H, Dh]`` in q's dtype: scores in q's dtype, then fp32 scale, bias and
    softmax, probabilities cast back, dropout, then ``probs @ v``.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, Dh]
    scores = torch.matmul(qh, kh.transpose(-1, -2)).float().mul_(scale)
    if key_bias is not None:
        scores = scores.add_(key_bias)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = dropout(probs, dropout_p)
    return torch.matmul(probs, vh).transpose(1, 2)


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`attention_reference` through ``F.scaled_dot_product_attention`` (the stock composition used on
    GPUs where the Triton kernels lose, e.g. sm_75): the head dim is zero-padded to a multiple of 8 so the
    fused SDPA backends (which need that alignment) take it; the padding changes no score and its output
    columns are dropped. Same shapes and mask rule (an additive most-negative bias per padded key); dropout
    draws its own mask. Returns ``[B, L, H, Dh]``.
    """
    head_dim = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    pad = (-head_dim) % 8
    qh, kh, vh = (F.pad(t, (0, pad)).transpose(1, 2) if pad else t.transpose(1, 2) for t in (q, k, v))
    bias = None if key_padding_mask is None else key_mask_bias(key_padding_mask, q.dtype)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    return out.transpose(1, 2)[..., :head_dim]


def attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Packed (varlen) form of :func:`attention_reference`.

    q, k, v: ``[N, H, Dh]`` with sequences back to back; cu_seqlens: ``[B+1]`` int32 or int64 cumulative lengths.
    Returns ``[N, H, Dh]``.
    """
    padded, mask, index = pad_packed(torch.stack((q, k, v)), cu_seqlens, max_seqlen)
    out = attention_reference(padded[0], padded[1], padded[2], mask, dropout_p, softmax_scale)
    return out.flatten(0, 1).index_select(0, index)


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
