"""Mixed-task micro-batches: which examples each holds (:class:`MixedBatchSampler`) and how they are packed: a
dict of int64 ``input_ids``, ``token_type_ids`` ``[N]`` grouped by task (``*_b``: the siamese second
sentences, ``layout.second``), float32 ``labels [B]``, ``ids``, ``tasks`` (names) and ``layout``
(:class:`BatchLayout`)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastpals.data.layout import BatchLayout, pack_rows
from fastpals.data.sampling import (
    EQUAL_SHARE_METHODS,
    SAMPLING_METHODS,
    check_int,
    check_resume_settings,
    next_epoch,
    task_probabilities,
)
from fastpals_kernels.padding import unpad

if TYPE_CHECKING:
    from fastpals.data.per_task_batches import TaskBatcher


def padding_fraction(batch: dict) -> float:
    """The share of a batch's token slots that are padding: 0.0 when packed, ``1 - tokens / (B * L)`` if padded."""
    if "layout" in batch:
        return 0.0
    slots = tokens = 0
    for key in ("attention_mask", "attention_mask_b"):
        if key in batch:
            slots += batch[key].numel()
            tokens += int(batch[key].sum())
    return 1.0 - tokens / slots if slots else 0.0


def share_counts(total: int, probabilities: np.ndarray, u: float) -> np.ndarray:
    """int64 counts ``[T]`` summing to ``total`` with mean ``total * p``, by systematic rounding at the points
    ``u, u+1, ...`` (``u`` one uniform draw in [0, 1))."""
    exact = total * np.asarray(probabilities, dtype=np.float64)
    base = np.floor(exact)
    cum = np.concatenate([[0.0], np.cumsum(exact - base)])
    extra = np.floor(cum[1:] - u + 1e-9) - np.floor(cum[:-1] - u + 1e-9)
    counts = (base + extra).astype(np.int64)
    short = total - int(counts.sum())  # rounding of the cumulative sum can leave at most one point out
    if short:
        counts[int(np.argmax(exact - base))] += short
    return counts


@dataclass
class MixedSelection:
    """One mixed micro-batch: int64 example indices per task (maybe empty), its ``epoch`` (from 1) and ``step``."""

    indices: list[np.ndarray]
    epoch: int
    step: int

    @property
    def counts(self) -> list[int]:
        """Examples per task."""
        return [len(i) for i in self.indices]


