"""Evaluation metrics over whole sets, the overall score (mean of each task's ``unit_score``: the CS224N score for
``sst, para, sts``), CS224N prediction files and confusion-matrix plots."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from fastpals.data.task_kinds import accuracy as accuracy
from fastpals.data.task_kinds import as_1d
from fastpals.data.task_kinds import confusion_matrix as confusion_matrix
from fastpals.data.task_kinds import pearson as pearson
from fastpals.data.task_kinds import spearman as spearman
from fastpals.data.tasks import TaskSpec, get_task

# Column names used by the CS224N starter code (its STS spelling "Similiary" included), so that its graders and
# scripts read these files unchanged.
PREDICTION_HEADERS = {
    "sst": "Predicted_Sentiment",
    "cfimdb": "Predicted_Sentiment",
    "para": "Predicted_Is_Paraphrase",
    "sts": "Predicted_Similiary",
}


def task_metrics(task: str | TaskSpec, y_true: Sequence, y_pred: Sequence) -> dict[str, float]:
    """The metrics of one task by its kind, from 1-D inputs of one length; ``task.metric`` is the primary one."""
    spec = get_task(task)
    return spec.task_kind.metrics(spec, y_true, y_pred)


def unit_score(task: str | TaskSpec, value: float) -> float:
    """One task's share of ``overall``, in [0, 1], by its kind (:meth:`fastpals.data.task_kinds.TaskKind.unit_score`):
    its accuracy, or ``(r + 1) / 2`` of a regression task's Pearson ``r`` (NaN counts as ``r = 0``, i.e. 0.5)."""
    spec = get_task(task)
    return spec.task_kind.unit_score(spec, value)


def overall(scores: Mapping[str, float], tasks: Iterable[str | TaskSpec] | None = None) -> float:
    """The mean ``unit_score`` of ``scores`` (``{task name: primary metric}``, an ``"overall"`` key ignored) for
    the specs ``tasks`` (built-in names need none)."""
    specs = {spec.name: spec for spec in (get_task(t) for t in (tasks or ()))}
    parts = [unit_score(specs.get(name, name), value) for name, value in scores.items() if name != "overall"]
    if not parts:
        raise ValueError("scores holds no task")
    return float(sum(parts) / len(parts))


def overall_score(sst_acc: float, para_acc: float, sts_pearson: float) -> float:
    """CS224N overall score ``(sst_acc + para_acc + (sts_pearson + 1) / 2) / 3``; accuracies in [0, 1], r in [-1, 1]."""
    for name, value, low in (
        ("sst_acc", sst_acc, 0.0),
        ("para_acc", para_acc, 0.0),
        ("sts_pearson", sts_pearson, -1.0),
    ):
        if not low <= value <= 1.0:  # also rejects NaN
            raise ValueError(f"{name} must be in [{low:g}, 1], got {value!r}")
    return (sst_acc + para_acc + (sts_pearson + 1.0) / 2.0) / 3.0


def bin_sts(scores: Sequence[float]) -> np.ndarray:
    """STS scores to classes 0..10 (``k`` = score ``k / 2``): clip to [0, 5], round to the nearest 0.5 (halves
    round up). Returns int64 ``(N,)``; for predictions from a [0, 1] head multiply by 5 first."""
    values = as_1d(scores, "scores", np.float64)
    if not np.isfinite(values).all():
        raise ValueError("scores hold non-finite values (NaN or inf)")
    return np.floor(np.clip(values, 0.0, 5.0) * 2.0 + 0.5).astype(np.int64)


def task_confusion_matrix(
    task: str | TaskSpec, y_true: Sequence, y_pred: Sequence, steps: int = 10
) -> tuple[np.ndarray, list[str]]:
    """``(int64 [K, K], K names)`` of any task by its kind (regression: ``steps + 1`` score bins)."""
    spec = get_task(task)
    return spec.task_kind.confusion_matrix(spec, y_true, y_pred, steps)


def _format_prediction(value: object) -> str:
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(float(value)):
            raise ValueError(f"prediction {value!r} is not finite")
        return repr(float(value))
    raise TypeError(f"predictions must be ints or floats, got {type(value).__name__}")


def prediction_header(task: str | TaskSpec) -> str:
    """The prediction-file column of a task: the CS224N name, else ``Predicted_<Label column>``."""
    spec = get_task(task)
    if spec.name in PREDICTION_HEADERS and spec.source is None:
        return PREDICTION_HEADERS[spec.name]
    column = spec.label_column or spec.name
    return "Predicted_" + re.sub(r"\W", "_", column[:1].upper() + column[1:])


