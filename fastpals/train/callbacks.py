"""What a run reports: every record of the loop (a dict with a ``type``: config, step, eval, epoch, nonfinite,
interrupted) goes to the callbacks' ``on_record``; they also have ``on_train_start`` and ``on_train_end``."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from fastpals.train.outputs import strict_json
from fastpals.train.plots import plot_confusion_matrices, plot_training_curves


class Callback:
    """Base class: every hook does nothing."""

    def on_train_start(self, trainer: Any) -> None:
        pass

    def on_record(self, trainer: Any, entry: dict[str, Any]) -> None:
        pass

    def on_train_end(self, trainer: Any) -> None:
        pass


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
