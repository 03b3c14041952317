# ruff: noqa: ANN001, ANN202 - Triton kernel parameters and the custom ops' fake/autograd hooks mirror their schemas
"""The combine op: ``out[p] = sum_t weights[t] * buf[t, p]`` over a ``[T, P]`` task-gradient buffer in one
pass, accumulated in fp32 and stored in ``out``'s dtype (a flat gradient, or a row of the buffer itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fastpals_kernels.backends import backend, registered
from fastpals_kernels.common import (
    BUFFER_DTYPES,
    TritonKernel,
    cdiv,
    check_task_buffer,
    device_context,
    next_power_of_2,
    per_sample_vmap,
    target_arch,
)

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["check_combine_args", "combine", "combine_reference", "combine_triton"]

_REFERENCE_CHUNK = 1 << 20  # columns per fp32 up-cast of a 16-bit buffer (bounds the temporary memory)
_IN_PLACE_CHUNK = 1 << 20  # columns per chunk when the result overwrites a row of the buffer (4 MiB fp32)


def combine(
    buf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None, *, out_row: int | None = None
) -> torch.Tensor:
    """``out = weights @ buf``, returned: ``buf [T, P]`` float32/float16/bfloat16 (contiguous along P, ``T <=
    MAX_TASKS``), ``weights [T]`` float32/float64 on its device, ``out [P]`` contiguous float32/float16/bfloat16
    apart from ``buf`` (a new float32 tensor when omitted), or ``out_row``: write over that row of ``buf``."""
    buf = check_task_buffer(buf)
    given = out
    out, in_place = check_combine_args(buf, weights, out, out_row)
    ext = registered("combine", backend("combine", buf))
    if ext is not None:
        return ext.impl(buf, weights, given, out_row=out_row)
    if in_place:
        torch.ops.fastpals.combine_row(buf, weights, out_row)
        return out
    if given is None:
        return torch.ops.fastpals.combine(buf, weights)
    torch.ops.fastpals.combine_out(buf, weights, out)
    return out


def check_combine_args(buf: torch.Tensor, weights: object, out: object, out_row: object = None) -> tuple:
    """Validate :func:`combine`'s arguments (``buf`` checked already) and return ``(out, in_place)``: ``out`` a new
    float32 ``[P]`` when None, row ``out_row`` of ``buf`` when that is given."""
    in_place = out_row is not None
    if in_place:
        if out is not None:
            raise ValueError("give either out or out_row, not both")
        if isinstance(out_row, bool) or not isinstance(out_row, int) or not 0 <= out_row < buf.shape[0]:
            raise ValueError(f"out_row must be a row index in [0, {buf.shape[0]}), got {out_row!r}")
        out = buf[out_row]
    elif out is None:
        out = torch.empty(buf.shape[1], dtype=torch.float32, device=buf.device)
    elif (
        isinstance(out, torch.Tensor) and out.untyped_storage()._cdata == buf.untyped_storage()._cdata
    ):  # the same storage (compared by identity: fake tensors have no data pointer)
        raise ValueError("out shares memory with buf: use out_row to overwrite a row of buf")
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
    if out.shape != (p,) or out.dtype not in BUFFER_DTYPES or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float tensor of shape ({p},), got {out.dtype} {list(out.shape)}"
        )
    if out.device != buf.device:
        raise ValueError(f"out is on {out.device} but buf is on {buf.device}")
    return out, in_place


def combine_reference(
    buf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """:func:`combine` in PyTorch (arguments checked): fp32 ``w @ buf``, in chunks of 2^20 columns through a
    temporary when ``out`` is a row of ``buf`` (``in_place``) or ``buf`` is 16-bit."""
    w = weights.float()
    if buf.dtype == torch.float32 and out.dtype == torch.float32:
        if in_place:
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


#: the kernel's constexpr for each output dtype
OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@TritonKernel
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
    """``out = weights @ buf`` by the Triton kernel (arguments checked; ``out`` may be a row of ``buf``: each
    column is read in full before it is written). Returns ``out``."""
    t, p = buf.shape
    t_pad = max(2, next_power_of_2(t))
    block_p = 1024 if target_arch(buf) is None else max(32, 4096 // t_pad)  # None: the CPU interpreter
    w = weights.to(torch.float32).contiguous()
    with device_context(buf):
        _combine_kernel[(cdiv(p, block_p),)](
            buf, w, out, t, p, buf.stride(0), T_PAD=t_pad, BLOCK_P=block_p, OUT_KIND=OUT_KIND[out.dtype]
        )
    return out


def _combine_into(
    buf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, in_place: bool
) -> torch.Tensor:
    if backend("combine", buf) == "triton":
        return combine_triton(buf, weights, out)
    return combine_reference(buf, weights, out, in_place=in_place)


@torch.library.custom_op("fastpals::combine", mutates_args=())
def combine_op(buf: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights @ buf``: buf ``[T, P]``, weights ``[T]`` fp32/fp64 → a new fp32 ``[P]``."""
    out = torch.empty(buf.shape[1], dtype=torch.float32, device=buf.device)
    return _combine_into(buf, weights, out, in_place=False)


@combine_op.register_fake
def _(buf, weights):
    return buf.new_empty(buf.shape[1], dtype=torch.float32)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    buf, weights = ctx.saved_tensors
    d_buf = (weights.float()[:, None] * grad[None, :]).to(buf.dtype)
    d_weights = (buf.float() @ grad).to(weights.dtype)
    return d_buf, d_weights


combine_op.register_autograd(_backward, setup_context=_setup)
combine_op.register_vmap(per_sample_vmap(combine_op))


@torch.library.custom_op("fastpals::combine_out", mutates_args=("out",))
def combine_out_op(buf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """``out = weights @ buf`` into ``out [P]`` (fp32/fp16/bf16, not sharing memory with buf)."""
    _combine_into(buf, weights, out, in_place=False)


@torch.library.custom_op("fastpals::combine_row", mutates_args=("buf",))
def combine_row_op(buf: torch.Tensor, weights: torch.Tensor, row: int) -> None:
    """``buf[row] = weights @ buf`` (each column read in full before it is written; no ``[P]`` temporary)."""
    _combine_into(buf, weights, buf[row], in_place=True)


combine_out_op.register_fake(lambda buf, weights, out: None)
combine_row_op.register_fake(lambda buf, weights, row: None)
