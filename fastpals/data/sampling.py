"""Which task each micro-batch comes from (:class:`TaskSampler`, a resumable stream of task ids). With ``N_t``
examples of task ``t``: ``round_robin`` (turns until every task is used up), ``proportional`` (``p_t ∝ N_t``),
``uniform``, ``sqrt``, ``annealed`` (``p_t ∝ N_t^α``, :func:`annealed_alpha`, Stickland & Murray 2019), and two
that form update groups so that surgery sees several tasks: ``random_round_robin`` (every task once, in a fresh
random order) and ``every_task_plus_annealed`` (the same, then ``extra`` annealed draws)."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_PROBABILITY_METHODS = ("proportional", "uniform", "sqrt", "annealed")
GROUPED_METHODS = ("every_task_plus_annealed", "random_round_robin")
SAMPLING_METHODS = ("round_robin", *_PROBABILITY_METHODS, *GROUPED_METHODS)
EQUAL_SHARE_METHODS = ("round_robin", "random_round_robin", "every_task_plus_annealed")  # in mixed batches


def _check_sizes(sizes: Sequence[int]) -> np.ndarray:
    array = np.asarray(list(sizes), dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"sizes must be a non-empty 1-D sequence, got {sizes!r}")
    if not np.all(np.isfinite(array)) or np.any(array <= 0):
        raise ValueError(f"sizes must be positive counts, got {list(sizes)!r}")
    return array


def check_int(name: str, value: Any, low: int) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_epoch(epoch: int, num_epochs: int) -> None:
    check_int("num_epochs", num_epochs, 1)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 1 <= epoch <= num_epochs:
        raise ValueError(f"epoch must be an int in [1, {num_epochs}] (counted from 1), got {epoch!r}")


def next_epoch(epoch: int, num_epochs: int) -> int:
    """``epoch + 1``; ``ValueError`` when ``epoch`` is already the last of ``num_epochs`` (epochs count from 1)."""
    if epoch >= num_epochs:
        raise ValueError(f"epoch {epoch} is the last of {num_epochs}")
    return epoch + 1


def check_resume_settings(
    state: Mapping[str, Any], mine: Mapping[str, Any], what: str, skip: Sequence[str] = ()
) -> None:
    """``ValueError("cannot resume {what}: ...")`` naming every setting of ``mine`` that differs in ``state``
    (missing: None), ``skip`` aside."""
    differ = [k for k in mine if k not in skip and state.get(k) != mine[k]]
    if differ:
        detail = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in differ)
        raise ValueError(f"cannot resume {what}: {detail}")


def annealed_alpha(epoch: int, num_epochs: int) -> float:
    """``α = 1 - 0.8 (epoch - 1) / (num_epochs - 1)`` for ``epoch`` in ``1..num_epochs``; 1.0 when ``num_epochs == 1``."""
    _check_epoch(epoch, num_epochs)
    return 1.0 - 0.8 * (epoch - 1) / max(num_epochs - 1, 1)


def task_probabilities(sizes: Sequence[int], method: str, epoch: int = 1, num_epochs: int = 1) -> np.ndarray:
    """Each task's share, float64 ``[T]`` summing to 1, of ``sizes`` examples per task in ``epoch`` (from 1)."""
    n = _check_sizes(sizes)
    _check_epoch(epoch, num_epochs)
    weigh = {"proportional": lambda: n, "uniform": lambda: np.ones_like(n), "sqrt": lambda: np.sqrt(n)}
    if method in ("annealed", "every_task_plus_annealed"):
        weights = n ** annealed_alpha(epoch, num_epochs)
    elif method in weigh:
        weights = weigh[method]()
    else:
        raise ValueError(
            f"method {method!r} has no per-draw probabilities; choose one of "
            f"{', '.join(_PROBABILITY_METHODS)} (or every_task_plus_annealed)"
        )
    return weights / weights.sum()


def round_robin_order(batches_per_task: Sequence[int]) -> list[int]:
    """Task ids of one round-robin epoch: ``round_robin_order([2, 1, 3]) == [0, 1, 2, 0, 2, 2]``."""
    counts = [int(c) for c in batches_per_task]
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"batches_per_task must be positive counts, got {list(batches_per_task)!r}")
    return [t for turn in range(max(counts)) for t, count in enumerate(counts) if count > turn]


