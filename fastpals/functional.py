"""Reference (plain PyTorch) definitions of the PAL ops.

These functions *define* what every fused kernel in ``fastpals.kernels`` computes. They run on any device and
are the path used on CPU. Shapes use these letters:

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

__all__ = [
    "TaskGroups",
    "attention_reference",
    "attention_varlen_reference",
    "check_task_ids",
    "group_by_task",
    "grouped_linear_reference",
    "pal_reference",
    "pal_varlen_reference",
]


@dataclass(frozen=True)
class TaskGroups:
    """Examples grouped by task.

    ``order [B] int64``: a stable permutation putting examples of task 0 first, then task 1, ...;
    ``counts [T] int64``: examples per task; ``offsets [T+1] int64``: start of each task's run in ``order``.
    """

    order: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor


def check_task_ids(task_ids: object, num_tasks: int, batch: int, device: torch.device) -> torch.Tensor:
    """Validate ``task_ids`` (one integer task per example) and return it as int64.

    Raises ``TypeError``/``ValueError`` naming the argument on a wrong type, dtype, shape, device or range.
    The range check reads the tensor once (a device sync); it guarantees no kernel ever indexes a weight out of
    bounds.
    """
    if not isinstance(task_ids, torch.Tensor):
        raise TypeError(f"task_ids must be a torch.Tensor of integer task ids, got {type(task_ids).__name__}")
    if task_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"task_ids must have an integer dtype, got {task_ids.dtype}")
    if task_ids.dim() != 1 or task_ids.shape[0] != batch:
        raise ValueError(
            f"task_ids must have shape [{batch}] (one task per example), got {list(task_ids.shape)}"
        )
    if task_ids.device != device:
        raise ValueError(f"task_ids is on {task_ids.device} but the inputs are on {device}")
    if batch > 0:
        lo, hi = int(task_ids.min()), int(task_ids.max())
        if lo < 0 or hi >= num_tasks:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"task_ids contains {bad}, outside [0, {num_tasks}) for a model with {num_tasks} tasks"
            )
    return task_ids.long()


def group_by_task(task_ids: torch.Tensor, num_tasks: int) -> TaskGroups:
    """Group examples by task with one stable sort (no Python loop over examples)."""
    order = torch.argsort(task_ids, stable=True)
    counts = torch.bincount(task_ids, minlength=num_tasks)
    offsets = torch.zeros(num_tasks + 1, dtype=torch.long, device=task_ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return TaskGroups(order=order, counts=counts, offsets=offsets)


def grouped_linear_reference(
    x: torch.Tensor, task_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``y[b] = x[b] @ weight[task_ids[b]].T + bias[task_ids[b]]``.

    x: ``[B, ..., K]``; task_ids: ``[B]`` int64; weight: ``[T, M, K]``; bias: ``[T, M]`` or None.
    Returns ``[B, ..., M]`` in x's dtype. Loops over tasks (T is small), never over examples.
    """
    counts = torch.bincount(task_ids, minlength=weight.shape[0]).tolist()  # one host sync
    order = torch.argsort(task_ids, stable=True)
    x_sorted = x.index_select(0, order)
    pieces, start = [], 0
    for t, n in enumerate(counts):
        if n:
            pieces.append(F.linear(x_sorted[start : start + n], weight[t], None if bias is None else bias[t]))
        start += n
    if not pieces:
        return x.new_empty(*x.shape[:-1], weight.shape[1])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(pieces).index_select(0, inverse)


def _key_mask_bias(key_padding_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] (1 = token, 0 = padding) -> additive [B, 1, 1, L] (0 or the dtype's most negative value)."""
    keep = key_padding_mask.to(torch.bool)[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


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
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, Dh]
    scores = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale
    if key_padding_mask is not None:
        scores = scores + _key_mask_bias(key_padding_mask, torch.float32)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, vh).transpose(1, 2)


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

    q, k, v: ``[N, H, Dh]`` with sequences back to back; cu_seqlens: ``[B+1]`` int32 cumulative lengths.
    Returns ``[N, H, Dh]``.
    """
    padded, mask, index = _pad(torch.stack((q, k, v)), cu_seqlens, max_seqlen)
    out = attention_reference(padded[0], padded[1], padded[2], mask, dropout_p, softmax_scale)
    return out.flatten(0, 1).index_select(0, index)


def _pad(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> tuple[torch.Tensor, ...]:
    """Scatter packed rows ``x[..., N, *rest]`` (packed dim 1 if x is stacked, else 0) into a padded batch.

    Returns (padded ``[..., B, max_seqlen, *rest]``, mask ``[B, max_seqlen]``, index ``[N]`` of each packed
    row in the flattened padded batch).
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    batch = lengths.shape[0]
    pos = torch.arange(max_seqlen, device=x.device)
    mask = pos[None, :] < lengths[:, None]
    index = mask.flatten().nonzero(as_tuple=True)[0]
    stacked = x.dim() >= 4  # [3, N, H, Dh] vs [N, ...]
    if stacked:
        flat = x.new_zeros(x.shape[0], batch * max_seqlen, *x.shape[2:])
        flat[:, index] = x
        return flat.view(x.shape[0], batch, max_seqlen, *x.shape[2:]), mask, index
    flat = x.new_zeros(batch * max_seqlen, *x.shape[1:])
    flat[index] = x
    return flat.view(batch, max_seqlen, *x.shape[1:]), mask, index


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
) -> torch.Tensor:
    """The task-specific PAL output ``TS_t(h)`` for a mixed-task padded batch.

    h: ``[B, L, d]``; attention_mask: ``[B, L]`` (1 = token) or None; task_ids: ``[B]`` int64 (validated by
    the caller with :func:`check_task_ids`); weights as in the module docstring. Returns ``[B, L, d]``.
    """
    batch, length, _ = h.shape
    d_s = enc_weight.shape[1]
    s = grouped_linear_reference(h, task_ids, enc_weight, enc_bias)  # [B, L, d_s]
    qkv = grouped_linear_reference(s, task_ids, qkv_weight, qkv_bias)  # [B, L, 3 d_s]
    q, k, v = qkv.view(batch, length, 3, num_heads, d_s // num_heads).unbind(2)
    ctx = attention_reference(q, k, v, attention_mask, dropout_p).reshape(batch, length, d_s)
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
) -> torch.Tensor:
    """Packed form of :func:`pal_reference`: h ``[N, d]``, cu_seqlens ``[B+1]`` int32, task_ids ``[B]``.

    Returns ``[N, d]``.
    """
    padded, mask, index = _pad(h, cu_seqlens, max_seqlen)
    out = pal_reference(
        padded, mask, task_ids, enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias,
        num_heads, gelu, dropout_p,
    )  # fmt: skip
    return out.flatten(0, 1).index_select(0, index)
