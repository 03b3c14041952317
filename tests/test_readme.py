"""The README's Python: every import line of its code blocks (and of docs/api.md's) works, and the quick use (its
first block: the embedded MiniLM with PALs, one mixed batch, save and load) runs as printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def import_lines(block: str) -> list[str]:
    return [line for line in block.splitlines() if re.match(r"(import|from) \S+", line)]


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md"])
def test_every_import_shown_works(doc):
    lines = [line for block in python_blocks(ROOT / doc) for line in import_lines(block)]
    assert lines, f"{doc} shows no Python imports"
    for line in lines:
        exec(compile(line, f"{doc}: {line}", "exec"), {})


def test_quick_use_runs(tmp_path, monkeypatch, capsys):
    block = python_blocks(ROOT / "README.md")[0]
    assert "MultiTaskBert.from_base" in block and "save_pretrained" in block
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md: quick use", "exec"), {})
    assert (tmp_path / "my_model" / "config.json").is_file()
    assert capsys.readouterr().out.strip()
