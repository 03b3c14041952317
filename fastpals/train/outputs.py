"""The run folder: refusing to mix runs, the best model, prediction files, ``results.json`` and its table."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from fastpals.data.metrics import write_predictions
from fastpals.train.errors import ConfigError, OutputError, is_write_error, save_error_cause

__all__ = [
    "MANIFEST_NAME",
    "RUN_OUTPUTS",
    "entries",
    "read_manifest",
    "record_manifest",
    "atomic_write_text",
    "discard_replaced",
    "finite_or_null",
    "free_space_error",
    "prepare_out",
    "restore_replaced",
    "run_outputs",
    "results_table",
    "save_best",
    "strict_json",
    "trim_metrics",
    "write_dev_predictions",
]

# what a run writes into --out; any of these there means an earlier run
RUN_OUTPUTS = ("metrics.jsonl", "results.json", "train_args.json", "best", "checkpoints", "tensorboard",
               "predictions", "training_curves.png", "confusion_sst.png", "confusion_sts.png")  # fmt: skip


REPLACED_PREFIX = ".replaced-"
#: the run's manifest in ``--out``: every top-level name the run created there (``--overwrite`` clears those)
MANIFEST_NAME = "run_manifest.json"
_NOT_OUTPUTS = (".lock", MANIFEST_NAME)


def entries(out: Path) -> set[str]:
    """The top-level names in ``out`` now (empty when it does not exist)."""
    return set(os.listdir(out)) if out.is_dir() else set()


def read_manifest(out: Path) -> list[str] | None:
    """The names the manifest of ``out`` lists, or None without a (readable) manifest."""
    try:
        names = json.loads((out / MANIFEST_NAME).read_text()).get("outputs")
    except (OSError, ValueError, AttributeError):
        return None
    return (
        [n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")]
        if isinstance(names, list)
        else None
    )


def record_manifest(out: Path, before: set[str]) -> None:
    """Write (atomically) the manifest of the run writing ``out``: the names it holds now that were not there
    when the run started (``before``: the user's own files, and the lock, an earlier run moved aside), added to
    those the manifest already lists (a resumed run's)."""
    now = entries(out)
    made = {n for n in now - before if n not in _NOT_OUTPUTS and not n.startswith(REPLACED_PREFIX)}
    names = sorted(set(read_manifest(out) or []) | made)
    atomic_write_text(out / MANIFEST_NAME, json.dumps({"outputs": names}, indent=1) + "\n")


def run_outputs(out: Path) -> list[str]:
    """The names in ``out`` that a run wrote: those its manifest (:data:`MANIFEST_NAME`) lists (every file and
    folder the run created, a user task's confusion plot included, nothing else of the user's), the manifest
    itself, the fixed :data:`RUN_OUTPUTS` names (a run killed between two manifest updates) and a best/ save cut
    short (``best.partial``, ``best.old``). A run without a manifest (written before manifests) is found by
    :data:`RUN_OUTPUTS` and ``confusion_*.png``."""
    if not out.is_dir():
        return []
    names = [name for name in RUN_OUTPUTS if (out / name).exists()]
    listed = read_manifest(out)
    if listed is None:
        extra = sorted(p.name for p in out.glob("confusion_*.png"))
    else:
        extra = sorted(listed) + [MANIFEST_NAME]
    extra += ["best.partial", "best.old"]
    return names + [name for name in dict.fromkeys(extra) if name not in names and (out / name).exists()]


def prepare_out(out: Path, resume: bool, overwrite: bool, is_main: bool) -> Path | None:
    """Make ``out`` ready: a new run needs a folder without an earlier run's outputs; ``resume`` continues the run
    there. :class:`ConfigError` otherwise.

    ``overwrite`` deletes nothing here: the earlier run's outputs move aside, into ``out/.replaced-<pid>/`` (a
    rename in the same folder), and that folder is returned. The trainer deletes it once the new run has written
    its first checkpoint or finished (:func:`discard_replaced`), and moves the earlier outputs back if the new run
    fails before that (:func:`restore_replaced`): a failed start leaves the earlier run as it was. After a kill
    in between, the earlier run stays in that folder."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: choose another --out")
    earlier = run_outputs(out)
    if resume:
        if overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: give one of them")
        return None
    if earlier and not overwrite:
        raise ConfigError(
            f"--out {out} already holds a run ({', '.join(earlier)}): pass --resume to continue it, --overwrite to "
            f"replace it, or choose another --out"
        )
    if not is_main:
        return None
    out.mkdir(parents=True, exist_ok=True)
    if not earlier:
        return None
    aside = out / f"{REPLACED_PREFIX}{os.getpid()}"
    suffix = 0
    while aside.exists():
        suffix += 1
        aside = out / f"{REPLACED_PREFIX}{os.getpid()}-{suffix}"
    try:
        aside.mkdir()
        for name in earlier:
            (out / name).rename(aside / name)
    except OSError as err:
        restore_replaced(out, aside, remove_new=False)
        raise ConfigError(
            f"--overwrite: cannot move the earlier run in {out} aside ({err.strerror}): {err.filename}"
        ) from None
    return aside


def discard_replaced(aside: Path | None) -> None:
    """Delete the earlier run that :func:`prepare_out` moved aside (the new run has a checkpoint, or finished)."""
    if aside is not None and aside.exists():
        shutil.rmtree(aside, ignore_errors=True)


def restore_replaced(out: Path, aside: Path | None, remove_new: bool = True) -> None:
    """Put the earlier run moved aside by :func:`prepare_out` back in ``out``: the new run's outputs (any of
    :data:`RUN_OUTPUTS`) are removed first when ``remove_new``, so the earlier run is as it was."""
    if aside is None or not aside.exists():
        return
    if remove_new:
        for name in run_outputs(out):
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    for child in aside.iterdir():
        child.rename(out / child.name)
    aside.rmdir()


def finite_or_null(value: Any) -> Any:
    """``value`` with every NaN/inf float (inside dicts, lists and tuples too) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def strict_json(value: Any, **kw: Any) -> str:
    """``json.dumps`` that writes strict JSON: NaN and inf become ``null`` (Python's ``NaN`` is not JSON)."""
    return json.dumps(finite_or_null(value), allow_nan=False, **kw)


def trim_metrics(path: Path, step: int) -> int:
    """Before a resume from the checkpoint of update ``step``: drop the records of ``path`` (``metrics.jsonl``)
    of later updates, which the resumed run writes again, and a last line cut short by a kill; the file is
    replaced atomically. Returns the number of records dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        later = isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step
        if later:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, fsync, rename over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # the rename itself survives a power cut once the folder is synced
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save_best(
    module: Any, tokenizer: Any, folder: Path, max_length: int, step: int, tasks: list[str]
) -> None:
    """The best model so far: ``module.save_pretrained(folder)`` (the one place the trainer saves a model), the
    tokenizer's files (HF layout) and ``training_args.json`` (max length, step, tasks) for ``fastpals predict``.

    Written whole or not at all: into ``<folder>.partial``, which then takes the place of ``folder``. A failed
    write (a full disk, no permission) removes the partial folder, keeps the previous best model and raises
    :class:`OutputError` naming the path and the cause."""

    partial, old = folder.with_name(folder.name + ".partial"), folder.with_name(folder.name + ".old")
    try:
        for leftover in (partial, old):  # a kill during an earlier save
            if leftover.exists():
                shutil.rmtree(leftover)
        module.save_pretrained(partial, tokenizer=tokenizer)
        info = {"max_length": max_length, "step": step, "tasks": tasks}
        (partial / "training_args.json").write_text(json.dumps(info, indent=2))
        if folder.exists():
            folder.rename(old)
        partial.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError) as err:
        if not is_write_error(err):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        if old.exists() and not folder.exists():
            old.rename(folder)
        path = Path(getattr(err, "filename", None) or partial)
        kept = (
            f"the previous best model in {folder} is whole" if folder.exists() else "no best model is saved"
        )
        raise OutputError(
            f"cannot write the best model, {path}: {save_error_cause(err, path)}; the partial files were removed "
            f"and {kept}: free space or fix the permissions, then --resume"
        ) from err


def free_space_error(out: Path, checkpoint_bytes: int, best_bytes: int, resume: bool) -> ConfigError | None:
    """None when the disk of ``out`` has room for what the run writes: a checkpoint (twice while a new one is
    written beside the previous one, unless resuming, where the previous one is already there) and best/
    (twice: the new one is written beside the old); else the one-line error giving both sizes."""
    need = checkpoint_bytes * (1 if resume else 2) + 2 * best_bytes
    free = shutil.disk_usage(out).free
    if free >= need:
        return None
    mib = 2**20
    return ConfigError(
        f"--out {out}: {free / mib:.0f} MiB free, but the run writes about {need / mib:.0f} MiB (checkpoint "
        f"{checkpoint_bytes / mib:.0f} MiB, written beside the previous one, and best/ {best_bytes / mib:.0f} MiB, "
        f"twice): free space or choose an --out on another disk"
    )


def _values(spec: Any, p: np.ndarray) -> np.ndarray:
    return p.astype(np.int64) if spec.integer_labels else p.astype(np.float64)


def write_dev_predictions(folder: Path, preds: dict[str, Any], specs: dict[str, Any]) -> None:
    """CS224N-format ``<task>-dev-output.csv`` files and ``dev_labels_and_predictions.npz`` (for the confusion
    matrices) from ``{task: (ids, predictions, labels)}``; ``specs``: ``{task: TaskSpec}``."""

    for t, (ids, p, _) in preds.items():
        write_predictions(folder / f"{t}-dev-output.csv", ids, _values(specs[t], p), specs[t])
    np.savez(
        folder / "dev_labels_and_predictions.npz",
        **{f"{t}_pred": p for t, (_, p, _) in preds.items()},
        **{f"{t}_label": y for t, (_, _, y) in preds.items()},
    )


def write_test_predictions(folder: Path, spec: Any, ids: list[str], p: np.ndarray) -> Path:
    """``<task>-test-output.csv`` in CS224N format (``spec``: the task's TaskSpec)."""

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
