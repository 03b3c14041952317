"""What a run reports: every record of the loop (a dict with a ``type``: config, step, eval, epoch, nonfinite,
interrupted) goes to the callbacks' ``on_record``; :class:`Plots` draws PNGs (matplotlib's Agg canvas)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from fastpals.data.metrics import bin_sts, confusion_matrix, plot_confusion_matrix, task_confusion_matrix
from fastpals.train.outputs import strict_json


class Callback:
    """Base class: every hook does nothing."""

    def on_train_start(self, trainer: Any) -> None: ...

    def on_record(self, trainer: Any, entry: dict[str, Any]) -> None: ...

    def on_train_end(self, trainer: Any) -> None: ...


@dataclass
class JsonlLog(Callback):
    path: Path

    def on_record(self, trainer: Any, entry: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(strict_json(entry) + "\n")  # NaN/inf as null: every line is strict JSON


@dataclass
class TensorBoardLog(Callback):
    folder: Path
    writer: Any = None

    def on_train_start(self, trainer: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            trainer.log("[log] tensorboard is not installed: metrics go to metrics.jsonl only")
            return
        # a resumed run drops the events of the updates after its checkpoint, which it runs again
        purge = trainer.state.global_step + 1 if trainer.args.resume else None
        self.writer = SummaryWriter(str(self.folder), purge_step=purge)

    def on_record(self, trainer: Any, entry: dict[str, Any]) -> None:
        if self.writer is None:
            return
        step = entry.get("step")
        if entry["type"] == "step":
            for t, v in entry["loss"].items():
                self.writer.add_scalar(f"train/loss_{t}", v, step)
            self.writer.add_scalar("train/lr", entry["lr"][0], step)
            self.writer.add_scalar("train/examples_per_s", entry["examples_per_s"], step)
            for key in ("task_examples", "task_tokens"):  # mixed batches
                for t, v in entry.get(key, {}).items():
                    self.writer.add_scalar(f"train/{key.split('_')[1]}_{t}", v, step)
        elif entry["type"] == "eval" and not entry.get("untrained"):
            for k, v in entry["dev"].items():
                self.writer.add_scalar(f"dev/{k}", v, step)

    def on_train_end(self, trainer: Any) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@dataclass
class Progress(Callback):
    """One bar over the run's updates; each task's loss (moving average) and the throughput in the postfix."""

    enabled: bool = True
    bar: Any = None
    ema: dict[str, float] = field(default_factory=dict)

    def on_train_start(self, trainer: Any) -> None:
        self.bar = tqdm(
            total=trainer.total_updates, initial=trainer.state.global_step, desc="train", unit="update",
            disable=not self.enabled, file=sys.stderr, dynamic_ncols=True, mininterval=1.0,
        )  # fmt: skip

    def on_record(self, trainer: Any, entry: dict[str, Any]) -> None:
        if self.bar is None or entry["type"] != "step":
            return
        for t, v in entry["loss"].items():
            self.ema[t] = v if t not in self.ema else 0.9 * self.ema[t] + 0.1 * v
        postfix = {**{t: f"{v:.3f}" for t, v in self.ema.items()}, "ex/s": f"{entry['examples_per_s']:.1f}"}
        self.bar.set_description(f"train, epoch {entry['epoch']}/{trainer.args.epochs}", refresh=False)
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def on_train_end(self, trainer: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_title(args: Any) -> str:
    """The settings a training-curves figure is about, in one line."""
    return (
        f"{args.model} | tasks {','.join(args.task_list)} | PAL {args.pal} | sampling {args.sampling} | "
        f"surgery {args.surgery} | batch {args.batch_size} | lr {args.lr:g}"
    )


class Plots(Callback):
    """``training_curves.png`` (losses and dev scores, one colour per task) and ``confusion_*.png``."""

    def on_train_end(self, trainer: Any) -> None:
        if not trainer.is_main or not trainer.finished:
            return
        state, args = trainer.state, trainer.args
        untrained = [{"step": 0, "dev": state.untrained}] if state.untrained else []
        plot_training_curves(state.step_losses, untrained + list(state.evals), trainer.out / "training_curves.png",
                             title=run_title(args), tasks=args.task_list)  # fmt: skip
        npz = trainer.out / "predictions" / "dev_labels_and_predictions.npz"
        if npz.is_file():
            data = np.load(npz)
            pairs = {
                t: (data[f"{t}_label"], data[f"{t}_pred"]) for t in args.task_list if f"{t}_pred" in data
            }
            plot_confusion_matrices(pairs, trainer.out, args.task_specs)


@dataclass
class FaultInjection(Callback):
    """Test-only faults: a NaN loss at update ``nan_at_step``, a NaN weight after ``nan_weights_at_step``,
    SIGTERM after ``stop_after_steps``, SIGKILL after ``kill_after_steps``."""

    nan_at_step: int | None
    stop_after_steps: int | None
    kill_after_steps: int | None = None
    nan_weights_at_step: int | None = None

    def on_train_start(self, trainer: Any) -> None:
        if self.nan_at_step is not None:

            def nan_loss(step: int, loss: Any) -> Any:
                return loss * float("nan") if step == self.nan_at_step else loss

            trainer.loss_hooks.append(nan_loss)

    def on_record(self, trainer: Any, entry: dict[str, Any]) -> None:
        if entry["type"] != "step":
            return
        if entry["step"] == self.nan_weights_at_step:
            weight = next(p for p in trainer.engine.module.parameters() if p.requires_grad)
            with torch.no_grad():
                weight.view(-1)[0] = float("nan")
        if entry["step"] == self.kill_after_steps:
            os.kill(os.getpid(), signal.SIGKILL)
        if entry["step"] == self.stop_after_steps:
            os.kill(os.getpid(), signal.SIGTERM)


def default_callbacks(args: Any, out: Path, is_main: bool) -> list[Callback]:
    """JSONL, TensorBoard, progress and plots on the main rank, and the faults a test option asks for."""
    callbacks: list[Callback] = []
    if is_main:
        callbacks += [JsonlLog(out / "metrics.jsonl"), TensorBoardLog(out / "tensorboard"),
                      Progress(enabled=not args.no_progress), Plots()]  # fmt: skip
    faults = (
        args.inject_nan_at_step,
        args.stop_after_steps,
        args.kill_after_steps,
        args.inject_nan_weights_at_step,
    )
    if any(f is not None for f in faults):
        callbacks.append(FaultInjection(*faults))
    return callbacks


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average of ``values`` over ``window`` points (shorter at the start), float64."""
    x = np.asarray(values, dtype=np.float64)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if x.size == 0:
        return x
    c = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def training_curve_series(
    step_losses: dict[str, tuple[Sequence[int], Sequence[float]]],
    evals: Sequence[dict],
    tasks: Sequence[str] | None = None,
) -> list[dict]:
    """What :func:`plot_training_curves` draws, as series ``{"panel": "loss" | "dev", "task", "kind":
    "points" | "smoothed" | "dev", "x", "y", "color"}``; a task's losses only where it trained."""
    keys = sorted({k for e in evals for k in e["dev"] if isinstance(e["dev"][k], (int, float))} - {"overall"})
    order = list(tasks) if tasks is not None else sorted(set(step_losses) | set(keys))
    order += [t for t in sorted(set(step_losses) | set(keys)) if t not in order]
    colors = {**{task: f"C{i % 10}" for i, task in enumerate(order)}, "overall": "black"}  # in both panels
    series = []
    for task in [t for t in order if t in step_losses]:
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
    overall = ["overall"] if any("overall" in e["dev"] for e in evals) else []
    for key in [t for t in order if t in keys] + overall:
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
    losses)}``, points, moving average) beside the dev scores of ``evals`` (``[{"step", "dev"}, ...]``)."""
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
        labels, preds = (bin_sts(v) for v in predictions["sts"])
        names = [f"{k / 2:g}" for k in range(11)]
        plots["sts"] = (confusion_matrix(labels, preds, 11), names, "STS dev, binned to 0.5")
    return [
        plot_confusion_matrix(matrix, Path(folder) / f"confusion_{task}.png", class_names=names, title=title)
        for task, (matrix, names, title) in plots.items()
    ]
