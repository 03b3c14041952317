"""What a run carries from update to update, and its checkpoints.

:class:`TrainState` (progress, curves, evaluations, best score, timings, the options that must match on resume)
is one dataclass that round-trips through ``state_dict`` / ``from_state_dict``. A checkpoint is DeepSpeed's
(module, optimizer, scheduler) with the client state ``{"train_state": ..., "components": {name: state}}``,
where the components (task sampler, batchers, RNGs) are objects with ``state_dict``/``load_state_dict`` named
once by the loop: saving and loading walk the same dict, so nothing is mirrored by hand.

A missing, truncated or corrupt checkpoint file, or a ``latest`` that names no folder, is a
:class:`ConfigError` with one line naming the file and what to do.
"""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fastpals.train.errors import ConfigError

__all__ = ["GeneratorState", "RNGState", "Stateful", "TrainState", "check_checkpoint", "load_checkpoint",
           "save_checkpoint"]  # fmt: skip

FRESH_START = "start the run again with --overwrite (or restore the file from a copy)"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _no_best() -> dict[str, Any]:
    return {"overall": -math.inf, "step": None, "epoch": None, "dev": None}


@dataclass
class TrainState:
    """Progress of a run: updates done, epochs evaluated, per-task loss curves ``{task: (steps, losses)}``,
    evaluation records, the best dev score, the untrained scores, timings (seconds) and ``options`` (the
    options that must match on ``--resume``)."""

    global_step: int = 0
    evaluated_epoch: int = 0
    step_losses: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=_no_best)
    untrained: dict[str, float] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def add_time(self, key: str, seconds: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + seconds

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TrainState:
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in state]
        if missing:
            raise ValueError(f"train state lacks {missing}")
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls)})


class RNGState:
    """Python, numpy, torch (and CUDA) global RNG states as one component."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class GeneratorState:
    """A ``torch.Generator`` as a component."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["state"])


def save_checkpoint(
    engine: Any, ckpt_dir: Path, state: TrainState, components: dict[str, Stateful], is_main: bool
) -> Path:
    """DeepSpeed checkpoint ``<ckpt_dir>/step<N>`` with the train state and every component's state; the
    previous checkpoint is removed once the new one is written."""
    tag = f"step{state.global_step}"
    latest = ckpt_dir / "latest"
    previous = latest.read_text().strip() if latest.is_file() else None
    client = {
        "train_state": state.state_dict(),
        "components": {k: c.state_dict() for k, c in components.items()},
    }
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client)
    if is_main and previous and previous != tag and (ckpt_dir / previous).is_dir():
        shutil.rmtree(ckpt_dir / previous)
    return ckpt_dir / tag


def check_checkpoint(ckpt_dir: Path) -> str:
    """The tag ``latest`` names, after checking that its folder and files are there and whole (every ``.pt``
    file is a complete zip whose CRCs match); else :class:`ConfigError` naming the file."""
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        raise ConfigError(
            f"--resume: {latest} does not exist, so there is no checkpoint to resume: drop --resume (with "
            f"--overwrite if --out holds an earlier run)"
        )
    tag = latest.read_text().strip()
    folder = ckpt_dir / tag
    if not tag or not folder.is_dir():
        raise ConfigError(
            f"--resume: {latest} names checkpoint {tag!r} but {folder} does not exist: write the name of an "
            f"existing checkpoint folder into {latest}, or {FRESH_START}"
        )
    models = sorted(folder.glob("mp_rank_*_model_states.pt"))
    if not models:
        raise ConfigError(f"--resume: {folder / 'mp_rank_00_model_states.pt'} is missing: {FRESH_START}")
    for path in sorted(folder.glob("*.pt")):
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            raise ConfigError(
                f"--resume: checkpoint file {path} is truncated or corrupt ({err}): {FRESH_START}"
            ) from None
        if bad is not None:
            raise ConfigError(
                f"--resume: checkpoint file {path} is corrupt (bad CRC in {bad}): {FRESH_START}"
            )
    return tag


def load_checkpoint(engine: Any, ckpt_dir: Path, components: dict[str, Stateful]) -> tuple[Path, TrainState]:
    """Load the checkpoint ``latest`` names into ``engine`` and ``components``; returns its folder and the
    :class:`TrainState`. Every failure is a one-line :class:`ConfigError`."""
    tag = check_checkpoint(ckpt_dir)
    folder = ckpt_dir / tag
    try:
        path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    except Exception as err:  # DeepSpeed's errors name no file; ours does
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"--resume: cannot load checkpoint {folder} ({detail}): {FRESH_START}") from err
    if path is None or not isinstance(client, dict) or "train_state" not in client:
        raise ConfigError(f"--resume: {folder} holds no fastpals train state: {FRESH_START}")
    try:
        state = TrainState.from_state_dict(client["train_state"])
        for name, component in components.items():
            component.load_state_dict(client["components"][name])
    except (KeyError, ValueError, TypeError) as err:
        raise ConfigError(f"--resume: {folder} does not match this run ({err}): {FRESH_START}") from err
    return folder, state
