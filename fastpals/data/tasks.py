"""Tasks: one :class:`TaskSpec` per task (model side, files and their reading, metric); :data:`TASKS` holds the
built-in CS224N ones, a JSON task file defines another (:meth:`TaskSpec.from_file`, keys in docs/training.md), and
a bad one is a one-line :class:`TaskFileError`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastpals.data.task_kinds import TASK_KINDS, TaskKind, kind_names

PAIR_MODES = ("joint", "sbert_cosine", "sbert_concat")
HEADS = ("linear", "mlp")
POOLINGS = ("cls", "mean", "max")
FORMATS = ("csv", "tsv", "jsonl")
SPLITS = ("train", "dev", "test")
COLUMN_ROLES = ("text", "text_pair", "label", "id")
FORMAT_BY_EXTENSION = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


class TaskFileError(ValueError):
    """A task file (or a task definition) is invalid: ``path`` and ``key`` say where, the message in one line."""

    def __init__(self, path: str | os.PathLike | None, key: str | None, reason: str) -> None:
        self.path, self.key, self.reason = None if path is None else str(path), key, reason
        where = ": ".join(part for part in (self.path, key) if part)
        super().__init__(f"{where}: {reason}" if where else reason)


@dataclass
class TaskSpec:
    """One task, its fields the task-file keys (docs/training.md): ``kind`` names a :class:`TaskKind`;
    ``pair_mode`` ``joint`` or siamese (``sbert_cosine``, ``sbert_concat``); ``files`` per split, relative to
    ``$FASTPALS_DATA_DIR`` (empty: the built-in ``data`` task's, default ``name``); ``label_scale`` divides
    regression labels (default ``label_range[1]``); ``source``: the task file, if any."""

    name: str
    kind: str
    num_labels: int = 1
    pair: bool = False
    pair_mode: str = "joint"
    head: str = "linear"
    pooling: str = "cls"
    loss: str | None = None
    label_scale: float | None = None
    data: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=dict)
    format: str | None = None
    label_range: tuple[float, float] | None = None
    label_names: list[str] | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        def fail(reason: str) -> None:
            raise ValueError(f"task {self.name!r}: {reason}")

        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"task name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.kind, str) or self.kind not in TASK_KINDS:
            fail(f"kind={self.kind!r}, choose one of {tuple(TASK_KINDS)}")
        kind = self.task_kind
        if isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int):
            fail(f"num_labels must be an int, got {self.num_labels!r}")
        try:
            self.num_labels = kind.head_outputs(self.num_labels)
        except ValueError as err:
            fail(str(err))
        self.loss = kind.losses[0] if self.loss is None else self.loss
        if self.loss not in kind.losses:
            fail(f"loss={self.loss!r} not valid for {self.kind} ({kind.losses})")
        for key, choices in (("pair_mode", PAIR_MODES), ("head", HEADS), ("pooling", POOLINGS)):
            if getattr(self, key) not in choices:
                fail(f"{key}={getattr(self, key)!r}, choose one of {choices}")
        if self.pair_mode != "joint" and not self.pair:
            fail(f"pair_mode={self.pair_mode!r} needs pair=True")
        if self.pair_mode == "sbert_cosine" and not kind.cosine_pairs:
            fail(f"sbert_cosine is for {kind_names(lambda k: k.cosine_pairs)} tasks")

        builtin = _BUILTIN_FORMATS.get(self.data or self.name)
        if not self.files and not self.columns and builtin is not None and builtin["pair"] == self.pair:
            self.files, self.columns, self.format = builtin["files"], builtin["columns"], "tsv"
            names = builtin["label_names"]
            if self.label_names is None and not kind.scored and names and len(names) == self.num_classes:
                self.label_names = list(names)
            if kind.scored and self.label_range is None and builtin["label_range"] is not None:
                self.label_range = builtin["label_range"]
        self.files, self.columns = dict(self.files), dict(self.columns)
        for key, allowed, what in (("files", SPLITS, "split"), ("columns", COLUMN_ROLES, "key")):
            bad = [name for name in getattr(self, key) if name not in allowed]
            if bad:
                fail(f"{key} has {what}(s) {bad}; the {what}s are {allowed}")
        if self.columns:
            for role in ("text", "label"):
                if role not in self.columns:
                    fail(f"columns needs a {role!r} entry")
            if "text_pair" in self.columns and not self.pair:
                fail("columns has a 'text_pair' entry but pair=False")
            if self.pair and "text_pair" not in self.columns:
                fail("pair=True needs a 'text_pair' entry in columns")
        if self.format is not None and self.format not in FORMATS:
            fail(f"format={self.format!r}, choose one of {FORMATS}")
        if self.label_range is not None:
            if len(self.label_range) != 2:
                fail(f"label_range must be [low, high], got {self.label_range!r}")
            low, high = (float(v) for v in self.label_range)
            if not low < high:
                fail(f"label_range [{low:g}, {high:g}] needs low < high")
            self.label_range = (low, high)
        self.task_kind.check_labels(self, fail)
        self.label_scale = float(self.label_scale)
        if not self.label_scale > 0:
            fail("label_scale must be > 0")

    @property
    def task_kind(self) -> TaskKind:
        """``TASK_KINDS[kind]``: the kind's loss, predictions, metrics and label rules."""
        return TASK_KINDS[self.kind]

    @property
    def metric(self) -> str:
        """The primary dev metric (the kind's first)."""
        return self.task_kind.metric_names[0]

    @property
    def metrics(self) -> tuple[str, ...]:
        """Every metric reported for the task."""
        return self.task_kind.metric_names

    @property
    def siamese(self) -> bool:
        return self.pair and self.pair_mode != "joint"

    @property
    def num_classes(self) -> int | None:
        """The number of classes; None for regression."""
        return self.task_kind.num_classes(self)

    @property
    def label_column(self) -> str | None:
        return self.columns.get("label")

    @property
    def integer_labels(self) -> bool:
        """Labels are whole numbers (class indices or 0/1)."""
        return self.task_kind.integer_labels

    @property
    def label_dtype(self) -> Any:
        """The batch label dtype (the kind's)."""
        return self.task_kind.label_dtype

    def label_name(self, label: int) -> str:
        """The name of class ``label`` (``label_names``), or the index as text."""
        if self.label_names is not None and 0 <= int(label) < len(self.label_names):
            return self.label_names[int(label)]
        return str(int(label))

    def file_format(self, split: str) -> str:
        """``csv``, ``tsv`` or ``jsonl`` for the file of ``split`` (``format``, else by extension)."""
        if self.format is not None:
            return self.format
        path = self.files[split]
        fmt = FORMAT_BY_EXTENSION.get(Path(path).suffix.lower())
        if fmt is None:
            raise _unknown_format(self.source, split, path)
        return fmt

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON fields; ``TaskSpec(**spec.to_dict())`` rebuilds the spec."""
        out = dataclasses.asdict(self)
        out["label_range"] = None if self.label_range is None else list(self.label_range)
        return out

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> TaskSpec:
        """Read a JSON task file; its data paths resolve against its folder. ``TaskFileError`` when the file,
        a key or a listed data file is bad."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise TaskFileError(path, None, "task file does not exist")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise TaskFileError(path, None, "not valid UTF-8") from None
        except json.JSONDecodeError as err:
            raise TaskFileError(path, None, f"not valid JSON: {err.msg} at line {err.lineno}") from None
        return cls.from_task_dict(raw, base_dir=path.resolve().parent, source=path)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> TaskSpec:
        """The inverse of :meth:`to_dict` (not the task-file schema)."""
        return cls(**fields)

    @classmethod
    def from_task_dict(
        cls,
        raw: dict[str, Any],
        base_dir: str | os.PathLike | None = None,
        source: str | os.PathLike | None = None,
        check_files: bool = True,
    ) -> TaskSpec:
        """A spec from a parsed task file ``raw``: ``files`` resolve against ``base_dir`` (default: the current
        folder), ``source`` names the file in errors, ``check_files`` requires each data file to exist."""
        src = None if source is None else str(source)
        if not isinstance(raw, dict):
            raise TaskFileError(src, None, f"must hold a JSON object, got {type(raw).__name__}")
        allowed = (
            "name", "kind", "num_labels", "files", "columns", "format", "label_range", "label_names",
            "head", "pooling", "loss", "pair_mode",
        )  # fmt: skip
        unknown = [key for key in raw if key not in allowed]
        if unknown:
            raise TaskFileError(src, unknown[0], f"unknown key (the keys are {', '.join(allowed)})")

        name = raw.get("name")
        if name is None:
            if src is None:
                raise TaskFileError(src, "name", "missing")
            name = Path(src).stem
        if not isinstance(name, str) or not _NAME.match(name):
            raise TaskFileError(src, "name", f"{name!r} must be letters, digits, '_' or '-'")
        kind = raw.get("kind")
        if not isinstance(kind, str) or kind not in TASK_KINDS:
            what = "missing" if kind is None else f"{kind!r} is not one of {', '.join(TASK_KINDS)}"
            raise TaskFileError(src, "kind", what)
        try:
            num_labels = TASK_KINDS[kind].task_file_num_labels(raw.get("num_labels"))
        except ValueError as err:
            raise TaskFileError(src, "num_labels", str(err)) from None

        files = raw.get("files")
        if not isinstance(files, dict) or not files:
            raise TaskFileError(src, "files", 'needs an object like {"train": PATH, "dev": PATH}')
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        resolved: dict[str, str] = {}
        _check_names(src, "files", files, SPLITS, "split", "a file path")
        for split, value in files.items():
            file_path = Path(os.path.normpath(base / Path(value).expanduser()))
            if check_files and not file_path.is_file():
                raise TaskFileError(src, f"files.{split}", f"data file {file_path} does not exist")
            resolved[split] = str(file_path)
        if "train" not in resolved:
            raise TaskFileError(src, "files.train", "missing (a task needs a training file)")

        columns = raw.get("columns")
        if not isinstance(columns, dict):
            raise TaskFileError(src, "columns", 'needs an object like {"text": COLUMN, "label": COLUMN}')
        _check_names(src, "columns", columns, COLUMN_ROLES, "key", "a column name")
        for role in ("text", "label"):
            if role not in columns:
                raise TaskFileError(src, f"columns.{role}", "missing")

        fmt = raw.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise TaskFileError(src, "format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
        if fmt is None:
            for split, value in resolved.items():
                if Path(value).suffix.lower() not in FORMAT_BY_EXTENSION:
                    raise _unknown_format(src, split, value)

        label_range = raw.get("label_range")
        if label_range is not None:
            if not TASK_KINDS[kind].scored:
                scored = kind_names(lambda k: k.scored)
                raise TaskFileError(src, "label_range", f"only for {scored} tasks, this one is {kind}")
            if (
                not isinstance(label_range, list)
                or len(label_range) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in label_range)
            ):
                raise TaskFileError(src, "label_range", f"must be [low, high] numbers, got {label_range!r}")
        label_names = raw.get("label_names")
        if label_names is not None and (
            not isinstance(label_names, list) or not all(isinstance(n, str) for n in label_names)
        ):
            raise TaskFileError(src, "label_names", f"must be a list of strings, got {label_names!r}")

        keys = ("format", "label_names", "head", "pooling", "loss", "pair_mode")
        options = {key: raw[key] for key in keys if key in raw}
        options.update(num_labels=num_labels, pair="text_pair" in columns, files=resolved, columns=columns)
        if label_range is not None:
            options["label_range"] = tuple(label_range)
        if src is not None:
            options["source"] = str(Path(src).resolve())
        try:
            return cls(name, kind, **options)
        except ValueError as err:
            raise TaskFileError(src, None, str(err)) from None


def _check_names(
    src: str | None, name: str, entries: dict, allowed: tuple[str, ...], kind: str, what: str
) -> None:
    """``TaskFileError`` at ``name.KEY`` for a key not in ``allowed`` or a value not a non-empty str
    (``what``)."""
    for key, value in entries.items():
        where = f"{name}.{key}"
        if key not in allowed:
            raise TaskFileError(src, where, f"unknown {kind} (the {kind}s are {', '.join(allowed)})")
        if not isinstance(value, str) or not value:
            raise TaskFileError(src, where, f"must be {what}, got {value!r}")


def _unknown_format(source: str | None, split: str, path: str) -> TaskFileError:
    reason = f'cannot tell the format of {path} from its extension: add "format": one of {", ".join(FORMATS)}'
    return TaskFileError(source, f"files.{split}", reason)


def _builtin_format(
    files: str | dict[str, str],
    label: str,
    pair: bool,
    label_names: list[str] | None = None,
    label_range: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """A CS224N task's files (a prefix ``P``: ``P-train.csv``, ``P-dev.csv``, ``P-test-student.csv``), columns
    (``sentence`` or ``sentence1``/``sentence2``) and labels."""
    if isinstance(files, str):
        files = dict(train=f"{files}-train.csv", dev=f"{files}-dev.csv", test=f"{files}-test-student.csv")
    columns = {"id": "id", "text": "sentence1" if pair else "sentence", "label": label}
    if pair:
        columns["text_pair"] = "sentence2"
    return dict(files=files, columns=columns, pair=pair, label_names=label_names, label_range=label_range)


QUORA_FILE = "quora-dev.csv"

# The CS224N files (tab-separated although named .csv). Quora has one labelled file: ``para`` train and dev are
# its hash split (same file for both splits), and there is no test file.
_BUILTIN_FORMATS: dict[str, dict[str, Any]] = {
    "sst": _builtin_format(
        "ids-sst", "sentiment", False, ["very negative", "negative", "neutral", "positive", "very positive"]
    ),
    "cfimdb": _builtin_format("ids-cfimdb", "sentiment", False, ["negative", "positive"]),
    "para": _builtin_format(
        {"train": QUORA_FILE, "dev": QUORA_FILE}, "is_duplicate", True, ["not paraphrase", "paraphrase"]
    ),
    "sts": _builtin_format("sts", "similarity", True, label_range=(0.0, 5.0)),
}

TASKS: dict[str, TaskSpec] = {
    "sst": TaskSpec("sst", "classification", num_labels=5),
    "para": TaskSpec("para", "binary", pair=True),
    "sts": TaskSpec("sts", "regression", pair=True),
    "cfimdb": TaskSpec("cfimdb", "binary"),
}


def get_task(task: str | TaskSpec) -> TaskSpec:
    """A copy of a built-in task by name (``sst``, ``para``, ``sts``, ``cfimdb``), or a :class:`TaskSpec` as is."""
    if isinstance(task, TaskSpec):
        return task
    if task not in TASKS:
        raise ValueError(
            f"unknown task {task!r}: built-in tasks are {sorted(TASKS)} (or pass a TaskSpec or a task file)"
        )
    return dataclasses.replace(TASKS[task])


def resolve_tasks(tasks: str | Sequence[str | TaskSpec]) -> list[TaskSpec]:
    """Built-in names and task files (``.json`` or a path) to specs, in order: ``"sst,para,imdb.json"``
    (``--tasks``) or a list of names, paths and specs. ``ValueError`` for an unknown, missing or repeated name."""
    items = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    items = [t for t in items if not (isinstance(t, str) and not t)]
    if not items:
        raise ValueError("no tasks given")
    specs: list[TaskSpec] = []
    for item in items:
        if isinstance(item, TaskSpec):
            specs.append(item)
        elif item in TASKS:
            specs.append(get_task(item))
        elif item.lower().endswith(".json") or "/" in item or os.sep in item or Path(item).is_file():
            specs.append(TaskSpec.from_file(item))
        else:
            raise ValueError(
                f"unknown task {item!r}: give a built-in task ({', '.join(TASKS)}) or a task file ending in .json"
            )
    names = [spec.name for spec in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"task name(s) {', '.join(twice)} given twice (tasks: {', '.join(names)})")
    return specs
