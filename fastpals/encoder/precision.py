"""Which float types this machine computes natively: the trainer's ``"auto"`` precision
(:mod:`fastpals.train.dsconfig`) and the dtype evaluation runs in (:func:`fastpals.model.evaluate.eval_model`)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["cpu_has_native_bf16"]


def cpu_has_native_bf16() -> bool:
    """Does this CPU run bf16 matmuls in hardware (AVX512-BF16 or AMX)? Read from torch's CPU capability checks,
    else from ``/proc/cpuinfo``'s flags; False when neither can tell."""
    checks = [
        getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    if all(callable(c) for c in checks):
        return any(bool(c()) for c in checks)  # type: ignore[misc]
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