def write_predictions(
    path: str | os.PathLike, ids: Sequence[str], predictions: Sequence, task: str | TaskSpec
) -> Path:
    """Write a CS224N prediction file (``id \\t Predicted_<Name> ``, then ``<id> , <prediction> `` per id) and
    return its path; ``task`` picks the header."""
    if isinstance(task, str) and task not in PREDICTION_HEADERS:
        raise ValueError(f"task must be one of {', '.join(PREDICTION_HEADERS)} or a TaskSpec, got {task!r}")
    header = prediction_header(task)
    if hasattr(predictions, "detach") or isinstance(predictions, np.ndarray):
        predictions = as_1d(predictions, "predictions").tolist()
    ids, predictions = list(ids), list(predictions)
    if len(ids) != len(predictions):
        raise ValueError(f"ids has {len(ids)} entries but predictions has {len(predictions)}")
    lines = [f"id \t {header} \n"]
    for example_id, value in zip(ids, predictions):
        if not isinstance(example_id, str) or not example_id or any(ch in example_id for ch in ",\t\n\r"):
            raise ValueError(f"id {example_id!r} must be a non-empty str without comma, tab or newline")
        lines.append(f"{example_id} , {_format_prediction(value)} \n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")
    return path


def read_predictions(path: str | os.PathLike) -> tuple[str, dict[str, str]]:
    """Read a file from ``write_predictions`` (or the CS224N starter): ``(header name, {id: prediction text})``."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines:
        raise ValueError(f"{path}: empty prediction file")
    header = lines[0].split("\t")
    if len(header) != 2 or header[0].strip() != "id":
        raise ValueError(f"{path}:1: header must be 'id \\t Predicted_...', got {lines[0]!r}")
    out: dict[str, str] = {}
    for line_no, line in enumerate(lines[1:], start=2):
        parts = line.split(",")
        if len(parts) != 2:
            raise ValueError(f"{path}:{line_no}: expected '<id> , <prediction>', got {line!r}")
        example_id = parts[0].strip()
        if example_id in out:
            raise ValueError(f"{path}:{line_no}: duplicate id {example_id}")
        out[example_id] = parts[1].strip()
    return header[1].strip(), out


def plot_confusion_matrix(
    matrix: np.ndarray,
    path: str | os.PathLike,
    class_names: Sequence[str] | None = None,
    title: str | None = None,
    normalize: bool = False,
) -> Path:
    """Draw ``matrix [K, K]`` (rows true) to a PNG with the Agg canvas (no pyplot state); returns the path.
    ``normalize``: each row as shares of its true class."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # matplotlib: costly, only for plots
    from matplotlib.figure import Figure

    counts = np.asarray(matrix)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1] or counts.shape[0] == 0:
        raise ValueError(f"matrix must be square (K, K) with K >= 1, got shape {counts.shape}")
    if counts.dtype.kind not in "iu" or counts.min() < 0:
        raise ValueError("matrix must hold non-negative integer counts")
    size = counts.shape[0]
    names = [str(i) for i in range(size)] if class_names is None else [str(name) for name in class_names]
    if len(names) != size:
        raise ValueError(f"class_names has {len(names)} entries but the matrix has {size} classes")
    if normalize:
        totals = counts.sum(axis=1, keepdims=True)
        shown = np.divide(counts, totals, out=np.zeros(counts.shape, dtype=np.float64), where=totals > 0)
        text = [[f"{value:.2f}" for value in row] for row in shown]
    else:
        shown = counts.astype(np.float64)
        text = [[str(int(value)) for value in row] for row in counts]

    side = max(3.5, 0.55 * size + 2.0)
    figure = Figure(figsize=(side + 1.0, side))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    image = axes.imshow(shown, cmap="Blues", vmin=0.0, vmax=max(float(shown.max()), 1e-12))
    figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04)
    axes.set_xticks(range(size), labels=names, rotation=45 if size > 6 else 0)
    axes.set_yticks(range(size), labels=names)
    axes.set(xlabel="predicted", ylabel="true")
    if title:
        axes.set_title(title)
    threshold, fontsize = float(shown.max()) / 2.0, 8 if size > 6 else 10
    for i in range(size):
        for j in range(size):
            colour = "white" if shown[i, j] > threshold else "black"
            axes.text(j, i, text[i][j], ha="center", va="center", color=colour, fontsize=fontsize)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=110)
    return path
