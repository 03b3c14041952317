# ruff: noqa: ANN001  (Triton kernel arguments are pointers and constexprs without Python annotations)
"""Weighted combination of the per-task gradients, ``out[p] = sum_t w[t] * buf[t, p]``, in one pass.

The sum is accumulated in fp32 and stored in ``out``'s dtype (the parameters' gradient dtype), so the update of
gradient surgery is written straight into a flat gradient tensor whose views are the parameters' ``.grad``.
No autograd. The public op is :func:`fastpals_kernels.combine` (validation and dispatch in
:mod:`fastpals_kernels.dispatch`); the reference is :func:`fastpals.functional.combine_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastpals_kernels.common import device_context, target_arch

__all__ = ["OUT_KIND", "combine_triton"]

#: the kernel's constexpr for each output dtype
OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _combine_kernel(
    buf_ptr,
    w_ptr,
    out_ptr,
    T,
    P,
    stride_t,
    T_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    OUT_KIND: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    rows = tl.arange(0, T_PAD)
    row_mask = rows < T
    w = tl.load(w_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    col_mask = cols < P
    x = tl.load(
        buf_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    y = tl.sum(x * w[:, None], axis=0)
    if OUT_KIND == 0:
        tl.store(out_ptr + cols, y, mask=col_mask)
    elif OUT_KIND == 1:
        # bf16, round to nearest even with integer ops (identical on GPUs and in the interpreter, whose float
        # down-cast truncates); NaN stays NaN.
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)
        tl.store(out_ptr + cols, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=col_mask)
    else:
        tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)


def combine_triton(buf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = weights @ buf`` by the Triton kernel on ``buf``'s device (arguments already validated by
    :func:`fastpals.functional.check_combine_args`; ``out`` may be a row of ``buf``: each column is read in full
    before it is written). Returns ``out``."""
    t, p = buf.shape
    t_pad = max(2, triton.next_power_of_2(t))
    block_p = 1024 if target_arch(buf) is None else max(32, 4096 // t_pad)  # None: the CPU interpreter
    w = weights.to(torch.float32).contiguous()
    with device_context(buf):
        _combine_kernel[(triton.cdiv(p, block_p),)](
            buf, w, out, t, p, buf.stride(0), T_PAD=t_pad, BLOCK_P=block_p, OUT_KIND=OUT_KIND[out.dtype]
        )
    return out
