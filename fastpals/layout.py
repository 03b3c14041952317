"""The one description of a micro-batch (:class:`BatchLayout`) and every pad/unpad/``cu_seqlens`` helper of the
package (the role of flash-attention's ``bert_padding.py``).

A batch runs either *packed* (``[N, d]`` token rows, no padding; ``cu_seqlens [B+1]`` int32 says where each of
the ``B`` sequences lies, the layout of flash-attn's varlen kernels) or *padded* (``[B, L, d]`` with a ``[B, L]``
mask). Its :class:`BatchLayout` is built ONCE, on the host, where the data enters:

- packed batches: by :meth:`BatchLayout.from_lengths` at collate time, straight from the examples' token lengths
  and task ids (Python ints / NumPy), validated there;
- padded batches (and packed tensors handed to the model without a layout): by :func:`make_layout` /
  :func:`layout_from_cu_seqlens` at the model's entry, which read the mask or ``cu_seqlens`` on the host once.

Everything after that point (the model, PALs, heads, losses, per-task gradients, kernels) reads the layout's host
values (Python ints, NumPy arrays) and its device tensors, and never derives them again: a training step reads no
device value on the host.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "AttentionBucket",
    "AttentionPlan",
    "BatchLayout",
    "attention_plan",
    "bucketed_attention",
    "check_packed",
    "cu_seqlens_to_mask",
    "layout_from_cu_seqlens",
    "layout_for",
    "lengths_to_cu_seqlens",
    "make_layout",
    "pack_rows",
    "packed_position_ids",
    "pad_packed",
    "pad_packed_index",
    "pool_packed",
    "unpad",
]


# ----------------------------------------------------------------------------------------------------------------
# cu_seqlens helpers (tensors in, tensors out; no host read unless the docstring says so)
# ----------------------------------------------------------------------------------------------------------------
def lengths_to_cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """Sequence lengths ``[B]`` (int) → ``cu_seqlens [B+1]`` int32 (0, then the running sums)."""
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


def cu_seqlens_to_mask(cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """``cu_seqlens [B+1]`` → right-padded mask ``[B, max_seqlen]`` bool (True = token)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.arange(max_seqlen, device=cu_seqlens.device)[None, :] < lengths[:, None]


