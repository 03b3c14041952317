"""tests/tolerances.py tells compiled-GPU rounding from a wrong kernel, on the CPU.

Compiled fp32 Triton computes ``tl.exp(x)`` as ``ex2.approx.f32(x * log2(e))`` (the product rounded, the result
within 2 ulp) and ``/`` as ``div.full.f32`` (within 2 ulp). Attention written that way must pass the 2x-of-the-
reference rule against float64; one whose exp is off by 1e-5 relative must fail it, though it stays within an
absolute 1e-5 of the fp32 reference (the check it replaces).
"""

import math

import pytest
import torch
from tolerances import assert_close_to_reference

from fastpals.functional import attention_reference

LOG2E = 1.4426950408889634


def _attention(q, k, v, exp, div):
    """softmax(q k^T / sqrt(Dh)) v for [B, L, H, Dh] inputs with the given exp and division."""
    scores = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(q.shape[-1])
    p = exp(scores - scores.amax(-1, keepdim=True))
    return torch.einsum("bhlm,bmhd->blhd", div(p, p.sum(-1, keepdim=True)), v)


def _within_ulps(y, ulps, gen):
    return y + (torch.rand(y.shape, generator=gen) * 2 - 1) * ulps * y.abs() * 2**-23


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hardware_rounding_passes_and_a_wrong_exp_fails(seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, 21, 3, 46, generator=gen) for _ in range(3))
    ref = attention_reference(q, k, v)
    ref64 = _attention(q.double(), k.double(), v.double(), torch.exp, torch.div)

    def ex2_approx(x):
        return _within_ulps(torch.exp2(x * LOG2E), 2, gen)

    def div_full(a, b):
        return _within_ulps(a / b, 2, gen)

    def exp_off_by_1e5(x):
        return torch.exp(x) * (1 + 1e-5 * torch.sin(37 * x))

    compiled = _attention(q, k, v, ex2_approx, div_full)
    assert_close_to_reference("ex2.approx, div.full", compiled, ref, ref64)
    wrong = _attention(q, k, v, exp_off_by_1e5, torch.div)
    assert (wrong - ref).abs().max().item() <= 1e-5  # the absolute check alone accepts it
    with pytest.raises(AssertionError, match="error against float64"):
        assert_close_to_reference("wrong exp", wrong, ref, ref64)
