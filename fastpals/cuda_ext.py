"""The optional compiled CUDA extension ``fastpals._C`` (sources in ``csrc/``).

It holds the two memory-bound passes of gradient surgery as plain CUDA kernels: the T×T Gram matrix of a
``[T, P]`` buffer of per-task gradients (fp32 accumulation, fused finite check) and the weighted combination
``out = w @ buf``. ``pip install .`` builds it where CUDA and a compiler exist (``FASTPALS_BUILD_CUDA=0`` skips
it); otherwise :func:`load` can JIT-build it with ninja. Everything in fastpals works without it: the Triton
kernels and the PyTorch references cover the same ops.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["available", "combine", "gram", "load"]

_SOURCES = ("surgery_kernels.cu", "bindings.cpp")
_module: ModuleType | None = None
_error: str | None = None


def _csrc_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "csrc"


def load(build: bool = True) -> ModuleType:
    """Return the extension: the installed ``fastpals._C``, else (``build=True``) a JIT build of ``csrc/``.

    Raises ``RuntimeError`` saying why it is not available (no CUDA device, no nvcc/ninja, no sources).
    """
    global _module, _error
    if _module is not None:
        return _module
    try:
        from fastpals import _C  # type: ignore[attr-defined]

        _module = _C
        return _module
    except ImportError:
        pass
    if not torch.cuda.is_available():
        raise RuntimeError("fastpals._C is not built and there is no CUDA device to build it for")
    if torch.version.cuda is None:
        raise RuntimeError("this torch build has no CUDA support")
    sources = [_csrc_dir() / s for s in _SOURCES]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise RuntimeError(f"CUDA sources not found: {missing} (installed from a wheel without csrc/?)")
    if not build:
        raise RuntimeError("fastpals._C is not built (pip install . on a machine with CUDA builds it)")
    for tool in ("nvcc", "ninja"):
        if shutil.which(tool) is None and not (tool == "nvcc" and os.environ.get("CUDA_HOME")):
            raise RuntimeError(f"{tool} not found on PATH: cannot JIT-build fastpals._C")
    from torch.utils.cpp_extension import load as jit_load

    _module = jit_load(name="fastpals_C", sources=[str(s) for s in sources], extra_cuda_cflags=["-O3"])
    return _module


def available() -> tuple[bool, str]:
    """(True, how) if the extension can be used, else (False, why not). Never builds."""
    try:
        load(build=False)
        return True, "fastpals._C"
    except RuntimeError as e:
        return False, str(e)


def _check(buf: torch.Tensor) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dim() != 2:
        raise ValueError("buf must be a [T, P] tensor")
    if not buf.is_cuda:
        raise ValueError(f"buf must be on a CUDA device, got {buf.device}")
    if buf.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"buf dtype must be float32, float16 or bfloat16, got {buf.dtype}")
    if not 1 <= buf.shape[0] <= 16:
        raise ValueError(f"buf must have 1 to 16 task rows, got {buf.shape[0]}")


def gram(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """buf ``[T, P]`` (CUDA, fp32/fp16/bf16) → (``G [T, T]`` fp32, ``all_finite`` bool scalar tensor)."""
    _check(buf)
    ext = load()
    with torch.cuda.device(buf.device):
        return ext.gram(buf.contiguous(), torch.cuda.current_stream().cuda_stream)


def combine(buf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out [P] = weights [T] @ buf [T, P]`` in fp32 arithmetic, written in buf's dtype."""
    _check(buf)
    if out is None:
        out = torch.empty(buf.shape[1], dtype=buf.dtype, device=buf.device)
    ext = load()
    with torch.cuda.device(buf.device):
        ext.combine(buf.contiguous(), weights.float(), out, torch.cuda.current_stream().cuda_stream)
    return out
