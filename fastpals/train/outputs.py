"""The run folder: refusing to mix runs, the best model, prediction files, ``results.json`` and its table."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from fastpals.train.errors import ConfigError

__all__ = ["RUN_OUTPUTS", "prepare_out", "results_table", "save_best", "write_dev_predictions"]

# what a run writes into --out; any of these there means an earlier run
RUN_OUTPUTS = ("metrics.jsonl", "results.json", "train_args.json", "best", "checkpoints", "tensorboard",
               "predictions", "training_curves.png", "confusion_sst.png", "confusion_sts.png")  # fmt: skip


def prepare_out(out: Path, resume: bool, overwrite: bool, is_main: bool) -> None:
    """Make ``out`` ready: a new run needs a folder without an earlier run's outputs (``overwrite`` deletes
    them first); ``resume`` continues the run there. :class:`ConfigError` otherwise."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: choose another --out")
    earlier = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if resume:
        if overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: give one of them")
        return
    if earlier and not overwrite:
        raise ConfigError(
            f"--out {out} already holds a run ({', '.join(earlier)}): pass --resume to continue it, --overwrite to "
            f"replace it, or choose another --out"
        )
    if is_main:
        for name in earlier:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        out.mkdir(parents=True, exist_ok=True)


def save_best(
    module: Any, tokenizer: Any, folder: Path, max_length: int, step: int, tasks: list[str]
) -> None:
    """The best model so far: ``module.save_pretrained(folder)`` (the one place the trainer saves a model), the
    tokenizer's files (HF layout) and ``training_args.json`` (max length, step, tasks) for ``fastpals predict``."""
    module.save_pretrained(folder, tokenizer=tokenizer)
    info = {"max_length": max_length, "step": step, "tasks": tasks}
    (folder / "training_args.json").write_text(json.dumps(info, indent=2))


def _values(spec: Any, p: np.ndarray) -> np.ndarray:
    return p.astype(np.int64) if spec.integer_labels else p.astype(np.float64)


def write_dev_predictions(folder: Path, preds: dict[str, Any], specs: dict[str, Any]) -> None:
    """CS224N-format ``<task>-dev-output.csv`` files and ``dev_labels_and_predictions.npz`` (for the confusion
    matrices) from ``{task: (ids, predictions, labels)}``; ``specs``: ``{task: TaskSpec}``."""
    from fastpals.metrics import write_predictions

    for t, (ids, p, _) in preds.items():
        write_predictions(folder / f"{t}-dev-output.csv", ids, _values(specs[t], p), specs[t])
    np.savez(
        folder / "dev_labels_and_predictions.npz",
        **{f"{t}_pred": p for t, (_, p, _) in preds.items()},
        **{f"{t}_label": y for t, (_, _, y) in preds.items()},
    )


def write_test_predictions(folder: Path, spec: Any, ids: list[str], p: np.ndarray) -> Path:
    """``<task>-test-output.csv`` in CS224N format (``spec``: the task's TaskSpec)."""
    from fastpals.metrics import write_predictions

    return write_predictions(folder / f"{spec.name}-test-output.csv", ids, _values(spec, p), spec)


def results_table(results: dict[str, Any]) -> str:
    """A plain-text table of the best dev scores (and the untrained ones when measured)."""
    dev = results.get("dev") or {}
    untrained = results.get("untrained_dev") or {}
    lines = [f"{'dev metric':<22}{'best':>10}" + (f"{'untrained':>12}" if untrained else "")]
    names = {
        "sst": "sst accuracy",
        "para": "para accuracy*",
        "sts": "sts pearson",
        "cfimdb": "cfimdb accuracy",
    }
    for k, v in dev.items():
        name = names.get(k, k)
        lines.append(f"{name:<22}{v:>10.4f}" + (f"{untrained.get(k, math.nan):>12.4f}" if untrained else ""))
    lines.append(f"(best at update step {results.get('best_step')}, epoch {results.get('best_epoch')}; "
                 "*para dev = held-out 10% of quora-dev.csv)")  # fmt: skip
    return "\n".join(lines)
