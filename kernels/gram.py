# ruff: noqa: ANN001, ANN202 - Triton kernel parameters and the custom op's fake/autograd hooks mirror its schema
"""The Gram op: ``gram[i, j] = sum_p buf[i, p] * buf[j, p]`` of a ``[T, P]`` task-gradient buffer in one pass
(fp32 accumulation, IEEE products), with ``finite[t]`` false when row t holds an inf/nan or its sum of squares
overflows. The Triton kernels write one partial Gram per program, summed after (no atomics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fastpals_kernels.backends import backend, registered
from fastpals_kernels.common import (
    TritonKernel,
    cdiv,
    check_task_buffer,
    device_context,
    next_power_of_2,
    per_sample_vmap,
)

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["gram", "gram_reference", "gram_triton"]

#: up to this many rows the Gram runs as row-pair products (:func:`_gram_pairs_kernel`), beyond as ``tl.dot``
PAIRS_MAX_TASKS = 8
#: warps of the row-pair kernel
PAIRS_WARPS = 4
_REFERENCE_CHUNK = 1 << 20  # columns per fp32 up-cast of a 16-bit buffer (bounds the temporary memory)
_GRAM_BLOCK = 1 << 16  # columns per block of the blocked Gram


def gram(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gram [T, T] float32, finite [T] bool)`` of ``buf [T, P]`` float32/float16/bfloat16 (contiguous along P,
    ``T <= MAX_TASKS``) on its device, in one pass with no host sync."""
    buf = check_task_buffer(buf)
    ext = registered("gram", backend("gram", buf))
    if ext is not None:
        return ext.impl(buf)
    return torch.ops.fastpals.gram(buf)


def _blocked_gram(x: torch.Tensor) -> torch.Tensor:
    """``x @ x.T`` for a float32 ``[T, n]`` as a batched GEMM over blocks of ``_GRAM_BLOCK`` columns, summed (one
    long dot product per entry is slower and far less accurate against float64)."""
    t, n = x.shape
    full = n // _GRAM_BLOCK
    rest = x[:, full * _GRAM_BLOCK :]
    g = rest @ rest.T
    if full:
        blocks = x[:, : full * _GRAM_BLOCK].view(t, full, _GRAM_BLOCK).transpose(0, 1)  # [full, T, block]
        g = g + torch.bmm(blocks, blocks.transpose(1, 2)).sum(0)
    return g


