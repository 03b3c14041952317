# ruff: noqa: ANN001  (Triton kernel arguments are pointers and constexprs without Python annotations)
"""Gram matrix of the per-task gradients, with a fused finite check, in one pass over the ``[T, P]`` buffer.

``gram[i, j] = sum_p buf[i, p] * buf[j, p]`` accumulated in fp32 (every element is up-cast to fp32 and the dots
run in IEEE precision, no TF32), and ``finite[t]`` is true when row ``t`` holds no inf/nan and its sum of
squares did not overflow. The rows are padded to ``T_PAD`` (a power of two >= 16) and cut into row blocks of
``T_BLK = min(T_PAD, 32)`` rows; each program reads a contiguous run of columns of two row blocks ``I`` and
``J``, accumulates the ``T_BLK x T_BLK`` partial Gram block ``(I, J)`` with ``tl.dot`` and (for ``J = 0``)
counts non-finite values per row of ``I``; the partials are then summed (a tiny ``[programs, T_PAD, T_PAD]``
reduction, deterministic: no atomics). Up to 32 tasks that is one block, as many tasks as needed beyond.

No autograd: the buffer holds gradients. The public op is :func:`fastpals_kernels.gram` (validation and
dispatch in :mod:`fastpals_kernels.dispatch`); the reference is :func:`fastpals.functional.gram_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastpals_kernels.common import device_context

__all__ = ["gram_triton"]


@triton.jit
def _gram_partial_kernel(
    buf_ptr,
    partial_ptr,  # [programs, T_PAD, T_PAD] fp32
    bad_ptr,  # [programs, T_PAD] int32
    T,
    P,
    stride_t,
    cols_per_program,
    T_PAD: tl.constexpr,
    T_BLK: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
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


def gram_triton(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fastpals.functional.gram_reference` by the Triton kernel, on ``buf``'s device (``buf`` already
    validated by :func:`fastpals.functional.check_task_buffer`). No host synchronisation."""
    t, p = buf.shape
    t_pad = max(16, triton.next_power_of_2(t))  # tl.dot needs every dimension >= 16
    t_blk = min(t_pad, 32)  # a 32 x 32 fp32 accumulator per program at most: more tasks, more row blocks
    # 16 x 128 up-cast tiles of a 16-bit buffer spilled 12 B on sm_90 (AOT test): 64 columns for 16-bit buffers
    block_p = 128 if t_blk <= 16 and buf.element_size() == 4 else 64
    if t_pad > t_blk and buf.element_size() < 4:  # two 32 x 64 up-cast tiles spilled 8 B on sm_90 (AOT test)
        block_p = 32
    blocks = triton.cdiv(p, block_p)
    if buf.is_cuda:
        max_programs = 4 * torch.cuda.get_device_properties(buf.device).multi_processor_count
    else:  # the interpreter: few programs, each looping over many blocks
        max_programs = 4
    programs = min(blocks, max_programs)
    cols_per_program = triton.cdiv(blocks, programs) * block_p
    programs = triton.cdiv(p, cols_per_program)
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
