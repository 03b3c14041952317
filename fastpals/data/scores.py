"""The float64 scores of one set of predictions, free of task definitions so that the task kinds import them."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

__all__ = ["accuracy", "as_1d", "confusion_matrix", "paired_arrays", "pearson", "spearman"]


def as_1d(values: Sequence | np.ndarray, name: str, dtype: type | None = None) -> np.ndarray:
    """``values`` (a list, NumPy array or torch tensor) as a 1-D host array of ``dtype``; ``ValueError`` naming
    ``name`` otherwise."""
    if hasattr(values, "detach"):  # torch tensors, without importing torch here
        values = values.detach().cpu().numpy()
    array = np.asarray(values, dtype=dtype)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    return array


def paired_arrays(
    y_true: Sequence, y_pred: Sequence, dtype: type | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(y_true, y_pred)`` as 1-D host arrays of one length (:func:`as_1d`); ``ValueError`` otherwise."""
    true = as_1d(y_true, "y_true", dtype)
    pred = as_1d(y_pred, "y_pred", dtype)
    if true.shape != pred.shape:
        raise ValueError(f"y_true has {true.shape[0]} entries but y_pred has {pred.shape[0]}")
    if true.size == 0:
        raise ValueError("y_true and y_pred are empty")
    return true, pred


def accuracy(y_true: Sequence, y_pred: Sequence) -> float:
    """Share of positions where ``y_pred == y_true``; both 1-D of length ``N >= 1`` (lists, numpy or torch)."""
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
    da = a - a.mean()
    db = b - b.mean()
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
    values share the mean of their ranks), in float64. NaN with a ``RuntimeWarning`` when either is constant."""
    a, b = _samples(x, y, "spearman")
    ranks_a, ranks_b = _average_ranks(a), _average_ranks(b)
    if np.all(ranks_a == ranks_a[0]) or np.all(ranks_b == ranks_b[0]):
        return _undefined("spearman")
    return pearson(ranks_a, ranks_b)


def confusion_matrix(y_true: Sequence[int], y_pred: Sequence[int], num_classes: int) -> np.ndarray:
    """int64 ``[K, K]`` counts of true class ``i`` predicted as ``j``, for whole-number labels in ``[0, K)``."""
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
