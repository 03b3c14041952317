"""The one adapter format (``docs/api.md``) of ``MultiTaskBert``, ``save_pals`` / ``load_pals`` and PEFT:
``adapter_config.json`` (PEFT's fields, ``pal_config``, ``tasks``, ``encoder``, each tensor's name and shape
by kind) and ``adapter_model.safetensors``, in ``pals/`` of a full model folder."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fastpals._version import __version__
from fastpals.encoder.bert import state_dict_mismatches, task_specific_kind

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_SUBFOLDER",
    "ADAPTER_WEIGHTS_NAME",
    "FORMAT_VERSION",
    "PEFT_TYPE",
    "adapter_config",
    "read_adapter",
    "write_adapter",
]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
#: a full model folder's adapter subfolder: with ``adapter_config.json`` at the top, transformers would hand the
#: folder to PEFT instead of opening the shared encoder
ADAPTER_SUBFOLDER = "pals"
PEFT_TYPE = "FASTPALS"
FORMAT_VERSION = 2
LIBRARY = "fastpals"


def join_name(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` when the prefix is empty (a module's own parameters)."""
    return f"{prefix}.{name}" if prefix else name


def check_same_pal_config(own: dict[str, Any], saved: dict[str, Any], source: str, caller: str) -> None:
    """``ValueError`` naming each ``PALConfig.to_dict()`` field where a saved adapter and a model differ."""
    diffs = [f"{k}: saved {v!r}, model {own.get(k)!r}" for k, v in saved.items() if own.get(k) != v]
    if diffs:
        raise ValueError(
            f"{caller}: the PALs in {source} differ from the model's PALConfig: " + "; ".join(diffs)
        )


def adapter_config(
    tensors: dict[str, torch.Tensor],
    *,
    pal_config: dict[str, Any] | None,
    encoder: dict[str, Any],
    base_model_name_or_path: str | None,
    task_names: list[str] | None,
    tasks: list[dict[str, Any]] | None = None,
    head_names: set[str] = frozenset(),
    trained_base_names: set[str] = frozenset(),
    modules_to_save: list[str] | None = None,
    extra: dict[str, Any] | None = None,
    saved_from: str = "",
) -> dict[str, Any]:
    """The ``adapter_config.json`` of an adapter holding ``tensors`` (named as in the saving model): heads,
    trained base weights, the rest PAL tensors. ``encoder``: ``prefix`` (the encoder's name in the saving
    model, ``""`` for itself) and the injection's description."""

    def shapes(names: set[str] | None) -> dict[str, list[int]]:
        return {
            k: list(v.shape)
            for k, v in sorted(tensors.items())
            if (k in names if names is not None else k not in head_names | trained_base_names)
        }

    return {
        "peft_type": PEFT_TYPE,
        "task_type": "FEATURE_EXTRACTION",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "modules_to_save": modules_to_save,
        "library_name": LIBRARY,
        "fastpals_version": __version__,
        "format_version": FORMAT_VERSION,
        "saved_from": saved_from,
        "pal_config": pal_config,
        "task_names": task_names,
        "tasks": tasks,
        "encoder": encoder,
        "pal_parameters": shapes(None),
        "head_parameters": shapes(set(head_names)),
        "trained_base_parameters": shapes(set(trained_base_names)),
        "extra": extra or {},
    }


