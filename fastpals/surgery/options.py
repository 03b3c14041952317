"""Aggregators from command-line options (``--surgery NAME --surgery-opt KEY=VALUE``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from fastpals.surgery.weights_solved import AGGREGATORS, STATEFUL

__all__ = ["make_weighting", "parse_surgery_options"]

# the parameters of an aggregator that are not options settable from strings
_NOT_OPTIONS = {"gram", "generator", "state", "orders", "constraints"}


def _parse(name: str, key: str, value: Any, default: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if key in ("pref_vector", "weights") or (key in ("proposal", "tau") and "," in text):
            return torch.tensor([float(x) for x in text.split(",")], dtype=torch.float64)
        if key == "proposal":
            return int(text) if text.lstrip("-").isdigit() else text
        if isinstance(default, bool):
            return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[
                text.lower()
            ]
        if isinstance(default, int) or (default is None and key in ("max_iter", "max_iters", "sweeps")):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except (ValueError, KeyError):
        raise ValueError(f"surgery {name}: option {key}={value!r} is not a valid value") from None
    return text


def make_weighting(name: str, **options: Any) -> tuple[Callable[..., torch.Tensor], Any]:
    """Build the aggregator ``name`` of :data:`AGGREGATORS` with ``options`` (strings, as from ``--surgery-opt
    KEY=VALUE``, are parsed by the option's default type; vectors are comma-separated). Returns ``(fn, state)``:
    ``fn(gram, generator=None) -> w [T]`` and the state object of a stateful method (``None`` otherwise), which
    ``fn`` closes over. Raises a one-line ``ValueError`` for an unknown name or option or a bad value.
    """
    key = str(name).lower()
    if key not in AGGREGATORS:
        raise ValueError(f"unknown surgery method {name!r}; choose one of {', '.join(AGGREGATORS)}")
    params = inspect.signature(AGGREGATORS[key]).parameters
    allowed = {k: p for k, p in params.items() if k not in _NOT_OPTIONS}
    parsed: dict[str, Any] = {}
    for opt, value in options.items():
        if opt not in allowed:
            known = ", ".join(allowed) or "none"
            raise ValueError(f"surgery {key}: unknown option {opt!r} (options: {known})")
        parsed[opt] = _parse(key, opt, value, allowed[opt].default)
    fn = AGGREGATORS[key]
    state = STATEFUL[key]() if key in STATEFUL else None

    def weighting(gram: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if state is not None:
            return fn(gram, state, generator, **parsed)
        return fn(gram, generator, **parsed)

    weighting.reads_rows = getattr(fn, "reads_rows", False)  # type: ignore[attr-defined]
    weighting.__name__ = f"{key}_weighting"
    weighting.__qualname__ = weighting.__name__
    return weighting, state


def parse_surgery_options(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["c=0.5", "alpha=2"] -> {"c": "0.5", "alpha": "2"}`` (for ``--surgery-opt KEY=VALUE``, repeatable)."""
    out: dict[str, str] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--surgery-opt expects KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        out[k.strip()] = v.strip()
    return out
