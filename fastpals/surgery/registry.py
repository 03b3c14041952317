"""The aggregators by name: :data:`AGGREGATORS`, :data:`STATEFUL`, :func:`make_weighting` (a ``gram -> w``
callable from a name and string options, for ``--surgery NAME --surgery-opt KEY=VALUE``), and CR-MOGM, which
smooths any stateless aggregator of the registry."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from fastpals.surgery import weights_basic, weights_extra, weights_solved
from fastpals.surgery.weights_basic import weights_dtype

__all__ = [
    "AGGREGATORS",
    "STATEFUL",
    "CRMOGMState",
    "crmogm_weights",
    "make_weighting",
    "parse_surgery_options",
]

F64 = torch.float64


class CRMOGMState(weights_extra.WeightsState):
    """CR-MOGM's smoothed weights ``lambda [T]`` (float64, on the Gram's device; ``None`` before the first call)."""


def crmogm_weights(
    gram: torch.Tensor,
    state: CRMOGMState,
    generator: torch.Generator | None = None,
    *,
    base: str = "mgda",
    alpha: float = 0.9,
) -> torch.Tensor:
    """CR-MOGM (Zhou et al., "On the Convergence of Stochastic Multi-Objective Gradient Manipulation", NeurIPS
    2022): the weights of the stateless aggregator ``base`` (default ``mgda``, with its default options),
    smoothed across calls, ``lambda <- alpha lambda + (1 - alpha) lambda_hat`` (the first call returns
    ``lambda_hat``). ``state`` is a :class:`CRMOGMState`.

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32)."""
    if not isinstance(state, CRMOGMState):
        raise TypeError(f"crmogm needs a CRMOGMState, got {type(state).__name__}")
    if base not in AGGREGATORS or base in STATEFUL:
        stateless = ", ".join(k for k in AGGREGATORS if k not in STATEFUL and k != "constant")
        raise ValueError(f"crmogm: option base={base!r} must be a stateless weighting: {stateless}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"crmogm: alpha must be in [0, 1], got {alpha}")
    lam_hat = AGGREGATORS[base](gram, generator).to(F64)
    t = lam_hat.shape[0]
    if state.weights is None or state.weights.shape != (t,):
        lam = lam_hat
    else:
        lam = (
            alpha * state.weights.to(device=lam_hat.device, dtype=F64, non_blocking=True)
            + (1.0 - alpha) * lam_hat
        )
    state.weights = lam
    return lam.to(weights_dtype(gram))


AGGREGATORS: dict[str, Callable[..., torch.Tensor]] = {
    "sum": weights_basic.sum_weights,
    "mean": weights_basic.mean_weights,
    "pcgrad": weights_basic.pcgrad_weights,
    "gem": weights_basic.gem_weights,
    "upgrad": weights_solved.upgrad_weights,
    "mgda": weights_solved.mgda_weights,
    "dualproj": weights_solved.dualproj_weights,
    "imtlg": weights_solved.imtlg_weights,
    "cagrad": weights_solved.cagrad_weights,
    "alignedmtl": weights_solved.alignedmtl_weights,
    "fairgrad": weights_solved.fairgrad_weights,
    "nashmtl": weights_solved.nashmtl_weights,
    "gradvac": weights_solved.gradvac_weights,
    "constant": weights_extra.constant_weights,
    "random": weights_extra.random_weights,
    "krum": weights_extra.krum_weights,
    "modo": weights_extra.modo_weights,
    "sdmgrad": weights_extra.sdmgrad_weights,
    "crmogm": crmogm_weights,
}
"""Name -> aggregator ``fn(gram, [state,] generator=None, **options) -> w``."""

STATEFUL: dict[str, type] = {
    "nashmtl": weights_solved.NashMTLState,
    "gradvac": weights_solved.GradVacState,
    "modo": weights_extra.MoDoState,
    "sdmgrad": weights_extra.SDMGradState,
    "crmogm": CRMOGMState,
}
"""Names whose function takes a state object (second argument / ``state=``), and the state's class."""

# options settable from strings; everything else in a signature (generator, orders, state) is not an option
_NOT_OPTIONS = {"gram", "generator", "state", "orders", "constraints"}


def _options(name: str) -> dict[str, inspect.Parameter]:
    sig = inspect.signature(AGGREGATORS[name])
    return {k: p for k, p in sig.parameters.items() if k not in _NOT_OPTIONS}


def _parse(name: str, key: str, value: Any, default: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if key in ("pref_vector", "weights") or (key == "proposal" and "," in text):
            return torch.tensor([float(x) for x in text.split(",")], dtype=F64)
        if key == "proposal":
            return int(text) if text.lstrip("-").isdigit() else text
        if isinstance(default, bool):
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError(text)
        if isinstance(default, int) or (default is None and key in ("max_iter", "max_iters", "sweeps")):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError:
        raise ValueError(f"surgery {name}: option {key}={value!r} is not a valid value") from None
    return text


def make_weighting(name: str, **options: Any) -> tuple[Callable[..., torch.Tensor], Any]:
    """Build the weighting ``name`` of :data:`AGGREGATORS` with ``options`` (values may be strings, as from
    ``--surgery-opt KEY=VALUE``; they are parsed by the option's default type; ``pref_vector`` is comma-separated).

    Returns ``(fn, state)``: ``fn(gram, generator=None) -> w [T]`` (the signature
    :meth:`TaskGradientBuffer.apply` calls) and the state object of a stateful method (``None`` otherwise; keep it
    in checkpoints through its ``state_dict()`` / ``load_state_dict()``; ``fn`` closes over it).
    Raises ``ValueError`` (one line) for an unknown name or option or an unparsable value.
    """
    key = str(name).lower()
    if key not in AGGREGATORS:
        raise ValueError(f"unknown surgery method {name!r}; choose one of {', '.join(AGGREGATORS)}")
    allowed = _options(key)
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
