"""Readers for the CS224N minBERT task files, and deterministic batching.

Tasks and files (``data_dir`` defaults to ``$FASTPALS_DATA_DIR``)
------------------------------------------------------------------

======  ======  ================================  ==========================================  ==============
task    kind    files (train / dev / test)        label                                       batch labels
======  ======  ================================  ==========================================  ==============
sst     single  ids-sst-{train,dev,test-student}  sentiment, int 0..4                         int64
cfimdb  single  ids-cfimdb-{train,dev,test-...}   sentiment, int 0/1                          float32
para    pair    quora-dev.csv (see below)         is_duplicate, "0.0"/"1.0" -> int 0/1        float32
sts     pair    sts-{train,dev,test-student}      similarity, float in [0, 5]                 float32
======  ======  ================================  ==========================================  ==============

The label kinds match ``fastpals.multitask.TASKS``: ``sst`` is a 5-way classification (batch labels are class
indices, int64); ``cfimdb`` and ``para`` are binary (one logit, float labels 0./1.); ``sts`` is a regression on the
raw 0..5 score (float; the model divides by its ``label_scale``). Test files carry no label
(``label is None``; batches have no ``labels``); the SST and CFIMDB test files have a shifted header (an extra
leading column), which is handled by finding every column by its header name.

The Quora split
---------------
Only ``quora-dev.csv`` (20,214 rows, 2 of them broken) is available, so ``para`` ``train`` and ``dev`` are carved
from it deterministically: a row goes to ``dev`` when ``int.from_bytes(sha256(id)[:8], "big") % 100 < 10`` (``id``
= the 25-character hex id column, UTF-8), else to ``train``. This does not depend on the row order, on Python's
hash seed or on the other rows. On the released file with the 2 broken rows skipped that gives
``train`` 18,187 rows and ``dev`` 2,025 rows (``quora_split_sizes()`` recomputes it). ``para`` has no ``test``
split. Quora numbers reported from this package are on that held-out 10% of the original dev file, not on the
original CS224N dev/test sets.

Bad input
---------
Every data row is checked: field count equal to the header's, valid UTF-8, non-empty id, no duplicate id,
non-empty sentence(s), and (labelled files) a label that parses and lies in range. A missing file, an empty
file, or a header that lacks a needed column always raises. With ``strict=True`` (the default) the first bad row
raises ``DataError`` naming file, line and reason; with ``strict=False`` bad rows are skipped and a
``DataWarning`` lists the count per reason and the ``file:line`` of each skipped row (the first 20). Nothing is
dropped silently. ``quora-dev.csv`` really has 2 broken rows (lines 2577 and 14222), so loading ``para`` needs
``strict=False``.

Batching
--------
``TaskBatcher`` tokenizes every example once, then yields padded batches in an order that is a pure function
of ``(seed, epoch)``; ``state_dict()`` / ``load_state_dict()`` hold ``(epoch, position)``, so a resumed run
continues with exactly the batches it would have seen. ``merge_batches`` concatenates one batch per task into a
mixed-task batch (``task_ids``, float labels) for ``MultiTaskBert.forward`` / ``MultiTaskBert.loss``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastpals.tokenizer import Tokenizer

__all__ = [
    "DATA_DIR_ENV",
    "TASK_FORMATS",
    "BadRow",
    "DataError",
    "DataWarning",
    "PairExample",
    "SentenceExample",
    "TaskBatcher",
    "TaskFormat",
    "load_task",
    "merge_batches",
    "quora_split",
    "quora_split_sizes",
    "read_task_file",
    "resolve_data_dir",
]

DATA_DIR_ENV = "FASTPALS_DATA_DIR"
QUORA_FILE = "quora-dev.csv"
QUORA_DEV_PERCENT = 10
_MAX_LISTED_BAD_ROWS = 20


class DataError(ValueError):
    """A task file is malformed. ``path``, ``line`` (1-based, of the row's first line) and ``reason`` say where."""

    def __init__(self, path: str | os.PathLike, line: int, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path}:{line}: {reason}")


class DataWarning(UserWarning):
    """Rows were skipped by a non-strict reader; the message lists how many, why, and where."""


@dataclass(frozen=True)
class SentenceExample:
    """One sentence of ``sst`` / ``cfimdb``; ``label`` is a class index or ``None`` (test files)."""

    id: str
    sentence: str
    label: int | None = None


@dataclass(frozen=True)
class PairExample:
    """One sentence pair of ``para`` (label int 0/1) or ``sts`` (label float in [0, 5]); ``None`` in test files."""

    id: str
    sentence1: str
    sentence2: str
    label: int | float | None = None


Example = SentenceExample | PairExample


@dataclass(frozen=True)
class BadRow:
    """A row a non-strict reader skipped: ``kind`` is the reason's category, ``reason`` the full text."""

    path: str
    line: int
    kind: str
    reason: str


@dataclass(frozen=True)
class TaskFormat:
    """What a task's files hold and how its labels are read.

    Attributes:
        name: ``sst``, ``cfimdb``, ``para`` or ``sts``.
        pair: two sentences per example (``sentence1``, ``sentence2``) instead of one (``sentence``).
        label_column: header name of the label column in labelled files.
        label_kind: ``"classification"`` (int64 batch labels), ``"binary"`` or ``"regression"`` (float32).
        num_classes: classes of a classification or binary task, ``None`` for regression.
        label_range: inclusive bounds of a valid label.
        files: file name per split.
    """

    name: str
    pair: bool
    label_column: str
    label_kind: str
    num_classes: int | None
    label_range: tuple[float, float]
    files: dict[str, str]

    @property
    def integer_labels(self) -> bool:
        return self.label_kind != "regression"

    @property
    def label_dtype(self) -> torch.dtype:
        return torch.int64 if self.label_kind == "classification" else torch.float32


TASK_FORMATS: dict[str, TaskFormat] = {
    "sst": TaskFormat(
        "sst",
        False,
        "sentiment",
        "classification",
        5,
        (0, 4),
        {"train": "ids-sst-train.csv", "dev": "ids-sst-dev.csv", "test": "ids-sst-test-student.csv"},
    ),
    "cfimdb": TaskFormat(
        "cfimdb",
        False,
        "sentiment",
        "binary",
        2,
        (0, 1),
        {"train": "ids-cfimdb-train.csv", "dev": "ids-cfimdb-dev.csv", "test": "ids-cfimdb-test-student.csv"},
    ),
    "para": TaskFormat(
        "para", True, "is_duplicate", "binary", 2, (0, 1), {"train": QUORA_FILE, "dev": QUORA_FILE}
    ),
    "sts": TaskFormat(
        "sts",
        True,
        "similarity",
        "regression",
        None,
        (0.0, 5.0),
        {"train": "sts-train.csv", "dev": "sts-dev.csv", "test": "sts-test-student.csv"},
    ),
}

SPLITS = ("train", "dev", "test")
PAIR_ENCODINGS = ("joint", "separate", "both")


def _task_spec(task: str | TaskFormat) -> TaskFormat:
    if isinstance(task, TaskFormat):
        return task
    if task not in TASK_FORMATS:
        raise ValueError(f"task must be one of {', '.join(TASK_FORMATS)}, got {task!r}")
    return TASK_FORMATS[task]


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """``data_dir`` if given, else ``$FASTPALS_DATA_DIR``; the folder must exist."""
    if data_dir is None:
        data_dir = os.environ.get(DATA_DIR_ENV)
        if not data_dir:
            raise FileNotFoundError(
                f"no data_dir given and ${DATA_DIR_ENV} is not set: pass data_dir= or "
                f"`export {DATA_DIR_ENV}=/path/to/the/csv/files`"
            )
        origin = f"${DATA_DIR_ENV}"
    else:
        origin = "data_dir"
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{origin} = {str(path)!r} is not a folder")
    return path


def _parse_label(text: str, spec: TaskFormat) -> tuple[int | float | None, str, str]:
    """Return ``(label, kind, reason)``; ``label`` is ``None`` when the text is not a valid label."""
    stripped = text.strip()
    if not stripped:
        return None, "empty label", f"empty {spec.label_column}"
    try:
        value = float(stripped)
    except ValueError:
        return None, "bad label", f"{spec.label_column} {text!r} is not a number"
    if not math.isfinite(value):
        return None, "bad label", f"{spec.label_column} {text!r} is not a finite number"
    low, high = spec.label_range
    if not low <= value <= high:
        return None, "label out of range", f"{spec.label_column} {text!r} is outside [{low}, {high}]"
    if spec.integer_labels:
        if value != int(value):
            return None, "bad label", f"{spec.label_column} {text!r} is not a whole number"
        return int(value), "", ""
    return value, "", ""


def _has_bad_utf8(text: str) -> bool:
    # bytes that are not UTF-8 decode to lone surrogates U+DC80..U+DCFF under errors="surrogateescape"
    return any("\udc80" <= ch <= "\udcff" for ch in text)


def read_task_file(
    path: str | os.PathLike, task: str | TaskFormat, labelled: bool, strict: bool = True
) -> tuple[list[Example], list[BadRow]]:
    """Read one tab-separated task file.

    Args:
        path: the CSV file (header row, then one example per row; quoted fields may span lines).
        task: task name or ``TaskFormat``: which columns to read and how to check the label.
        labelled: read the label column (train/dev files) or not (test files: ``label=None``).
        strict: raise ``DataError`` at the first bad row (``True``) or skip bad rows (``False``).

    Returns:
        ``(examples, bad_rows)`` in file order; ``bad_rows`` is empty when ``strict``. The caller reports them
        (``load_task`` warns); this function does not warn.

    Raises:
        FileNotFoundError: no file at ``path``.
        DataError: empty file, header without a needed column, or (``strict``) a bad row.
    """
    spec = _task_spec(task)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(path, 1, "empty file (a header row and at least one data row are needed)")
    text = raw.decode("utf-8", errors="surrogateescape")
    if text.startswith("\ufeff"):
        text = text[1:]
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t")
    header = next(reader)
    if any(_has_bad_utf8(name) for name in header):
        raise DataError(path, 1, "header row is not valid UTF-8")
    sentence_columns = ("sentence1", "sentence2") if spec.pair else ("sentence",)
    needed = ("id", *sentence_columns) + ((spec.label_column,) if labelled else ())
    columns = {name: i for i, name in reversed(list(enumerate(header)))}  # first occurrence wins
    missing = [name for name in needed if name not in columns]
    if missing:
        raise DataError(
            path,
            1,
            f"header lacks column(s) {', '.join(missing)} (header: {header!r}; needed: {', '.join(needed)})",
        )

    examples: list[Example] = []
    bad_rows: list[BadRow] = []
    first_line_of_id: dict[str, int] = {}
    line_before = reader.line_num
    for row in reader:
        line = line_before + 1
        line_before = reader.line_num

        kind, reason = "", ""
        label: int | float | None = None
        if any(_has_bad_utf8(field) for field in row):
            kind, reason = "bad UTF-8", "row is not valid UTF-8"
        elif len(row) != len(header):
            kind = "wrong number of fields"
            reason = f"{len(row)} tab-separated fields, the header has {len(header)}"
        else:
            row_id = row[columns["id"]].strip()
            empty = [name for name in sentence_columns if not row[columns[name]].strip()]
            if not row_id:
                kind, reason = "empty id", "empty id"
            elif row_id in first_line_of_id:
                kind, reason = "duplicate id", f"id {row_id} already on line {first_line_of_id[row_id]}"
            elif empty:
                kind, reason = "empty sentence", f"empty {' and '.join(empty)}"
            elif labelled:
                label, kind, reason = _parse_label(row[columns[spec.label_column]], spec)
        if kind:
            if strict:
                raise DataError(path, line, f"{reason} (pass strict=False to skip such rows with a warning)")
            bad_rows.append(BadRow(str(path), line, kind, reason))
            continue
        first_line_of_id[row_id] = line
        if spec.pair:
            examples.append(PairExample(row_id, row[columns["sentence1"]], row[columns["sentence2"]], label))
        else:
            examples.append(SentenceExample(row_id, row[columns["sentence"]], label))
    if not examples and not bad_rows:
        raise DataError(path, 2, "no data rows after the header")
    return examples, bad_rows


def _warn_bad_rows(bad_rows: Sequence[BadRow], path: Path, kept: int) -> None:
    if not bad_rows:
        return
    counts = Counter(bad.kind for bad in bad_rows)
    per_reason = ", ".join(f"{count} x {kind}" for kind, count in counts.most_common())
    listed = "; ".join(f"{bad.path}:{bad.line}: {bad.reason}" for bad in bad_rows[:_MAX_LISTED_BAD_ROWS])
    more = (
        f"; and {len(bad_rows) - _MAX_LISTED_BAD_ROWS} more" if len(bad_rows) > _MAX_LISTED_BAD_ROWS else ""
    )
    warnings.warn(
        f"{path}: skipped {len(bad_rows)} bad row(s), kept {kept} ({per_reason}): {listed}{more}",
        DataWarning,
        stacklevel=3,
    )


def _quora_is_dev(example_id: str) -> bool:
    digest = hashlib.sha256(example_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < QUORA_DEV_PERCENT


def quora_split(examples: Sequence[PairExample]) -> tuple[list[PairExample], list[PairExample]]:
    """Split Quora examples into ``(train, dev)`` by a SHA-256 hash of each id (about 90% / 10%)."""
    train, dev = [], []
    for example in examples:
        (dev if _quora_is_dev(example.id) else train).append(example)
    return train, dev


def quora_split_sizes(data_dir: str | os.PathLike | None = None) -> dict[str, int]:
    """Rows per ``para`` split and skipped rows: ``{"train": ..., "dev": ..., "skipped": ...}``."""
    path = resolve_data_dir(data_dir) / QUORA_FILE
    examples, bad_rows = read_task_file(path, "para", labelled=True, strict=False)
    train, dev = quora_split(examples)
    return {"train": len(train), "dev": len(dev), "skipped": len(bad_rows)}


def load_task(
    name: str, split: str, data_dir: str | os.PathLike | None = None, strict: bool = True
) -> list[Example]:
    """Load one split of a task as typed examples, in file order.

    Args:
        name: ``"sst"``, ``"para"``, ``"sts"`` or ``"cfimdb"``.
        split: ``"train"``, ``"dev"`` or ``"test"`` (``para`` has no ``test``; its ``train`` / ``dev`` are the
            hash split of ``quora-dev.csv`` described in the module docstring).
        data_dir: folder of the CSV files; default ``$FASTPALS_DATA_DIR``.
        strict: raise ``DataError`` on the first bad row, or skip bad rows with a ``DataWarning``.

    Returns:
        ``list[SentenceExample]`` (sst, cfimdb) or ``list[PairExample]`` (para, sts); labels are ``None`` for
        ``test``.
    """
    spec = _task_spec(name)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if split not in spec.files:
        raise ValueError(
            f"task {spec.name!r} has no {split!r} split: its labelled Quora data is only {QUORA_FILE}, which is "
            f"split by id hash into 'train' and 'dev' (there is no Quora test file in this data set)"
        )
    path = resolve_data_dir(data_dir) / spec.files[split]
    examples, bad_rows = read_task_file(path, spec, labelled=split != "test", strict=strict)
    _warn_bad_rows(bad_rows, path, len(examples))
    if spec.name == "para":
        train, dev = quora_split(examples)
        return train if split == "train" else dev
    return examples


class TaskBatcher:
    """Padded, deterministic batches of one task's examples.

    All examples are tokenized once at construction. The batches of epoch ``e`` are ``epoch_batches(e)``, a pure
    function of ``(seed, e)``:

    1. the example indices, permuted by ``numpy.random.default_rng([seed, e])`` when ``shuffle``;
    2. with ``bucket_by_length``: cut into chunks of ``bucket_size * batch_size`` and each chunk sorted by token
       length (stable), so a batch holds examples of similar length and pads little;
    3. cut into batches of ``batch_size`` (the last one smaller unless ``drop_last``);
    4. when ``shuffle``: the batches permuted by the same generator.

    Iterating yields the remaining batches of the current epoch, then moves to the next epoch (``next_batch()``
    gives the same sequence one batch at a time, across epochs); ``state_dict()``
    taken between two batches and given to ``load_state_dict()`` of a new batcher over the same examples resumes
    with the next batch. Use one iterator at a time.

    Each batch is a dict:
        ``input_ids``, ``attention_mask``, ``token_type_ids``: int64 ``(B, L)``, ``L`` = longest in the batch; for
            pairs the joint ``[CLS] s1 [SEP] s2 [SEP]`` encoding with token types 0/1.
        ``labels``: ``(B,)`` int64 (classification) or float32 (binary, regression); absent without labels.
        ``ids``: ``list[str]`` of length ``B``; ``task``: the task name.
        Pairs with ``pair_encoding="separate"`` (siamese heads; the keys ``MultiTaskBert.forward`` takes):
            ``input_ids``, ``attention_mask``, ``token_type_ids`` hold sentence1 alone (``[CLS] s1 [SEP]``,
            ``(B, L1)``) and ``input_ids_b``, ``attention_mask_b``, ``token_type_ids_b`` sentence2 alone
            (``(B, L2)``). With ``"both"``: those keys plus the joint encoding as ``joint_input_ids``,
            ``joint_attention_mask``, ``joint_token_type_ids``.

    ``lengths [N]`` int64: each example's padded-width length (bucketing key); ``packed_lengths [N]`` int64: its
    tokens once packed without padding (``fastpals.batching``: the joint encoding, or both sentences when
    ``pair_encoding`` is ``"separate"``/``"both"``).

    Args:
        examples: examples of one task (all with labels, or all without).
        tokenizer: a ``fastpals.Tokenizer``.
        task: task name or ``TaskFormat`` (kind of example, label dtype).
        batch_size: examples per batch.
        max_length: token limit per sequence (truncations are counted in ``num_truncated``).
        shuffle: permute examples and batches each epoch (training) or keep file order (evaluation).
        seed: non-negative int.
        bucket_by_length: group examples of similar length (see above).
        bucket_size: chunk size in batches for the length sort.
        drop_last: drop a final incomplete batch.
        pair_encoding: ``"joint"`` (cross-encoder, default), ``"separate"`` or ``"both"`` (see above; pairs only).
    """

    def __init__(
        self,
        examples: Sequence[Example],
        tokenizer: Tokenizer,
        task: str | TaskFormat,
        batch_size: int,
        *,
        max_length: int = 128,
        shuffle: bool = True,
        seed: int = 0,
        bucket_by_length: bool = True,
        bucket_size: int = 100,
        drop_last: bool = False,
        pair_encoding: str = "joint",
    ) -> None:
        self.spec = _task_spec(task)
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("bucket_size", bucket_size, 1),
            ("seed", seed, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if pair_encoding not in PAIR_ENCODINGS:
            raise ValueError(
                f"pair_encoding must be one of {', '.join(PAIR_ENCODINGS)}, got {pair_encoding!r}"
            )
        if pair_encoding != "joint" and not self.spec.pair:
            raise ValueError(
                f"pair_encoding={pair_encoding!r} needs a sentence-pair task, {self.spec.name!r} has single sentences"
            )
        example_type = PairExample if self.spec.pair else SentenceExample
        examples = list(examples)
        if not examples:
            raise ValueError("examples is empty")
        for i, example in enumerate(examples):
            if not isinstance(example, example_type):
                raise TypeError(
                    f"examples[{i}] is a {type(example).__name__}; task {self.spec.name!r} needs {example_type.__name__}"
                )
        with_labels = [example.label is not None for example in examples]
        if any(with_labels) and not all(with_labels):
            raise ValueError(
                f"examples mix labelled and unlabelled ones (example {with_labels.index(False)} has none)"
            )
        self.has_labels = with_labels[0]
        self.examples = examples
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.shuffle = shuffle
        self.seed = seed
        self.bucket_by_length = bucket_by_length
        self.bucket_size = bucket_size
        self.drop_last = drop_last
        self.pair_encoding = pair_encoding

        truncated_before = tokenizer.num_truncated
        if self.spec.pair:
            first = [example.sentence1 for example in examples]
            second = [example.sentence2 for example in examples]
            if pair_encoding != "separate":
                self._joint = tokenizer.encode(first, second, max_length)
            if pair_encoding != "joint":
                self._first = tokenizer.encode(first, max_length=max_length)
                self._second = tokenizer.encode(second, max_length=max_length)
        else:
            self._joint = tokenizer.encode([example.sentence for example in examples], max_length=max_length)
        self.num_truncated = tokenizer.num_truncated - truncated_before
        if pair_encoding == "separate":  # bucket on the longer side: it sets the padded width of its tensor
            lengths = [max(len(a.input_ids), len(b.input_ids)) for a, b in zip(self._first, self._second)]
        else:
            lengths = [len(enc.input_ids) for enc in self._joint]
        self.lengths = np.array(lengths, dtype=np.int64)
        # tokens of each example once packed without padding (fastpals.batching): both sentences when separate
        if pair_encoding == "joint":
            self.packed_lengths = np.array([len(enc.input_ids) for enc in self._joint], dtype=np.int64)
        else:
            self.packed_lengths = np.array(
                [len(a.input_ids) + len(b.input_ids) for a, b in zip(self._first, self._second)],
                dtype=np.int64,
            )
        if self.has_labels:
            self._labels = torch.tensor([example.label for example in examples], dtype=self.spec.label_dtype)

        self.epoch = 0
        self.position = 0
        self._cached_epoch: int | None = None
        self._cached_batches: list[np.ndarray] = []

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.examples), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The example indices of every batch of ``epoch``, in order (int64 arrays)."""
        n = len(self.examples)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if self.bucket_by_length:
            chunk = self.bucket_size * self.batch_size
            order = np.concatenate(
                [
                    part[np.argsort(self.lengths[part], kind="stable")]
                    for part in (order[start : start + chunk] for start in range(0, n, chunk))
                ]
            )
        batches = [order[start : start + self.batch_size] for start in range(0, n, self.batch_size)]
        if self.drop_last and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def collate(self, indices: Sequence[int]) -> dict:
        """The batch dict (see the class docstring) of the examples at ``indices``."""
        indices = [int(i) for i in indices]
        pad = self.tokenizer.pad
        if self.pair_encoding == "joint":
            batch: dict = dict(pad([self._joint[i] for i in indices]))
        else:
            batch = dict(pad([self._first[i] for i in indices]))
            batch.update(
                (key + "_b", value) for key, value in pad([self._second[i] for i in indices]).items()
            )
            if self.pair_encoding == "both":
                batch.update(
                    ("joint_" + key, value) for key, value in pad([self._joint[i] for i in indices]).items()
                )
        if self.has_labels:
            batch["labels"] = self._labels[indices]
        batch["ids"] = [self.examples[i].id for i in indices]
        batch["task"] = self.spec.name
        return batch

    def _batches_of(self, epoch: int) -> list[np.ndarray]:
        if self._cached_epoch != epoch:
            self._cached_batches = self.epoch_batches(epoch)
            self._cached_epoch = epoch
        return self._cached_batches

    def __iter__(self) -> Iterator[dict]:
        """Yield the remaining batches of the current epoch, then move ``epoch`` on by one."""
        batches = self._batches_of(self.epoch)
        while self.position < len(batches):
            indices = batches[self.position]
            self.position += 1  # counted before the yield: a state_dict taken now resumes after this batch
            yield self.collate(indices)
        self.epoch += 1
        self.position = 0

    def next_batch(self) -> dict:
        """The next batch, going on into the next epoch when the current one is used up.

        For trainers that interleave tasks (one ``next_batch()`` per task step); the sequence of batches is the
        same as iterating epoch after epoch.
        """
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        indices = self._batches_of(self.epoch)[self.position]
        self.position += 1
        return self.collate(indices)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch
        self.position = 0

    def _fingerprint(self) -> str:
        digest = hashlib.sha256()
        for example in self.examples:
            digest.update(example.id.encode("utf-8") + b"\0")
        return digest.hexdigest()[:16]

    def state_dict(self) -> dict:
        """``{"epoch", "position", "seed", "batch_size", "num_examples", "fingerprint", ...}`` (plain Python)."""
        return {
            "task": self.spec.name,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "bucket_by_length": self.bucket_by_length,
            "bucket_size": self.bucket_size,
            "drop_last": self.drop_last,
            "pair_encoding": self.pair_encoding,
            "max_length": self.max_length,
            "num_examples": len(self.examples),
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was taken; the batch order settings and examples must be the same."""
        mine = self.state_dict()
        differ = [key for key in mine if key not in ("epoch", "position") and state.get(key) != mine[key]]
        if differ:
            detail = ", ".join(f"{key}: saved {state.get(key)!r}, now {mine[key]!r}" for key in differ)
            raise ValueError(f"cannot resume TaskBatcher: {detail}")
        epoch, position = state["epoch"], state["position"]
        if not 0 <= position <= len(self):
            raise ValueError(f"position {position} is outside [0, {len(self)}]")
        self.epoch, self.position = int(epoch), int(position)


_ENCODING_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def _pad_cat(tensors: Sequence[torch.Tensor], value: int) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def merge_batches(batches: Sequence[dict], task_ids: Sequence[int], tokenizer: Tokenizer) -> dict:
    """Concatenate one batch per task into a mixed-task batch for ``MultiTaskBert.forward(..., task_ids=...)``.

    Args:
        batches: ``TaskBatcher`` batches (any tasks, single or pair, any ``pair_encoding``).
        task_ids: for each batch, its task's index in the model (all its rows get that id).
        tokenizer: gives the ``[PAD]``, ``[CLS]`` and ``[SEP]`` ids.

    Returns:
        ``input_ids``, ``attention_mask``, ``token_type_ids``: int64 ``(B, L)``, each batch right-padded to the
        widest; ``task_ids``: int64 ``(B,)``; ``labels``: float32 ``(B,)`` (class indices are exact in float32;
        ``MultiTaskBert.loss`` casts per task) when every batch has labels; ``ids``: ``list[str]``; ``tasks``: the
        task name of every row. ``*_b`` (second sentences of siamese tasks) when some batch has them: the rows of
        batches without them get ``[CLS] [SEP]`` (ignored by the model, and never an all-masked row).
        ``joint_*`` keys are kept only when every batch has them.
    """
    if len(batches) == 0:
        raise ValueError("batches is empty")
    if len(task_ids) != len(batches):
        raise ValueError(f"batches has {len(batches)} entries but task_ids has {len(task_ids)}")
    pad_values = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0, "token_type_ids": 0}
    sizes = [len(batch["ids"]) for batch in batches]
    merged: dict = {
        key: _pad_cat([batch[key] for batch in batches], pad_values[key]) for key in _ENCODING_KEYS
    }
    if any("input_ids_b" in batch for batch in batches):
        filler = {
            "input_ids": [tokenizer.cls_token_id, tokenizer.sep_token_id],
            "attention_mask": [1, 1],
            "token_type_ids": [0, 0],
        }
        for key in _ENCODING_KEYS:
            parts = [
                batch[key + "_b"]
                if key + "_b" in batch
                else torch.tensor([filler[key]] * size, dtype=torch.int64)
                for batch, size in zip(batches, sizes)
            ]
            merged[key + "_b"] = _pad_cat(parts, pad_values[key])
    if all("joint_input_ids" in batch for batch in batches):
        for key in _ENCODING_KEYS:
            merged["joint_" + key] = _pad_cat([batch["joint_" + key] for batch in batches], pad_values[key])
    merged["task_ids"] = torch.cat(
        [torch.full((size,), int(task_id), dtype=torch.int64) for task_id, size in zip(task_ids, sizes)]
    )
    if all("labels" in batch for batch in batches):
        merged["labels"] = torch.cat([batch["labels"].to(torch.float32) for batch in batches])
    elif any("labels" in batch for batch in batches):
        raise ValueError("some batches have labels and some do not")
    merged["ids"] = [i for batch in batches for i in batch["ids"]]
    merged["tasks"] = [batch["task"] for batch, size in zip(batches, sizes) for _ in range(size)]
    return merged
