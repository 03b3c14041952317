"""The layout of one batch (:class:`BatchLayout`): where each sequence's tokens lie (*packed* ``[N, d]`` rows
with ``cu_seqlens``, or *padded* ``[B, L, d]`` with a mask) and which task it belongs to. Built once on the
host where the data enters, then passed to the model, the losses and ``per_task_gradients``, which never
rebuild it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fastpals_kernels.padding import AttentionPlan, attention_plan, check_packed


def _check_task_range(ids: np.ndarray, num_tasks: int) -> None:
    bad = [t for t in (int(ids.min()), int(ids.max())) if not 0 <= t < num_tasks]
    if bad:
        raise ValueError(
            f"task_ids contains {bad[0]}, outside [0, {num_tasks}) for a model with {num_tasks} tasks"
        )


def _ranges(ids: np.ndarray, starts: np.ndarray, num_tasks: int) -> dict[int, tuple[int, int]] | None:
    """Per present task, its range ``[starts[first row], starts[last row + 1])`` when rows are grouped by task;
    None otherwise."""
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

    Host values: ``batch`` B, ``length`` L (padded width or ``max_seqlen``), ``lengths [B]``, ``cu_host [B+1]``,
    ``total`` N, ``host_task_ids [B]`` (None: no tasks), per task ``task_examples`` / ``task_tokens``, and when
    rows are grouped by task its ``example_ranges`` / ``token_ranges`` ``(start, stop)``; ``second``: the siamese
    second sentences' layout (of the rows ``second_rows``). Device tensors, int64 unless said: ``task_ids [B]``,
    ``cu_seqlens [B+1]`` int32, ``position_ids``, ``row_task_ids``, ``row_example [N]``, ``cls_index [B]``,
    ``mask [B, L]`` bool and ``index [N]`` (flat positions in ``[B*L]``), ``second_slot [B]`` (-1: none)."""

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
    buckets: bool = False  # packed attention over length buckets (the CPU path)
    second: BatchLayout | None = None
    second_rows: np.ndarray | None = None
    second_slot: torch.Tensor | None = None
    plan: AttentionPlan | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        self.cu_host = np.zeros(self.batch + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.cu_host[1:])
        self.total = int(self.cu_host[-1])
        self.max_seqlen = int(self.lengths.max()) if self.batch else 0
        num = max(self.num_tasks, 1)
        ids = self.host_task_ids if self.host_task_ids is not None else np.zeros(self.batch, dtype=np.int64)
        self.task_examples = np.bincount(ids, minlength=num).tolist()
        self.task_tokens = np.bincount(ids, weights=self.lengths, minlength=num).astype(np.int64).tolist()
        self.present = [t for t in range(num) if self.task_examples[t]]
        self.example_ranges = _ranges(ids, np.arange(self.batch + 1), num)
        self.token_ranges = _ranges(ids, self.cu_host, num) if self.packed else None

    @property
    def grouped(self) -> bool:
        """True when rows are grouped by task in increasing order."""
        return self.example_ranges is not None

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int] | np.ndarray,
        task_ids: Sequence[int] | np.ndarray | None,
        num_tasks: int,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ) -> BatchLayout:
        """The packed layout of sequences of ``lengths`` (host ints >= 1) of tasks ``task_ids`` (host ints, or
        None without tasks), tensors on ``device``. The one place packed batches are validated."""
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
            _check_task_range(ids, num_tasks)
        layout = cls(
            batch=int(lengths.size), length=int(lengths.max()), packed=True, lengths=lengths, host_task_ids=ids,
            num_tasks=num_tasks, device=torch.device(device), buckets=True,
        )  # fmt: skip
        layout._build_packed_tensors()
        return layout

    @classmethod
    def from_mask(
        cls,
        attention_mask: torch.Tensor,
        task_ids: torch.Tensor | np.ndarray | None,
        num_tasks: int,
        max_positions: int | None = None,
    ) -> BatchLayout:
        """The packed layout of a right-padded ``attention_mask [B, L]`` and ``task_ids [B]`` (tensor, host
        values or None); one host read."""
        mask = attention_mask.to(torch.bool)
        host = mask.long()
        if isinstance(task_ids, torch.Tensor):
            host = torch.cat([host, task_ids.to(host.device, torch.long)[:, None]], 1)
        host = np.asarray(host.tolist(), dtype=np.int64).reshape(mask.shape[0], -1)  # the one host read
        keep = host[:, : mask.shape[1]].astype(bool)
        lengths = keep.sum(1)
        if not np.array_equal(keep, np.arange(mask.shape[1])[None, :] < lengths[:, None]):
            raise ValueError("attention_mask rows must be right-padded (1...1 0...0) to be packed")
        ids = host[:, -1] if isinstance(task_ids, torch.Tensor) else task_ids
        return cls.from_lengths(lengths, ids, num_tasks, mask.device, max_positions)

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
        if self.buckets:  # host work, kept out of compiled forwards (they would trace the NumPy code)
            self.attention_plan()

    def with_second(self, second: BatchLayout, rows: Sequence[int] | np.ndarray) -> BatchLayout:
        """Attach ``second``, the layout of the second sentences of the siamese ``rows``; returns self."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size != second.batch:
            raise ValueError(f"the second pass holds {second.batch} sequences for {rows.size} siamese rows")
        self.second, self.second_rows = second, rows
        slot = np.full(self.batch, -1, dtype=np.int64)
        slot[rows] = np.arange(rows.size)
        self.second_slot = torch.as_tensor(slot, device=self.device)
        return self

    def to(self, device: torch.device | str) -> BatchLayout:
        """This layout with its device tensors on ``device`` (self if there already), host values shared."""
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
        if moved.packed and moved.buckets:
            moved.attention_plan()
        return moved

    def attention_plan(self) -> AttentionPlan:
        """The length buckets packed attention runs over without a fused kernel (built once per batch)."""
        if self.plan is None:
            self.plan = attention_plan(self.cu_host, device=self.device)
        return self.plan

    def task_segments(self, num_tasks: int) -> list[int] | None:
        """Packed token rows per task (host ints) when rows are grouped by task; None otherwise."""
        if not self.packed or self.token_ranges is None or num_tasks != max(self.num_tasks, 1):
            return None
        return [b - a for a, b in (self.token_ranges.get(t, (0, 0)) for t in range(num_tasks))]

    def rows_of(self, task: int) -> slice | torch.Tensor:
        """The example rows of ``task``: a ``slice`` when rows are grouped, else an int64 index tensor."""
        if self.example_ranges is not None:
            a, b = self.example_ranges.get(task, (0, 0))
            return slice(a, b)
        return torch.as_tensor(np.flatnonzero(self.host_task_ids == task), device=self.device)

    def _padded_index(self) -> None:
        if self.index is None:
            keep = np.arange(self.length)[None, :] < self.lengths[:, None]
            self.index = torch.as_tensor(np.flatnonzero(keep), device=self.device)  # flat positions in [B*L]
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
        out = x.new_zeros(self.batch * self.length, *x.shape[1:]).index_copy(0, self.index, x)
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
    """The layout of a padded batch ``shape = (B, L)`` at the model's entry, one host read: ``attention_mask``,
    ``task_ids [B]`` or None (in ``[0, num_tasks)`` when ``num_tasks > 0``); ``packed`` needs right-padded rows."""
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
        lengths, ids = host[0], (host[1] if task_ids is not None else None)
    if ids is not None and ids.size:
        if num_tasks > 0:
            _check_task_range(ids, num_tasks)
        num_tasks = max(num_tasks, int(ids.max()) + 1)
    layout = BatchLayout(
        batch=batch, length=length, packed=packed, lengths=lengths, host_task_ids=ids, num_tasks=num_tasks,
        device=mask.device, task_ids=task_ids, mask=mask,
    )  # fmt: skip
    if packed:
        layout._build_packed_tensors()
        layout.task_ids = task_ids
        layout.index = torch.as_tensor(np.flatnonzero(host_mask.reshape(-1)), device=mask.device)
    return layout


class PaddedBatch:
    """A padded batch as a compiled forward of injected PALs reads it, from device tensors alone (no host read):
    ``mask [B, L]`` bool (from ``attention_mask``, 1/True = token), ``task_ids [B]`` int64, ``num_tasks``."""

    packed = False
    buckets = False
    cu_seqlens = None

    def __init__(self, attention_mask: torch.Tensor, task_ids: torch.Tensor | None, num_tasks: int) -> None:
        self.mask, self.task_ids, self.num_tasks = attention_mask.to(torch.bool), task_ids, num_tasks
        self.batch, self.length = self.mask.shape
        self.max_seqlen = self.length

    def padding_mask(self) -> torch.Tensor:
        """``[B, L]`` bool, True = token."""
        return self.mask

    def per_row(self, per_example: torch.Tensor) -> torch.Tensor:
        """``[B, ...]`` → ``[B, 1, ...]`` (broadcast over the padded rows)."""
        return per_example.unsqueeze(1)


def layout_from_cu_seqlens(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    task_ids: torch.Tensor | None,
    num_tasks: int,
    max_positions: int,
) -> BatchLayout:
    """The layout of packed tensors given without one (``cu_seqlens [B+1]`` int32, ``task_ids [B]``): validated
    and read on the host once."""
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
