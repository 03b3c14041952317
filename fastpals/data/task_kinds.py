"""Task kinds: one :class:`TaskKind` per kind (``TaskSpec.kind`` names an entry of :data:`TASK_KINDS`) holds the
head's output count, label parsing and checks, the loss, the predictions, the metrics and the score share. A new
kind is a subclass passed to :func:`register_task_kind`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from fastpals.data.tasks import TaskSpec


def as_1d(values: Sequence | np.ndarray, name: str, dtype: type | None = None) -> np.ndarray:
    """``values`` (a list, NumPy array or torch tensor) as a 1-D host array of ``dtype``; ``ValueError``
    naming ``name`` otherwise."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values, dtype=dtype)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    return array


def paired_arrays(
    y_true: Sequence, y_pred: Sequence, dtype: type | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(y_true, y_pred)`` as 1-D host arrays of one length (:func:`as_1d`); ``ValueError`` otherwise."""
    true, pred = as_1d(y_true, "y_true", dtype), as_1d(y_pred, "y_pred", dtype)
    if true.shape != pred.shape:
        raise ValueError(f"y_true has {true.shape[0]} entries but y_pred has {pred.shape[0]}")
    if true.size == 0:
        raise ValueError("y_true and y_pred are empty")
    return true, pred


def accuracy(y_true: Sequence, y_pred: Sequence) -> float:
    """Share of positions where ``y_pred == y_true``; both 1-D of length ``N >= 1`` (lists, numpy or
    torch)."""
    true, pred = paired_arrays(y_true, y_pred)
    return float(np.mean(true == pred))


def _samples(x: Sequence[float], y: Sequence[float], name: str) -> tuple[np.ndarray, np.ndarray]:
    """Two finite float64 samples of one length ``N >= 2`` for the correlation ``name``."""
    a, b = paired_arrays(x, y, np.float64)
    if a.size < 2:
        raise ValueError(f"{name} needs at least 2 pairs, got {a.size}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError(f"{name} got non-finite values (NaN or inf)")
    return a, b


def _undefined(name: str) -> float:
    warnings.warn(
        f"{name}: one input is constant, the correlation is undefined (NaN)", RuntimeWarning, stacklevel=3
    )
    return math.nan


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of two 1-D samples of length ``N >= 2`` in float64; NaN with a ``RuntimeWarning``
    when either is constant."""
    a, b = _samples(x, y, "pearson")
    da, db = a - a.mean(), b - b.mean()
    norm = math.sqrt(float(np.dot(da, da))) * math.sqrt(float(np.dot(db, db)))
    if norm == 0.0:
        return _undefined("pearson")
    return float(np.clip(np.dot(da, db) / norm, -1.0, 1.0))


def _average_ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    new_group = np.concatenate([[True], ordered[1:] != ordered[:-1]])
    starts = np.flatnonzero(new_group)
    sizes = np.diff(np.concatenate([starts, [values.size]]))
    mean_rank = starts + (sizes - 1) / 2.0 + 1.0  # 1-based ranks, ties get the mean of their positions
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, sizes)
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation of two 1-D samples of length ``N >= 2``: Pearson of the average ranks (tied
    values share the mean of their ranks), in float64. NaN with a ``RuntimeWarning`` when either is
    constant."""
    a, b = _samples(x, y, "spearman")
    ranks_a, ranks_b = _average_ranks(a), _average_ranks(b)
    if np.all(ranks_a == ranks_a[0]) or np.all(ranks_b == ranks_b[0]):
        return _undefined("spearman")
    return pearson(ranks_a, ranks_b)


def confusion_matrix(y_true: Sequence[int], y_pred: Sequence[int], num_classes: int) -> np.ndarray:
    """int64 ``[K, K]`` counts of true class ``i`` predicted as ``j``, for whole-number labels in
    ``[0, K)``."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
    true, pred = paired_arrays(y_true, y_pred)
    for name, array in (("y_true", true), ("y_pred", pred)):
        if array.dtype.kind not in "iub":
            if not np.all(np.isfinite(array)) or not np.all(array == np.round(array)):
                raise ValueError(f"{name} must hold whole class indices")
        if array.min() < 0 or array.max() >= num_classes:
            raise ValueError(f"{name} holds {array.min()}..{array.max()}, outside [0, {num_classes})")
    flat = true.astype(np.int64) * num_classes + pred.astype(np.int64)
    return np.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


Fail = Callable[[str], NoReturn]