def write_adapter(folder: str | os.PathLike, tensors: dict[str, torch.Tensor], **fields: Any) -> Path:
    """Write ``adapter_config.json`` (:func:`adapter_config` of ``tensors`` and ``fields``) and
    ``adapter_model.safetensors`` to ``folder`` (created if needed). Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    config = adapter_config(tensors, **fields)
    # one metadata entry: the header stays byte-stable
    save_file(tensors, str(folder / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return folder


def find_adapter_folder(folder: str | os.PathLike) -> Path | None:
    """The folder holding a fastpals ``adapter_config.json`` (``folder`` or its ``pals/``), or None."""
    found = [
        f for f in (Path(folder), Path(folder) / ADAPTER_SUBFOLDER) if (f / ADAPTER_CONFIG_NAME).is_file()
    ]
    return found[0] if found else None


def read_adapter_config(folder: str | os.PathLike, caller: str) -> tuple[dict[str, Any], Path]:
    """``(config, adapter_folder)`` of an adapter folder (or a full model folder's ``pals/``); raises
    ``FileNotFoundError`` without one, ``ValueError`` for invalid JSON, another adapter (e.g. PEFT's LoRA) or
    another format version."""
    adapter = find_adapter_folder(folder)
    if adapter is None:
        raise FileNotFoundError(
            f"{caller}: no {ADAPTER_CONFIG_NAME} in {folder} or {Path(folder) / ADAPTER_SUBFOLDER} "
            "(not a folder written by fastpals' save_pals / MultiTaskBert.save_pretrained)"
        )
    cfg_path = adapter / ADAPTER_CONFIG_NAME
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{caller}: {cfg_path} is not valid JSON ({e})") from None
    if config.get("peft_type") != PEFT_TYPE or config.get("library_name") != LIBRARY:
        raise ValueError(
            f"{caller}: {cfg_path} is a {config.get('peft_type')!r} adapter, not a fastpals PAL adapter "
            f"(peft_type {PEFT_TYPE!r}); load PEFT adapters with peft.PeftModel.from_pretrained"
        )
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{caller}: {cfg_path} has format_version {config.get('format_version')!r}; this fastpals reads "
            f"version {FORMAT_VERSION}"
        )
    return config, adapter


def read_adapter(
    folder: str | os.PathLike, caller: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """Read an adapter folder (or a full model folder's ``pals/``): ``(config, tensors, adapter_folder)``. Raises
    as :func:`read_adapter_config` does, and ``ValueError`` when the weights file and the config differ."""
    config, adapter = read_adapter_config(folder, caller)
    cfg_path, weights_path = adapter / ADAPTER_CONFIG_NAME, adapter / ADAPTER_WEIGHTS_NAME
    if not weights_path.is_file():
        raise FileNotFoundError(f"{caller}: {weights_path} not found (the adapter config is there)")
    tensors = load_file(str(weights_path))
    check_adapter_tensors(config, tensors, f"{weights_path} does not match {cfg_path}", caller)
    return config, tensors, adapter


def check_adapter_tensors(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], what: str, caller: str
) -> None:
    """``ValueError`` (``"{caller}: {what}:"`` and the differences) unless ``tensors`` have exactly the names
    and shapes an adapter ``config`` lists."""
    listed = {
        k: v
        for kind in ("pal_parameters", "head_parameters", "trained_base_parameters")
        for k, v in (config.get(kind) or {}).items()
    }
    problems = state_dict_mismatches({k: torch.empty(s, device="meta") for k, s in listed.items()}, tensors)
    if problems:
        raise ValueError(
            f"{caller}: {what}:\n  " + "\n  ".join(p.replace("checkpoint", "weights file") for p in problems)
        )


def retarget(name: str, saved_prefix: str, encoder_prefix: str) -> str:
    """The name in the loading model (encoder at ``encoder_prefix``) of a tensor saved as ``name`` by a model
    with its encoder at ``saved_prefix``: the encoder's tensors move, others (heads) keep their name."""
    lead = saved_prefix + "." if saved_prefix else ""
    return join_name(encoder_prefix, name.removeprefix(lead)) if name.startswith(lead) else name


def plan_adapter_load(
    model: nn.Module,
    encoder_prefix: str,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    source: str,
    caller: str,
    load_trained_base: bool = True,
    strict: bool = True,
    stacklevel: int = 3,
) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """Check an adapter's tensors against ``model`` (encoder at ``encoder_prefix``): ``(copies, skipped)``,
    the ``(name in the model, saved tensor)`` pairs (PALs first: they must match exactly) and the saved names
    without a place in the model (a warning; with ``strict`` an error). Another shape is an error."""
    saved_prefix = config["encoder"]["prefix"]
    own = model.state_dict(keep_vars=True)
    pal_saved = {retarget(k, saved_prefix, encoder_prefix): tensors[k] for k in config["pal_parameters"]}
    enc_dot = encoder_prefix + "." if encoder_prefix else ""
    pal_own = {
        k: v
        for k, v in own.items()
        if k.startswith(enc_dot) and task_specific_kind(k[len(enc_dot) :]) == "pal"
    }
    problems = state_dict_mismatches(pal_own, pal_saved)
    if problems:
        raise ValueError(
            f"{caller}: the PALs in {source} do not fit {type(model).__name__}:\n  "
            + "\n  ".join(p.replace("checkpoint", "adapter") for p in problems)
        )
    copies = list(pal_saved.items())
    others = [*config["head_parameters"], *(config["trained_base_parameters"] if load_trained_base else ())]
    skipped, bad = [], []
    for k in others:
        name = retarget(k, saved_prefix, encoder_prefix)
        if name not in own:
            skipped.append(k)
        elif own[name].shape != tensors[k].shape:
            bad.append(f"{k}: saved {list(tensors[k].shape)}, model {list(own[name].shape)}")
        else:
            copies.append((name, tensors[k]))
    if bad:
        raise ValueError(
            f"{caller}: cannot load {source} into {type(model).__name__}:\n  " + "\n  ".join(bad)
        )
    if skipped:
        msg = (
            f"{caller}: {type(model).__name__} has no place for {len(skipped)} tensors of {source} "
            f"({', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''})"
        )
        if strict:
            raise ValueError(msg + "; pass strict=False to load the rest")
        warnings.warn(msg + ": not loaded", stacklevel=stacklevel)
    return copies, skipped


def load_adapter_tensors(
    model: nn.Module,
    encoder_prefix: str,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    **options: Any,
) -> list[str]:
    """Copy an adapter's tensors into ``model`` (its devices and dtypes) after the checks of
    :func:`plan_adapter_load` (``options``: its keyword arguments); returns the saved names not loaded."""
    copies, skipped = plan_adapter_load(model, encoder_prefix, config, tensors, stacklevel=4, **options)
    own = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in copies:
            own[name].copy_(value)
    return skipped


def trained_base_in_encoder(config: dict[str, Any]) -> set[str]:
    """The trained base weights an adapter holds, by their names inside the encoder (the saving model's encoder
    prefix removed): what :func:`fastpals.encoder.fingerprint.encoder_fingerprint` leaves out."""
    prefix = config.get("encoder", {}).get("prefix", "")
    lead = f"{prefix}." if prefix else ""
    return {n.removeprefix(lead) for n in config.get("trained_base_parameters", {})}
