"""Task data: each split's file (:func:`split_path`) and :func:`load_task` (typed examples, in file order). A
task whose ``dev`` file is its ``train`` file (``para``) is split by id hash: a row is ``dev`` when
``int.from_bytes(sha256(id)[:8], "big") % 100 < 10``."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from fastpals.data.readers import DataWarning, Example, read_task_file
from fastpals.data.tasks import QUORA_FILE, SPLITS, TASKS, TaskSpec, get_task

DATA_DIR_ENV = "FASTPALS_DATA_DIR"
QUORA_DEV_PERCENT = 10
_MAX_LISTED_BAD_ROWS = 20

TASK_FORMATS = TASKS  # the registry's former name


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """``data_dir`` if given, else ``$FASTPALS_DATA_DIR``; the folder must exist."""
    origin = "data_dir" if data_dir is not None else f"${DATA_DIR_ENV}"
    data_dir = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    if not data_dir:
        raise FileNotFoundError(
            f"no data_dir given and ${DATA_DIR_ENV} is not set: pass data_dir= or "
            f"`export {DATA_DIR_ENV}=/path/to/the/csv/files`"
        )
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{origin} = {str(path)!r} is not a folder")
    return path


def hash_split(examples: Sequence[Example]) -> tuple[list[Example], list[Example]]:
    """Split examples into ``(train, dev)`` by a SHA-256 hash of each id (about 90% / 10%; see the module)."""
    train, dev = [], []
    for example in examples:
        digest = hashlib.sha256(example.id.encode("utf-8")).digest()
        (dev if int.from_bytes(digest[:8], "big") % 100 < QUORA_DEV_PERCENT else train).append(example)
    return train, dev


quora_split = hash_split


def quora_split_sizes(data_dir: str | os.PathLike | None = None) -> dict[str, int]:
    """Rows per ``para`` split and skipped rows: ``{"train": ..., "dev": ..., "skipped": ...}``."""
    path = resolve_data_dir(data_dir) / QUORA_FILE
    examples, bad_rows = read_task_file(path, "para", labelled=True, strict=False)
    train, dev = hash_split(examples)
    return {"train": len(train), "dev": len(dev), "skipped": len(bad_rows)}


def split_path(task: str | TaskSpec, split: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The file of ``split`` of ``task``: task-file paths as they are, built-in names under the data folder."""
    spec = get_task(task)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if split not in spec.files:
        if not spec.files:
            raise ValueError(
                f"task {spec.name!r} defines no files: give files= or load it with TaskSpec.from_file"
            )
        shared = spec.files.get("train") is not None and spec.files.get("train") == spec.files.get("dev")
        note = (
            f": its labelled data is only {Path(spec.files['train']).name}, which is split by id hash into "
            f"'train' and 'dev'"
            if shared
            else f" (its files: {', '.join(spec.files)})"
        )
        raise ValueError(f"task {spec.name!r} has no {split!r} split{note}")
    path = Path(spec.files[split]).expanduser()
    return path if path.is_absolute() else resolve_data_dir(data_dir) / path


def load_task(
    name: str | TaskSpec, split: str, data_dir: str | os.PathLike | None = None, strict: bool = True
) -> list[Example]:
    """One split of a task (built-in name or ``TaskSpec``) as examples in file order (``test``: no labels).
    ``data_dir``: default ``$FASTPALS_DATA_DIR``; ``strict``: raise at a bad row, else skip it with a warning."""
    spec = get_task(name)
    path = split_path(spec, split, data_dir)
    examples, bad_rows = read_task_file(path, spec, labelled=split != "test", strict=strict)
    if bad_rows:
        per_reason = ", ".join(
            f"{n} x {kind}" for kind, n in Counter(bad.kind for bad in bad_rows).most_common()
        )
        listed = "; ".join(f"{bad.path}:{bad.line}: {bad.reason}" for bad in bad_rows[:_MAX_LISTED_BAD_ROWS])
        more = len(bad_rows) - _MAX_LISTED_BAD_ROWS
        more_text = f"; and {more} more" if more > 0 else ""
        kept = f"skipped {len(bad_rows)} bad row(s), kept {len(examples)}"
        warnings.warn(f"{path}: {kept} ({per_reason}): {listed}{more_text}", DataWarning, stacklevel=2)
    if split in ("train", "dev") and spec.files.get("train") == spec.files.get("dev"):
        train, dev = hash_split(examples)
        return train if split == "train" else dev
    return examples
