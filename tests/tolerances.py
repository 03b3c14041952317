"""Kernel-test tolerances that hold on compiled GPU code as on Triton's interpreter.

Compiled fp32 differs from the interpreter by a few units in the last place (``tl.exp`` lowers to ``ex2.approx``,
``/`` to ``div.full.f32``), so every rule has a relative and an absolute term:

- :func:`assert_fp32_close`: an fp32 kernel within 1e-5 (relative and absolute) of the fp32 PyTorch reference;
- :func:`assert_close_to_reference`: flash-attention's rule, the kernel's max error against a float64 reference at
  most twice the same-dtype PyTorch reference's, plus a floor ``atol + rtol * max|float64 reference|`` where the
  reference is exact (a copied gradient) or rounds luckily.
"""

import math

import torch

FP32_TOL = 1e-5


def max_abs_error(got: torch.Tensor, ref64: torch.Tensor) -> float:
    """max |got - ref64| in float64 (0 for empty tensors)."""
    return (got.double() - ref64).abs().max().item() if ref64.numel() else 0.0


def assert_fp32_close(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """``got`` within ``FP32_TOL`` of ``ref`` elementwise, relative and absolute (same dtype, device, shape)."""
    torch.testing.assert_close(got, ref, rtol=FP32_TOL, atol=FP32_TOL, msg=lambda m: f"{name}: {m}")


def assert_close_to_reference(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    ref64: torch.Tensor,
    *,
    rtol: float = 1e-6,
    atol: float = 0.0,
) -> None:
    """The kernel output ``got`` against float64: max error at most 2x that of ``ref``, the same computation in
    PyTorch at ``got``'s dtype, plus ``atol + rtol * max|ref64|``. ``got`` and ``ref`` have ``ref64``'s shape."""
    assert got.shape == ref.shape == ref64.shape, f"{name}: shapes {got.shape}, {ref.shape}, {ref64.shape}"
    err_got, err_ref = max_abs_error(got, ref64), max_abs_error(ref, ref64)
    floor = atol + rtol * (ref64.abs().max().item() if ref64.numel() else 0.0)
    assert math.isfinite(err_got), f"{name}: the kernel produced non-finite values"
    assert err_got <= 2 * err_ref + floor, (
        f"{name}: error against float64 {err_got:.3g} > 2 x the reference's {err_ref:.3g} + {floor:.3g}"
    )
