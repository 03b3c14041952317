"""The run folder: refusing to mix runs, the manifest, the best model, predictions and ``results.json``."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np

from fastpals.data.metrics import write_predictions
from fastpals.train.errors import ConfigError, OutputError, is_write_error, save_error_cause

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
        names = None
    if not isinstance(names, list):
        return None
    return [n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")]


def record_manifest(out: Path, before: set[str]) -> None:
    """Write the manifest of the run writing ``out`` (atomically): the names there now that were not in
    ``before`` (the user's files), added to those it already lists (a resumed run's)."""
    made = {n for n in entries(out) - before if n not in _NOT_OUTPUTS and not n.startswith(REPLACED_PREFIX)}
    names = sorted(set(read_manifest(out) or []) | made)
    atomic_write_text(out / MANIFEST_NAME, json.dumps({"outputs": names}, indent=1) + "\n")


def run_outputs(out: Path) -> list[str]:
    """The names in ``out`` that a run wrote: the manifest and what it lists (nothing of the user's), the
    fixed :data:`RUN_OUTPUTS` (no manifest: also ``confusion_*.png``) and a best/ save cut short."""
    if not out.is_dir():
        return []
    names = [name for name in RUN_OUTPUTS if (out / name).exists()]
    listed = read_manifest(out)
    extra = (
        sorted(p.name for p in out.glob("confusion_*.png"))
        if listed is None
        else [*sorted(listed), MANIFEST_NAME]
    )
    extra += ["best.partial", "best.old"]
    return names + [name for name in dict.fromkeys(extra) if name not in names and (out / name).exists()]


def prepare_out(out: Path, resume: bool, overwrite: bool, is_main: bool) -> Path | None:
    """Make ``out`` ready for a new run (no earlier run's outputs) or a ``resume``; else :class:`ConfigError`.
    ``overwrite`` moves the earlier outputs into ``out/.replaced-<pid>/`` (returned), deleted once the new run
    has a checkpoint (:func:`discard_replaced`), moved back if it fails before (:func:`restore_replaced`)."""
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
    """Put the run :func:`prepare_out` moved aside back (``remove_new``: the new run's outputs first)."""
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
    """Before a resume from the checkpoint of update ``step``: drop the records of ``metrics.jsonl`` at
    ``path`` of later updates (run again) and a last line cut short by a kill, atomically; returns how many."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if _kept_record(line, step)]
    dropped = len(lines) - len(kept)
    if dropped:
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped


def _kept_record(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return not (isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step)


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
    with contextlib.suppress(OSError):  # the rename itself survives a power cut once the folder is synced
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_best(
    module: Any, tokenizer: Any, folder: Path, max_length: int, step: int, tasks: list[str]
) -> None:
    """The best model so far in ``folder`` (``save_pretrained``, the tokenizer, ``training_args.json``), whole
    or not at all (``<folder>.partial`` renamed); a failed write keeps the previous one (OutputError)."""
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
    """None when the disk of ``out`` has room for a checkpoint (twice unless resuming: the new one is written
    beside the previous) and best/ (twice); else the one-line error giving both sizes."""
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
    """CS224N-format ``<task>-dev-output.csv`` files and ``dev_labels_and_predictions.npz`` from
    ``{task: (ids, predictions, labels)}``; ``specs``: ``{task: TaskSpec}``."""
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
        lines.append(
            f"{names.get(k, k):<22}{v:>10.4f}" + (f"{untrained.get(k, math.nan):>12.4f}" if untrained else "")
        )
    lines.append(f"(best at update step {results.get('best_step')}, epoch {results.get('best_epoch')}; "
                 "*para dev = held-out 10% of quora-dev.csv)")  # fmt: skip
    return "\n".join(lines)


LOCK_NAME = ".lock"
_HELD = (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN)  # flock's errors for a lock another process holds


def writable_folder_error(out: Path, err: OSError) -> ConfigError:
    """The one-line error for an ``--out`` that cannot be created or written (read-only, permissions)."""
    where, cause = err.filename or out, err.strerror or type(err).__name__
    return ConfigError(
        f"--out {out}: cannot write {where} ({cause}): choose an --out in a folder you can write to"
    )


class RunLock:
    """The lock of ``out``; :meth:`acquire` raises :class:`ConfigError` naming the run that holds it, and sets
    ``taken_over`` to the ``(pid, host)`` of an earlier run that died holding it (else None)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self.fd: int | None = None
        self.taken_over: tuple[str, str] | None = None

    def check_free(self) -> None:
        """Raise the :meth:`acquire` error when a live run holds the lock, changing nothing in ``out``."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # no lock file (or unreadable: acquire reports it)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in _HELD:
                raise self._busy(_lock_holder(fd)) from None
        finally:
            os.close(fd)

    def _busy(self, holder: tuple[str, str] | None) -> ConfigError:
        pid, host = holder or ("?", "?")
        return ConfigError(
            f"--out {self.out} is in use by the run with pid {pid} on host {host} (lock {self.path}): wait "
            f"for it to end, stop it, or choose another --out"
        )

    def acquire(self) -> RunLock:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise writable_folder_error(self.out, err) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _lock_holder(fd)
            os.close(fd)
            if err.errno not in _HELD:
                raise writable_folder_error(self.out, err) from None
            raise self._busy(holder) from None
        earlier = _lock_holder(fd)
        if earlier is not None and earlier[0] != str(os.getpid()):
            self.taken_over = earlier
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            os.fsync(fd)
        except OSError as err:
            os.close(fd)
            raise writable_folder_error(self.out, err) from None
        self.fd = fd
        return self

    def release(self) -> None:
        """Empty the file and release the lock; the file stays (else a third run could lock a new one)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing releases the flock


def _lock_holder(fd: int) -> tuple[str, str] | None:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").split()
    except OSError:
        text = []
    return (text[0], text[1] if len(text) > 1 else "?") if text else None
