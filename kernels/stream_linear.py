# ruff: noqa: ANN001, ANN202 - Triton kernel arguments and fake implementations mirror the ops' schemas
"""The streaming surgery's ops over all its streamed Linear weights at once: their ``[T, T]`` Gram and their
weighted weight gradients, from the kept output gradients and inputs of their calls.

A *problem* is one Linear weight ``[M, K]`` (with its bias ``[M]`` where ``bias[p]``); each of its *calls* brings
``dy [R, M]``, ``x [R, K]`` (one dtype for all calls) and its rows' task plan (``row_index [R]``,
``task_row_offsets [T+1]``). Task t's gradient of problem p is ``G_pt = sum over p's calls of dy[rows of t]^T
[x, 1][rows of t]`` ``[M, K (+1)]`` (the bias as a last column). The Triton kernels run one program per
(problem, block of output rows) from tables built on the host; elsewhere the PyTorch reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from fastpals_kernels import backends
from fastpals_kernels.common import TritonKernel, device_context, dot_flags, next_power_of_2, plan_row_tasks
from fastpals_kernels.tl_helpers import dot_acc

if TYPE_CHECKING:
    import triton.language as tl

__all__ = [
    "stream_linear_combine",
    "stream_linear_combine_reference",
    "stream_linear_gram",
    "stream_linear_gram_reference",
]

Tensor = torch.Tensor


def _check(
    dy: Sequence[Tensor], x: Sequence[Tensor], row_index, offsets, problem: Sequence[int], bias
) -> list:
    """The problems' shapes ``[(M, K)]`` after checking the calls' arguments (one line per mistake)."""
    n = len(dy)
    if not n or not len(x) == len(row_index) == len(offsets) == len(problem) == n:
        raise ValueError(
            "stream_linear ops: dy, x, row_index, task_row_offsets and problem need one entry per call, "
            f"got {len(dy)}, {len(x)}, {len(row_index)}, {len(offsets)}, {len(problem)}"
        )
    if sorted(set(problem)) != list(range(max(problem) + 1)):
        raise ValueError(f"stream_linear ops: problem must number the problems 0, 1, ... got {list(problem)}")
    shapes: dict[int, tuple[int, int]] = {}
    for i, (a, b, p) in enumerate(zip(dy, x, problem)):
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or a.dtype != b.dtype:
            raise ValueError(
                f"stream_linear ops: call {i} needs dy [R, M] and x [R, K] of one dtype, got "
                f"{list(a.shape)} {a.dtype} and {list(b.shape)} {b.dtype}"
            )
        if shapes.setdefault(p, (a.shape[1], b.shape[1])) != (a.shape[1], b.shape[1]):
            raise ValueError(
                f"stream_linear ops: the calls of problem {p} differ in shape ([M, K] {shapes[p]})"
            )
    if len(bias) != len(shapes):
        raise ValueError(
            f"stream_linear ops: bias needs one flag per problem ({len(shapes)}), got {len(bias)}"
        )
    return [shapes[p] for p in range(len(shapes))]


def _task_products(dy, x, row_index, offsets, problem: Sequence[int], bias, num_tasks: int) -> list[Tensor]:
    """Per problem the per-task gradients ``[T, M, K (+1)]`` in ``dy``'s dtype widened to at least fp32."""
    shapes = _check(dy, x, row_index, offsets, problem, bias)
    out = []
    for p, (m, k) in enumerate(shapes):
        dtype = torch.promote_types(dy[problem.index(p)].dtype, torch.float32)
        g = torch.zeros(num_tasks, m, k + bool(bias[p]), dtype=dtype, device=dy[0].device)
        for a, b, ri, off, q in zip(dy, x, row_index, offsets, problem):
            if q != p:
                continue
            row_task = plan_row_tasks(ri, off, a.shape[0])
            b = b.to(dtype)
            if bias[p]:
                b = torch.cat([b, b.new_ones(b.shape[0], 1)], 1)
            for t in range(num_tasks):
                g[t] += (a.to(dtype) * (row_task == t)[:, None]).T @ b
        out.append(g)
    return out


def stream_linear_gram_reference(
    dy, x, row_index, offsets, problem: Sequence[int], bias: Sequence[bool], num_tasks: int
) -> Tensor:
    """``sum_p G_p G_p^T`` ``[T, T]`` float64, each problem's Gram in its products' dtype."""
    g = torch.zeros(num_tasks, num_tasks, dtype=torch.float64, device=dy[0].device)
    for prod in _task_products(dy, x, row_index, offsets, problem, bias, num_tasks):
        flat = prod.reshape(num_tasks, -1)
        g += (flat @ flat.T).double()
    return g