def packed_position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token inside its own sequence: int64 ``[N]`` (``N = total = cu_seqlens[-1]``)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def unpad(x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-padded ``x [B, L, ...]`` with ``attention_mask [B, L]`` (1 = token) → ``(packed [N, ...],
    cu_seqlens [B+1] int32, max_seqlen)``. Reads the mask on the host (validation: raises ``ValueError`` if a
    mask row is not ``1...1 0...0``)."""
    mask = attention_mask.to(torch.bool)
    lengths = mask.sum(1)
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]):
        raise ValueError("attention_mask rows must be right-padded (1...1 0...0) to be packed")
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return x[mask], lengths_to_cu_seqlens(lengths), max_seqlen


def pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, value: float = 0) -> torch.Tensor:
    """Packed ``x [N, ...]`` → right-padded ``[B, max_seqlen, ...]`` filled with ``value`` (inverse of :func:`unpad`)."""
    mask = cu_seqlens_to_mask(cu_seqlens, max_seqlen)
    out = x.new_full((mask.shape[0], max_seqlen, *x.shape[1:]), value)
    out[mask] = x
    return out


def pad_packed_index(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> tuple[torch.Tensor, ...]:
    """Scatter packed rows ``x[..., N, *rest]`` (packed dim 1 if x is stacked, else 0) into a padded batch.

    Returns (padded ``[..., B, max_seqlen, *rest]``, mask ``[B, max_seqlen]``, index ``[N]`` of each packed
    row in the flattened padded batch).
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    batch = lengths.shape[0]
    pos = torch.arange(max_seqlen, device=x.device)
    mask = pos[None, :] < lengths[:, None]
    stacked = x.dim() >= 4  # [3, N, H, Dh] vs [N, ...]
    total = x.shape[1] if stacked else x.shape[0]
    example = torch.repeat_interleave(torch.arange(batch, device=x.device), lengths, output_size=total)
    index = example * max_seqlen + packed_position_ids(
        cu_seqlens, total
    )  # no data-dependent size: no host read
    if stacked:
        flat = x.new_zeros(x.shape[0], batch * max_seqlen, *x.shape[2:])
        flat[:, index] = x
        return flat.view(x.shape[0], batch, max_seqlen, *x.shape[2:]), mask, index
    flat = x.new_zeros(batch * max_seqlen, *x.shape[1:])
    flat[index] = x
    return flat.view(batch, max_seqlen, *x.shape[1:]), mask, index


def check_packed(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None, max_positions: int
) -> np.ndarray:
    """Validate packed tensors handed over without a layout and return their lengths ``[B]`` int64 on the host
    (one host read of ``cu_seqlens``: this is where such data enters).

    ``input_ids [N]``; ``cu_seqlens [B+1]`` int32 on the same device, starting at 0, ending at N, every sequence
    at least one token; ``max_seqlen`` an int >= the longest sequence and <= ``max_positions``.
    """
    if input_ids.dim() != 1:
        raise ValueError(
            f"packed input_ids must be [N] (cu_seqlens given), got shape {list(input_ids.shape)}"
        )
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [B+1] with B >= 1")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 (flash-attn's layout), got {cu_seqlens.dtype}")
    if cu_seqlens.device != input_ids.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but input_ids on {input_ids.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be an int with packed inputs, got {max_seqlen!r}")
    cu = np.asarray(cu_seqlens.tolist(), dtype=np.int64)  # the one host read
    lengths = cu[1:] - cu[:-1]
    if cu[0] != 0 or cu[-1] != input_ids.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to N = {input_ids.shape[0]}, got {cu[0]} .. {cu[-1]}")
    if int(lengths.min()) < 1:
        raise ValueError("cu_seqlens holds an empty sequence: every packed sequence needs at least one token")
    if not int(lengths.max()) <= max_seqlen <= max_positions:
        raise ValueError(
            f"max_seqlen {max_seqlen} must be >= the longest sequence ({int(lengths.max())}) and <= {max_positions}"
        )
    return lengths


def pool_packed(hidden: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool packed token states ``hidden [N, d]`` per sequence → ``[B, d]`` (same dtype).

    ``mode``: ``"first"`` (the [CLS] token), ``"mean"`` (over the sequence's tokens) or ``"max"`` (element-wise).
    Equals the masked pooling of the padded batch.
    """
    starts = cu_seqlens[:-1].long()
    if mode == "first":
        return hidden.index_select(0, starts)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(
        torch.arange(lengths.shape[0], device=hidden.device), lengths, output_size=hidden.shape[0]
    )
    index = segment[:, None].expand_as(hidden)
    if mode == "mean":
        total = hidden.new_zeros(lengths.shape[0], hidden.shape[1]).index_add(0, segment, hidden)
        return total / lengths.clamp_min(1).to(hidden.dtype)[:, None]
    if mode == "max":
        init = hidden.new_full((lengths.shape[0], hidden.shape[1]), torch.finfo(hidden.dtype).min)
        return init.scatter_reduce(0, index, hidden, reduce="amax", include_self=False)
    raise ValueError(f"pooling mode {mode!r}: choose first, mean or max")


# ----------------------------------------------------------------------------------------------------------------
# Attention over length buckets (packed attention without a varlen kernel)
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionBucket:
    """Sequences of similar length attended together in one padded block ``[size, length]``.

    ``mask [size, length]`` bool (True = token); where each token lands is the plan's ``slots``.
    """

    mask: torch.Tensor
    size: int
    length: int

    @functools.cached_property
    def key_bias(self) -> torch.Tensor:
        """The block's additive fp32 key bias ``[size, 1, 1, length]`` (:func:`fastpals.functional.key_mask_bias`),
        built on first use and shared by every layer that attends over this block."""
        keep = self.mask[:, None, None, :]
        zeros = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
        return zeros.masked_fill(~keep, torch.finfo(torch.float32).min)


@dataclass(frozen=True)
class AttentionPlan:
    """How :func:`bucketed_attention` splits a packed batch: ``buckets``, laid out back to back in one padded
    buffer of ``sum(size * length)`` slots, and ``slots [N]`` int64: the buffer slot of every packed token."""

    buckets: list[AttentionBucket]
    slots: torch.Tensor


def attention_plan(
    cu_seqlens: torch.Tensor | np.ndarray | Sequence[int], ratio: float = 0.5, device: Any = None
) -> AttentionPlan:
    """Group the sequences of ``cu_seqlens [B+1]`` by length for attention over padded blocks (the CPU path):
    sorted longest first, a sequence joins the current block while its length is at least ``ratio`` times the
    block's longest, so at most ``1 - ratio`` of a block's query rows (and keys) are padding.

    ``cu_seqlens``: host values (NumPy / a list: no device read; tensors go on ``device``) or a tensor (read on
    the host once; the plan's tensors go on its device).

    The ratio trades padding against per-block overhead: on ``make train``'s batches (32 rows of 5-69 tokens,
    MiniLM on 2 CPU cores), paired on the same batches, 0.5 made the update 0.87x as long as 0.8; 0.65 gave
    0.94x and 0.35 1.03x."""
    if isinstance(cu_seqlens, torch.Tensor):
        device = cu_seqlens.device if device is None else device
        cu = np.asarray(cu_seqlens.tolist(), dtype=np.int64)
    else:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = cu[1:] - cu[:-1]
    order = np.argsort(-lengths, kind="stable")
    groups: list[list[int]] = []
    for s in order:
        if groups and lengths[s] >= ratio * lengths[groups[-1][0]]:
            groups[-1].append(int(s))
        else:
            groups.append([int(s)])
    buckets = []
    slots = np.empty(int(cu[-1]), dtype=np.int64)
    offset = 0
    for group in groups:
        length = int(lengths[group[0]])
        tokens = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in group])
        local = np.concatenate([j * length + np.arange(lengths[s]) for j, s in enumerate(group)])
        slots[tokens] = offset + local
        offset += len(group) * length
        mask = np.arange(length)[None, :] < lengths[group][:, None]
        buckets.append(
            AttentionBucket(mask=torch.as_tensor(mask, device=device), size=len(group), length=length)
        )
    return AttentionPlan(buckets=buckets, slots=torch.as_tensor(slots, device=device))


def bucketed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBucket], torch.Tensor],
) -> torch.Tensor:
    """Packed attention computed block by block: ``q, k, v [N, H, Dh]`` → ``[N, H, Dh]``.

    ``attend(q, k, v, bucket)`` is padded attention on ``[size, length, H, Dh]`` with the bucket's key mask
    (``bucket.mask [size, length]`` bool, or its cached fp32 ``bucket.key_bias``; e.g.
    :func:`fastpals.functional.attention_with_key_bias`); each sequence only sees its own keys, as in
    :func:`fastpals.functional.attention_varlen_reference`, with padding bounded per block instead of padding
    every sequence to the batch's longest. The tokens enter one padded buffer holding every block with one
    scatter and leave it with one gather (``plan.slots``), so the backward adds no per-block full-size gradients.
    """
    qkv = torch.stack((q, k, v), 1)  # [N, 3, H, Dh]
    sizes = [b.size * b.length for b in plan.buckets]
    padded = qkv.new_zeros(sum(sizes), *qkv.shape[1:]).index_copy(0, plan.slots, qkv)
    pieces = []
    for b, block in zip(plan.buckets, padded.split(sizes)):
        qb, kb, vb = block.view(b.size, b.length, *qkv.shape[1:]).unbind(2)
        ctx = attend(qb, kb, vb, b)
        pieces.append(ctx.reshape(b.size * b.length, *ctx.shape[2:]))
    return torch.cat(pieces).index_select(0, plan.slots)


# ----------------------------------------------------------------------------------------------------------------
# The layout
# ----------------------------------------------------------------------------------------------------------------
_BY_TASK_IDS: weakref.WeakValueDictionary[int, BatchLayout] = weakref.WeakValueDictionary()


def layout_for(task_ids: object) -> BatchLayout | None:
    """The live layout whose device ``task_ids`` tensor is this very tensor (e.g. ``model_inputs(...)["task_ids"]``),
    else None: callers handed only the tensor (:func:`fastpals.surgery.per_task_gradients`) find the host values
    without reading the device."""
    if isinstance(task_ids, BatchLayout):
        return task_ids
    if not isinstance(task_ids, torch.Tensor):
        return None
    layout = _BY_TASK_IDS.get(id(task_ids))
    return layout if layout is not None and layout.task_ids is task_ids else None


def _ranges(ids: np.ndarray, starts: np.ndarray, num_tasks: int) -> dict[int, tuple[int, int]] | None:
    """Per present task, its contiguous range ``[starts[first row], starts[last row + 1])`` when rows are grouped
    by task in increasing order; None otherwise."""
    if ids.size > 1 and bool(np.any(ids[1:] < ids[:-1])):
        return None
    out: dict[int, tuple[int, int]] = {}
    for t in range(num_tasks):
        rows = np.flatnonzero(ids == t)
        if rows.size:
            out[t] = (int(starts[rows[0]]), int(starts[rows[-1] + 1]))
    return out


@dataclass(eq=False)
class BatchLayout:
    """How one batch is laid out, shared by every layer, head, loss and per-task gradient of one step.

    Host values (Python ints / NumPy, never read back from a device):

    - ``batch`` B sequences, ``length`` L (padded width; ``max_seqlen`` for packed layouts), ``packed``;
    - ``lengths [B]`` int64 tokens per sequence, ``cu_host [B+1]`` int64, ``total`` N tokens, ``max_seqlen``;
    - ``host_task_ids [B]`` int64 (or None: a model without tasks), ``num_tasks``; ``task_examples`` /
      ``task_tokens``: per task (``num_tasks`` ints) its sequences and tokens in this pass;
    - ``example_ranges`` / ``token_ranges``: per present task, its contiguous ``(start, stop)`` example rows and
      packed token rows when rows are grouped by task in increasing order (as collate lays them out), else None;
    - ``second``: the siamese second pass (its own layout: the second sentences of the rows ``second_rows``).

    Device tensors (built once, on ``device``): ``task_ids [B]`` int64, ``cu_seqlens [B+1]`` int32,
    ``position_ids [N]`` int64, ``row_task_ids [N]`` int64 (task of each packed token), ``row_example [N]`` int64
    (sequence of each packed token), ``cls_index [B]`` int64 (first token of each sequence); padded layouts hold
    ``mask [B, L]`` bool (built on demand for packed ones, with ``index [N]``: the tokens' flat positions in
    ``[B*L]``). ``second_slot [B]`` int64: the second-pass row of each siamese row (-1 elsewhere).
    """

    batch: int
    length: int
    packed: bool
    lengths: np.ndarray
    host_task_ids: np.ndarray | None
    num_tasks: int
    device: torch.device
    task_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    row_task_ids: torch.Tensor | None = None
    row_example: torch.Tensor | None = None
    cls_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    index: torch.Tensor | None = None
    # packed inputs: attention over length buckets where no varlen kernel serves them (the CPU path)
    buckets: bool = False
    second: BatchLayout | None = None
    second_rows: np.ndarray | None = None
    second_slot: torch.Tensor | None = None
    plan: AttentionPlan | None = field(default=None, repr=False)

    # --- derived host values ------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        self.cu_host = np.zeros(self.batch + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.cu_host[1:])
        self.total = int(self.cu_host[-1])
        self.max_seqlen = int(self.lengths.max()) if self.batch else 0
        ids = self.host_task_ids
        num = max(self.num_tasks, 1)
        if ids is None:
            self.task_examples = [self.batch] + [0] * (num - 1)
            self.task_tokens = [self.total] + [0] * (num - 1)
            grouped_ids = np.zeros(self.batch, dtype=np.int64)
        else:
            self.task_examples = np.bincount(ids, minlength=num).tolist()
            self.task_tokens = np.bincount(ids, weights=self.lengths, minlength=num).astype(np.int64).tolist()
            grouped_ids = ids
        self.present = [t for t in range(num) if self.task_examples[t]]
        self.example_ranges = _ranges(grouped_ids, np.arange(self.batch + 1), num)
        self.token_ranges = _ranges(grouped_ids, self.cu_host, num) if self.packed else None

    @property
    def grouped(self) -> bool:
        """True when rows are grouped by task in increasing order (every task's rows one contiguous range)."""
        return self.example_ranges is not None

    # --- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int] | np.ndarray,
        task_ids: Sequence[int] | np.ndarray | None,
        num_tasks: int,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ) -> BatchLayout:
        """The packed layout of sequences of ``lengths`` (host ints, each >= 1) whose tasks are ``task_ids``
        (host ints in ``[0, num_tasks)``, or None for a model without tasks), with device tensors on ``device``.
        The one place packed batches are validated (``ValueError`` naming what is wrong)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0:
            raise ValueError("a packed batch needs at least one sequence (lengths [B], B >= 1)")
        if int(lengths.min()) < 1:
            raise ValueError("every packed sequence needs at least one token (a length is < 1)")
        if max_positions is not None and int(lengths.max()) > max_positions:
            raise ValueError(
                f"a sequence of {int(lengths.max())} tokens exceeds max_position_embeddings {max_positions}"
            )
        ids = None
        if task_ids is not None:
            ids = np.asarray(task_ids, dtype=np.int64)
            if ids.shape != lengths.shape:
                raise ValueError(f"task_ids has {ids.size} entries for {lengths.size} sequences")
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_tasks):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise ValueError(
                    f"task_ids contains {bad}, outside [0, {num_tasks}) for a model with {num_tasks} tasks"
                )
        layout = cls(
            batch=int(lengths.size), length=int(lengths.max()), packed=True, lengths=lengths, host_task_ids=ids,
            num_tasks=num_tasks, device=torch.device(device), buckets=True,
        )  # fmt: skip
        layout._build_packed_tensors()
        return layout

    def _build_packed_tensors(self) -> None:
        dev = self.device
        row_example = np.repeat(np.arange(self.batch, dtype=np.int64), self.lengths)
        self.cu_seqlens = torch.as_tensor(self.cu_host.astype(np.int32), device=dev)
        self.position_ids = torch.as_tensor(
            np.arange(self.total, dtype=np.int64) - self.cu_host[row_example], device=dev
        )
        self.row_example = torch.as_tensor(row_example, device=dev)
        self.cls_index = torch.as_tensor(self.cu_host[:-1].copy(), device=dev)
        if self.host_task_ids is not None:
            self.task_ids = torch.as_tensor(self.host_task_ids, device=dev)
            self.row_task_ids = torch.as_tensor(self.host_task_ids[row_example], device=dev)
            _BY_TASK_IDS[id(self.task_ids)] = self

    def with_second(self, second: BatchLayout, rows: Sequence[int] | np.ndarray) -> BatchLayout:
        """Attach the siamese second pass: ``second`` lays out the second sentences of this layout's rows
        ``rows`` (host ints, in row order). Returns self."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size != second.batch:
            raise ValueError(f"the second pass holds {second.batch} sequences for {rows.size} siamese rows")
        self.second, self.second_rows = second, rows
        slot = np.full(self.batch, -1, dtype=np.int64)
        slot[rows] = np.arange(rows.size)
        self.second_slot = torch.as_tensor(slot, device=self.device)
        return self

    def to(self, device: torch.device | str) -> BatchLayout:
        """This layout with its device tensors on ``device`` (self when they are there already). The host values
        are shared; the copies are asynchronous where the source is pinned."""
        device = torch.device(device)
        if device == self.device:
            return self
        moved = BatchLayout(
            batch=self.batch, length=self.length, packed=self.packed, lengths=self.lengths,
            host_task_ids=self.host_task_ids, num_tasks=self.num_tasks, device=device, buckets=self.buckets,
        )  # fmt: skip
        for name in ("task_ids", "cu_seqlens", "position_ids", "row_task_ids", "row_example", "cls_index",
                     "mask", "index", "second_slot"):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                setattr(moved, name, value.to(device, non_blocking=True))
        if self.second is not None:
            moved.second, moved.second_rows = self.second.to(device), self.second_rows
        if moved.task_ids is not None:
            _BY_TASK_IDS[id(moved.task_ids)] = moved
        return moved

    # --- what the layers use ------------------------------------------------------------------------------------
    def attention_plan(self) -> AttentionPlan:
        """The length buckets packed attention runs over when no varlen kernel serves it (built once per batch,
        from the host lengths)."""
        if self.plan is None:
            self.plan = attention_plan(self.cu_host, device=self.device)
        return self.plan

    def task_segments(self, num_tasks: int) -> list[int] | None:
        """Packed token rows per task (``num_tasks`` counts) when the rows are grouped by task in increasing order
        (as collate lays them out); None otherwise. Host values."""
        if not self.packed or self.token_ranges is None or num_tasks != max(self.num_tasks, 1):
            return None
        counts = [0] * num_tasks
        for t, (a, b) in self.token_ranges.items():
            counts[t] = b - a
        return counts

    def rows_of(self, task: int) -> slice | torch.Tensor:
        """The example rows of ``task``: a ``slice`` when rows are grouped, else an int64 index tensor."""
        if self.example_ranges is not None:
            a, b = self.example_ranges.get(task, (0, 0))
            return slice(a, b)
        ids = self.host_task_ids if self.host_task_ids is not None else np.zeros(self.batch, dtype=np.int64)
        return torch.as_tensor(np.flatnonzero(ids == task), device=self.device)

    def _padded_index(self) -> None:
        if self.index is None:
            flat = (
                np.arange(self.batch, dtype=np.int64)[:, None] * self.length + np.arange(self.length)[None, :]
            )
            keep = np.arange(self.length)[None, :] < self.lengths[:, None]
            self.index = torch.as_tensor(flat[keep], device=self.device)
            if self.mask is None:
                self.mask = torch.as_tensor(keep, device=self.device)

    def padding_mask(self) -> torch.Tensor:
        """``[B, L]`` bool, True = token."""
        if self.mask is None:
            self._padded_index()
        return self.mask

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] packed rows → [B, L, ...] with zeros at padding (identity when not packed)."""
        if not self.packed:
            return x
        self._padded_index()
        out = x.new_zeros(self.batch * self.length, *x.shape[1:])
        out = out.index_copy(0, self.index, x)
        return out.view(self.batch, self.length, *x.shape[1:])

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] → [N, ...] packed rows (identity when not packed)."""
        if not self.packed:
            return x
        self._padded_index()
        return x.flatten(0, 1).index_select(0, self.index)

    def per_row(self, per_example: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-example tensor [B, ...] to the rows of this layout: [B, 1, ...] or [N, ...]."""
        if self.packed:
            return per_example.index_select(0, self.row_example)
        return per_example.unsqueeze(1)


def pack_rows(
    rows: Sequence[Sequence[int]] | Sequence[np.ndarray], dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Host token lists (one per sequence) back to back → ``[N]`` tensor of ``dtype`` (no padding made)."""
    if not rows:
        return torch.zeros(0, dtype=dtype)
    return torch.from_numpy(np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])).to(dtype)


def make_layout(
    attention_mask: torch.Tensor,
    task_ids: torch.Tensor | None,
    packed: bool,
    shape: tuple[int, int],
    num_tasks: int = 0,
) -> BatchLayout:
    """The layout of a padded batch at the model's entry: ``attention_mask [B, L]`` (1/True = token),
    ``task_ids [B]`` int64 or None, ``packed`` (run token-wise ops on the N real tokens only; needs right-padded
    rows), ``shape = (B, L)``, ``num_tasks`` (task ids must lie in ``[0, num_tasks)`` when it is > 0).

    Padded batches enter here: the row lengths and task ids are read on the host once (the whole mask when
    ``packed``, to check it is right-padded)."""
    mask = attention_mask.to(torch.bool)
    batch, length = shape
    ids: np.ndarray | None = None
    if packed:
        host_mask = np.asarray(mask.tolist(), dtype=bool).reshape(batch, length)
        lengths = host_mask.sum(1).astype(np.int64)
        if not np.array_equal(host_mask, np.arange(length)[None, :] < lengths[:, None]):
            raise ValueError("unpad=True needs right-padded attention_mask rows (1...1 0...0)")
        if task_ids is not None:
            ids = np.asarray(task_ids.tolist(), dtype=np.int64)
    else:
        rows = [mask.sum(1)] + ([task_ids.to(mask.device)] if task_ids is not None else [])
        host = np.asarray(torch.stack(rows).tolist(), dtype=np.int64).reshape(len(rows), batch)
        lengths = host[0]
        ids = host[1] if task_ids is not None else None
    if ids is not None and ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if num_tasks > 0 and (lo < 0 or hi >= num_tasks):
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"task_ids contains {bad}, outside [0, {num_tasks}) for a model with {num_tasks} tasks"
            )
        num_tasks = max(num_tasks, hi + 1)
    layout = BatchLayout(
        batch=batch, length=length, packed=packed, lengths=lengths, host_task_ids=ids, num_tasks=num_tasks,
        device=mask.device, task_ids=task_ids, mask=mask,
    )  # fmt: skip
    if packed:
        layout._build_packed_tensors()
        layout.task_ids = task_ids
        layout.index = torch.as_tensor(np.flatnonzero(host_mask.reshape(-1)), device=mask.device)
    return layout


