"""Named recipes: JSON objects of :class:`~fastpals.train.args.TrainArgs` options (and ``description``,
``source``) in ``fastpals/configs/recipes/`` or a path: ``--recipe``'s defaults, which options override."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from fastpals.train.args import OPTIONS, type_problem
from fastpals.train.errors import ConfigError, read_json_object

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
    return path, read_json_object(path, "--recipe ", "a recipe is a JSON object of TrainArgs options")


def recipe_info(name: str) -> dict[str, str]:
    """``{"description": ..., "source": ...}`` of a recipe (empty strings where missing)."""
    _, data = _read(name)
    return {k: str(data.get(k, "")) for k in RECIPE_INFO_KEYS}


def load_recipe(name: str) -> dict[str, Any]:
    """The options of recipe ``name`` (shipped name or JSON path) as ``{TrainArgs field: value}``; a key that is
    not an option or a value of the wrong JSON type is a one-line :class:`ConfigError` naming the file and the key."""
    path, data = _read(name)
    options = {}
    for key, value in data.items():
        if key in RECIPE_INFO_KEYS:
            continue
        if key not in OPTIONS:
            raise ConfigError(
                f"--recipe {path}: key {key!r} is not a training option (the keys are TrainArgs field names, "
                f"e.g. pal, surgery, pair_mode, or {', '.join(RECIPE_INFO_KEYS)})"
            )
        if key in ("resume", "overwrite", "local_rank", "stop_after_steps", "inject_nan_at_step"):
            raise ConfigError(f"--recipe {path}: key {key!r} belongs to one command, not to a recipe")
        if type_problem(OPTIONS[key], value) is not None:
            raise ConfigError(f"--recipe {path}: key {key!r} has a value of the wrong type: {value!r}")
        options[key] = value
    return options
