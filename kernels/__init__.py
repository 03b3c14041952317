"""Triton kernels of fastpals, installed as ``fastpals.kernels``.

Public API (the ops load lazily, on first use, so ``import fastpals.kernels`` is cheap and works without
Triton; :func:`available` says whether the kernels can run here):

- :func:`grouped_linear` / :func:`grouped_linear_varlen`: ``residual + act(x @ W[task].T + b[task])`` for a
  mixed-task batch, one launch for all tasks;
- :func:`pal` / :func:`pal_varlen`: the fused Projected Attention Layer (``pal_reference`` + residual);
- :func:`pal_attention` / :func:`pal_attention_varlen`: the PAL's flash-style attention (small head dims);
- :func:`available`, :func:`use_triton`: the dispatch rule (``$FASTPALS_KERNELS`` = auto | triton | reference).

Several ops share their name with the module defining them (``pal``, ``grouped_linear``, ``pal_attention``):
``fastpals.kernels.pal`` is always the function; import a module's other names with
``from fastpals.kernels.pal import ...``.
"""

from __future__ import annotations

import importlib
import sys
import types

from fastpals.kernels.utils import available, kernel_mode, use_triton

__all__ = [
    "available",
    "grouped_linear",
    "grouped_linear_varlen",
    "kernel_mode",
    "pal",
    "pal_attention",
    "pal_attention_varlen",
    "pal_varlen",
    "use_triton",
]

# exported name -> module holding it
_LAZY = {
    "grouped_linear": "grouped_linear",
    "grouped_linear_varlen": "grouped_linear",
    "pal": "pal",
    "pal_varlen": "pal",
    "pal_attention": "pal_attention",
    "pal_attention_varlen": "pal_attention",
}


def __getattr__(name: str) -> object:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ImportError as exc:
        ok, reason = available()
        raise ImportError(
            f"fastpals.kernels.{name} needs Triton ({reason if not ok else exc}); use the references in "
            "fastpals.functional instead"
        ) from exc
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _KernelsPackage(types.ModuleType):
    """Keeps an exported function from being replaced by the submodule of the same name: the import system
    sets ``package.<submodule>`` after loading a submodule, which would turn ``fastpals.kernels.pal`` from
    the function into the module."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage
