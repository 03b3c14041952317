# ruff: noqa: ANN001, ANN201 - Triton kernel parameters are untyped by design
"""Triton building blocks shared by the op modules' kernels: the dot with its precision flags, the rounding cast,
the GELU derivative."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastpals_kernels.common import TritonKernel

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["cast_rne", "dot_acc", "gelu_grad"]


@TritonKernel
def dot_acc(a, b, acc, IEEE: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``acc + a @ b`` in fp32 (``a @ b`` for ``acc=None``). IEEE: exact fp32 products for fp32 operands (no
    TF32). INTERP_BF16 (bf16 under the CPU interpreter only, whose bf16 ``tl.dot`` is wrong): widen the tiles
    to fp32 first (bf16 products are exact in fp32: the same result as a bf16 MMA with fp32 accumulation)."""
    if INTERP_BF16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@TritonKernel
def cast_rne(x, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even. The CPU interpreter truncates fp32 -> bf16 (GPUs round to
    nearest even), so under INTERP_BF16 the fp32 bits are rounded to the nearest bf16 value first and the
    truncation is then exact."""
    if INTERP_BF16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@TritonKernel
def gelu_grad(z):
    """d/dz of z * Phi(z) (exact erf GELU), in fp32."""
    cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
    return cdf + z * pdf
