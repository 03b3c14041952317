"""Fused kernels of fastpals and the dispatch that picks them.

Public API (the Triton ops load lazily, on first use, so ``import fastpals_kernels`` is cheap and works without
Triton; :func:`available` says whether the kernels can run here):

- :func:`grouped_linear` / :func:`grouped_linear_varlen`: ``residual + act(x @ W[task].T + b[task])`` for a
  mixed-task batch, one launch for all tasks (Triton);
- :func:`pal` / :func:`pal_varlen`: the fused Projected Attention Layer (``pal_reference`` + residual) (Triton);
- :func:`pal_attention` / :func:`pal_attention_varlen`: the PAL's flash-style attention, small head dims (Triton);
- :func:`gram` / :func:`combine`: the gradient-surgery buffer ops, dispatching to Triton or the reference;
- :func:`available`, :func:`use_triton`, :func:`kernel_mode`, :func:`backend`, :func:`decide`: the dispatch
  (:mod:`fastpals_kernels.dispatch`; ``$FASTPALS_KERNELS`` = auto | triton | reference).

Layout: ``*_triton.py`` hold the Triton kernels and their host wrappers (the PAL attention's kernels are in
:mod:`~fastpals_kernels.pal_attention_kernels`), :mod:`~fastpals_kernels.tl_helpers`
their shared Triton building blocks, :mod:`~fastpals_kernels.common` the shared host-side helpers (no Triton),
:mod:`~fastpals_kernels.dispatch` the backend decision; the references are in :mod:`fastpals.functional`.
"""

from __future__ import annotations

import importlib

from fastpals_kernels import library  # noqa: F401 - registers torch.ops.fastpals
from fastpals_kernels.combine import combine
from fastpals_kernels.dispatch import available, backend, decide, kernel_mode, use_triton
from fastpals_kernels.gram import gram
from fastpals_kernels.grouped_linear import grouped_linear, grouped_linear_varlen

__all__ = [
    "available",
    "backend",
    "combine",
    "decide",
    "gram",
    "grouped_linear",
    "grouped_linear_varlen",
    "kernel_mode",
    "pal",
    "pal_attention",
    "pal_attention_varlen",
    "pal_varlen",
    "use_triton",
]

# exported Triton op -> module holding it; loaded on first use: Triton is optional (Linux only) and its import
# costs about 0.5 s, which `import fastpals` on a CPU never needs
_LAZY = {
    "pal": "pal_triton",
    "pal_varlen": "pal_triton",
    "pal_attention": "pal_attention_triton",
    "pal_attention_varlen": "pal_attention_triton",
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
            f"fastpals_kernels.{name} needs Triton ({reason if not ok else exc}); use the references in "
            "fastpals.functional instead"
        ) from exc
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
