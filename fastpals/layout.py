"""How one batch is laid out for every layer of a forward call: padded ``[B, L, d]`` or packed ``[N, d]`` rows (no
compute on padding), with the task of each row (:class:`BatchLayout`, built by :func:`make_layout`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BatchLayout", "make_layout"]


@dataclass
class BatchLayout:
    """How a batch is laid out, shared by every layer of one forward call (build it with :func:`make_layout`).

    ``mask [B, L]`` bool (True = token), ``task_ids [B]`` int64 or None. Packed layouts (``packed=True``) also
    hold ``index [N]`` (flat positions of the N tokens in ``[B*L]``), ``cu_seqlens [B+1]`` int32,
    ``max_seqlen`` and ``row_task_ids [N]``.
    """

    batch: int
    length: int
    mask: torch.Tensor  # [B, L] bool, True = token
    task_ids: torch.Tensor | None  # [B] int64
    packed: bool = False
    index: torch.Tensor | None = None  # [N] flat positions of the tokens in [B*L] (packed only)
    cu_seqlens: torch.Tensor | None = None  # [B+1] int32 (packed only)
    max_seqlen: int = 0
    row_task_ids: torch.Tensor | None = None  # [N] task of each packed token
    plan: Any = field(default=None, repr=False)  # fastpals.batching.AttentionPlan, built on first use
    segments: tuple[int, list[int] | None] | None = field(default=None, repr=False)  # see task_segments
    # packed inputs (cu_seqlens given): attention over length buckets and PAL linears on the packed tokens on the
    # reference path; unpad=True keeps the padded-shape reference ops (bit-identical to the padded path)
    buckets: bool = False

    def attention_plan(self) -> Any:
        """The length buckets packed attention runs over when no varlen kernel serves it (built once per batch)."""
        if self.plan is None:
            from fastpals.batching import attention_plan

            self.plan = attention_plan(self.cu_seqlens)
        return self.plan

    def task_segments(self, num_tasks: int) -> list[int] | None:
        """Packed rows per task (``num_tasks`` counts) when the rows are grouped by task in increasing order, as
        :func:`fastpals.batching.pack_batches` lays them out; None otherwise (built once per batch, one sync)."""
        if self.segments is None:
            ids = self.task_ids
            grouped = ids is not None and self.packed and bool((ids[1:] >= ids[:-1]).all())
            counts = torch.bincount(self.row_task_ids, minlength=num_tasks).tolist() if grouped else None
            self.segments = (num_tasks, counts)
        return self.segments[1] if self.segments[0] == num_tasks else None

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] packed rows → [B, L, ...] with zeros at padding (identity when not packed)."""
        if not self.packed:
            return x
        out = x.new_zeros(self.batch * self.length, *x.shape[1:])
        out = out.index_copy(0, self.index, x)
        return out.view(self.batch, self.length, *x.shape[1:])

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] → [N, ...] packed rows (identity when not packed)."""
        if not self.packed:
            return x
        return x.flatten(0, 1).index_select(0, self.index)

    def per_row(self, per_example: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-example tensor [B, ...] to the rows of this layout: [B, 1, ...] or [N, ...]."""
        if self.packed:
            return per_example.index_select(0, self.index // self.length)
        return per_example.unsqueeze(1)


def make_layout(
    attention_mask: torch.Tensor, task_ids: torch.Tensor | None, packed: bool, shape: tuple[int, int]
) -> BatchLayout:
    """The layout of one batch: ``attention_mask [B, L]`` (1/True = token), ``task_ids [B]`` int64 or None,
    ``packed`` (run token-wise ops on the N real tokens only; needs right-padded rows), ``shape = (B, L)``."""
    mask = attention_mask.to(torch.bool)
    batch, length = shape
    layout = BatchLayout(batch=batch, length=length, mask=mask, task_ids=task_ids, packed=packed)
    if packed:
        lengths = mask.sum(1)
        if not torch.equal(mask, torch.arange(length, device=mask.device)[None, :] < lengths[:, None]):
            raise ValueError("unpad=True needs right-padded attention_mask rows (1...1 0...0)")
        layout.index = mask.flatten().nonzero(as_tuple=True)[0]
        cu = torch.zeros(batch + 1, dtype=torch.int32, device=mask.device)
        cu[1:] = torch.cumsum(lengths, 0)
        layout.cu_seqlens = cu
        layout.max_seqlen = int(lengths.max()) if batch else 0
        if task_ids is not None:
            layout.row_task_ids = task_ids.index_select(0, layout.index // length)
    return layout
