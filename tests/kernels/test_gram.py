"""The Gram op (fastpals_kernels.gram): its Triton kernels against PyTorch and float64, on tests/device.py's DEVICE
(off CUDA in Triton's interpreter), its finite flags and input checks.

Rule (flash-attention's, tests/tolerances.py): the kernel's error against float64 is at most twice the same-dtype
PyTorch reference's, plus a floor of 1e-7 of the largest float64 value (exactly representable results).
"""

from __future__ import annotations

import pytest
import torch
from device import DEVICE
from inputs import make_buf, max_err
from tolerances import assert_close_to_reference

from fastpals_kernels import gram
from fastpals_kernels.common import MAX_TASKS
from fastpals_kernels.gram import gram_reference

# the interpreter runs numpy, which warns on inf/nan arithmetic in the finite-check tests
pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t,p",
    # T <= 8: row-pair products in blocks of 256 to 1024 columns; beyond: tl.dot on padded row blocks
    [
        (1, 1),
        (2, 1000),
        (3, 4099),
        (4, 513),
        (5, 1537),
        (6, 2049),
        (7, 255),
        (8, 777),
        (17, 300),
        (MAX_TASKS, 513),
    ],
)
def test_gram_matches_torch_and_float64(triton_mode, dtype, t, p):
    buf = make_buf(t, p, dtype, seed=t * 1000 + p, row_pad=5 if t in (3, 6) else 0)
    got, finite = gram(buf)
    ref, ref_finite = gram_reference(buf)
    ref64 = buf.double() @ buf.double().T
    assert got.dtype == torch.float32 and got.shape == (t, t) and finite.shape == (t,)
    assert finite.all() and ref_finite.all()
    assert torch.equal(got, got.T)
    assert_close_to_reference("gram", got, ref, ref64, rtol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,p", [(3, (1 << 22) + 12345), (8, (1 << 17) + 5)])
def test_reference_gram_of_long_rows_is_blocked_and_accurate(dtype, t, p):
    """Rows longer than a Gram block: the reference sums per-block products (a batched GEMM). Against float64 it
    stays within a few fp32 roundings, where one fp32 ``x @ x.T`` (one long dot product per entry) drifts:
    measured 1.7e-4 at 4M columns, against 2.9e-7 blocked."""
    buf = make_buf(t, p, dtype, seed=p, row_pad=7)
    got, finite = gram_reference(buf)
    ref64 = buf.double() @ buf.double().T
    assert finite.all() and torch.equal(got, got.T)
    assert max_err(got, ref64) < 1e-5, max_err(got, ref64)
    if p > 1 << 22:
        one_gemm = buf.float() @ buf.float().T
        assert max_err(got, ref64) < max_err(one_gemm, ref64) / 10


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [5, 17])  # the row-pair kernel and the tl.dot kernel
def test_gram_finite_check(triton_mode, bad, dtype, t):
    buf = make_buf(t, 2000, dtype, seed=2).clone()
    buf[2, 1999] = bad
    buf[4, 0] = bad
    _, finite = gram(buf)
    assert finite.tolist() == [i not in (2, 4) for i in range(t)]
    assert gram_reference(buf)[1].tolist() == finite.tolist()


@pytest.mark.parametrize("t", [2, 17])
def test_gram_overflow_is_reported(triton_mode, t):
    buf = torch.ones(t, 10, device=DEVICE)
    buf[0] = 1e20  # finite, but its squares overflow fp32
    _, finite = gram(buf)
    assert finite.tolist() == [i != 0 for i in range(t)]


def test_gram_validates_inputs(triton_mode):
    with pytest.raises(TypeError, match="buf"):
        gram([[1.0]])
    with pytest.raises(ValueError, match=r"\[T, P\]"):
        gram(torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="T = 129"):
        gram(torch.zeros(129, 4, device=DEVICE))
    with pytest.raises(TypeError, match="float32"):
        gram(torch.zeros(2, 4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        gram(torch.zeros(4, 2, device=DEVICE).T)


def test_dispatch_reference_mode_uses_torch(monkeypatch):
    monkeypatch.setenv("FASTPALS_KERNELS", "reference")
    buf = make_buf(3, 50, torch.float32, seed=3)
    got, _ = gram(buf)
    assert torch.equal(got, gram_reference(buf)[0])