def layout_from_cu_seqlens(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    task_ids: torch.Tensor | None,
    num_tasks: int,
    max_positions: int,
) -> BatchLayout:
    """The layout of packed tensors handed to the model without one (``cu_seqlens [B+1]`` int32, ``task_ids
    [B]``): validated and read on the host once, here, where they enter. Collated batches carry their layout
    (:meth:`BatchLayout.from_lengths`) and skip this."""
    lengths = check_packed(input_ids, cu_seqlens, max_seqlen, max_positions)
    ids = None
    if task_ids is not None:
        if not isinstance(task_ids, torch.Tensor) or task_ids.dim() != 1 or task_ids.dtype.is_floating_point:
            raise TypeError("task_ids must be an integer tensor [B] (one task per sequence)")
        if task_ids.shape[0] != lengths.size:
            raise ValueError(
                f"task_ids must have shape [{lengths.size}] (one task per sequence), got {list(task_ids.shape)}"
            )
        if task_ids.device != input_ids.device:
            raise ValueError(f"task_ids is on {task_ids.device} but the inputs are on {input_ids.device}")
        ids = np.asarray(task_ids.tolist(), dtype=np.int64)
    layout = BatchLayout.from_lengths(lengths, ids, num_tasks, device=input_ids.device)
    layout.cu_seqlens = cu_seqlens
    layout.length = int(max_seqlen)  # type: ignore[arg-type]
    return layout
