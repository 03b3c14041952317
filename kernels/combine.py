# ruff: noqa: ANN001  (Triton kernel arguments are pointers and constexprs without Python annotations)
"""Weighted combination of the per-task gradients, ``out[p] = sum_t w[t] * buf[t, p]``, in one pass.

The sum is accumulated in fp32 and stored in ``out``'s dtype (the parameters' gradient dtype), so the update of
gradient surgery is written straight into a flat gradient tensor whose views are the parameters' ``.grad``.
No autograd. Dispatch: Triton on CUDA, the PyTorch reference on CPU, ``$FASTPALS_KERNELS`` overrides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastpals.kernels.gram import check_task_buffer
from fastpals.kernels.utils import use_triton

__all__ = ["combine", "combine_reference"]

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_REFERENCE_CHUNK = 1 << 20
_IN_PLACE_CHUNK = 1 << 14
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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


def _check(buf: torch.Tensor, weights: object, out: object) -> None:
    t, p = buf.shape
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
    if weights.shape != (t,) or weights.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"weights must be float32/float64 of shape ({t},), got {weights.dtype} {list(weights.shape)}"
        )
    if weights.device != buf.device:
        raise ValueError(f"weights are on {weights.device} but buf is on {buf.device}")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != (p,) or out.dtype not in _OUT_DTYPES or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float tensor of shape ({p},), got {out.dtype} {list(out.shape)}"
        )
    if out.device != buf.device:
        raise ValueError(f"out is on {out.device} but buf is on {buf.device}")


def combine_reference(
    buf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """PyTorch reference of :func:`combine`: fp32 ``w @ buf`` (in chunks of 2^14 columns through a small
    temporary when ``out`` is a row of ``buf``, ``in_place``); bf16/fp16 up-cast in chunks of 2^20 columns, each
    computed in full before it is stored."""
    w = weights.float()
    if buf.dtype == torch.float32 and out.dtype == torch.float32:
        if in_place:  # cache-sized column chunks through a small temporary (no [P] allocation)
            tmp = torch.empty(min(_IN_PLACE_CHUNK, out.numel()), dtype=torch.float32, device=out.device)
            for chunk, dst in zip(
                torch.split(buf, _IN_PLACE_CHUNK, dim=1), torch.split(out, _IN_PLACE_CHUNK)
            ):
                part = tmp[: dst.numel()]
                torch.mv(chunk.T, w, out=part)
                dst.copy_(part)
        else:
            torch.mv(buf.T, w, out=out)
        return out
    for chunk, dst in zip(torch.split(buf, _REFERENCE_CHUNK, dim=1), torch.split(out, _REFERENCE_CHUNK)):
        dst.copy_(w @ chunk.float())
    return out


def combine(
    buf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None, *, out_row: int | None = None
) -> torch.Tensor:
    """``out = weights @ buf`` in one pass.

    Args:
        buf: ``[T, P]`` float32/float16/bfloat16, contiguous along P, ``T <= 32``.
        weights: ``[T]`` float32/float64 on ``buf``'s device (read as fp32).
        out: ``[P]`` contiguous float32/float16/bfloat16 destination (e.g. the flat gradient of the shared
            parameters); a new float32 tensor when omitted. It must not overlap ``buf``.
        out_row: instead of ``out``, write the result over row ``out_row`` of ``buf`` (no extra ``[P]`` memory;
            each column is read in full before it is written).

    Returns:
        ``out``.
    """
    buf = check_task_buffer(buf)
    in_place = out_row is not None
    if in_place:
        if out is not None:
            raise ValueError("give either out or out_row, not both")
        if not isinstance(out_row, int) or not 0 <= out_row < buf.shape[0]:
            raise ValueError(f"out_row must be a row index in [0, {buf.shape[0]}), got {out_row!r}")
        out = buf[out_row]
    elif out is None:
        out = torch.empty(buf.shape[1], dtype=torch.float32, device=buf.device)
    elif (
        isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    ):
        raise ValueError("out shares memory with buf: use out_row to overwrite a row of buf")
    _check(buf, weights, out)
    if not use_triton(buf):
        return combine_reference(buf, weights, out, in_place=in_place)
    t, p = buf.shape
    t_pad = max(2, triton.next_power_of_2(t))
    block_p = max(128, 4096 // t_pad) if buf.is_cuda else 1024
    w = weights.to(torch.float32).contiguous()
    _combine_kernel[(triton.cdiv(p, block_p),)](
        buf, w, out, t, p, buf.stride(0), T_PAD=t_pad, BLOCK_P=block_p, OUT_KIND=_OUT_KIND[out.dtype]
    )
    return out
