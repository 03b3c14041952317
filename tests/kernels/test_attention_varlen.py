"""The packed attention op (fastpals_kernels.attention_varlen): its custom op passes opcheck and matches the
reference in output and gradients, and the SDPA composition matches the matmul reference, on tests/device.py's
DEVICE."""

import pytest
import torch
from device import DEVICE
from torch.library import opcheck

from fastpals_kernels.attention_varlen import attention_reference, attention_sdpa, attention_varlen_reference
from fastpals_kernels.common import draw_seed

pytestmark = pytest.mark.kernels

DTYPES = [torch.float32, torch.bfloat16]


def _w(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * 0.2).to(DEVICE, dtype).requires_grad_(True)


def _grads(out: torch.Tensor, inputs: list, grad: torch.Tensor) -> tuple:
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_varlen_opcheck_and_reference(dtype):
    g = torch.Generator().manual_seed(1)
    q, k, v = (_w(g, 20, 2, 8, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, 7, 11, 18, 20], dtype=torch.int32, device=DEVICE)
    for p in (0.0, 0.2):
        opcheck(torch.ops.fastpals.attention_varlen.default, (q, k, v, cu, 7, p, draw_seed()))
    got = torch.ops.fastpals.attention_varlen(q, k, v, cu, 7, 0.0, draw_seed())
    want = attention_varlen_reference(q, k, v, cu, 7)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    grad = torch.randn(got.shape, generator=g).to(DEVICE, dtype)
    for a, b in zip(_grads(got, [q, k, v], grad), _grads(want, [q, k, v], grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


@pytest.mark.parametrize("head_dim", [17, 34, 46, 64])
def test_attention_sdpa_matches_the_reference(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(3, 11, 2, head_dim, generator=g).to(DEVICE) for _ in range(3))
    mask = torch.ones(3, 11, dtype=torch.bool, device=DEVICE)
    mask[1, 6:] = False
    mask[2, :] = False  # no token: both average every key uniformly (softmax in fp32 in both)
    got = attention_sdpa(q, k, v, mask)
    want = attention_reference(q, k, v, mask)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(attention_sdpa(q, k, v), attention_reference(q, k, v), rtol=0, atol=1e-5)
