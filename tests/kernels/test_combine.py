"""The combine op (fastpals_kernels.combine): its Triton kernel against PyTorch and float64, on tests/device.py's
DEVICE (off CUDA in Triton's interpreter), in place over a row of the buffer, its input checks, and the surgery
buffer through the Gram and combine kernels.

Rule (flash-attention's, tests/tolerances.py): the kernel's error against float64 is at most twice the same-dtype
PyTorch reference's, plus a floor of 1e-7 of the largest float64 value (exactly representable results).
"""

from __future__ import annotations

import sys

import pytest
import torch
from device import DEVICE
from inputs import make_buf, max_err
from tolerances import assert_close_to_reference

from fastpals.surgery import TaskGradientBuffer, gem_weights, pcgrad_weights
from fastpals_kernels import combine
from fastpals_kernels.combine import combine_reference
from fastpals_kernels.common import MAX_TASKS

# the interpreter runs numpy, which warns on inf/nan arithmetic in the finite-check tests
pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("t,p", [(1, 5), (3, 4099), (8, 1030), (MAX_TASKS, 257)])
def test_combine_matches_torch_and_float64(triton_mode, dtype, out_dtype, t, p):
    buf = make_buf(t, p, dtype, seed=t + p, row_pad=3 if t == 3 else 0)
    w = torch.randn(t, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    got = combine(buf, w, torch.empty(p, dtype=out_dtype, device=DEVICE))
    ref = combine_reference(buf.contiguous(), w, torch.empty(p, dtype=out_dtype, device=DEVICE))
    ref64 = w.double() @ buf.double()
    assert got.dtype == out_dtype
    assert_close_to_reference("combine", got, ref, ref64, rtol=1e-7)
    if out_dtype != torch.float32:  # fp32 sums rounded to nearest even, as PyTorch rounds
        assert max_err(got, ref64) <= 1.01 * max_err(ref, ref64) + 1e-7


def test_combine_float64_weights_and_default_out(triton_mode):
    buf = make_buf(4, 100, torch.float32, seed=1)
    w = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    got = combine(buf, w)
    assert got.dtype == torch.float32
    assert max_err(got, w @ buf.double()) < 1e-6


@pytest.mark.parametrize("mode", ["triton", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_over_a_row_of_the_buffer(monkeypatch, mode, dtype):
    monkeypatch.setenv("FASTPALS_KERNELS", mode)
    monkeypatch.setattr(
        sys.modules["fastpals_kernels.combine"], "_IN_PLACE_CHUNK", 1 << 14
    )  # several chunks of the reference path
    buf = make_buf(5, 40001, dtype, seed=9).clone()
    w = torch.randn(5, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    expected = combine_reference(buf.clone(), w, torch.empty(40001, dtype=dtype, device=DEVICE))
    got = combine(buf, w, out_row=4)
    assert got.data_ptr() == buf[4].data_ptr()
    assert torch.equal(got, expected)


def test_combine_validates_inputs(triton_mode):
    buf = torch.zeros(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="weights"):
        combine(buf, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="weights"):
        combine(buf, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        combine(buf, torch.zeros(2, device=DEVICE), torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        combine(buf, torch.zeros(2, device=DEVICE), torch.zeros(8, device=DEVICE)[::2])
    with pytest.raises(TypeError, match="out"):
        combine(buf, torch.zeros(2, device=DEVICE), "out")
    with pytest.raises(ValueError, match="out_row"):
        combine(buf, torch.zeros(2, device=DEVICE), out=buf[1])
    with pytest.raises(ValueError, match="out_row"):
        combine(buf, torch.zeros(2, device=DEVICE), out_row=2)


@pytest.mark.parametrize("aggregator", [pcgrad_weights, gem_weights])
def test_buffer_through_the_triton_kernels(triton_mode, aggregator):
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(4, 600, generator=gen).to(DEVICE)
    grads[0] -= 2 * grads[1]
    p = torch.nn.Parameter(torch.zeros(600, device=DEVICE))
    buf = TaskGradientBuffer([p], 4)
    for t in range(4):
        p.grad = grads[t].clone()
        buf.capture(t)
    result = buf.apply(aggregator, generator=torch.Generator().manual_seed(1))
    g64 = grads.double()
    w_ref = aggregator(g64 @ g64.T, generator=torch.Generator().manual_seed(1))
    assert max_err(p.grad, w_ref @ g64) < 1e-5
    assert max_err(result.gram, g64 @ g64.T) < 1e-6
