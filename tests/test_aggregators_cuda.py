"""Every weighting of ``fastpals.surgery`` solves on a CUDA Gram without a host synchronisation.

Apart from ``tests/test_aggregators.py`` (whose comparisons need torchjd, skipped without it) so that the GPU
session runs this check whatever is installed there."""

from __future__ import annotations

import pytest
import torch
from device import DEVICE, requires_cuda

from fastpals.surgery import AGGREGATORS, make_weighting


def conflicting_gram(t: int = 4, dim: int = 40, seed: int = 0) -> torch.Tensor:
    """``[T, T]`` float64 Gram of ``T`` gradients, half along a common direction and half against it."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(dim, generator=gen, dtype=torch.float64)
    j = 0.3 * torch.randn(t, dim, generator=gen, dtype=torch.float64)
    j[0::2] += base
    j[1::2] -= base
    return j @ j.T


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", list(AGGREGATORS))
def test_no_host_sync_on_cuda(name: str) -> None:
    g = conflicting_gram().float().to(DEVICE)
    fn, _ = make_weighting(name)
    fn(g, generator=torch.Generator().manual_seed(0))  # warm-up (allocations, cuSOLVER/cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w = fn(g, generator=torch.Generator().manual_seed(0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert w.shape == (4,) and w.device.type == "cuda"