class TaskSampler:
    """A resumable stream of task ids, one per micro-batch; epoch ``e``'s are :meth:`epoch_order` ``(e)``, a
    pure function of ``(seed, e)``. ``updates_per_epoch`` None: a full ``round_robin`` pass;
    ``micro_batches_per_update``: for the ungrouped methods; ``extra``: ``every_task_plus_annealed``'s draws."""

    def __init__(
        self,
        method: str,
        sizes: Sequence[int],
        batches_per_task: Sequence[int],
        num_epochs: int,
        updates_per_epoch: int | None,
        micro_batches_per_update: int = 1,
        extra: int = 1,
        seed: int = 0,
    ) -> None:
        if method not in SAMPLING_METHODS:
            raise ValueError(f"sampling method {method!r}: choose one of {', '.join(SAMPLING_METHODS)}")
        self.sizes = [int(s) for s in _check_sizes(sizes)]
        self.batches_per_task = [int(b) for b in batches_per_task]
        if len(self.batches_per_task) != len(self.sizes) or any(b < 1 for b in self.batches_per_task):
            raise ValueError(
                f"batches_per_task must hold {len(self.sizes)} positive counts, got {list(batches_per_task)!r}"
            )
        _check_epoch(1, num_epochs)
        check_int("micro_batches_per_update", micro_batches_per_update, 1)
        check_int("extra", extra, 0)
        check_int("seed", seed, 0)
        if updates_per_epoch is None and method != "round_robin":
            raise ValueError(f"updates_per_epoch is needed for sampling {method!r}")
        if updates_per_epoch is not None:
            check_int("updates_per_epoch", updates_per_epoch, 1)
        self.method, self.num_tasks, self.num_epochs = method, len(self.sizes), num_epochs
        self.micro_batches_per_update, self.extra, self.seed = micro_batches_per_update, extra, seed
        grouped = {"random_round_robin": self.num_tasks, "every_task_plus_annealed": self.num_tasks + extra}
        self.group_size = grouped.get(method, micro_batches_per_update)
        if method == "round_robin":
            full = math.ceil(sum(self.batches_per_task) / self.group_size)
            self.updates_per_epoch = full if updates_per_epoch is None else min(full, updates_per_epoch)
        else:
            self.updates_per_epoch = int(updates_per_epoch)
        self.epoch, self.position = 1, 0
        self._cached: tuple[int, list[int]] | None = None

    def probabilities(self, epoch: int) -> np.ndarray | None:
        """Per-draw task probabilities in ``epoch`` (None for ``round_robin`` / ``random_round_robin``)."""
        if self.method in ("round_robin", "random_round_robin"):
            return None
        return task_probabilities(self.sizes, self.method, epoch, self.num_epochs)

    def epoch_order(self, epoch: int) -> list[int]:
        """Task ids of every micro-batch of ``epoch`` (from 1): ``updates_per_epoch * group_size`` ids, except a
        ``round_robin`` pass whose last update may be short."""
        _check_epoch(epoch, self.num_epochs)
        rng = np.random.default_rng([self.seed, epoch])
        total = self.updates_per_epoch * self.group_size
        if self.method == "round_robin":
            return round_robin_order(self.batches_per_task)[:total]
        if self.method == "random_round_robin":
            return [int(t) for _ in range(self.updates_per_epoch) for t in rng.permutation(self.num_tasks)]
        p = self.probabilities(epoch)
        if self.method == "every_task_plus_annealed":
            order: list[int] = []
            for _ in range(self.updates_per_epoch):
                order.extend(int(t) for t in rng.permutation(self.num_tasks))
                order.extend(int(t) for t in rng.choice(self.num_tasks, size=self.extra, p=p))
            return order
        return [int(t) for t in rng.choice(self.num_tasks, size=total, p=p)]

    def _order(self) -> list[int]:
        if self._cached is None or self._cached[0] != self.epoch:
            self._cached = (self.epoch, self.epoch_order(self.epoch))
        return self._cached[1]

    def epoch_done(self) -> bool:
        """True when the current epoch's micro-batches are all used."""
        return self.position >= len(self._order())

    def next_update(self) -> list[int]:
        """The task ids of the next update's micro-batches (``group_size`` of them, or the rest of a round-robin
        pass). Raises ``StopIteration`` at the end of the epoch: call :meth:`start_next_epoch`."""
        order = self._order()
        if self.position >= len(order):
            raise StopIteration(f"epoch {self.epoch} is done")
        group = order[self.position : self.position + self.group_size]
        self.position += len(group)
        return group

    def start_next_epoch(self) -> None:
        """Move to the first micro-batch of the next epoch."""
        self.epoch, self.position = next_epoch(self.epoch, self.num_epochs), 0

    def state_dict(self) -> dict:
        """Plain-Python state: method, seed and shape settings (checked on load) and ``(epoch, position)``."""
        names = "method sizes batches_per_task num_epochs updates_per_epoch group_size seed epoch position"
        # a copy: the caller may edit it
        return copy.deepcopy({name: getattr(self, name) for name in names.split()})

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s ``(epoch, position)``; every other entry must match this sampler's."""
        check_resume_settings(state, self.state_dict(), "the task sampler", skip=("epoch", "position"))
        _check_epoch(int(state["epoch"]), self.num_epochs)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if not 0 <= self.position <= len(self._order()):
            raise ValueError(f"sampler position {self.position} is outside epoch {self.epoch}")
