"""The package layout of docs/architecture.md: few modules at the top, every module of every package named in the
page's table (the layers themselves are checked by ``lint-imports`` in ``make lint``)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "encoder", "adapters", "model", "surgery", "train", "commands", "integrations")


def test_at_most_five_modules_sit_directly_in_the_package():
    top = sorted(p.name for p in (ROOT / "fastpals").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 5, top


def test_every_module_is_in_the_architecture_table():
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)/` \| (.*) \|$", page, flags=re.M))
    assert set(rows) == set(PACKAGES), sorted(rows)
    missing = [
        f"fastpals/{pkg}/{path.name}"
        for pkg in PACKAGES
        for path in sorted((ROOT / "fastpals" / pkg).glob("*.py"))
        if path.name != "__init__.py" and f"`{path.stem}`" not in rows[pkg]
    ]
    assert not missing, f"not in docs/architecture.md's table: {missing}"