class MixedBatchSampler:
    """A resumable stream of mixed-task micro-batches (example indices per task). Task ``t`` gets the share
    ``p_t`` (``method``) of ``batch_size`` by systematic rounding, or of ``max_tokens`` by smooth weighted round
    robin over ``lengths`` (each example's packed tokens); each task walks its own permutation per pass,
    ``default_rng([task_seed, pass])`` (``task_seeds`` default ``seed * 1000 + t``)."""

    def __init__(
        self,
        lengths: Sequence[Sequence[int] | np.ndarray],
        method: str,
        num_epochs: int,
        *,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        micro_batches_per_epoch: int | None = None,
        seed: int = 0,
        task_seeds: Sequence[int] | None = None,
        task_names: Sequence[str] | None = None,
    ) -> None:
        if method not in SAMPLING_METHODS:
            raise ValueError(f"sampling method {method!r}: choose one of {', '.join(SAMPLING_METHODS)}")
        self.lengths = [np.asarray(x, dtype=np.int64) for x in lengths]
        if not self.lengths or any(x.ndim != 1 or x.size == 0 for x in self.lengths):
            raise ValueError("lengths must hold, for each task, a non-empty 1-D sequence of token counts")
        if any(int(x.min()) < 1 for x in self.lengths):
            raise ValueError("lengths must be positive token counts")
        t = len(self.lengths)
        self.task_names = list(task_names) if task_names is not None else [f"task{i}" for i in range(t)]
        if len(self.task_names) != t:
            raise ValueError(f"task_names has {len(self.task_names)} entries for {t} tasks")
        check_int("num_epochs", num_epochs, 1)
        check_int("seed", seed, 0)
        if batch_size is None and max_tokens is None:
            raise ValueError("give batch_size (--batch-size) or max_tokens (--max-tokens)")
        for name, value in (("--batch-size", batch_size), ("--max-tokens", max_tokens)):
            if value is not None:
                check_int(name, value, 1)
        if max_tokens is not None:
            longest = max(int(x.max()) for x in self.lengths)
            for name, x in zip(self.task_names, self.lengths):
                if int(x.max()) > max_tokens:
                    i = int(np.argmax(x))
                    raise ValueError(
                        f"--max-tokens {max_tokens} is less than example {i} of task {name} ({int(x[i])} tokens): "
                        f"raise --max-tokens to at least {longest} or lower --max-length"
                    )
        self.task_seeds = (
            [int(s) for s in task_seeds] if task_seeds is not None else [seed * 1000 + i for i in range(t)]
        )
        if len(self.task_seeds) != t or any(s < 0 for s in self.task_seeds):
            raise ValueError(f"task_seeds must hold {t} non-negative ints, got {task_seeds!r}")
        self.method, self.num_tasks, self.sizes = method, t, [int(x.size) for x in self.lengths]
        self.num_epochs, self.batch_size, self.max_tokens = num_epochs, batch_size, max_tokens
        self.seed, self.tokens = seed, [int(x.sum()) for x in self.lengths]
        if micro_batches_per_epoch is None:  # about one pass over the examples, or over their tokens
            total = sum(self.sizes) if batch_size is not None else sum(self.tokens)
            micro_batches_per_epoch = math.ceil(total / (batch_size or max_tokens))
        check_int("micro_batches_per_epoch", micro_batches_per_epoch, 1)
        self.micro_batches_per_epoch = micro_batches_per_epoch
        self.epoch, self.step, self.passes, self.positions = 1, 0, [0] * t, [0] * t
        self._rng = np.random.default_rng(seed)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    @classmethod
    def from_batchers(
        cls, batchers: Sequence[TaskBatcher], method: str, num_epochs: int, **kwargs: Any
    ) -> MixedBatchSampler:
        """A sampler over ``batchers`` (one per task, in model order): their ``packed_lengths`` and ``seed``."""
        kwargs.setdefault("task_seeds", [b.seed for b in batchers])
        kwargs.setdefault("task_names", [b.spec.name for b in batchers])
        return cls([b.packed_lengths for b in batchers], method, num_epochs, **kwargs)

    def probabilities(self, epoch: int | None = None) -> np.ndarray:
        """Per-task shares ``[T]`` float64 in ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self.method in EQUAL_SHARE_METHODS:
            return np.full(self.num_tasks, 1.0 / self.num_tasks)
        return task_probabilities(self.sizes, self.method, epoch, self.num_epochs)

    def pass_order(self, task: int, k: int) -> np.ndarray:
        """int64 ``[N_t]``: task ``task``'s example order in pass ``k`` (the batcher's epoch ``k`` order)."""
        return np.random.default_rng([self.task_seeds[task], k]).permutation(self.sizes[task])

    def _peek(self, t: int) -> int:
        if self.positions[t] >= self.sizes[t]:
            self.passes[t], self.positions[t] = self.passes[t] + 1, 0
        if t not in self._perms or self._perms[t][0] != self.passes[t]:
            self._perms[t] = (self.passes[t], self.pass_order(t, self.passes[t]))
        return int(self._perms[t][1][self.positions[t]])

    def _take(self, t: int, k: int) -> np.ndarray:
        out = []
        for _ in range(k):
            out.append(self._peek(t))
            self.positions[t] += 1
        return np.asarray(out, dtype=np.int64)

    def epoch_done(self) -> bool:
        """True when the current epoch's micro-batches are all drawn."""
        return self.step >= self.micro_batches_per_epoch

    def start_next_epoch(self) -> None:
        """Move to the first micro-batch of the next epoch (the tasks' permutations go on where they were)."""
        self.epoch, self.step = next_epoch(self.epoch, self.num_epochs), 0

    def next_micro_batch(self) -> MixedSelection:
        """Draw the next micro-batch; ``StopIteration`` at the end of the epoch."""
        if self.epoch_done():
            raise StopIteration(f"epoch {self.epoch} is done")
        p = self.probabilities()
        if self.max_tokens is None:
            counts = share_counts(self.batch_size, p, float(self._rng.random()))
            indices = [self._take(t, int(c)) for t, c in enumerate(counts)]
        else:
            indices = self._fill_budget(p)
        self.step += 1
        return MixedSelection(indices, self.epoch, self.step - 1)

    def _fill_budget(self, p: np.ndarray) -> list[np.ndarray]:
        credit = self._rng.random(self.num_tasks)
        taken: list[list[int]] = [[] for _ in range(self.num_tasks)]
        used = examples = 0
        while self.batch_size is None or examples < self.batch_size:
            credit += p
            t = int(np.argmax(credit))
            i = self._peek(t)
            n = int(self.lengths[t][i])
            if used + n > self.max_tokens:
                break
            taken[t].append(i)
            self.positions[t] += 1
            credit[t] -= 1.0
            used += n
            examples += 1
        return [np.asarray(x, dtype=np.int64) for x in taken]

    def _settings(self) -> dict[str, Any]:
        names = "method sizes tokens num_epochs batch_size max_tokens micro_batches_per_epoch seed task_seeds"
        # a copy: the caller may edit it
        return copy.deepcopy({name: getattr(self, name) for name in names.split()})

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state: the settings (checked on load), position in the stream, generator state."""
        return {
            **self._settings(),
            "epoch": self.epoch,
            "step": self.step,
            "passes": list(self.passes),
            "positions": list(self.positions),
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken; every setting must match this sampler's."""
        check_resume_settings(state, self._settings(), "the mixed batch sampler")
        epoch, step = int(state["epoch"]), int(state["step"])
        if not 1 <= epoch <= self.num_epochs or not 0 <= step <= self.micro_batches_per_epoch:
            raise ValueError(f"saved epoch {epoch} / step {step} is outside this schedule")
        passes, positions = [int(x) for x in state["passes"]], [int(x) for x in state["positions"]]
        fits = len(passes) == len(positions) == self.num_tasks and all(p >= 0 for p in passes)
        if not fits or any(not 0 <= p <= n for p, n in zip(positions, self.sizes)):
            raise ValueError("saved per-task positions do not fit these tasks")
        self.epoch, self.step, self.passes, self.positions = epoch, step, passes, positions
        self._rng.bit_generator.state = state["rng"]
        self._perms.clear()


