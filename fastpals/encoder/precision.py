"""Which float types this CPU computes natively: the trainer's ``"auto"`` precision, the evaluation dtype."""

from __future__ import annotations

from pathlib import Path

import torch


def cpu_has_native_bf16() -> bool:
    """Does this CPU run bf16 matmuls in hardware (AVX512-BF16 or AMX)? Read from torch's CPU capability checks,
    else from ``/proc/cpuinfo``'s flags; False when neither can tell."""
    checks = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(callable(c) for c in checks):
        return any(bool(c()) for c in checks)  # type: ignore[misc]
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
