# ruff: noqa: ANN001  (Triton kernel arguments are pointers and constexprs without Python annotations)
"""Gram matrix of the per-task gradients, with a fused finite check, in one pass over the ``[T, P]`` buffer.

``gram[i, j] = sum_p buf[i, p] * buf[j, p]`` accumulated in fp32 (every element is up-cast to fp32 in registers
and the products run in IEEE precision, no TF32), and ``finite[t]`` is true when row ``t`` holds no inf/nan and
its sum of squares did not overflow. Each program reads a contiguous run of columns of the rows once and writes
a partial Gram; the partials are then summed (a tiny ``[programs, ., .]`` reduction, deterministic: no atomics).

- ``T <= 8`` (:func:`_gram_pairs_kernel`): the rows' ``T`` values of each column give the ``T (T + 1) / 2``
  products of the upper triangle, one FMA each into a per-pair, per-column accumulator, reduced once at the end.
  A non-finite value or an overflowing sum of squares makes the row's diagonal entry non-finite.
- ``T > 8`` (:func:`_gram_partial_kernel`): the rows are padded to ``T_PAD`` (a power of two >= 16, as ``tl.dot``
  needs) and cut into row blocks of ``T_BLK = min(T_PAD, 32)`` rows; each program accumulates the partial Gram
  block ``(I, J)`` of row blocks ``I`` and ``J`` with ``tl.dot`` and (for ``J = 0``) counts non-finite values
  per row of ``I``. Up to 32 tasks that is one block, as many tasks as needed beyond.

No autograd: the buffer holds gradients. The public op is :func:`fastpals_kernels.gram` (validation and
dispatch in :mod:`fastpals_kernels.dispatch`); the reference is :func:`fastpals.functional.gram_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastpals_kernels.common import device_context

__all__ = ["gram_triton"]

#: up to this many rows the Gram runs as row-pair products (:func:`_gram_pairs_kernel`), beyond as ``tl.dot``
PAIRS_MAX_TASKS = 8
#: warps of the row-pair kernel
PAIRS_WARPS = 4


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


@triton.jit
def _gram_pairs_kernel(
    buf_ptr,
    partial_ptr,  # [programs, T, T] fp32
    P,
    stride_t,
    cols_per_program,
    T: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program ``pid``'s partial Gram ``[T, T]`` (both triangles written) over its ``cols_per_program`` columns
    of the ``T <= 8`` rows of ``buf [T, P]`` (fp32, bf16 or fp16; columns contiguous, rows ``stride_t`` apart)."""
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
    """``(programs, cols_per_program)``: the columns cut into whole blocks of ``block_p``, spread over at most four
    programs per SM (on the CPU, in the interpreter: four programs, each looping over many blocks)."""
    blocks = triton.cdiv(buf.shape[1], block_p)
    if buf.is_cuda:
        max_programs = 4 * torch.cuda.get_device_properties(buf.device).multi_processor_count
    else:
        max_programs = 4
    cols_per_program = triton.cdiv(blocks, min(blocks, max_programs)) * block_p
    return triton.cdiv(buf.shape[1], cols_per_program), cols_per_program


def _gram_pairs(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gram of ``T <= PAIRS_MAX_TASKS`` rows by :func:`_gram_pairs_kernel`. A row holding inf/nan, or whose
    sum of squares overflows, has a non-finite diagonal entry: that is its finite flag."""
    t, p = buf.shape
    # columns per thread: 16-byte loads (4 fp32, 8 16-bit) while the T (T + 1) / 2 fp32 accumulators stay within
    # 64 registers, else halved down to two
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


def gram_triton(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fastpals.functional.gram_reference` by the Triton kernels, on ``buf``'s device (``buf`` already
    validated by :func:`fastpals.functional.check_task_buffer`). No host synchronisation."""
    t, p = buf.shape
    if t <= PAIRS_MAX_TASKS:
        return _gram_pairs(buf)
    t_pad = max(16, triton.next_power_of_2(t))  # tl.dot needs every dimension >= 16
    t_blk = min(t_pad, 32)  # a 32 x 32 fp32 accumulator per program at most: more tasks, more row blocks
    # 16 x 128 up-cast tiles of a 16-bit buffer spilled 12 B on sm_90 (AOT test): 64 columns for 16-bit buffers
    block_p = 128 if t_blk <= 16 and buf.element_size() == 4 else 64
    if t_pad > t_blk and buf.element_size() < 4:  # two 32 x 64 up-cast tiles spilled 8 B on sm_90 (AOT test)
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
