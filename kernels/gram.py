# ruff: noqa: ANN001  (Triton kernel arguments are pointers and constexprs without Python annotations)
"""Gram matrix of the per-task gradients, with a fused finite check, in one pass over the ``[T, P]`` buffer.

``gram[i, j] = sum_p buf[i, p] * buf[j, p]`` accumulated in fp32 (every element is up-cast to fp32 and the dots
run in IEEE precision, no TF32), and ``finite[t]`` is true when row ``t`` holds no inf/nan and its sum of
squares did not overflow. Each program reads a contiguous run of columns of all ``T`` rows, accumulates a
``T_PAD x T_PAD`` partial Gram with ``tl.dot`` and counts non-finite values per row; the partials are then
summed (a tiny ``[programs, T_PAD, T_PAD]`` reduction, deterministic: no atomics).

No autograd: the buffer holds gradients. Dispatch: Triton on CUDA, the PyTorch reference on CPU,
``$FASTPALS_KERNELS`` overrides (see :func:`fastpals.kernels.utils.use_triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastpals.kernels.utils import use_triton

__all__ = ["MAX_TASKS", "check_task_buffer", "gram", "gram_reference"]

MAX_TASKS = 32
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_REFERENCE_CHUNK = 1 << 20  # columns per fp32 up-cast in the reference path (bounds its temporary memory)


def check_task_buffer(buf: object, name: str = "buf") -> torch.Tensor:
    """Validate a per-task gradient buffer: ``[T, P]`` float32/float16/bfloat16, ``1 <= T <= MAX_TASKS``,
    ``P >= 1``, unit stride along P (rows may be strided)."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dim() != 2:
        raise ValueError(f"{name} must have shape [T, P], got {list(buf.shape)}")
    t, p = buf.shape
    if not 1 <= t <= MAX_TASKS:
        raise ValueError(f"{name} has T = {t} rows; 1 <= T <= {MAX_TASKS} is supported")
    if p < 1:
        raise ValueError(f"{name} has P = {p} columns; at least 1 is needed")
    if buf.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {buf.dtype}")
    if buf.stride(1) != 1 or buf.stride(0) < p:
        raise ValueError(f"{name} must be contiguous along P (strides {buf.stride()})")
    return buf


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
    BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, T_PAD)
    row_mask = rows < T
    row_offs = rows.to(tl.int64)[:, None] * stride_t
    start = pid * cols_per_program
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


def _gram_triton(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, p = buf.shape
    t_pad = max(16, triton.next_power_of_2(t))  # tl.dot needs every dimension >= 16
    block_p = 128 if t_pad <= 16 else 64
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
    _gram_partial_kernel[(programs,)](
        buf,
        partial,
        bad,
        t,
        p,
        buf.stride(0),
        cols_per_program,
        T_PAD=t_pad,
        BLOCK_P=block_p,
    )
    g = partial.sum(dim=0)[:t, :t]
    g = 0.5 * (g + g.T)
    finite = (bad.sum(dim=0)[:t] == 0) & torch.isfinite(torch.diagonal(g))
    return g, finite


def gram_reference(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`gram`: fp32 matmul (bf16/fp16 up-cast in chunks of 2^20 columns).

    ``finite[t]`` is read from the diagonal: a sum of squares is inf/nan exactly when row ``t`` holds an inf or
    a nan (non-negative terms never cancel) or overflows.
    """
    buf = check_task_buffer(buf)
    if buf.dtype == torch.float32:
        g = buf @ buf.T
    else:
        t = buf.shape[0]
        g = torch.zeros((t, t), dtype=torch.float32, device=buf.device)
        for chunk in torch.split(buf, _REFERENCE_CHUNK, dim=1):
            c = chunk.float()
            g.addmm_(c, c.T)
    g = 0.5 * (g + g.T)
    return g, torch.isfinite(torch.diagonal(g)).clone()


def gram(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gram matrix of the rows of ``buf`` and a per-row finite flag, in one pass.

    Args:
        buf: ``[T, P]`` float32/float16/bfloat16, contiguous along P, ``T <= MAX_TASKS`` (32).

    Returns:
        ``(gram [T, T] float32, finite [T] bool)`` on ``buf``'s device. No host synchronisation.
    """
    buf = check_task_buffer(buf)
    if use_triton(buf):
        return _gram_triton(buf)
    return gram_reference(buf)