def stream_linear_combine_reference(
    dy, x, row_index, offsets, problem: Sequence[int], bias: Sequence[bool], weights: Tensor
) -> Tensor:
    """``sum_t weights[t] G_pt`` of every problem, its weight's then its bias's: float32
    ``[sum_p M_p (K_p + bias_p)]``."""
    parts = []
    for p, prod in enumerate(_task_products(dy, x, row_index, offsets, problem, bias, weights.shape[0])):
        g = torch.tensordot(weights.to(prod.dtype), prod, 1)
        k = g.shape[1] - bool(bias[p])
        parts += [g[:, :k].reshape(-1), g[:, k:].T.reshape(-1)]
    return torch.cat(parts).to(torch.float32)


@TritonKernel
def _task_product(
    seg_ptr, s0, s1, t, offs_m, offs_k, m_mask, k, has_bias, DT: tl.constexpr, IEEE: tl.constexpr,
    INTERP_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``sum over calls s0..s1 of dy[rows of t, offs_m]^T [x, 1][rows of t, offs_k]`` ``[BLOCK_M, BLOCK_K]``
    fp32: ``x [R, k]``, its column ``k`` read as ones where ``has_bias``."""
    k_mask = offs_k < k
    ones = (offs_k == k) & (offs_k * 0 + has_bias != 0)  # vectors: the interpreter's scalar masks are wrong
    p = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for s in range(s0, s1):
        seg = seg_ptr + s * 6
        dy_ptr = tl.load(seg).to(tl.pointer_type(DT))
        x_ptr = tl.load(seg + 1).to(tl.pointer_type(DT))
        row_index_ptr = tl.load(seg + 2).to(tl.pointer_type(tl.int32))
        offsets_ptr = tl.load(seg + 3).to(tl.pointer_type(tl.int32))
        stride_dy = tl.load(seg + 4)
        stride_x = tl.load(seg + 5)
        start = tl.load(offsets_ptr + t)
        end = tl.load(offsets_ptr + t + 1)
        for r0 in range(start, end, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < end
            rows = tl.load(row_index_ptr + offs_r, mask=r_mask, other=0).to(tl.int64)
            a = tl.load(
                dy_ptr + rows[:, None] * stride_dy + offs_m[None, :],
                mask=r_mask[:, None] & m_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b = tl.where(ones[None, :], tl.full((1, BLOCK_K), 1.0, DT), b)  # a is zero on the masked rows
            p = dot_acc(tl.trans(a), b, p, IEEE, INTERP_BF16)
    return p


@TritonKernel
def _tile(tile_ptr, prob_ptr, pid, BLOCK_M: tl.constexpr):
    """Program ``pid``'s problem (M, K, first call, end of its calls, output offset, bias) and output rows."""
    prob = prob_ptr + tl.load(tile_ptr + 2 * pid) * 6
    m, k, s0, s1 = tl.load(prob), tl.load(prob + 1), tl.load(prob + 2), tl.load(prob + 3)
    offs_m = tl.load(tile_ptr + 2 * pid + 1) + tl.arange(0, BLOCK_M)
    return m, k, s0, s1, tl.load(prob + 4), tl.load(prob + 5), offs_m, offs_m < m


@TritonKernel
def _stream_gram_kernel(
    tile_ptr, prob_ptr, seg_ptr, partial_ptr, T, DT: tl.constexpr, IEEE: tl.constexpr,
    INTERP_BF16: tl.constexpr, T_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``partial[pid] = sum over the column blocks of P P^T`` ``[T, T]`` fp32, ``P [T_PAD, BLOCK_M * BLOCK_K]``
    the per-task products of the tile (problem, output rows) of program ``pid``."""
    pid = tl.program_id(0)
    m, k, s0, s1, _, has_bias, offs_m, m_mask = _tile(tile_ptr, prob_ptr, pid, BLOCK_M)
    tasks = tl.arange(0, T_PAD)
    g = tl.zeros((T_PAD, T_PAD), dtype=tl.float32)
    for k0 in range(0, k + has_bias, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        stacked = tl.zeros((T_PAD, BLOCK_M * BLOCK_K), dtype=tl.float32)
        for t in range(0, T):
            p = _task_product(seg_ptr, s0, s1, t, offs_m, offs_k, m_mask, k, has_bias, DT, IEEE, INTERP_BF16,
                              BLOCK_M, BLOCK_K, BLOCK_R)  # fmt: skip
            stacked = tl.where(tasks[:, None] == t, tl.reshape(p, (1, BLOCK_M * BLOCK_K)), stacked)
        g = tl.dot(stacked, tl.trans(stacked), g, input_precision="ieee")
    out = partial_ptr + pid.to(tl.int64) * T * T + tasks[:, None] * T + tasks[None, :]
    tl.store(out, g, mask=(tasks[:, None] < T) & (tasks[None, :] < T))


@TritonKernel
def _stream_combine_kernel(
    tile_ptr, prob_ptr, seg_ptr, w_ptr, out_ptr, T, DT: tl.constexpr, IEEE: tl.constexpr,
    INTERP_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``sum_t w[t] * (task t's product)`` fp32 over the tile of ``pid``: the weight's ``(m, k)`` at the
    problem's offset ``+ m * K + k``, the bias's ``m`` at ``+ M * K + m``."""
    pid = tl.program_id(0)
    m, k, s0, s1, base, has_bias, offs_m, m_mask = _tile(tile_ptr, prob_ptr, pid, BLOCK_M)
    for k0 in range(0, k + has_bias, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for t in range(0, T):
            w = tl.load(w_ptr + t).to(tl.float32)
            p = _task_product(seg_ptr, s0, s1, t, offs_m, offs_k, m_mask, k, has_bias, DT, IEEE, INTERP_BF16,
                              BLOCK_M, BLOCK_K, BLOCK_R)  # fmt: skip
            acc += w * p
        out = out_ptr + base + offs_m.to(tl.int64)[:, None] * k + offs_k[None, :]
        tl.store(out, acc, mask=m_mask[:, None] & (offs_k < k)[None, :])
        bias = tl.sum(tl.where((offs_k == k)[None, :], acc, 0.0), axis=1)
        bias_rows = (
            m_mask & (offs_m * 0 + has_bias != 0) & (offs_m * 0 + k >= k0) & (offs_m * 0 + k < k0 + BLOCK_K)
        )
        tl.store(out_ptr + base + m.to(tl.int64) * k + offs_m, bias, mask=bias_rows)


def _blocks(num_tasks: int) -> tuple[int, int, int]:
    """``(T_PAD, BLOCK_M, BLOCK_K)``: the stacked products ``[T_PAD, BLOCK_M * BLOCK_K]`` within 16K fp32."""
    t_pad = max(16, next_power_of_2(num_tasks))
    block = 32 if t_pad <= 16 else 16
    return t_pad, block, block


def _tables(dy, x, row_index, offsets, problem, bias, block_m: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """The tile, problem and call tables (one int64 host-to-device copy; shapes and addresses only) and the
    flat output's length."""
    shapes = _check(dy, x, row_index, offsets, problem, bias)
    order = sorted(range(len(problem)), key=lambda i: problem[i])
    segs = np.array(  # per call: dy, x, row_index, task_row_offsets addresses; dy's and x's row strides
        [[dy[i].data_ptr(), x[i].data_ptr(), row_index[i].data_ptr(), offsets[i].data_ptr(), dy[i].stride(0),
          x[i].stride(0)] for i in order],
        dtype=np.int64,
    ).reshape(-1, 6)  # fmt: skip
    counts = np.bincount(np.asarray(problem), minlength=len(shapes))
    ends = np.cumsum(counts)
    with_bias = np.array([bool(b) for b in bias], dtype=np.int64)
    widths = np.array([k for _, k in shapes], dtype=np.int64) + with_bias
    sizes = np.array([m for m, _ in shapes], dtype=np.int64) * widths
    probs = np.stack([
        np.array([m for m, _ in shapes]), np.array([k for _, k in shapes]), ends - counts, ends,
        np.cumsum(sizes) - sizes, with_bias,
    ], axis=1).astype(np.int64)  # fmt: skip
    tiles = np.array(
        [[p, m0] for p, (m, _) in enumerate(shapes) if widths[p] for m0 in range(0, m, block_m)],
        dtype=np.int64,
    ).reshape(-1, 2)
    flat = np.concatenate([tiles.reshape(-1), probs.reshape(-1), segs.reshape(-1)])
    table = torch.from_numpy(flat)
    if dy[0].is_cuda:  # pinned: an asynchronous copy, no wait on the device
        table = table.pin_memory().to(dy[0].device, non_blocking=True)
    n_tiles, n_probs = tiles.size, probs.size
    return table[:n_tiles], table[n_tiles : n_tiles + n_probs], table[n_tiles + n_probs :], int(sizes.sum())


def _launch_args(dy, x, row_index, offsets, problem, bias, num_tasks: int) -> tuple[list[Tensor], int, dict]:
    """The kernels' tables (:func:`_tables`, from rows with unit feature stride and int32 plans), the flat
    output's length and the launch keywords."""
    dy, x = ([t if t.stride(-1) == 1 else t.contiguous() for t in ts] for ts in (dy, x))
    row_index, offsets = ([t.to(torch.int32).contiguous() for t in ts] for ts in (row_index, offsets))
    _, block_m, block_k = _blocks(num_tasks)
    *tables, total = _tables(dy, x, row_index, offsets, problem, bias, block_m)
    import triton.language as tl  # Triton: optional; the launchers run only where it is

    dt = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dy[0].dtype]
    meta = {"DT": dt, **dot_flags(dy[0].dtype), "BLOCK_M": block_m, "BLOCK_K": block_k, "BLOCK_R": 16}
    return tables, total, meta


def stream_linear_gram_triton(
    dy, x, row_index, offsets, problem: Sequence[int], bias: Sequence[bool], num_tasks: int
) -> Tensor:
    """:func:`stream_linear_gram` on the Triton kernel (arguments as there)."""
    tables, _, meta = _launch_args(dy, x, row_index, offsets, problem, bias, num_tasks)
    n_tiles = tables[0].shape[0] // 2
    partial = torch.empty(n_tiles, num_tasks, num_tasks, dtype=torch.float32, device=tables[0].device)
    if n_tiles:
        with device_context(tables[0]):
            _stream_gram_kernel[(n_tiles,)](
                *tables, partial, num_tasks, **meta, T_PAD=_blocks(num_tasks)[0], num_warps=8
            )
    g = partial.sum(0, dtype=torch.float64)
    return 0.5 * (g + g.T)


def stream_linear_combine_triton(
    dy, x, row_index, offsets, problem: Sequence[int], bias: Sequence[bool], weights: Tensor
) -> Tensor:
    """:func:`stream_linear_combine` on the Triton kernel (arguments as there)."""
    tables, total, meta = _launch_args(dy, x, row_index, offsets, problem, bias, weights.shape[0])
    out = torch.empty(total, dtype=torch.float32, device=tables[0].device)
    n_tiles = tables[0].shape[0] // 2
    if n_tiles:
        with device_context(tables[0]):
            w = weights.to(torch.float32).contiguous()
            _stream_combine_kernel[(n_tiles,)](*tables, w, out, weights.shape[0], **meta, num_warps=4)
    return out


@torch.library.custom_op("fastpals::stream_linear_gram", mutates_args=())
def stream_linear_gram(
    dy: list[Tensor],
    x: list[Tensor],
    row_index: list[Tensor],
    task_row_offsets: list[Tensor],
    problem: list[int],
    bias: list[bool],
    num_tasks: int,
) -> Tensor:
    """``sum_p G_p G_p^T`` ``[T, T]`` float64 (module docstring): call i's ``dy[i] [R_i, M]``, ``x[i] [R_i, K]``
    (fp32/bf16/fp16), its rows' task plan (int32/int64) and problem number; ``bias[p]``: problem p has a bias."""
    if backends.backend("grouped_wgrad", dy[0]) == "triton":  # where the grouped wgrad kernel runs
        return stream_linear_gram_triton(dy, x, row_index, task_row_offsets, problem, bias, num_tasks)
    return stream_linear_gram_reference(dy, x, row_index, task_row_offsets, problem, bias, num_tasks)


@stream_linear_gram.register_fake
def _(dy, x, row_index, task_row_offsets, problem, bias, num_tasks):
    _check(dy, x, row_index, task_row_offsets, problem, bias)
    return dy[0].new_empty(num_tasks, num_tasks, dtype=torch.float64)


@torch.library.custom_op("fastpals::stream_linear_combine", mutates_args=())
def stream_linear_combine(
    dy: list[Tensor],
    x: list[Tensor],
    row_index: list[Tensor],
    task_row_offsets: list[Tensor],
    problem: list[int],
    bias: list[bool],
    weights: Tensor,
) -> Tensor:
    """``sum_t weights[t] G_pt`` of every problem as one float32 ``[sum_p M_p (K_p + bias_p)]`` (module
    docstring); arguments as for :func:`stream_linear_gram`, ``weights [T]`` float on the calls' device."""
    if backends.backend("grouped_wgrad", dy[0]) == "triton":  # where the grouped wgrad kernel runs
        return stream_linear_combine_triton(dy, x, row_index, task_row_offsets, problem, bias, weights)
    return stream_linear_combine_reference(dy, x, row_index, task_row_offsets, problem, bias, weights)


@stream_linear_combine.register_fake
def _(dy, x, row_index, task_row_offsets, problem, bias, weights):
    shapes = _check(dy, x, row_index, task_row_offsets, problem, bias)
    return dy[0].new_empty(sum(m * (k + bool(b)) for (m, k), b in zip(shapes, bias)), dtype=torch.float32)
