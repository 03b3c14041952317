"""Pictures of a training run (PNG, matplotlib's Agg canvas, no pyplot state): loss curves per task with the dev
scores per evaluation, and confusion matrices for SST and for STS binned to 0.5 (via :mod:`fastpals.metrics`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fastpals.metrics import bin_sts, confusion_matrix, plot_confusion_matrix

__all__ = ["plot_confusion_matrices", "plot_training_curves", "smooth"]


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


def plot_training_curves(
    step_losses: dict[str, tuple[Sequence[int], Sequence[float]]],
    evals: Sequence[dict],
    path: str | os.PathLike,
    title: str | None = None,
) -> Path:
    """Two panels: per-task training loss against the update step (raw, faint, and a moving average), and the dev
    metric of every task plus the overall score at each evaluation.

    Args:
        step_losses: ``{task: (steps, losses)}``, steps and losses of equal length.
        evals: ``[{"step": int, "dev": {task or "overall": float}}, ...]``.
        path: the PNG to write (its folder is created).
        title: figure title.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(figure)
    left = figure.add_subplot(1, 2, 1)
    for task, (steps, losses) in sorted(step_losses.items()):
        if len(steps) != len(losses):
            raise ValueError(f"task {task}: {len(steps)} steps but {len(losses)} losses")
        if not len(steps):
            continue
        (line,) = left.plot(steps, losses, alpha=0.25, linewidth=0.8)
        window = max(1, len(losses) // 20)
        left.plot(steps, smooth(losses, window), color=line.get_color(), label=task)
    left.set_xlabel("update step")
    left.set_ylabel("training loss")
    left.set_title("training loss per task")
    if step_losses:
        left.legend()
    right = figure.add_subplot(1, 2, 2)
    if evals:
        keys = sorted({k for e in evals for k in e["dev"] if isinstance(e["dev"][k], (int, float))})
        for key in keys:
            xs = [e["step"] for e in evals if key in e["dev"]]
            ys = [e["dev"][key] for e in evals if key in e["dev"]]
            right.plot(xs, ys, marker="o", label=key, linewidth=2.0 if key == "overall" else 1.0)
        right.legend()
    right.set_xlabel("update step")
    right.set_ylabel("dev score (accuracy / Pearson r)")
    right.set_title("dev evaluation")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path


def plot_confusion_matrices(
    predictions: dict[str, tuple[Sequence, Sequence]], folder: str | os.PathLike
) -> list[Path]:
    """Confusion matrices of the dev predictions: ``sst`` (5 classes) to ``confusion_sst.png`` and ``sts``
    (scores binned to 0, 0.5, ..., 5) to ``confusion_sts.png``.

    Args:
        predictions: ``{task: (labels, predictions)}``; other tasks are ignored.
        folder: where the PNGs go.

    Returns:
        The paths written.
    """
    folder = Path(folder)
    written = []
    if "sst" in predictions:
        labels, preds = predictions["sst"]
        matrix = confusion_matrix(np.asarray(labels, dtype=np.int64), np.asarray(preds, dtype=np.int64), 5)
        written.append(
            plot_confusion_matrix(matrix, folder / "confusion_sst.png", title="SST dev (rows: true)")
        )
    if "sts" in predictions:
        labels, preds = predictions["sts"]
        matrix = confusion_matrix(bin_sts(labels), bin_sts(preds), 11)
        names = [f"{k / 2:g}" for k in range(11)]
        written.append(
            plot_confusion_matrix(
                matrix, folder / "confusion_sts.png", class_names=names, title="STS dev, binned to 0.5"
            )
        )
    return written
