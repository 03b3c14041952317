"""The training errors a user acts on: each message is one line saying what to change."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """An option, the ds_config, the data, the run folder or a checkpoint is wrong; one line, the fix."""


def read_json_object(path: Path, where: str, what: str, fix: str = "") -> dict[str, Any]:
    """The JSON object in ``path``; else a one-line :class:`ConfigError` starting with ``where`` (the option)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}{path}: {what}, not {type(data).__name__}{fix}")
    return data


class SetupCtrlC:
    """Ctrl-C during the set-up: raises KeyboardInterrupt and remembers it, so that one Python swallows (in an
    import lock's or a finalizer's callback) still stops the run at :meth:`check`. Main thread only."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: tuple[Any, Any] | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def _unraisable(self, info: Any) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt):
            self.seen = True  # swallowed by Python: no "Exception ignored" traceback, the check stops the run
        else:
            self._previous[1](info)  # type: ignore[index]

    def install(self) -> SetupCtrlC:
        self._previous = (signal.signal(signal.SIGINT, self), sys.unraisablehook)
        sys.unraisablehook = self._unraisable
        return self

    def restore(self) -> None:
        if self._previous is not None and signal.getsignal(signal.SIGINT) is self:
            signal.signal(signal.SIGINT, self._previous[0])
        if self._previous is not None:
            sys.unraisablehook, self._previous = self._previous[1], None

    def check(self) -> None:
        """Raise KeyboardInterrupt if a Ctrl-C came since :meth:`install`, swallowed or not."""
        if self.seen:
            raise KeyboardInterrupt


class OutputError(RuntimeError):
    """Writing an output failed (disk full, no permission, read-only): one line naming the path and cause."""


class NonFiniteLossError(RuntimeError):
    """A loss (or a task gradient under surgery, the weights, the dev outputs) was NaN/inf at update
    ``step``; :meth:`add_context` names the run's last checkpoint and best model (both finite)."""

    def __init__(self, step: int, task: str, value: float, what: str = "loss") -> None:
        self.step, self.task, self.value, self.what = step, task, value, what
        self.context = ""
        super().__init__(self._message())

    def _message(self) -> str:
        head = {
            "outputs": f"non-finite dev outputs (NaN/inf) of task {self.task!r} after update step "
            f"{self.step}, from finite weights (an overflow in the forward): training stopped; this model "
            "was not saved as best/ or checkpointed",
            "weights": f"non-finite weights after update step {self.step}: training stopped; they were not "
            "evaluated, saved as best/ or checkpointed",
        }.get(
            self.what,
            f"non-finite {self.what} {self.value} at update step {self.step}, task {self.task!r}: training "
            "stopped before this step's update",
        )
        return (
            f"{head}{self.context}. To go on, start a new run (another --out, or --overwrite) with a lower "
            "--lr / --pal-lr / --head-lr, or bf16 instead of fp16 (--resume keeps the saved options, so it "
            "would meet the same non-finite value again)."
        )

    def add_context(
        self, checkpoint: Path | None, checkpoint_step: int | None, best: Path | None, best_step: int | None
    ) -> None:
        """Say which good checkpoint and best model this run has (None: none yet)."""
        ckpt = "this run wrote no checkpoint yet"
        if checkpoint is not None:
            ckpt = f"the last checkpoint, {checkpoint} (update {checkpoint_step}), is good"
        best_text = f"; {best} holds the best model so far (update {best_step})" if best is not None else ""
        self.context = f" ({ckpt}{best_text})"
        self.args = (self._message(),)


class TrainingInterrupted(RuntimeError):
    """SIGTERM/SIGINT/SIGHUP ``signum`` stopped the run after writing ``checkpoint`` (``--resume``
    continues), or a second Ctrl-C stopped it at once (``at_once``; ``checkpoint``: the last one, or None)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, at_once: bool = False) -> None:
        self.signum, self.step, self.checkpoint, self.at_once = signum, step, checkpoint, at_once
        then = "this run wrote no checkpoint yet: start it again (--overwrite)"
        if checkpoint is not None:
            then = f"continue with --out {checkpoint.parent.parent} --resume"
        last = f"; the last checkpoint is {checkpoint}" if checkpoint is not None else ""
        super().__init__(
            f"stopped at once by a second Ctrl-C after update step {step}, without a new checkpoint{last} "
            f"({then})"
            if at_once
            else f"stopped by signal {signal.Signals(signum).name} after update step {step}; checkpoint "
            f"{checkpoint} ({then})"
        )


def save_error_cause(err: BaseException, path: Path) -> str:
    """What an error writing ``path`` means: the OS's cause (``No space left on device (ENOSPC)``), or for
    torch's file writer, which reports a full disk as ``unexpected pos``, the free space."""
    if isinstance(err, OSError) and err.errno is not None:
        name = errno.errorcode.get(err.errno, str(err.errno))
        return f"{err.strerror or os.strerror(err.errno)} ({name})"
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
        return f"the file writer failed ({first}); {free / 2**20:.0f} MiB free there: is the disk full?"
    except OSError:
        return f"the file writer failed ({first})"


def is_write_error(err: BaseException) -> bool:
    """An OSError, or torch's file-writer RuntimeError (how ``torch.save`` reports a full disk)."""
    if isinstance(err, OSError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("unexpected pos" in text or "PytorchStreamWriter" in text
                                              or "file write failed" in text)  # fmt: skip
