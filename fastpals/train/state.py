"""What a run carries from update to update (:class:`TrainState`), and its checkpoints: DeepSpeed's (module,
optimizer, scheduler) with the client state ``{"train_state": ..., "components": {name: state}}``, ``latest``
written atomically once the folder is whole; failures are one-line errors."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fastpals.train.errors import ConfigError, OutputError, is_write_error, save_error_cause
from fastpals.train.outputs import atomic_write_text

__all__ = ["GeneratorState", "RNGState", "Stateful", "TrainState", "check_checkpoint", "load_checkpoint",
           "save_checkpoint"]  # fmt: skip

FRESH_START = "start the run again with --overwrite (or restore the file from a copy)"


class Stateful(Protocol):
    """A checkpointed component: the sampler, a batcher, an RNG."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """Progress of a run: updates done, epochs evaluated, per-task loss curves ``{task: (steps, losses)}``,
    evaluation records, the best dev score, the untrained scores, timings (seconds) and ``options`` (the
    options that must match on ``--resume``)."""

    global_step: int = 0
    evaluated_epoch: int = 0
    step_losses: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] = field(
        default_factory=lambda: {"overall": -math.inf, "step": None, "epoch": None, "dev": None}
    )
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


@dataclass
class GeneratorState:
    """A ``torch.Generator`` as a component."""

    generator: torch.Generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["state"])


_STEP_FOLDER = re.compile(r"step(\d+)")


def save_checkpoint(
    engine: Any, ckpt_dir: Path, state: TrainState, components: dict[str, Stateful], is_main: bool
) -> Path:
    """DeepSpeed checkpoint ``<ckpt_dir>/step<N>`` with the train state and every component's state, then
    ``latest``; the previous one and step folders left by a kill are removed. A failed write removes the
    partial folder (the previous checkpoint stays whole) and is an :class:`OutputError` naming the path and
    the cause."""
    tag = f"step{state.global_step}"
    folder = ckpt_dir / tag
    try:
        previous = (ckpt_dir / "latest").read_text().strip() or None
    except OSError:
        previous = None
    if is_main and ckpt_dir.is_dir():  # step folders that ``latest`` does not name: a kill during a removal
        for stale in ckpt_dir.iterdir():
            if stale.is_dir() and _STEP_FOLDER.fullmatch(stale.name) and stale.name not in (previous, tag):
                shutil.rmtree(stale, ignore_errors=True)
    client = {
        "train_state": state.state_dict(),
        "components": {k: c.state_dict() for k, c in components.items()},
    }
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False)
        if is_main:
            atomic_write_text(ckpt_dir / "latest", tag)
    except (OSError, RuntimeError) as err:
        if not is_write_error(err):
            raise
        path = Path(getattr(err, "filename", None) or folder)
        if is_main and tag != previous:
            shutil.rmtree(folder, ignore_errors=True)
        kept = (
            f"the previous checkpoint {ckpt_dir / previous} is whole and `latest` names it"
            if previous
            else "there is no earlier checkpoint"
        )
        raise OutputError(
            f"cannot write checkpoint file {path}: {save_error_cause(err, path)}; the partial {folder} was "
            f"removed and {kept}: free space or fix the permissions, then --resume"
            + ("" if previous else " (or start again)")
        ) from err
    if is_main and previous and previous != tag and (ckpt_dir / previous).is_dir():
        shutil.rmtree(ckpt_dir / previous)
    return folder


def _whole(folder: Path) -> str | None:
    """None when ``folder`` is a whole checkpoint (its model file there, every ``.pt`` a zip whose CRCs match),
    else what is wrong."""
    if not sorted(folder.glob("mp_rank_*_model_states.pt")):
        return f"{folder / 'mp_rank_00_model_states.pt'} is missing"
    for path in sorted(folder.glob("*.pt")):
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, UnicodeDecodeError, NotImplementedError,
                ValueError, RuntimeError) as err:  # fmt: skip
            # a damaged zip directory (the file's tail) can name no method or an undecodable file name
            return f"checkpoint file {path} is truncated or corrupt ({type(err).__name__}: {err})"
        if bad is not None:
            return f"checkpoint file {path} is corrupt (bad CRC in {bad})"
        try:  # torch's own zip reader is stricter about the zip directory and the entries' headers
            reader = torch._C.PyTorchFileReader(str(path))
            for name in reader.get_all_records():
                reader.get_record_offset(name)
        except RuntimeError as err:
            detail = str(err).split(". ")[0] if str(err) else type(err).__name__
            return f"checkpoint file {path} is corrupt ({detail})"
    return None


def check_checkpoint(ckpt_dir: Path) -> str:
    """The tag ``latest`` names, once its folder and files are checked whole; else :class:`ConfigError`
    naming the file."""
    latest = ckpt_dir / "latest"
    try:
        tag = latest.read_text().strip() if latest.is_file() else None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--resume: cannot read {latest} ({err}): {FRESH_START}") from None
    if not tag or not (ckpt_dir / tag).is_dir():
        steps = [p for p in ckpt_dir.glob("step*") if p.is_dir() and _STEP_FOLDER.fullmatch(p.name)]
        newest = next((p for p in sorted(steps, key=lambda p: -int(p.name[4:])) if _whole(p) is None), None)
        if tag is None:
            problem = f"{latest} does not exist"
        elif not tag:
            problem = f"{latest} is empty"
        else:
            problem = f"{latest} names checkpoint {tag!r} but {ckpt_dir / tag} does not exist"
        if newest is not None:
            raise ConfigError(
                f"--resume: {problem}, but {newest} is a whole checkpoint (the newest): resume from it with "
                f"`echo {newest.name} > {latest}` and --resume again"
            )
        if tag is None:
            raise ConfigError(
                f"--resume: {problem}, so there is no checkpoint to resume: drop --resume (with --overwrite if "
                f"--out holds an earlier run)"
            )
        raise ConfigError(
            f"--resume: {problem}: write the name of an existing checkpoint folder into {latest}, or "
            f"{FRESH_START}"
        )
    if (problem := _whole(ckpt_dir / tag)) is not None:
        raise ConfigError(f"--resume: {problem}: {FRESH_START}")
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
