"""Readers for task files (the CS224N files and users' own CSV, TSV and JSONL files), and deterministic batching.

Every task, built-in or from a task file, is a :class:`fastpals.tasks.TaskSpec`: its ``files``, ``columns``,
``format`` and labels say how its files are read (see :mod:`fastpals.tasks` for the task-file keys). The
functions here take a task name (``sst``, ``para``, ``sts``, ``cfimdb``) or a spec.

Built-in tasks (``data_dir`` defaults to ``$FASTPALS_DATA_DIR``)
-----------------------------------------------------------------

======  ======  ================================  ==========================================  ==============
task    kind    files (train / dev / test)        label                                       batch labels
======  ======  ================================  ==========================================  ==============
sst     single  ids-sst-{train,dev,test-student}  sentiment, int 0..4                         int64
cfimdb  single  ids-cfimdb-{train,dev,test-...}   sentiment, int 0/1                          float32
para    pair    quora-dev.csv (see below)         is_duplicate, "0.0"/"1.0" -> int 0/1        float32
sts     pair    sts-{train,dev,test-student}      similarity, float in [0, 5]                 float32
======  ======  ================================  ==========================================  ==============

``sst`` is a 5-way classification (batch labels are class indices, int64); ``cfimdb`` and ``para`` are binary
(one logit, float labels 0./1.); ``sts`` is a regression on the raw 0..5 score (float; the model divides by its
``label_scale``). Test files carry no label (``label is None``; batches have no ``labels``); the SST and CFIMDB
test files have a shifted header (an extra leading column), which is handled by finding every column by its
header name. The CS224N files are tab-separated although they are named ``.csv``.

The Quora split
---------------
Only ``quora-dev.csv`` (20,214 rows, 2 of them broken) is available, so ``para`` ``train`` and ``dev`` are carved
from it deterministically: a row goes to ``dev`` when ``int.from_bytes(sha256(id)[:8], "big") % 100 < 10`` (``id``
= the 25-character hex id column, UTF-8), else to ``train``. This does not depend on the row order, on Python's
hash seed or on the other rows. On the released file with the 2 broken rows skipped that gives
``train`` 18,187 rows and ``dev`` 2,025 rows (``quora_split_sizes()`` recomputes it). ``para`` has no ``test``
split. Quora numbers reported from this package are on that held-out 10% of the original dev file, not on the
original CS224N dev/test sets. The same rule applies to any task whose ``dev`` file is its ``train`` file.

File formats
------------
* ``tsv`` / ``csv``: a header row naming the columns, then one example per row, separated by tabs / commas.
  Quoting follows the usual CSV rules: a field that *starts* with ``"`` is quoted, may hold the separator and
  line breaks, writes a quote as ``""``, and must end with ``"`` followed by the separator or the line end.
  A ``"`` elsewhere in a field is an ordinary character. CRLF, LF and CR line ends are all accepted; a UTF-8 BOM
  is dropped; lines holding nothing but spaces are not rows.
* ``jsonl``: one JSON object per line; ``columns`` name its keys. Labels may be numbers, booleans (binary) or
  strings; ids strings or integers. Blank lines are not rows.

Bad input (nothing is lost silently)
------------------------------------
Every data row is checked: valid UTF-8, no NUL byte, field count equal to the header's, no field longer than
``max_field_chars`` (default 131,072), non-empty id without comma, tab or line break (prediction files hold
ids), no duplicate id, non-empty text(s), and (labelled files) a label that parses and lies in range.

A quote that opens a field and is never closed properly would swallow the lines after it. The reader detects
it and names the line where the quote opened: the quote reaches the end of the file; the quote closes on a
later line and is followed by text; the row it makes has the wrong number of fields; or (tab-separated files) a
quoted field spanning lines holds as many tabs as a whole row. Such a row is one bad row, and reading goes on
from the line after the quote, so every other row is kept.

A missing file, an empty file, or a header that lacks a needed column always raises. With ``strict=True`` (the
default) the first bad row raises ``DataError`` naming file, line and reason; with ``strict=False`` bad rows are
skipped and a ``DataWarning`` lists the count per reason and the ``file:line`` of each skipped row (the first
20). ``quora-dev.csv`` really has 2 broken rows (lines 2577 and 14222), so loading ``para`` needs
``strict=False``.

Batching
--------
``TaskBatcher`` tokenizes every example once, then yields padded batches in an order that is a pure function
of ``(seed, epoch)``; ``state_dict()`` / ``load_state_dict()`` hold ``(epoch, position)``, so a resumed run
continues with exactly the batches it would have seen. ``merge_batches`` concatenates one batch per task into a
mixed-task batch (``task_ids``, float labels) for ``MultiTaskBert.forward`` / ``MultiTaskBert.loss``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastpals.tasks import FORMAT_BY_EXTENSION, QUORA_FILE, SPLITS, TASKS, TaskSpec, get_task
from fastpals.tokenizer import Tokenizer

__all__ = [
    "DATA_DIR_ENV",
    "MAX_FIELD_CHARS",
    "TASK_FORMATS",
    "BadRow",
    "DataError",
    "DataWarning",
    "PairExample",
    "SentenceExample",
    "TaskBatcher",
    "TaskFormat",
    "hash_split",
    "load_task",
    "merge_batches",
    "quora_split",
    "quora_split_sizes",
    "read_task_file",
    "resolve_data_dir",
    "split_path",
]

DATA_DIR_ENV = "FASTPALS_DATA_DIR"
QUORA_DEV_PERCENT = 10
MAX_FIELD_CHARS = 131_072  # the csv module's default field limit
_MAX_LISTED_BAD_ROWS = 20
_LINE_END = re.compile(r"\r\n|\n|\r")

# The one task registry lives in fastpals.tasks; these names are kept for code written against data.py.
TaskFormat = TaskSpec
TASK_FORMATS = TASKS


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
    """One text of a single-sentence task; ``label`` is a class index, 0/1, a score, or ``None`` (test files)."""

    id: str
    sentence: str
    label: int | float | None = None


@dataclass(frozen=True)
class PairExample:
    """One text pair (``para``: label int 0/1, ``sts``: float in [0, 5]); ``None`` in test files."""

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


PAIR_ENCODINGS = ("joint", "separate", "both")


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


# --------------------------------------------------------------------------------------------------------------
# labels and rows
# --------------------------------------------------------------------------------------------------------------
def _format_bound(value: float, spec: TaskSpec) -> str:
    return str(int(value)) if spec.integer_labels else f"{value:g}"


def _parse_label(value: Any, spec: TaskSpec) -> tuple[int | float | None, str, str]:
    """Return ``(label, kind, reason)``; ``label`` is ``None`` when ``value`` is not a valid label."""
    column = spec.label_column
    names = spec.label_names
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, "empty label", f"empty {column}"
    if isinstance(value, bool):
        if spec.kind != "binary":
            return None, "bad label", f"{column} {value!r} is a boolean, the task is {spec.kind}"
        return int(value), "", ""
    if isinstance(value, str):
        stripped = value.strip()
        if names is not None and stripped in names:
            return names.index(stripped), "", ""
        try:
            number = float(stripped)
        except ValueError:
            also = f" or one of {names}" if names is not None else ""
            return None, "bad label", f"{column} {value!r} is not a number{also}"
    elif isinstance(value, (int, float)):
        number = float(value)
    else:
        return None, "bad label", f"{column} {value!r} is not a number"
    if not math.isfinite(number):
        return None, "bad label", f"{column} {value!r} is not a finite number"
    low, high = spec.label_range
    if not low <= number <= high:
        bounds = f"[{_format_bound(low, spec)}, {_format_bound(high, spec)}]"
        return None, "label out of range", f"{column} {value!r} is outside {bounds}"
    if spec.integer_labels:
        if number != int(number):
            return None, "bad label", f"{column} {value!r} is not a whole number"
        return int(number), "", ""
    return number, "", ""


# bytes that are not UTF-8 decode to lone surrogates U+DC80..U+DCFF under errors="surrogateescape"
_BAD_UTF8 = re.compile("[\udc80-\udcff]")


def _has_bad_utf8(text: str) -> bool:
    return _BAD_UTF8.search(text) is not None


class _RowChecker:
    """Turns the id / text / label values of one row into an example, or a ``(kind, reason)`` problem."""

    def __init__(self, spec: TaskSpec, labelled: bool) -> None:
        self.spec = spec
        self.labelled = labelled
        self.text_roles = ("text", "text_pair") if spec.pair else ("text",)
        self.first_line_of_id: dict[str, int] = {}

    def example(self, line: int, values: dict[str, Any]) -> tuple[Example | None, str, str]:
        spec = self.spec
        if "id" in spec.columns:
            raw_id = values["id"]
            if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
                return None, "bad id", f"id {raw_id!r} is not a string or an integer"
            row_id = str(raw_id).strip()
            if not row_id:
                return None, "empty id", "empty id"
            if any(ch in row_id for ch in ",\t\r\n"):
                return (
                    None,
                    "bad id",
                    f"id {row_id!r} holds a comma, tab or line break (prediction files cannot)",
                )
            if row_id in self.first_line_of_id:
                return None, "duplicate id", f"id {row_id} already on line {self.first_line_of_id[row_id]}"
        else:
            row_id = f"line{line}"
        texts = []
        for role in self.text_roles:
            text = values[role]
            if not isinstance(text, str):
                return None, "bad text", f"{spec.columns[role]} {text!r} is not a string"
            texts.append(text)
        empty = [spec.columns[role] for role, text in zip(self.text_roles, texts) if not text.strip()]
        if empty:
            return None, "empty sentence", f"empty {' and '.join(empty)}"
        label = None
        if self.labelled:
            label, kind, reason = _parse_label(values["label"], spec)
            if kind:
                return None, kind, reason
        self.first_line_of_id[row_id] = line
        if spec.pair:
            return PairExample(row_id, texts[0], texts[1], label), "", ""
        return SentenceExample(row_id, texts[0], label), "", ""


# --------------------------------------------------------------------------------------------------------------
# delimited files (TSV, CSV)
# --------------------------------------------------------------------------------------------------------------
@dataclass
class _Row:
    """One parsed row: ``line`` (1-based first line), ``fields``, ``next_line`` (0-based index of the line after
    it), the quoted fields that span lines as ``(field index, open line, close line)`` (1-based), or a problem:
    ``kind``/``reason`` reported at ``problem_line`` with reading resumed at line index ``resume``."""

    line: int
    fields: list[str]
    next_line: int
    multiline: list[tuple[int, int, int]]
    kind: str = ""
    reason: str = ""
    problem_line: int = 0
    resume: int = 0


class _DelimitedText:
    """A tokenizer for tab/comma-separated text that knows the line of every quote (see the module docstring)."""

    def __init__(self, text: str, delimiter: str, max_field_chars: int) -> None:
        self.text = text
        self.delimiter = delimiter
        self.max_field_chars = max_field_chars
        starts, ends = [0], []
        for match in _LINE_END.finditer(text):
            ends.append(match.start())
            starts.append(match.end())
        if starts[-1] < len(text):
            ends.append(len(text))
        else:
            starts.pop()
        self.starts = starts
        self.ends = ends
        self.num_lines = len(starts)

    def _line_of(self, pos: int) -> int:
        return bisect.bisect_right(self.starts, pos) - 1

    def content(self, k: int) -> str:
        return self.text[self.starts[k] : self.ends[k]]

    def is_blank(self, k: int) -> bool:
        return not self.content(k).strip(" ")

    def row(self, k: int) -> _Row:
        """Parse the row starting at line index ``k`` (not blank)."""
        content = self.content(k)
        if '"' not in content:
            return _Row(k + 1, content.split(self.delimiter), k + 1, [])
        text, delimiter, n = self.text, self.delimiter, len(self.text)
        fields: list[str] = []
        multiline: list[tuple[int, int, int]] = []
        pos, line = self.starts[k], k
        while True:
            if pos < n and text[pos] == '"':
                open_line = line
                column = len(fields) + 1
                pos += 1
                parts = []
                while True:
                    quote = text.find('"', pos)
                    if quote == -1:
                        swallowed = self.num_lines - open_line - 1
                        return self._problem(
                            k, fields, "unclosed quote", open_line,
                            f"field {column} opens with a quote that is never closed (it would swallow the "
                            f"{swallowed} line(s) after it; inside a quoted field write a quote as \"\")",
                        )  # fmt: skip
                    parts.append(text[pos:quote])
                    if quote + 1 < n and text[quote + 1] == '"':
                        parts.append('"')
                        pos = quote + 2
                        continue
                    pos = quote + 1
                    break
                value = "".join(parts)
                line = self._line_of(quote)
                if line != open_line:
                    multiline.append((len(fields), open_line + 1, line + 1))
                if pos < n and text[pos] not in "\r\n" and text[pos] != delimiter:
                    if line != open_line:
                        reason = (
                            f"field {column} opens with a quote that closes only on line {line + 1}, followed by "
                            f"{self._snippet(pos, line)!r} instead of a separator or the line end: unclosed quote? "
                            f'(inside a quoted field write a quote as "")'
                        )
                    else:
                        reason = (
                            f"field {column}: text {self._snippet(pos, line)!r} follows the closing quote (a field "
                            f'that starts with a quote must end with one; write a quote inside it as "")'
                        )
                    return self._problem(k, fields, "unclosed quote", open_line, reason)
                if len(value) > self.max_field_chars:
                    what, hint = f"field {column}", ""
                    if line != open_line:
                        what = f"the quoted field {column} runs from here to line {line + 1} and"
                        hint = " (an unclosed quote?)"
                    return self._problem(
                        k, fields, "field too long", open_line,
                        f"{what} has {len(value)} characters, more than max_field_chars={self.max_field_chars}"
                        f"{hint}",
                    )  # fmt: skip
                fields.append(value)
                if pos < n and text[pos] == delimiter:
                    pos += 1
                    continue
                return _Row(k + 1, fields, line + 1, multiline)
            end = self.ends[line]
            cut = text.find(delimiter, pos, end)
            if cut == -1:
                fields.append(text[pos:end])
                return _Row(k + 1, fields, line + 1, multiline)
            fields.append(text[pos:cut])
            pos = cut + 1

    def _snippet(self, pos: int, line: int) -> str:
        return self.text[pos : min(pos + 20, self.ends[line])].split(self.delimiter)[0]

    def _problem(self, k: int, fields: list[str], kind: str, open_line: int, reason: str) -> _Row:
        return _Row(k + 1, fields, open_line + 1, [], kind, reason, open_line + 1, open_line + 1)


def _split_hint(header_line: str, delimiter: str, needed: Sequence[str]) -> str:
    other, name, fmt = ("\t", "tabs", "tsv") if delimiter == "," else (",", "commas", "csv")
    names = [field.strip() for field in header_line.split(other)]
    if all(column in names for column in needed):
        return f'; the header splits on {name} into the needed columns: is the file {fmt}? (set "format": "{fmt}")'
    return ""


def _read_delimited(
    path: Path, text: str, delimiter: str, spec: TaskSpec, labelled: bool, strict: bool, max_field_chars: int
) -> tuple[list[Example], list[BadRow]]:
    parsed = _DelimitedText(text, delimiter, max_field_chars)
    k = 0
    while k < parsed.num_lines and parsed.is_blank(k):
        k += 1
    if k == parsed.num_lines:
        raise DataError(path, 1, "empty file (a header row and at least one data row are needed)")
    head = parsed.row(k)
    if head.kind:
        raise DataError(path, head.problem_line, f"header row: {head.reason}")
    header = head.fields
    if any(_has_bad_utf8(name) for name in header):
        raise DataError(path, head.line, "header row is not valid UTF-8")
    if any("\x00" in name for name in header):
        raise DataError(path, head.line, "header row holds a NUL byte")
    roles = [role for role in ("id", "text", "text_pair") if role in spec.columns]
    if labelled:
        roles.append("label")
    needed = [spec.columns[role] for role in roles]
    columns = {name: i for i, name in reversed(list(enumerate(header)))}  # first occurrence wins
    missing = [name for name in needed if name not in columns]
    if missing:
        raise DataError(
            path,
            head.line,
            f"header lacks column(s) {', '.join(missing)} (header: {header!r}; needed: {', '.join(needed)})"
            + _split_hint(parsed.content(k), delimiter, needed),
        )
    index = {role: columns[spec.columns[role]] for role in roles}
    width = len(header)
    separated = "tab-separated" if delimiter == "\t" else "comma-separated"

    checker = _RowChecker(spec, labelled)
    bad_utf8, has_nul = _has_bad_utf8(text), "\x00" in text  # per-row checks only when the file needs them
    examples: list[Example] = []
    bad_rows: list[BadRow] = []
    k = head.next_line
    while k < parsed.num_lines:
        if parsed.is_blank(k):
            k += 1
            continue
        row = parsed.row(k)
        line, kind, reason, k = row.line, row.kind, row.reason, row.next_line
        example = None
        if kind:
            line, k = row.problem_line, row.resume
        elif row.multiline and (
            len(row.fields) != width
            or (
                delimiter == "\t"
                and width >= 2
                and any(row.fields[i].count("\t") >= width - 1 for i, _, _ in row.multiline)
            )
        ):
            field, open_line, close_line = row.multiline[0]
            kind, line, k = "unclosed quote", open_line, open_line
            reason = (
                f"field {field + 1} opens with a quote that closes only on line {close_line}, making a row of "
                f"{len(row.fields)} field(s) (the header has {width})"
                if len(row.fields) != width
                else f"field {field + 1} opens with a quote that closes only on line {close_line} and holds "
                f"whole rows (tabs and line breaks)"
            ) + ': unclosed quote? (inside a quoted field write a quote as "")'
        elif bad_utf8 and any(_has_bad_utf8(field) for field in row.fields):
            kind, reason = "bad UTF-8", "row is not valid UTF-8"
        elif has_nul and any("\x00" in field for field in row.fields):
            column = next(i for i, field in enumerate(row.fields) if "\x00" in field) + 1
            kind, reason = "NUL byte", f"field {column} holds a NUL byte (a binary or corrupt file?)"
        elif len(row.fields) != width:
            kind = "wrong number of fields"
            reason = f"{len(row.fields)} {separated} fields, the header has {width}"
        elif any(len(field) > max_field_chars for field in row.fields):
            column = next(i for i, field in enumerate(row.fields) if len(field) > max_field_chars) + 1
            kind = "field too long"
            reason = (
                f"field {column} has {len(row.fields[column - 1])} characters, more than "
                f"max_field_chars={max_field_chars}"
            )
        else:
            values = {role: row.fields[i] for role, i in index.items()}
            example, kind, reason = checker.example(line, values)
        if kind:
            if strict:
                raise DataError(path, line, f"{reason} (pass strict=False to skip such rows with a warning)")
            bad_rows.append(BadRow(str(path), line, kind, reason))
            continue
        examples.append(example)
    if not examples and not bad_rows:
        raise DataError(path, head.line + 1, "no data rows after the header")
    return examples, bad_rows


# --------------------------------------------------------------------------------------------------------------
# JSON lines
# --------------------------------------------------------------------------------------------------------------
def _read_jsonl(
    path: Path, text: str, spec: TaskSpec, labelled: bool, strict: bool, max_field_chars: int
) -> tuple[list[Example], list[BadRow]]:
    roles = [role for role in ("id", "text", "text_pair") if role in spec.columns]
    if labelled:
        roles.append("label")
    checker = _RowChecker(spec, labelled)
    examples: list[Example] = []
    bad_rows: list[BadRow] = []
    first = True
    for number, content in enumerate(_LINE_END.split(text), start=1):
        if not content.strip():
            continue
        example = None
        if _has_bad_utf8(content):
            kind, reason = "bad UTF-8", "line is not valid UTF-8"
        elif "\x00" in content:
            kind, reason = "NUL byte", "line holds a NUL byte (a binary or corrupt file?)"
        else:
            try:
                obj = json.loads(content)
                kind, reason = "", ""
            except json.JSONDecodeError as err:
                obj = None
                kind, reason = "bad JSON", f"not valid JSON: {err.msg} (column {err.colno})"
            if not kind and not isinstance(obj, dict):
                kind, reason = "bad JSON", f"a JSON {type(obj).__name__}, not an object"
            if not kind:
                missing = [spec.columns[role] for role in roles if spec.columns[role] not in obj]
                if missing and first:
                    raise DataError(
                        path, number,
                        f"the first object lacks key(s) {', '.join(missing)} (its keys: {', '.join(obj)}; "
                        f"needed: {', '.join(spec.columns[role] for role in roles)})",
                    )  # fmt: skip
                first = False
                if missing:
                    kind, reason = "missing key", f"no key(s) {', '.join(missing)}"
                else:
                    values = {role: obj[spec.columns[role]] for role in roles}
                    long = [
                        spec.columns[role]
                        for role in roles
                        if isinstance(values[role], str) and len(values[role]) > max_field_chars
                    ]
                    if long:
                        kind = "field too long"
                        reason = f"{long[0]} is longer than max_field_chars={max_field_chars}"
                    else:
                        example, kind, reason = checker.example(number, values)
        if kind:
            if strict:
                raise DataError(
                    path, number, f"{reason} (pass strict=False to skip such rows with a warning)"
                )
            bad_rows.append(BadRow(str(path), number, kind, reason))
            continue
        examples.append(example)
    if not examples and not bad_rows:
        raise DataError(path, 1, "empty file (one JSON object per line is needed)")
    return examples, bad_rows


# --------------------------------------------------------------------------------------------------------------
# public readers
# --------------------------------------------------------------------------------------------------------------
def read_task_file(
    path: str | os.PathLike,
    task: str | TaskSpec,
    labelled: bool,
    strict: bool = True,
    *,
    format: str | None = None,
    max_field_chars: int = MAX_FIELD_CHARS,
) -> tuple[list[Example], list[BadRow]]:
    """Read one task file (TSV, CSV or JSONL; see the module docstring for the rules and checks).

    Args:
        path: the file.
        task: task name or ``TaskSpec``: which columns to read and how to check the label.
        labelled: read the label column (train/dev files) or not (test files: ``label=None``).
        strict: raise ``DataError`` at the first bad row (``True``) or skip bad rows (``False``).
        format: ``"tsv"``, ``"csv"`` or ``"jsonl"``; default the task's ``format``, else by extension.
        max_field_chars: longest field accepted (characters); longer ones are bad rows.

    Returns:
        ``(examples, bad_rows)`` in file order; ``bad_rows`` is empty when ``strict``. The caller reports them
        (``load_task`` warns); this function does not warn.

    Raises:
        FileNotFoundError: no file at ``path``.
        DataError: empty file, header (or first JSON object) without a needed column, or (``strict``) a bad row.
    """
    spec = get_task(task)
    if not spec.columns:
        raise ValueError(
            f"task {spec.name!r} defines no columns: give columns= or load it with TaskSpec.from_file"
        )
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    if format is None:
        format = spec.format
    if format is None:
        format = FORMAT_BY_EXTENSION.get(path.suffix.lower())
        if format is None:
            raise ValueError(
                f"{path}: cannot tell the format from the extension: pass format='tsv', 'csv' or 'jsonl'"
            )
    if format not in ("tsv", "csv", "jsonl"):
        raise ValueError(f"format must be 'tsv', 'csv' or 'jsonl', got {format!r}")
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(path, 1, "empty file (a header row and at least one data row are needed)")
    text = raw.decode("utf-8", errors="surrogateescape")
    if text.startswith("\ufeff"):
        text = text[1:]
    if format == "jsonl":
        return _read_jsonl(path, text, spec, labelled, strict, max_field_chars)
    return _read_delimited(
        path, text, "\t" if format == "tsv" else ",", spec, labelled, strict, max_field_chars
    )


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


def _is_held_out(example_id: str) -> bool:
    digest = hashlib.sha256(example_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < QUORA_DEV_PERCENT


def hash_split(examples: Sequence[Example]) -> tuple[list[Example], list[Example]]:
    """Split examples into ``(train, dev)`` by a SHA-256 hash of each id (about 90% / 10%; see the docstring)."""
    train, dev = [], []
    for example in examples:
        (dev if _is_held_out(example.id) else train).append(example)
    return train, dev


quora_split = hash_split


def quora_split_sizes(data_dir: str | os.PathLike | None = None) -> dict[str, int]:
    """Rows per ``para`` split and skipped rows: ``{"train": ..., "dev": ..., "skipped": ...}``."""
    path = resolve_data_dir(data_dir) / QUORA_FILE
    examples, bad_rows = read_task_file(path, "para", labelled=True, strict=False)
    train, dev = quora_split(examples)
    return {"train": len(train), "dev": len(dev), "skipped": len(bad_rows)}


def split_path(task: str | TaskSpec, split: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The file of ``split`` of ``task``: task-file paths as they are, built-in names under the data folder.

    Raises:
        ValueError: unknown split, or the task has no file for it.
        FileNotFoundError: a relative file name and no data folder (see ``resolve_data_dir``).
    """
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
    """Load one split of a task as typed examples, in file order.

    Args:
        name: a built-in task (``"sst"``, ``"para"``, ``"sts"``, ``"cfimdb"``) or a ``TaskSpec`` (e.g. from
            ``TaskSpec.from_file``).
        split: ``"train"``, ``"dev"`` or ``"test"``. When a task's ``dev`` file is its ``train`` file (``para``),
            ``train`` / ``dev`` are the hash split described in the module docstring.
        data_dir: folder of relative file names (the built-in tasks); default ``$FASTPALS_DATA_DIR``.
        strict: raise ``DataError`` on the first bad row, or skip bad rows with a ``DataWarning``.

    Returns:
        ``list[SentenceExample]`` (single text) or ``list[PairExample]`` (pairs); labels are ``None`` for
        ``test``.
    """
    spec = get_task(name)
    path = split_path(spec, split, data_dir)
    examples, bad_rows = read_task_file(path, spec, labelled=split != "test", strict=strict)
    _warn_bad_rows(bad_rows, path, len(examples))
    if split in ("train", "dev") and spec.files.get("train") == spec.files.get("dev"):
        train, dev = hash_split(examples)
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
        task: task name or ``TaskSpec`` (kind of example, label dtype).
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
        task: str | TaskSpec,
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
        self.spec = get_task(task)
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
