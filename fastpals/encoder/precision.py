"""Which float types this CPU computes natively: the trainer's ``"auto"`` precision, the evaluation dtype."""

from __future__ import annotations

from pathlib import Path

import torch


def cpu_has_native_bf16() -> bool:
    """Does this CPU compute bf16 natively (AVX512-BF16, AMX)? torch's checks, else /proc/cpuinfo flags."""
    checks = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(callable(c) for c in checks):
        return any(bool(c()) for c in checks)  # type: ignore[misc]
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
