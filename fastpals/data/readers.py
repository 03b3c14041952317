"""The TSV, CSV and JSONL readers of one task file (:func:`read_task_file`) and the example types. Every row
is checked (UTF-8, NUL, fields, ids, texts, label); a quote never closed is one bad row at its opening line,
so it cannot swallow the rows below. A bad row raises :class:`DataError` with ``strict``, else is skipped."""

from __future__ import annotations

import bisect
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastpals.data.tasks import FORMAT_BY_EXTENSION, TaskSpec, get_task

MAX_FIELD_CHARS = 131_072  # the csv module's default field limit
_LINE_END = re.compile(r"\r\n|\n|\r")


class DataError(ValueError):
    """A task file is malformed. ``path``, ``line`` (1-based, of the row's first line) and ``reason`` say where."""

    def __init__(self, path: str | os.PathLike, line: int, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
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


# bytes that are not UTF-8 decode to lone surrogates U+DC80..U+DCFF under errors="surrogateescape"
_find_bad_utf8 = re.compile("[\udc80-\udcff]").search


class _RowChecker:
    """Turns the id / text / label values of one row into an example, or a ``(kind, reason)`` problem."""

    def __init__(self, spec: TaskSpec, labelled: bool) -> None:
        self.spec, self.labelled = spec, labelled
        self.text_roles = ("text", "text_pair") if spec.pair else ("text",)
        roles = [role for role in ("id", "text", "text_pair") if role in spec.columns]
        self.roles = roles + ["label"] if labelled else roles  # the columns read
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
                reason = f"id {row_id!r} holds a comma, tab or line break (prediction files cannot)"
                return None, "bad id", reason
            if row_id in self.first_line_of_id:
                return None, "duplicate id", f"id {row_id} already on line {self.first_line_of_id[row_id]}"
        else:
            row_id = f"line{line}"
        texts = [values[role] for role in self.text_roles]
        for role, text in zip(self.text_roles, texts):
            if not isinstance(text, str):
                return None, "bad text", f"{spec.columns[role]} {text!r} is not a string"
        empty = [spec.columns[role] for role, text in zip(self.text_roles, texts) if not text.strip()]
        if empty:
            return None, "empty sentence", f"empty {' and '.join(empty)}"
        label = None
        if self.labelled:
            label, kind, reason = spec.task_kind.parse_label(spec, values["label"])
            if kind:
                return None, kind, reason
        self.first_line_of_id[row_id] = line
        if spec.pair:
            return PairExample(row_id, texts[0], texts[1], label), "", ""
        return SentenceExample(row_id, texts[0], label), "", ""


@dataclass
class _Row:
    """One parsed row: ``line`` (1-based first line), ``fields``, ``next_line`` (0-based index of the line after
    it), the quoted fields that span lines as ``(field index, open line, close line)`` (1-based); for a
    problem ``kind``/``reason``, ``line`` is the opening quote's and ``next_line`` the one after it."""

    line: int
    fields: list[str]
    next_line: int
    multiline: list[tuple[int, int, int]]
    kind: str = ""
    reason: str = ""


class _DelimitedText:
    """A tokenizer for tab/comma-separated text that knows the line of every quote."""

    def __init__(self, text: str, delimiter: str, max_field_chars: int) -> None:
        self.text, self.delimiter, self.max_field_chars = text, delimiter, max_field_chars
        starts, ends = [0], []
        for match in _LINE_END.finditer(text):
            ends.append(match.start())
            starts.append(match.end())
        if starts[-1] < len(text):
            ends.append(len(text))
        else:
            starts.pop()
        self.starts, self.ends, self.num_lines = starts, ends, len(starts)

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
                open_line, column = line, len(fields) + 1
                pos += 1
                parts = []
                while True:
                    quote = text.find('"', pos)
                    if quote == -1:
                        swallowed = self.num_lines - open_line - 1
                        return self._problem(
                            fields, "unclosed quote", open_line,
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
                line = bisect.bisect_right(self.starts, quote) - 1
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
                    return self._problem(fields, "unclosed quote", open_line, reason)
                if len(value) > self.max_field_chars:
                    what, hint = f"field {column}", ""
                    if line != open_line:
                        what = f"the quoted field {column} runs from here to line {line + 1} and"
                        hint = " (an unclosed quote?)"
                    return self._problem(
                        fields, "field too long", open_line,
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

    def _problem(self, fields: list[str], kind: str, open_line: int, reason: str) -> _Row:
        return _Row(open_line + 1, fields, open_line + 1, [], kind, reason)


def _split_hint(header_line: str, delimiter: str, needed: Sequence[str]) -> str:
    other, name, fmt = ("\t", "tabs", "tsv") if delimiter == "," else (",", "commas", "csv")
    names = [field.strip() for field in header_line.split(other)]
    if all(column in names for column in needed):
        return f'; the header splits on {name} into the needed columns: is the file {fmt}? (set "format": "{fmt}")'
    return ""


def _delimited_rows(
    path: Path, text: str, delimiter: str, spec: TaskSpec, labelled: bool, max_field_chars: int
) -> Iterator[tuple[int, Example | None, str, str]]:
    """``(line, example, problem kind, reason)`` of each data row of a TSV/CSV text."""
    parsed = _DelimitedText(text, delimiter, max_field_chars)
    k = 0
    while k < parsed.num_lines and parsed.is_blank(k):
        k += 1
    if k == parsed.num_lines:
        raise DataError(path, 1, "empty file (a header row and at least one data row are needed)")
    head = parsed.row(k)
    if head.kind:
        raise DataError(path, head.line, f"header row: {head.reason}")
    header = head.fields
    if any(_find_bad_utf8(name) for name in header):
        raise DataError(path, head.line, "header row is not valid UTF-8")
    if any("\x00" in name for name in header):
        raise DataError(path, head.line, "header row holds a NUL byte")
    checker = _RowChecker(spec, labelled)
    roles = checker.roles
    needed = [spec.columns[role] for role in roles]
    columns = {name: i for i, name in reversed(list(enumerate(header)))}  # first occurrence wins
    missing = [name for name in needed if name not in columns]
    if missing:
        raise DataError(
            path, head.line,
            f"header lacks column(s) {', '.join(missing)} (header: {header!r}; needed: {', '.join(needed)})"
            + _split_hint(parsed.content(k), delimiter, needed),
        )  # fmt: skip
    index = {role: columns[spec.columns[role]] for role in roles}
    width, separated = len(header), "tab-separated" if delimiter == "\t" else "comma-separated"

    bad_utf8, has_nul = _find_bad_utf8(text), "\x00" in text  # per-row checks only when the file needs them
    k, rows = head.next_line, 0
    while k < parsed.num_lines:
        if parsed.is_blank(k):
            k += 1
            continue
        row = parsed.row(k)
        line, kind, reason, k = row.line, row.kind, row.reason, row.next_line
        example = None
        if kind:
            pass  # reported at its opening quote, reading resumes on the line after it
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
        elif bad_utf8 and any(_find_bad_utf8(field) for field in row.fields):
            kind, reason = "bad UTF-8", "row is not valid UTF-8"
        elif has_nul and any("\x00" in field for field in row.fields):
            column = next(i for i, field in enumerate(row.fields) if "\x00" in field) + 1
            kind, reason = "NUL byte", f"field {column} holds a NUL byte (a binary or corrupt file?)"
        elif len(row.fields) != width:
            kind = "wrong number of fields"
            reason = f"{len(row.fields)} {separated} fields, the header has {width}"
        elif any(len(field) > max_field_chars for field in row.fields):
            column = next(i for i, field in enumerate(row.fields) if len(field) > max_field_chars) + 1
            size, kind = len(row.fields[column - 1]), "field too long"
            reason = f"field {column} has {size} characters, more than max_field_chars={max_field_chars}"
        else:
            example, kind, reason = checker.example(line, {role: row.fields[i] for role, i in index.items()})
        rows += 1
        yield line, example, kind, reason
    if not rows:
        raise DataError(path, head.line + 1, "no data rows after the header")


def _jsonl_rows(
    path: Path, text: str, spec: TaskSpec, labelled: bool, max_field_chars: int
) -> Iterator[tuple[int, Example | None, str, str]]:
    """``(line, example, problem kind, reason)`` of each object line of a JSONL text."""
    checker = _RowChecker(spec, labelled)
    roles = checker.roles
    keys = [spec.columns[role] for role in roles]
    first, rows = True, 0
    for number, content in enumerate(_LINE_END.split(text), start=1):
        if not content.strip():
            continue
        rows += 1
        example, kind, reason, obj = None, "", "", None
        if _find_bad_utf8(content):
            kind, reason = "bad UTF-8", "line is not valid UTF-8"
        elif "\x00" in content:
            kind, reason = "NUL byte", "line holds a NUL byte (a binary or corrupt file?)"
        else:
            try:
                obj = json.loads(content)
            except json.JSONDecodeError as err:
                kind, reason = "bad JSON", f"not valid JSON: {err.msg} (column {err.colno})"
        if not kind and not isinstance(obj, dict):
            kind, reason = "bad JSON", f"a JSON {type(obj).__name__}, not an object"
        if not kind:
            missing = [key for key in keys if key not in obj]
            if missing and first:
                raise DataError(
                    path, number,
                    f"the first object lacks key(s) {', '.join(missing)} (its keys: {', '.join(obj)}; "
                    f"needed: {', '.join(keys)})",
                )  # fmt: skip
            first = False
            long = [key for key in keys if isinstance(obj.get(key), str) and len(obj[key]) > max_field_chars]
            if missing:
                kind, reason = "missing key", f"no key(s) {', '.join(missing)}"
            elif long:
                kind, reason = "field too long", f"{long[0]} is longer than max_field_chars={max_field_chars}"
            else:
                example, kind, reason = checker.example(
                    number, {role: obj[spec.columns[role]] for role in roles}
                )
        yield number, example, kind, reason
    if not rows:
        raise DataError(path, 1, "empty file (one JSON object per line is needed)")


def read_task_file(
    path: str | os.PathLike,
    task: str | TaskSpec,
    labelled: bool,
    strict: bool = True,
    *,
    format: str | None = None,
    max_field_chars: int = MAX_FIELD_CHARS,
) -> tuple[list[Example], list[BadRow]]:
    """``(examples, bad_rows)`` of one task file in file order, without warning. ``task`` says the columns and
    label rules; ``labelled``: read labels (else ``None``); ``strict``: raise ``DataError`` at the first bad row
    (else skip it); ``format``: default the task's, else by extension; fields over ``max_field_chars`` are bad.
    ``DataError`` also for an empty file or a missing column."""
    spec = get_task(task)
    if not spec.columns:
        raise ValueError(
            f"task {spec.name!r} defines no columns: give columns= or load it with TaskSpec.from_file"
        )
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    if format is None:
        format = spec.format or FORMAT_BY_EXTENSION.get(path.suffix.lower())
        if format is None:
            raise ValueError(
                f"{path}: cannot tell the format from the extension: pass format='tsv', 'csv' or 'jsonl'"
            )
    if format not in ("tsv", "csv", "jsonl"):
        raise ValueError(f"format must be 'tsv', 'csv' or 'jsonl', got {format!r}")
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(path, 1, "empty file (a header row and at least one data row are needed)")
    text = raw.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    if format == "jsonl":
        rows = _jsonl_rows(path, text, spec, labelled, max_field_chars)
    else:
        rows = _delimited_rows(path, text, "\t" if format == "tsv" else ",", spec, labelled, max_field_chars)
    examples: list[Example] = []
    bad_rows: list[BadRow] = []
    for line, example, kind, reason in rows:
        if not kind:
            examples.append(example)
        elif strict:
            raise DataError(path, line, f"{reason} (pass strict=False to skip such rows with a warning)")
        else:
            bad_rows.append(BadRow(str(path), line, kind, reason))
    return examples, bad_rows