@dataclass
class TaskRows:
    """One task's share of a packed micro-batch on the host: each example's token ids and types (and its second
    sentence's, for siamese tasks) as ``list[int]`` or int64 arrays."""

    task: int
    input_ids: list[Any]
    token_type_ids: list[Any]
    input_ids_b: list[Any] | None = None
    token_type_ids_b: list[Any] | None = None
    labels: torch.Tensor | None = None
    ids: list[str] | None = None
    name: str | None = None


def pack_task_rows(parts: Sequence[TaskRows], num_tasks: int) -> dict:
    """The packed micro-batch of the tasks' host rows, grouped by task, with its layout built once here."""
    if len(parts) == 0:
        raise ValueError("batches is empty")
    tasks_given = [int(p.task) for p in parts]
    if len(set(tasks_given)) != len(tasks_given) or not all(0 <= t < num_tasks for t in tasks_given):
        raise ValueError(f"task_ids must be distinct ints in [0, {num_tasks}), got {tasks_given}")
    labelled = [p.labels is not None for p in parts]
    if any(labelled) and not all(labelled):
        raise ValueError("some batches have labels and some do not")
    ids_a, types_a, ids_b, types_b, rows_task, rows_b, labels, names, tasks = ([] for _ in range(9))
    for part in sorted(parts, key=lambda p: p.task):
        t, n = part.task, len(part.input_ids)
        if part.input_ids_b is not None:
            rows_b.extend(range(len(rows_task), len(rows_task) + n))
            ids_b.extend(part.input_ids_b)
            types_b.extend(part.token_type_ids_b)
        rows_task.extend([t] * n)
        ids_a.extend(part.input_ids)
        types_a.extend(part.token_type_ids)
        if part.labels is not None:
            labels.append(part.labels.to(torch.float32))
        names.extend(part.ids if part.ids is not None else [""] * n)
        tasks.extend([part.name if part.name is not None else str(t)] * n)
    layout = BatchLayout.from_lengths([len(x) for x in ids_a], rows_task, num_tasks)
    out: dict[str, Any] = {"input_ids": pack_rows(ids_a), "token_type_ids": pack_rows(types_a)}
    if ids_b:
        second = BatchLayout.from_lengths([len(x) for x in ids_b], [rows_task[r] for r in rows_b], num_tasks)
        layout.with_second(second, rows_b)
        out.update(input_ids_b=pack_rows(ids_b), token_type_ids_b=pack_rows(types_b))
    if labels:
        out["labels"] = torch.cat(labels)
    out.update(ids=names, tasks=tasks, layout=layout)
    return out


