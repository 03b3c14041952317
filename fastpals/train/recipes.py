"""Named recipes: JSON objects of :class:`~fastpals.train.args.TrainArgs` option values plus ``"description"``
and ``"source"``, shipped in ``fastpals/configs/recipes/`` or given as a path. ``train.py --recipe NAME`` takes
them as defaults; options on the command line override them."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import Any

from fastpals.train.args import TrainArgs
from fastpals.train.errors import ConfigError

__all__ = ["RECIPE_INFO_KEYS", "load_recipe", "recipe_info", "recipe_names", "recipe_path"]

RECIPE_INFO_KEYS = ("description", "source")  # the keys of a recipe that are not options


def _folder() -> Path:
    return Path(str(resources.files("fastpals") / "configs" / "recipes"))


def recipe_names() -> list[str]:
    """The shipped recipes' names, sorted (file names without ``.json``)."""
    return sorted(p.stem for p in _folder().glob("*.json"))


def recipe_path(name: str) -> Path:
    """The JSON file of recipe ``name``: a shipped name, or a path to a ``.json`` file. Raises
    :class:`ConfigError` (one line, listing the shipped names) for anything else."""
    if name in recipe_names():
        return _folder() / f"{name}.json"
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return path
    raise ConfigError(f"--recipe {name!r}: no such recipe; shipped recipes: {', '.join(recipe_names())}")


def _read(name: str) -> tuple[Path, dict[str, Any]]:
    path = recipe_path(name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"--recipe {path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--recipe {path}: a recipe is a JSON object of TrainArgs options")
    return path, data


def recipe_info(name: str) -> dict[str, str]:
    """``{"description": ..., "source": ...}`` of a recipe (empty strings where missing)."""
    _, data = _read(name)
    return {k: str(data.get(k, "")) for k in RECIPE_INFO_KEYS}


def _type_ok(f: dataclasses.Field, value: Any) -> bool:
    if f.default is False:  # flags
        return isinstance(value, bool)
    if f.name == "surgery_opts":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if value is None:
        return f.default is None
    kind = f.metadata["type"] or (str if f.metadata["choices"] else None)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    return True


def load_recipe(name: str) -> dict[str, Any]:
    """The options of recipe ``name`` (shipped name or JSON path) as ``{TrainArgs field: value}``, without
    ``description``/``source``. Raises :class:`ConfigError` (one line naming the file and the key) for a key that
    is not a :class:`TrainArgs` option or a value of the wrong JSON type; the values themselves are checked by
    :class:`TrainArgs`."""
    path, data = _read(name)
    fields = {f.name: f for f in dataclasses.fields(TrainArgs) if f.init}
    options = {}
    for key, value in data.items():
        if key in RECIPE_INFO_KEYS:
            continue
        if key not in fields:
            raise ConfigError(
                f"--recipe {path}: key {key!r} is not a training option (the keys are TrainArgs field names, "
                f"e.g. pal, surgery, pair_mode, or {', '.join(RECIPE_INFO_KEYS)})"
            )
        if key in ("resume", "overwrite", "local_rank", "stop_after_steps", "inject_nan_at_step"):
            raise ConfigError(f"--recipe {path}: key {key!r} belongs to one command, not to a recipe")
        if not _type_ok(fields[key], value):
            raise ConfigError(f"--recipe {path}: key {key!r} has a value of the wrong type: {value!r}")
        options[key] = value
    return options
