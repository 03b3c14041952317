"""The compiled weight solve ``torch.ops.fastpals.solve_weights`` (``csrc/``): one op call per Gram -> weights
solve, from the extension ``fastpals._C`` or built just in time with ninja; without it (or with
``FASTPALS_SOLVE=torch``) the aggregators' PyTorch solvers run. The first solve prints which.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastpals_kernels.extension import CSRC, build, extension_cache_dir

CPU_SOURCES = ("solve_weights.cpp",)
CUDA_SOURCES = ("solve_weights_cuda.cu",)
#: the build's name (its folder under :func:`extension_cache_dir`)
NAME = "fastpals_solve_weights"

_state: dict[str, object] = {}


def build_directory() -> Path:
    """The folder of this op's just-in-time build."""
    return extension_cache_dir() / NAME


def _fake(gram: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return gram.new_empty((gram.shape[0],))  # w [T], whatever the rest


def load() -> bool:
    """Load (or build) the op once per process, print which solver path runs; True if the op is there."""
    if "ok" in _state:
        return bool(_state["ok"])
    if os.environ.get("FASTPALS_SOLVE", "").lower() == "torch":
        _state["ok"], how = False, "FASTPALS_SOLVE=torch: weight solves run as PyTorch ops"
    elif hasattr(torch.ops.fastpals, "solve_weights"):
        _state["ok"], how = True, None
    else:
        try:
            spec = importlib.util.find_spec("fastpals._C")
            if spec is not None and spec.origin:
                torch.ops.load_library(spec.origin)
                how = f"compiled weight solve from the installed extension {spec.origin}"
            elif (CSRC / CPU_SOURCES[0]).is_file():
                how = "compiled weight solve " + build(NAME, CPU_SOURCES, CUDA_SOURCES, ["-ffp-contract=off"])
            else:
                raise RuntimeError("neither the extension fastpals._C nor the csrc/ sources are installed")
            _state["ok"] = True
        except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch solvers run
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _state["ok"], how = False, f"weight solves run as PyTorch ops (no compiled solve: {reason})"
    if _state["ok"] and not hasattr(torch.ops.fastpals.solve_weights.default, "_fastpals_fake"):
        with contextlib.suppress(RuntimeError):  # registered by an earlier load of this module
            torch.library.register_fake("fastpals::solve_weights")(_fake)
        torch.ops.fastpals.solve_weights.default._fastpals_fake = True
    if how:
        print(f"fastpals: {how}", file=sys.stderr)
    return bool(_state["ok"])


def enabled(gram: torch.Tensor) -> bool:
    """Whether ``gram``'s solve goes through the compiled op: it is loaded and has a kernel for the device."""
    if os.environ.get("FASTPALS_SOLVE", "").lower() == "torch" or not load():
        return False
    key = "CUDA" if gram.device.type == "cuda" else "CPU" if gram.device.type in ("cpu", "meta") else None
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("fastpals::solve_weights", key)


def solve_weights(
    gram: torch.Tensor,
    method: str,
    vec: torch.Tensor | None,
    params: Sequence[float],
    state: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w [T]`` for the op code ``method`` with ``vec``, ``params``, ``state`` (``csrc/solvers.h``)."""
    if gram.dtype != torch.float64:
        gram = gram.to(torch.float32)
    return torch.ops.fastpals.solve_weights(gram, method, vec, [float(p) for p in params], state)
