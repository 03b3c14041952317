"""DeepSpeed JSON configs: the shipped ones (package data in ``fastpals/configs/``, also reachable as
``configs/<name>`` from the repository root), reading one, and checking it against the options."""

from __future__ import annotations

import copy
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from fastpals.train.errors import ConfigError

__all__ = ["DEFAULT_DS_CONFIG", "check_ds_config", "load_ds_config", "resolve_ds_config", "shipped_configs"]

DEFAULT_DS_CONFIG = "cpu_bf16.json"


def shipped_configs() -> dict[str, Path]:
    """``{name: path}`` of the configs shipped inside the package (they work from a wheel install too)."""
    folder = resources.files("fastpals") / "configs"
    return {p.name: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".json")}


def resolve_ds_config(path: str | os.PathLike) -> Path:
    """``path`` when it is a file; else a shipped config of that name (``cpu_bf16.json`` or
    ``configs/cpu_bf16.json`` from any folder); else :class:`ConfigError`."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    shipped = shipped_configs()
    if candidate.name in shipped and str(candidate.parent) in (".", "configs"):
        return shipped[candidate.name]
    raise ConfigError(
        f"--ds_config {path} does not exist (shipped configs, usable by name: {', '.join(sorted(shipped))})"
    )


def load_ds_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a DeepSpeed JSON config (a path or a shipped config's name); a missing file or bad JSON is a
    :class:`ConfigError`."""
    path = resolve_ds_config(path)
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"--ds_config {path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--ds_config {path}: the top level must be a JSON object")
    return cfg


def _enabled(cfg: dict[str, Any], key: str) -> bool:
    section = cfg.get(key)
    return isinstance(section, dict) and bool(section.get("enabled", False))


def check_ds_config(
    cfg: dict[str, Any],
    batch_size: int,
    grad_accum: int,
    surgery: str = "none",
    world_size: int = 1,
    cuda: bool | None = None,
    name: str = "--ds_config",
) -> dict[str, Any]:
    """Check a DeepSpeed config against the options and return a completed copy.

    Fills ``train_micro_batch_size_per_gpu`` (= ``batch_size``), ``gradient_accumulation_steps``
    (= ``grad_accum``, 1 with surgery) and ``train_batch_size`` when absent; every contradiction raises
    :class:`ConfigError` naming the entry and what to change. ``cuda`` defaults to ``torch.cuda.is_available()``.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    out = copy.deepcopy(cfg)
    accum = 1 if surgery != "none" else grad_accum
    micro = out.setdefault("train_micro_batch_size_per_gpu", batch_size)
    if micro != batch_size:
        raise ConfigError(
            f"{name}: train_micro_batch_size_per_gpu = {micro} but --batch-size {batch_size}: make them equal "
            f"(or delete the entry from the config)"
        )
    gas = out.setdefault("gradient_accumulation_steps", accum)
    if gas != accum:
        why = " (surgery accumulates the task batches of an update itself)" if surgery != "none" else ""
        raise ConfigError(
            f"{name}: gradient_accumulation_steps = {gas} but the run needs {accum} (--grad-accum {grad_accum}, "
            f"--surgery {surgery}){why}: set it to {accum} or delete it"
        )
    total = out.setdefault("train_batch_size", batch_size * accum * world_size)
    if total != batch_size * accum * world_size:
        raise ConfigError(
            f"{name}: train_batch_size = {total} but batch size {batch_size} x accumulation {accum} x "
            f"{world_size} rank(s) = {batch_size * accum * world_size}: fix it or delete it"
        )
    for key in ("optimizer", "scheduler"):
        if key in out:
            raise ConfigError(
                f"{name}: remove the {key!r} section; the optimizer and the warm-up/decay schedule come from "
                f"--optimizer, --lr, --pal-lr, --head-lr, --warmup, --weight-decay"
            )
    fp16, bf16 = _enabled(out, "fp16"), _enabled(out, "bf16")
    if fp16 and bf16:
        raise ConfigError(f"{name}: fp16 and bf16 are both enabled; enable one of them")
    if fp16 and not cuda:
        raise ConfigError(
            f"{name}: fp16 needs a CUDA GPU and none is available: use configs/cpu_bf16.json (bf16) on CPU"
        )
    stage = (out.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise ConfigError(
            f"{name}: zero_optimization.stage = {stage}: fastpals trains with ZeRO 0, 1 or 2 (ZeRO-3 partitions "
            f"the stacked per-task PAL weights and is not supported)"
        )
    if bf16 and stage == 0 and not cuda:
        raise ConfigError(
            f"{name}: bf16 with ZeRO stage 0 on CPU runs DeepSpeed's FP16_UnfusedOptimizer without fp32 master "
            f"weights; use zero_optimization.stage 1 (configs/cpu_bf16.json)"
        )
    clip = out.get("gradient_clipping", 0.0)
    if not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError(f"{name}: gradient_clipping must be a number >= 0, got {clip!r}")
    return out