class TaskKind:
    """What a task predicts. Subclasses set the attributes (``losses`` and ``metric_names``: the first is the
    default; ``boolean_labels``: JSON true/false read as 1/0; ``scored``: labels are scores in a ``label_range``;
    ``cosine_pairs``: ``sbert_cosine`` is allowed) and implement :meth:`head_outputs`,
    :meth:`task_file_num_labels`, :meth:`loss` and :meth:`predict`; the rest is class indices scored by accuracy."""

    name: str = ""
    losses: tuple[str, ...] = ()
    metric_names: tuple[str, ...] = ("accuracy",)
    integer_labels: bool = True
    label_dtype: torch.dtype = torch.int64
    boolean_labels: bool = False
    scored: bool = False
    cosine_pairs: bool = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def head_outputs(self, num_labels: int) -> int:
        """The head's output count (``TaskSpec.num_labels``) for ``num_labels``; idempotent, since saved specs are
        rebuilt from their fields. ``ValueError(reason)`` for a bad value."""
        raise NotImplementedError

    def task_file_num_labels(self, value: Any) -> int:
        """``TaskSpec.num_labels`` from a task file's ``num_labels`` (None: absent); ``ValueError(reason)``."""
        raise NotImplementedError

    def num_classes(self, spec: TaskSpec) -> int | None:
        """The task's number of classes (default ``num_labels``); None for a scored kind."""
        return spec.num_labels

    def check_labels(self, spec: TaskSpec, fail: Fail) -> None:
        """Check and complete ``spec``'s ``label_range``, ``label_names`` and ``label_scale``; ``fail(reason)``
        raises the spec's error."""
        num_classes = self.num_classes(spec)
        implied = (0.0, float(num_classes - 1))
        if spec.label_range is not None and spec.label_range != implied:
            fail(f"label_range is {implied} for a {spec.kind} task, got {spec.label_range}")
        spec.label_range = implied
        if spec.label_scale is None:
            spec.label_scale = 1.0
        if spec.label_names is not None:
            names = list(spec.label_names)
            if len(names) != num_classes or not all(isinstance(n, str) and n for n in names):
                fail(f"label_names must be {num_classes} non-empty strings, got {names!r}")
            if len(set(names)) != len(names):
                fail(f"label_names has a name twice: {names!r}")
            spec.label_names = names

    def parse_label(self, spec: TaskSpec, value: Any) -> tuple[int | float | None, str, str]:
        """A raw label cell (CSV/TSV string or JSON value) → ``(label, "", "")`` or ``(None, problem, reason)``;
        a name of ``label_names`` reads as its index."""
        column, names = spec.label_column, spec.label_names
        if value is None or (isinstance(value, str) and not value.strip()):
            return None, "empty label", f"empty {column}"
        if isinstance(value, bool):
            if not self.boolean_labels:
                return None, "bad label", f"{column} {value!r} is a boolean, the task is {spec.kind}"
            return int(value), "", ""
        if isinstance(value, str):
            stripped = value.strip()
            if names is not None and stripped in names:
                return names.index(stripped), "", ""
            try:
                number = float(stripped)
            except ValueError:
                also = f" or one of {names}" if names is not None else ""
                return None, "bad label", f"{column} {value!r} is not a number{also}"
        elif isinstance(value, (int, float)):
            number = float(value)
        else:
            return None, "bad label", f"{column} {value!r} is not a number"
        if not math.isfinite(number):
            return None, "bad label", f"{column} {value!r} is not a finite number"
        low, high = spec.label_range
        if not low <= number <= high:
            bounds = f"[{self._format_bound(low)}, {self._format_bound(high)}]"
            return None, "label out of range", f"{column} {value!r} is outside {bounds}"
        if self.integer_labels:
            if number != int(number):
                return None, "bad label", f"{column} {value!r} is not a whole number"
            return int(number), "", ""
        return number, "", ""

    def _format_bound(self, value: float) -> str:
        return str(int(value)) if self.integer_labels else f"{value:g}"

    def loss(self, spec: TaskSpec, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The task's 0-dim float32 loss of ``logits [n, num_labels]`` against ``labels [n]``."""
        raise NotImplementedError

    def predict(self, spec: TaskSpec, logits: torch.Tensor) -> torch.Tensor:
        """Predicted labels float32 ``[n]`` of ``logits [n, num_labels]``; no host reads (it runs on every row)."""
        raise NotImplementedError

    def confidence(self, spec: TaskSpec, logits: torch.Tensor) -> torch.Tensor | None:
        """Probability of the predicted label, float32 ``[n]``; None when the kind has none."""
        return None

    def metrics(self, spec: TaskSpec, y_true: Sequence, y_pred: Sequence) -> dict[str, float]:
        """``{name: value}`` for every one of :attr:`metric_names`, from 1-D host arrays of one length."""
        true, pred = paired_arrays(y_true, y_pred, np.float64)
        return {"accuracy": accuracy(np.rint(true).astype(np.int64), np.rint(pred).astype(np.int64))}

    def unit_score(self, spec: TaskSpec, value: float) -> float:
        """The task's share of the overall score, in [0, 1], from its primary metric ``value``."""
        if not 0.0 <= value <= 1.0:  # also rejects NaN
            raise ValueError(f"task {spec.name!r}: accuracy must be in [0, 1], got {value!r}")
        return float(value)

    def confusion_matrix(
        self, spec: TaskSpec, y_true: Sequence, y_pred: Sequence, steps: int = 10
    ) -> tuple[np.ndarray, list[str]]:
        """``(int64 [K, K] counts, K class names)``, rows true and columns predicted."""
        num_classes = self.num_classes(spec)
        names = [spec.label_name(k) for k in range(num_classes)]
        true, pred = paired_arrays(y_true, y_pred, np.float64)
        return confusion_matrix(true, pred, num_classes), names


class Classification(TaskKind):
    """``num_labels``-way classification: cross-entropy on ``num_labels`` logits, labels class indices (int64),
    prediction the argmax, scored by accuracy."""

    name = "classification"
    losses = ("ce",)

    def head_outputs(self, num_labels: int) -> int:
        if num_labels < 2:
            raise ValueError("classification needs num_labels >= 2")
        return num_labels

    def task_file_num_labels(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            what = "missing" if value is None else f"{value!r} must be an int >= 2"
            raise ValueError(f"{what} (classification needs the number of classes)")
        return value

    def loss(self, spec: TaskSpec, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels.long())

    def predict(self, spec: TaskSpec, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().argmax(-1).float()

    def confidence(self, spec: TaskSpec, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().softmax(-1).amax(-1)


class Binary(TaskKind):
    """Binary classification: one logit trained with BCE, labels 0/1 (float32 in batches; JSON booleans
    accepted), prediction ``logit > 0``, scored by accuracy."""

    name = "binary"
    losses = ("bce",)
    label_dtype = torch.float32
    boolean_labels = True

    def head_outputs(self, num_labels: int) -> int:
        return 1

    def task_file_num_labels(self, value: Any) -> int:
        if value not in (None, 2) or isinstance(value, bool):
            raise ValueError(f"a binary task has 2 labels, got {value!r}")
        return 1

    def num_classes(self, spec: TaskSpec) -> int:
        return 2

    def loss(self, spec: TaskSpec, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits[:, 0].float(), labels.float())

    def predict(self, spec: TaskSpec, logits: torch.Tensor) -> torch.Tensor:
        return (logits.float()[:, 0] > 0).float()

    def confidence(self, spec: TaskSpec, logits: torch.Tensor) -> torch.Tensor:
        p = logits.float()[:, 0].sigmoid()
        return torch.where(p >= 0.5, p, 1 - p)


class Regression(TaskKind):
    """Regression on a score in ``label_range`` (``low >= 0``): one value trained on ``label / label_scale``
    (``loss="mse"``) or with CoSENT (``loss="cosine"``, a ranking loss on the scores' pairwise order within the
    batch); prediction ``clip(z, 0, 1) * label_scale``, or ``cos * label_scale`` unclipped for
    ``pair_mode="sbert_cosine"`` (the cosine as sentence-transformers scores it, so an exported model gives the same
    correlations); Pearson (primary) and Spearman correlations."""

    name = "regression"
    losses = ("mse", "cosine")
    metric_names = ("pearson", "spearman")
    integer_labels = False
    label_dtype = torch.float32
    scored = True
    cosine_pairs = True

    def head_outputs(self, num_labels: int) -> int:
        return 1

    def task_file_num_labels(self, value: Any) -> int:
        if value is not None:
            raise ValueError("not used by a regression task (give label_range)")
        return 1

    def num_classes(self, spec: TaskSpec) -> None:
        return None

    def check_labels(self, spec: TaskSpec, fail: Fail) -> None:
        """``label_range`` defaults to ``(0, label_scale or 1)`` and needs ``low >= 0``; ``label_scale``
        defaults to the range's high and may not be below it; no ``label_names``."""
        if spec.label_names is not None:
            fail(f"label_names is for {kind_names(lambda kind: not kind.scored)} tasks")
        if spec.label_range is None:
            spec.label_range = (0.0, float(spec.label_scale or 1.0))
        low, high = spec.label_range
        if low < 0:
            fail(
                f"label_range [{low:g}, {high:g}]: low must be >= 0 (the model predicts in "
                "[0, label_scale]); shift the labels"
            )
        if spec.label_scale is None:
            spec.label_scale = high
        if not spec.label_scale >= high:
            fail(f"label_scale={spec.label_scale:g} is below label_range's high {high:g}")

    def loss(self, spec: TaskSpec, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if spec.loss == "mse":
            return F.mse_loss(logits[:, 0].float(), labels.float() / spec.label_scale)
        return cosent_loss(logits[:, 0].float(), labels.float())

    def predict(self, spec: TaskSpec, logits: torch.Tensor) -> torch.Tensor:
        score = logits.float()[:, 0]
        if spec.pair_mode != "sbert_cosine":
            score = score.clamp(0.0, 1.0)
        return score * spec.label_scale

    def metrics(self, spec: TaskSpec, y_true: Sequence, y_pred: Sequence) -> dict[str, float]:
        """``{"pearson": r, "spearman": rho}`` in float64 over the whole set (``N >= 2``); NaN, without a
        warning, when either side is constant."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return {"pearson": pearson(y_true, y_pred), "spearman": spearman(y_true, y_pred)}

    def unit_score(self, spec: TaskSpec, value: float) -> float:
        """``(r + 1) / 2`` of the Pearson ``r`` (NaN counts as ``r = 0``); ``ValueError`` outside [-1, 1]."""
        value = 0.0 if math.isnan(value) else float(value)
        if not -1.0 <= value <= 1.0:
            raise ValueError(f"task {spec.name!r}: Pearson r must be in [-1, 1], got {value!r}")
        return (value + 1.0) / 2.0

    def confusion_matrix(
        self, spec: TaskSpec, y_true: Sequence, y_pred: Sequence, steps: int = 10
    ) -> tuple[np.ndarray, list[str]]:
        """Labels and predictions clipped to ``label_range`` and rounded to ``steps + 1`` evenly spaced values
        (halves round up), named by those values: ``(int64 (steps + 1, steps + 1), names)``."""
        low, high = spec.label_range
        binned = []
        for name, values in (("y_true", y_true), ("y_pred", y_pred)):
            array = as_1d(values, name, np.float64)
            if not np.isfinite(array).all():
                raise ValueError(f"{name} holds non-finite values (NaN or inf)")
            scaled = (np.clip(array, low, high) - low) / (high - low)
            binned.append(np.floor(scaled * steps + 0.5).astype(np.int64))
        names = [f"{low + k * (high - low) / steps:g}" for k in range(steps + 1)]
        return confusion_matrix(binned[0], binned[1], steps + 1), names


def cosent_loss(scores: torch.Tensor, labels: torch.Tensor, scale: float = 20.0) -> torch.Tensor:
    """CoSENT: ``log(1 + sum_{y_i > y_j} exp(s * (p_j - p_i)))`` over the pairs of a batch.

    ``scores`` and ``labels`` float ``[n]``; returns a 0-dim tensor of ``scores``' dtype (0-dim ``log 1 = 0``
    when no pair is ordered)."""
    diff = scale * (scores[None, :] - scores[:, None])  # [i, j] = s (p_j - p_i)
    keep = labels[:, None] > labels[None, :]
    diff = diff.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff.flatten()]), 0)


TASK_KINDS: dict[str, TaskKind] = {}


def register_task_kind(kind: TaskKind, replace: bool = False) -> TaskKind:
    """Add ``kind`` to :data:`TASK_KINDS` under ``kind.name`` and return it. A name already registered is a
    ``ValueError`` unless ``replace``."""
    if not isinstance(kind, TaskKind):
        raise TypeError(f"register_task_kind takes a TaskKind instance, got {type(kind).__name__}")
    if not kind.name or not isinstance(kind.name, str):
        raise ValueError(f"{type(kind).__name__}.name must be a non-empty str, got {kind.name!r}")
    if not kind.losses or not kind.metric_names:
        raise ValueError(f"{type(kind).__name__} needs at least one loss and one metric name")
    if kind.name in TASK_KINDS and not replace:
        raise ValueError(f"task kind {kind.name!r} is already registered ({TASK_KINDS[kind.name]!r})")
    TASK_KINDS[kind.name] = kind
    return kind


def kind_names(where: Callable[[TaskKind], bool]) -> str:
    """The registered kinds ``where`` holds for, in registration order, for messages: ``"a"``,
    ``"a and b"``, ``"a, b and c"``."""
    names = [name for name, kind in TASK_KINDS.items() if where(kind)]
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " and " + names[-1]


for _kind in (Classification, Binary, Regression):
    register_task_kind(_kind())
