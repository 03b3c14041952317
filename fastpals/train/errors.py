"""The training errors a user acts on: each message is one line saying what to change."""

from __future__ import annotations

import signal
from pathlib import Path

__all__ = ["ConfigError", "NonFiniteLossError", "TrainingInterrupted"]


class ConfigError(ValueError):
    """An option, the DeepSpeed config, the data, the run folder or a checkpoint is wrong; the message (one line)
    says what to change. Raised before training starts (or when resuming)."""


class NonFiniteLossError(RuntimeError):
    """A loss (or a task gradient under surgery) was NaN/inf: ``step`` (update, from 1), ``task``, ``value``."""

    def __init__(self, step: int, task: str, value: float, what: str = "loss") -> None:
        self.step, self.task, self.value = step, task, value
        super().__init__(
            f"non-finite {what} {value} at update step {step}, task {task!r}: training stopped before this "
            f"step's update (the last checkpoint is intact). Lower --lr / --pal-lr / --head-lr, use bf16 instead "
            f"of fp16, then --resume."
        )


class TrainingInterrupted(RuntimeError):
    """SIGTERM/SIGINT arrived: a checkpoint was written; ``--resume`` continues. ``signum`` says which."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"stopped by signal {signal.Signals(signum).name} after update step {step}; checkpoint {checkpoint} "
            f"(continue with --out {checkpoint.parent.parent} --resume)"
        )