def gram_reference(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gram` in PyTorch: fp32 products over blocks of 2^16 columns (16-bit buffers up-cast in chunks)."""
    buf = check_task_buffer(buf)
    if buf.dtype == torch.float32:
        g = _blocked_gram(buf)
    else:
        g = sum(_blocked_gram(chunk.float()) for chunk in torch.split(buf, _REFERENCE_CHUNK, dim=1))
    g = 0.5 * (g + g.T)
    return g, torch.isfinite(torch.diagonal(g)).clone()


@TritonKernel
def _gram_partial_kernel(
    buf_ptr,
    partial_ptr,
    bad_ptr,
    T,
    P,
    stride_t,
    cols_per_program,
    T_PAD: tl.constexpr,
    T_BLK: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program ``pid``'s partial Gram ``partial[pid] [T_PAD, T_PAD]`` fp32 and non-finite counts ``bad[pid]
    [T_PAD]`` int32 over its columns, rows padded to ``T_PAD`` (a power of two >= 16, as ``tl.dot`` needs) in
    row blocks of ``T_BLK``."""
    pid = tl.program_id(0).to(tl.int64)
    start = pid * cols_per_program
    if T_BLK == T_PAD:  # one row block (T <= 32): all rows against themselves
        rows = tl.arange(0, T_PAD)
        row_mask = rows < T
        row_offs = rows.to(tl.int64)[:, None] * stride_t
        acc = tl.zeros((T_PAD, T_PAD), dtype=tl.float32)
        bad = tl.zeros((T_PAD,), dtype=tl.int32)
        for off in range(0, cols_per_program, BLOCK_P):
            cols = start + off + tl.arange(0, BLOCK_P)
            mask = row_mask[:, None] & (cols[None, :] < P)
            # Up-cast first: bf16/fp16 products are exact in fp32, and fp32 dots run in IEEE precision (no TF32).
            xf = tl.load(buf_ptr + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc = tl.dot(xf, tl.trans(xf), acc, input_precision="ieee")
            nonfinite = (xf != xf) | (tl.abs(xf) > 3.4028234663852886e38)
            bad += tl.sum(nonfinite.to(tl.int32), axis=1)
        out_rows = tl.arange(0, T_PAD)
        tl.store(partial_ptr + pid * T_PAD * T_PAD + out_rows[:, None] * T_PAD + out_rows[None, :], acc)
        tl.store(bad_ptr + pid * T_PAD + out_rows, bad)
    else:  # row blocks I (program axis 1) against J (axis 2)
        rows_i = tl.program_id(1) * T_BLK + tl.arange(0, T_BLK)
        rows_j = tl.program_id(2) * T_BLK + tl.arange(0, T_BLK)
        offs_i = rows_i.to(tl.int64)[:, None] * stride_t
        offs_j = rows_j.to(tl.int64)[:, None] * stride_t
        acc = tl.zeros((T_BLK, T_BLK), dtype=tl.float32)
        bad = tl.zeros((T_BLK,), dtype=tl.int32)
        for off in range(0, cols_per_program, BLOCK_P):
            cols = start + off + tl.arange(0, BLOCK_P)
            col_mask = cols[None, :] < P
            mask_i = (rows_i < T)[:, None] & col_mask
            mask_j = (rows_j < T)[:, None] & col_mask
            xi = tl.load(buf_ptr + offs_i + cols[None, :], mask=mask_i, other=0.0).to(tl.float32)
            xj = tl.load(buf_ptr + offs_j + cols[None, :], mask=mask_j, other=0.0).to(tl.float32)
            acc = tl.dot(xi, tl.trans(xj), acc, input_precision="ieee")
            nonfinite = (xi != xi) | (tl.abs(xi) > 3.4028234663852886e38)
            bad += tl.sum(nonfinite.to(tl.int32), axis=1)
        tl.store(partial_ptr + pid * T_PAD * T_PAD + rows_i[:, None] * T_PAD + rows_j[None, :], acc)
        if tl.program_id(2) == 0:
            tl.store(bad_ptr + pid * T_PAD + rows_i, bad)


@TritonKernel
def _gram_pairs_kernel(
    buf_ptr, partial_ptr, P, stride_t, cols_per_program, T: tl.constexpr, BLOCK_P: tl.constexpr
):
    """Program ``pid``'s partial Gram ``partial[pid] [T, T]`` fp32 (both triangles written) over its
    ``cols_per_program`` columns of the ``T <= 8`` rows of ``buf [T, P]`` (fp32, bf16 or fp16; columns
    contiguous, rows ``stride_t`` apart)."""
    pid = tl.program_id(0).to(tl.int64)
    start = pid * cols_per_program
    row_ptr = buf_ptr + start
    stride = stride_t.to(tl.int64)
    n_cols = tl.minimum(P - start, cols_per_program).to(tl.int32)  # this program's columns
    # one fp32 accumulator per column and row pair (i <= j), pair k = i * T - i * (i - 1) // 2 + j - i
    acc = ()
    for _ in tl.static_range(T * (T + 1) // 2):
        acc = acc + (tl.zeros((BLOCK_P,), dtype=tl.float32),)
    for off in range(0, cols_per_program, BLOCK_P):
        cols = off + tl.arange(0, BLOCK_P)
        mask = cols < n_cols
        rows = ()
        for i in tl.static_range(T):  # every row read once, up-cast in registers
            rows = rows + (tl.load(row_ptr + i * stride + cols, mask=mask, other=0.0).to(tl.float32),)
        new = ()
        for i in tl.static_range(T):
            for j in tl.static_range(i, T):
                new = new + (acc[i * T - i * (i - 1) // 2 + j - i] + rows[i] * rows[j],)
        acc = new
    for i in tl.static_range(T):
        for j in tl.static_range(i, T):
            s = tl.sum(acc[i * T - i * (i - 1) // 2 + j - i])
            tl.store(partial_ptr + pid * T * T + i * T + j, s)
            if j != i:
                tl.store(partial_ptr + pid * T * T + j * T + i, s)


def _programs(buf: torch.Tensor, block_p: int) -> tuple[int, int]:
    """``(programs, cols_per_program)``: whole blocks of ``block_p`` columns over at most four programs per SM
    (four in the interpreter)."""
    blocks = cdiv(buf.shape[1], block_p)
    sms = torch.cuda.get_device_properties(buf.device).multi_processor_count if buf.is_cuda else 1
    cols_per_program = cdiv(blocks, min(blocks, 4 * sms)) * block_p
    return cdiv(buf.shape[1], cols_per_program), cols_per_program


def gram_triton(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gram_reference` by the Triton kernels on ``buf``'s device (``buf`` validated already); no host sync."""
    t, p = buf.shape
    if t <= PAIRS_MAX_TASKS:  # one FMA per row pair and column; the finite flags from the diagonal
        # columns per thread: 16-byte loads (4 fp32, 8 16-bit) while the T (T + 1) / 2 fp32 accumulators stay
        # within 64 registers, else halved down to two
        per_thread = 16 // buf.element_size()
        while per_thread > 2 and t * (t + 1) // 2 * per_thread > 64:
            per_thread //= 2
        block_p = per_thread * 32 * PAIRS_WARPS
        programs, cols_per_program = _programs(buf, block_p)
        partial = torch.empty((programs, t, t), dtype=torch.float32, device=buf.device)
        with device_context(buf):
            _gram_pairs_kernel[(programs,)](
                buf, partial, p, buf.stride(0), cols_per_program, T=t, BLOCK_P=block_p, num_warps=PAIRS_WARPS
            )
        g = partial.sum(dim=0)
        return g, torch.isfinite(torch.diagonal(g))
    t_pad = max(16, next_power_of_2(t))  # tl.dot needs every dimension >= 16
    t_blk = min(t_pad, 32)  # a 32 x 32 fp32 accumulator per program at most: more tasks, more row blocks
    # narrower column blocks where wider up-cast tiles spill on sm_90 (tests/test_aot.py, docs/measurements.md)
    block_p = 128 if t_blk <= 16 and buf.element_size() == 4 else 64
    if t_pad > t_blk and buf.element_size() < 4:
        block_p = 32
    programs, cols_per_program = _programs(buf, block_p)
    partial = torch.empty((programs, t_pad, t_pad), dtype=torch.float32, device=buf.device)
    bad = torch.empty((programs, t_pad), dtype=torch.int32, device=buf.device)
    n_blk = t_pad // t_blk
    with device_context(buf):
        _gram_partial_kernel[(programs, n_blk, n_blk)](
            buf,
            partial,
            bad,
            t,
            p,
            buf.stride(0),
            cols_per_program,
            T_PAD=t_pad,
            T_BLK=t_blk,
            BLOCK_P=block_p,
        )
    g = partial.sum(dim=0)[:t, :t]
    g = 0.5 * (g + g.T)
    finite = (bad.sum(dim=0)[:t] == 0) & torch.isfinite(torch.diagonal(g))
    return g, finite


@torch.library.custom_op("fastpals::gram", mutates_args=())
def gram_op(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buf bufᵀ [T, T] fp32, finite [T] bool)`` for ``buf [T, P]`` fp32/fp16/bf16 (one pass; no host read)."""
    if backend("gram", buf) == "triton":
        return gram_triton(buf)
    return gram_reference(buf)


@gram_op.register_fake
def _(buf):
    t = buf.shape[0]
    return buf.new_empty(t, t, dtype=torch.float32), buf.new_empty(t, dtype=torch.bool)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad_gram: torch.Tensor, grad_finite: torch.Tensor | None) -> torch.Tensor:
    (buf,) = ctx.saved_tensors
    return ((grad_gram + grad_gram.T) @ buf.float()).to(buf.dtype)


gram_op.register_autograd(_backward, setup_context=_setup)
gram_op.register_vmap(per_sample_vmap(gram_op))