def _host_rows(ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> tuple[list, list]:
    """The token lists of a right-padded host batch ``[R, L]`` (``ValueError`` for another mask)."""
    _, cu, _ = unpad(ids, mask)  # validates the mask (host tensors: no device read)
    lengths = (cu[1:] - cu[:-1]).tolist()
    return [r[:n] for r, n in zip(ids.tolist(), lengths)], [r[:n] for r, n in zip(types.tolist(), lengths)]


def pack_batches(batches: Sequence[dict], task_ids: Sequence[int], num_tasks: int) -> dict:
    """Pack padded per-task host batches (``TaskBatcher.collate`` dicts; ``task_ids[i]`` the model's index of
    ``batches[i]``'s task) into one packed micro-batch. A batch with ``input_ids_b`` is siamese."""
    if len(batches) == 0:
        raise ValueError("batches is empty")
    if len(task_ids) != len(batches):
        raise ValueError(f"batches has {len(batches)} entries but task_ids has {len(task_ids)}")
    parts = []
    for batch, t in zip(batches, task_ids):
        ids, types = _host_rows(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        part = TaskRows(
            int(t), ids, types, labels=batch.get("labels"), ids=batch.get("ids"), name=batch.get("task")
        )
        if "input_ids_b" in batch:
            part.input_ids_b, part.token_type_ids_b = _host_rows(
                batch["input_ids_b"], batch["token_type_ids_b"], batch["attention_mask_b"]
            )
        parts.append(part)
    return pack_task_rows(parts, num_tasks)


def collate_packed(batchers: Sequence[TaskBatcher], selection: MixedSelection) -> dict:
    """The packed micro-batch of ``selection``, straight from the batchers' token lists."""
    if len(batchers) != len(selection.indices):
        raise ValueError(f"{len(batchers)} batchers for a selection over {len(selection.indices)} tasks")
    present = [t for t, idx in enumerate(selection.indices) if len(idx)]
    if not present:
        raise ValueError("the selection holds no example")
    return pack_task_rows([batchers[t].task_rows(selection.indices[t], t) for t in present], len(batchers))


_TOKEN_KEYS = ("input_ids", "token_type_ids", "input_ids_b", "token_type_ids_b")


class ModelInputs(dict):
    """``model_inputs``' dict; the former keys ``task_ids`` and ``cu_seqlens`` still read (deprecated) but are not
    passed by ``model(**inputs)``."""

    def __missing__(self, key: str) -> torch.Tensor:
        if key not in ("task_ids", "cu_seqlens") or "layout" not in self:
            raise KeyError(key)
        message = f"model_inputs(...)[{key!r}] will be removed in the next release: use ['layout'].{key}"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return getattr(self["layout"], key)


def model_inputs(batch: dict, device: torch.device | str) -> dict[str, Any]:
    """``MultiTaskBert.forward``'s keyword arguments of a packed batch (token tensors and layout) on ``device``."""
    out: dict[str, Any] = ModelInputs(
        (k, batch[k].to(device, non_blocking=True)) for k in _TOKEN_KEYS if k in batch
    )
    out["layout"] = batch["layout"].to(device)
    return out
