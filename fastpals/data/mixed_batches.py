"""Mixed-task micro-batches: which examples each holds (:class:`MixedBatchSampler`) and how they are packed.

Sampling: task ``t`` gets the share ``p_t`` of each micro-batch (:func:`fastpals.data.sampling.task_probabilities`,
or ``1/T`` for the round-robin methods). With ``batch_size`` B it gets ``floor(B p_t)`` examples plus one more with
the probability of the fractional part (systematic rounding: the counts sum to B, their mean is ``B p_t``). With
``max_tokens`` tasks take turns by smooth weighted round robin until the next row would pass the budget; rows are
never split. Each task walks through its own permutation per pass, ``default_rng([task_seed, pass])``, so the stream
is a function of the seeds and ``state_dict()`` resumes it exactly.

Packing: a packed micro-batch is a dict of the rows back to back, never padded, and their
:class:`~fastpals.data.layout.BatchLayout`:

* ``input_ids``, ``token_type_ids``: int64 ``[N]``; rows grouped by task in increasing order;
* siamese pair tasks: their second sentences ``input_ids_b``, ``token_type_ids_b`` int64 ``[N2]``, one per siamese
  row in row order (laid out by ``layout.second``);
* ``labels`` float32 ``[B]`` (when labelled), ``ids`` ``list[str]``, ``tasks`` (the task name of every row);
* ``layout``: lengths, task ids and offsets of the rows (host values and device tensors).

:func:`model_inputs` gives ``MultiTaskBert.forward``'s keyword arguments: the token tensors and the layout.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastpals.data.layout import BatchLayout, pack_rows
from fastpals.data.sampling import SAMPLING_METHODS, check_resume_settings, next_epoch, task_probabilities
from fastpals_kernels.padding import unpad

if TYPE_CHECKING:
    from fastpals.data.per_task_batches import TaskBatcher

__all__ = [
    "EQUAL_SHARE_METHODS",
    "MixedBatchSampler",
    "MixedSelection",
    "TaskRows",
    "collate_packed",
    "model_inputs",
    "pack_batches",
    "pack_task_rows",
    "padding_fraction",
    "share_counts",
]

EQUAL_SHARE_METHODS = ("round_robin", "random_round_robin", "every_task_plus_annealed")


def padding_fraction(batch: dict) -> float:
    """Fraction of the token slots a batch dict makes the model compute that are padding: 0.0 for a packed batch
    (``layout``), ``1 - tokens / (B * L)`` over ``attention_mask`` (and ``attention_mask_b``) for a padded one."""
    if "layout" in batch:
        return 0.0
    slots = tokens = 0
    for key in ("attention_mask", "attention_mask_b"):
        if key in batch:
            slots += batch[key].numel()
            tokens += int(batch[key].sum())
    return 1.0 - tokens / slots if slots else 0.0


# ----------------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------------
def share_counts(total: int, probabilities: np.ndarray, u: float) -> np.ndarray:
    """Integer counts summing to ``total`` with expectation ``total * p`` (systematic rounding).

    Each task gets ``floor(total p_t)`` plus 1 when one of the points ``u, u+1, u+2, ...`` falls in its slice of
    the cumulative fractional parts; ``u`` in [0, 1) (one uniform draw). Returns int64 ``[T]``.
    """
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
    """One mixed micro-batch: ``indices[t]`` int64 array of task t's example indices (maybe empty), with the
    ``epoch`` (from 1) and ``step`` (from 0, within the epoch) it was drawn at."""

    indices: list[np.ndarray]
    epoch: int
    step: int

    @property
    def counts(self) -> list[int]:
        """Examples per task."""
        return [len(i) for i in self.indices]


class MixedBatchSampler:
    """A resumable stream of mixed-task micro-batches (example indices per task); see the module docstring.

    Args:
        lengths: per task, the packed token count of every example (``[N_t]`` ints: the joint encoding's length,
            or both sentences' for siamese pairs; :attr:`fastpals.data.per_task_batches.TaskBatcher.packed_lengths`).
        method: a :data:`fastpals.data.sampling.SAMPLING_METHODS` name (sets the shares).
        num_epochs: ``E`` (the annealing schedule depends on it).
        batch_size: examples per micro-batch, and/or
        max_tokens: tokens per micro-batch (rows never split; an example above it is an error).
        micro_batches_per_epoch: micro-batches in an epoch (default: ``ceil(sum N_t / batch_size)``, or with
            ``max_tokens`` alone ``ceil(sum of all lengths / max_tokens)``, i.e. about one pass over the data).
        seed: non-negative int, seeds the share draws.
        task_seeds: per task, the seed of its example permutations (default ``seed * 1000 + t``, the trainer's
            batcher seeds).
        task_names: for error messages (default ``task0``, ``task1``, ...).
    """

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
        for name, value, low in (("num_epochs", num_epochs, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if batch_size is None and max_tokens is None:
            raise ValueError("give batch_size (--batch-size) or max_tokens (--max-tokens)")
        for name, value in (("--batch-size", batch_size), ("--max-tokens", max_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
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
        self.method = method
        self.num_tasks = t
        self.sizes = [int(x.size) for x in self.lengths]
        self.num_epochs = num_epochs
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.seed = seed
        if micro_batches_per_epoch is None:
            if batch_size is not None:
                micro_batches_per_epoch = math.ceil(sum(self.sizes) / batch_size)
            else:
                micro_batches_per_epoch = math.ceil(sum(int(x.sum()) for x in self.lengths) / max_tokens)
        if (
            isinstance(micro_batches_per_epoch, bool)
            or not isinstance(micro_batches_per_epoch, int)
            or micro_batches_per_epoch < 1
        ):
            raise ValueError(f"micro_batches_per_epoch must be an int >= 1, got {micro_batches_per_epoch!r}")
        self.micro_batches_per_epoch = micro_batches_per_epoch
        self.epoch = 1
        self.step = 0
        self.passes = [0] * t
        self.positions = [0] * t
        self._rng = np.random.default_rng(seed)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    @classmethod
    def from_batchers(
        cls, batchers: Sequence[TaskBatcher], method: str, num_epochs: int, **kwargs: Any
    ) -> MixedBatchSampler:
        """A sampler over the examples of ``batchers`` (one per task, in the model's task order): lengths from
        their ``packed_lengths``, permutation seeds from their ``seed``; ``kwargs`` as for the constructor."""
        kwargs.setdefault("task_seeds", [b.seed for b in batchers])
        kwargs.setdefault("task_names", [b.spec.name for b in batchers])
        return cls([b.packed_lengths for b in batchers], method, num_epochs, **kwargs)

    # ------------------------------------------------------------------------------------------------------------
    def probabilities(self, epoch: int | None = None) -> np.ndarray:
        """Per-task shares ``[T]`` float64 in ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self.method in EQUAL_SHARE_METHODS:
            return np.full(self.num_tasks, 1.0 / self.num_tasks)
        return task_probabilities(self.sizes, self.method, epoch, self.num_epochs)

    def pass_order(self, task: int, k: int) -> np.ndarray:
        """The example order of pass ``k`` (from 0) over task ``task``: int64 ``[N_t]``, the same permutation as
        :meth:`fastpals.data.per_task_batches.TaskBatcher.epoch_batches` starts epoch ``k`` with (given the batcher's seed)."""
        return np.random.default_rng([self.task_seeds[task], k]).permutation(self.sizes[task])

    def _perm(self, t: int) -> np.ndarray:
        cached = self._perms.get(t)
        if cached is None or cached[0] != self.passes[t]:
            cached = (self.passes[t], self.pass_order(t, self.passes[t]))
            self._perms[t] = cached
        return cached[1]

    def _peek(self, t: int) -> int:
        if self.positions[t] >= self.sizes[t]:
            self.passes[t] += 1
            self.positions[t] = 0
        return int(self._perm(t)[self.positions[t]])

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
        self.epoch = next_epoch(self.epoch, self.num_epochs)
        self.step = 0

    def next_micro_batch(self) -> MixedSelection:
        """Draw the next micro-batch. Raises ``StopIteration`` at the end of the epoch (call
        :meth:`start_next_epoch`)."""
        if self.epoch_done():
            raise StopIteration(f"epoch {self.epoch} is done")
        p = self.probabilities()
        if self.max_tokens is None:
            counts = share_counts(self.batch_size, p, float(self._rng.random()))
            indices = [self._take(t, int(c)) for t, c in enumerate(counts)]
        else:
            indices = self._fill_budget(p)
        selection = MixedSelection(indices=indices, epoch=self.epoch, step=self.step)
        self.step += 1
        return selection

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

    # ------------------------------------------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "sizes": list(self.sizes),
            "tokens": [int(x.sum()) for x in self.lengths],
            "num_epochs": self.num_epochs,
            "batch_size": self.batch_size,
            "max_tokens": self.max_tokens,
            "micro_batches_per_epoch": self.micro_batches_per_epoch,
            "seed": self.seed,
            "task_seeds": list(self.task_seeds),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state: the settings (checked on load), ``epoch``, ``step``, every task's ``passes`` and
        ``positions``, and ``rng`` (the numpy generator's bit-generator state)."""
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
        if (
            len(passes) != self.num_tasks
            or len(positions) != self.num_tasks
            or any(p < 0 for p in passes)
            or any(not 0 <= p <= n for p, n in zip(positions, self.sizes))
        ):
            raise ValueError("saved per-task positions do not fit these tasks")
        self.epoch, self.step, self.passes, self.positions = epoch, step, passes, positions
        self._rng.bit_generator.state = state["rng"]
        self._perms.clear()


# ----------------------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TaskRows:
    """One task's share of a packed micro-batch, as host values: per example its token ids and token types
    (``list[int]`` or int64 arrays, unpadded), and for siamese pair tasks those of its second sentences."""

    task: int
    input_ids: list[Any]
    token_type_ids: list[Any]
    input_ids_b: list[Any] | None = None
    token_type_ids_b: list[Any] | None = None
    labels: torch.Tensor | None = None
    ids: list[str] | None = None
    name: str | None = None


def pack_task_rows(parts: Sequence[TaskRows], num_tasks: int) -> dict:
    """One packed micro-batch (the dict of the module docstring) of the tasks' rows (host lists), grouped by task in
    increasing task order; its :class:`~fastpals.data.layout.BatchLayout` is built and validated here, once."""
    if len(parts) == 0:
        raise ValueError("batches is empty")
    tasks_given = [int(p.task) for p in parts]
    if len(set(tasks_given)) != len(tasks_given) or not all(0 <= t < num_tasks for t in tasks_given):
        raise ValueError(f"task_ids must be distinct ints in [0, {num_tasks}), got {tasks_given}")
    labelled = [p.labels is not None for p in parts]
    if any(labelled) and not all(labelled):
        raise ValueError("some batches have labels and some do not")
    ids_a, types_a, ids_b, types_b, rows_task, rows_b, labels, names, tasks = (
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
    )
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


def _unpadded_rows(ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> tuple[list, list]:
    """Host rows of a right-padded host batch ``[R, L]`` (raises ``ValueError`` on a mask that is not
    ``1...1 0...0``)."""
    _, cu, _ = unpad(ids, mask)  # validates the mask (host tensors: no device read)
    lengths = (cu[1:] - cu[:-1]).tolist()
    ids_l, types_l = ids.tolist(), types.tolist()
    return [r[:n] for r, n in zip(ids_l, lengths)], [r[:n] for r, n in zip(types_l, lengths)]


def pack_batches(batches: Sequence[dict], task_ids: Sequence[int], num_tasks: int) -> dict:
    """Pack padded per-task batches (:meth:`fastpals.data.per_task_batches.TaskBatcher.collate` dicts, host tensors) into one packed
    mixed micro-batch (the dict of the module docstring, with its ``layout``), rows grouped by task in increasing
    task order. The trainer packs straight from the token lists instead (:func:`collate_packed`).

    ``task_ids[i]``: the model's index of ``batches[i]``'s task (distinct, in ``[0, num_tasks)``). Batches with
    ``input_ids_b`` (``pair_encoding="separate"`` or ``"both"``) are siamese: their ``input_ids`` is sentence 1
    and ``input_ids_b`` sentence 2; ``joint_*`` keys are not used.
    """
    if len(batches) == 0:
        raise ValueError("batches is empty")
    if len(task_ids) != len(batches):
        raise ValueError(f"batches has {len(batches)} entries but task_ids has {len(task_ids)}")
    parts = []
    for batch, t in zip(batches, task_ids):
        ids, types = _unpadded_rows(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        part = TaskRows(
            int(t), ids, types, labels=batch.get("labels"), ids=batch.get("ids"), name=batch.get("task")
        )
        if "input_ids_b" in batch:
            part.input_ids_b, part.token_type_ids_b = _unpadded_rows(
                batch["input_ids_b"], batch["token_type_ids_b"], batch["attention_mask_b"]
            )
        parts.append(part)
    return pack_task_rows(parts, num_tasks)


def collate_packed(batchers: Sequence[TaskBatcher], selection: MixedSelection) -> dict:
    """The packed micro-batch of ``selection``: each task's selected examples straight from its batcher's token
    lists (:meth:`fastpals.data.per_task_batches.TaskBatcher.task_rows`, no padding made), packed by :func:`pack_task_rows`."""
    if len(batchers) != len(selection.indices):
        raise ValueError(f"{len(batchers)} batchers for a selection over {len(selection.indices)} tasks")
    present = [t for t, idx in enumerate(selection.indices) if len(idx)]
    if not present:
        raise ValueError("the selection holds no example")
    return pack_task_rows([batchers[t].task_rows(selection.indices[t], t) for t in present], len(batchers))


_TOKEN_KEYS = ("input_ids", "token_type_ids", "input_ids_b", "token_type_ids_b")


class ModelInputs(dict):
    """``model_inputs``' dict. ``["task_ids"]`` and ``["cu_seqlens"]``, the former keys, still read the layout's
    tensors (deprecated: use ``["layout"]``); they are not keys, so ``model(**inputs)`` does not get them."""

    def __missing__(self, key: str) -> torch.Tensor:
        if key not in ("task_ids", "cu_seqlens") or "layout" not in self:
            raise KeyError(key)
        warnings.warn(
            f"model_inputs(...)[{key!r}] will be removed in the next release: use ['layout'].{key}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self["layout"], key)


def model_inputs(batch: dict, device: torch.device | str) -> dict[str, Any]:
    """``MultiTaskBert.forward``'s keyword arguments of a packed batch: its token tensors and its ``layout``, on
    ``device``."""
    out: dict[str, Any] = ModelInputs(
        (k, batch[k].to(device, non_blocking=True)) for k in _TOKEN_KEYS if k in batch
    )
    out["layout"] = batch["layout"].to(device)
    return out
