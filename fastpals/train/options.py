"""The field helper of :class:`fastpals.train.args.TrainArgs`: :func:`opt` declares one command-line option as a
dataclass field whose metadata :mod:`fastpals.train.command` reads; :func:`option_flag` spells it and
:func:`jsonable` makes values JSON-ready for ``train_args.json``."""

from __future__ import annotations

from dataclasses import field
from typing import Any

__all__ = ["MAY", "jsonable", "opt", "option_flag"]


def opt(
    help: str,
    *,
    resume: str = "match",
    type: type | None = None,
    choices: tuple[str, ...] | None = None,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    hidden: bool = False,
    default: Any = None,
    factory: Any = None,
) -> Any:
    """A :class:`~fastpals.train.args.TrainArgs` field: ``help`` text, ``resume`` ``"match"`` (must equal the saved run's value on
    ``--resume``) or ``"may_change"``, argparse ``type``/``choices``/``metavar``, extra ``flags`` spellings, and
    ``hidden`` (left out of ``--help``: test-only options)."""
    assert resume in ("match", "may_change"), resume
    meta = {"help": help, "resume": resume, "type": type, "choices": choices, "flags": flags,
            "metavar": metavar, "hidden": hidden}  # fmt: skip
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


#: ``resume=MAY``: an option a resumed run may give anew
MAY = "may_change"


def option_flag(name: str) -> str:
    """The command-line spelling of option ``name``: ``"--" + name`` with ``_`` as ``-`` (``lr`` -> ``--lr``)."""
    return "--" + name.replace("_", "-")


def jsonable(value: Any) -> Any:
    """``value`` as JSON data: lists and tuples as lists (items converted), str/int/float/bool/None as they are,
    anything else as ``str(value)``."""
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return str(value)
