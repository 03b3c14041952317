"""Pictures of a training run (PNG, matplotlib's Agg canvas, no pyplot state): loss curves per task with the dev
scores per evaluation, and confusion matrices for SST and for STS binned to 0.5 (via :mod:`fastpals.data.metrics`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fastpals.data.metrics import bin_sts, confusion_matrix, plot_confusion_matrix, task_confusion_matrix


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average of ``values`` over ``window`` points (shorter at the start); float64 ``[N]``."""
    x = np.asarray(values, dtype=np.float64)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if x.size == 0:
        return x
    c = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def task_colors(tasks: Sequence[str]) -> dict[str, str]:
    """One colour per task (tab10, in the given order) and black for ``overall``, the same in every panel."""
    palette = [f"C{i % 10}" for i in range(len(tasks))]
    return {**dict(zip(tasks, palette)), "overall": "black"}


def training_curve_series(
    step_losses: dict[str, tuple[Sequence[int], Sequence[float]]],
    evals: Sequence[dict],
    tasks: Sequence[str] | None = None,
) -> list[dict]:
    """What :func:`plot_training_curves` draws, as series ``{"panel": "loss" | "dev", "task", "kind":
    "points" | "smoothed" | "dev", "x", "y", "color"}``; a task's losses only at the updates that trained it."""
    keys = sorted({k for e in evals for k in e["dev"] if isinstance(e["dev"][k], (int, float))} - {"overall"})
    order = list(tasks) if tasks is not None else sorted(set(step_losses) | set(keys))
    order += [t for t in sorted(set(step_losses) | set(keys)) if t not in order]
    colors = task_colors(order)
    series = []
    for task in order:
        if task not in step_losses:
            continue
        steps, losses = step_losses[task]
        if len(steps) != len(losses):
            raise ValueError(f"task {task}: {len(steps)} steps but {len(losses)} losses")
        if not len(steps):
            continue
        x, y = np.asarray(steps), np.asarray(losses, dtype=np.float64)
        for kind, values in (("points", y), ("smoothed", smooth(y, max(1, len(losses) // 20)))):
            series.append(
                {"panel": "loss", "task": task, "kind": kind, "x": x, "y": values, "color": colors[task]}
            )
    for key in [t for t in order if t in keys] + (
        ["overall"] if any("overall" in e["dev"] for e in evals) else []
    ):
        xs = [e["step"] for e in evals if key in e["dev"]]
        ys = [e["dev"][key] for e in evals if key in e["dev"]]
        series.append({"panel": "dev", "task": key, "kind": "dev", "x": np.asarray(xs), "y": np.asarray(ys),
                       "color": colors[key]})  # fmt: skip
    return series


def plot_training_curves(
    step_losses: dict[str, tuple[Sequence[int], Sequence[float]]],
    evals: Sequence[dict],
    path: str | os.PathLike,
    title: str | None = None,
    tasks: Sequence[str] | None = None,
) -> Path:
    """Write ``path`` (PNG): each task's training loss per update (``step_losses``: ``{task: (steps,
    losses)}``, points and a moving average) beside the dev scores of ``evals`` (``[{"step", "dev"}, ...]``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # start-up: matplotlib's import is slow
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.8))
    FigureCanvasAgg(figure)
    left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    handles: dict[str, object] = {}
    for s in training_curve_series(step_losses, evals, tasks):
        if s["kind"] == "points":
            left.plot(s["x"], s["y"], linestyle="none", marker=".", markersize=3, alpha=0.3, color=s["color"])
        elif s["kind"] == "smoothed":
            (handles[s["task"]],) = left.plot(s["x"], s["y"], color=s["color"], linewidth=1.5)
        else:
            width = 2.0 if s["task"] == "overall" else 1.0
            (line,) = right.plot(s["x"], s["y"], marker="o", color=s["color"], linewidth=width)
            handles.setdefault(s["task"], line)
    left.set(xlabel="update step", ylabel="training loss")
    left.set_title("training loss per task (points: updates that trained it)", fontsize=9)
    right.set(xlabel="update step", ylabel="dev score (accuracy / Pearson r)")
    right.set_title("dev evaluation", fontsize=9)
    if title:
        figure.suptitle(title, fontsize=9)
    if handles:
        figure.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 8),
                      frameon=False)  # fmt: skip
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path


def plot_confusion_matrices(
    predictions: dict[str, tuple[Sequence, Sequence]], folder: str | os.PathLike, specs: dict | None = None
) -> list[Path]:
    """Write the confusion matrices of the dev predictions (``{task: (labels, predictions)}``) into
    ``folder``: SST's, STS's (binned to 0.5) and, with ``specs``, every other task's; returns the paths."""
    plots = {
        task: (*task_confusion_matrix(spec, *predictions[task]), f"{task} dev (rows: true)")
        for task, spec in (specs or {}).items()
        if task not in ("sst", "sts") and task in predictions
    }
    if "sst" in predictions:
        labels, preds = (np.asarray(v, dtype=np.int64) for v in predictions["sst"])
        plots["sst"] = (confusion_matrix(labels, preds, 5), None, "SST dev (rows: true)")
    if "sts" in predictions:
        labels, preds = predictions["sts"]
        names = [f"{k / 2:g}" for k in range(11)]
        plots["sts"] = (
            confusion_matrix(bin_sts(labels), bin_sts(preds), 11),
            names,
            "STS dev, binned to 0.5",
        )
    return [
        plot_confusion_matrix(matrix, Path(folder) / f"confusion_{task}.png", class_names=names, title=title)
        for task, (matrix, names, title) in plots.items()
    ]
