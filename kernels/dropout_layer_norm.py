# ruff: noqa: ANN001, ANN202 - Triton kernel parameters and the custom ops' fake/autograd hooks mirror their schemas
"""The residual + dropout + LayerNorm op: ``LayerNorm((dropout(x) + residual) [+ extra])`` over the last dim, BERT's
sublayer output (``extra``: a PAL's output, added after the residual). The reference, also the CPU path, is
:func:`fastpals_kernels.dropout.dropout_add` then ``F.layer_norm``. The Triton path is one forward kernel per
block of rows (keep mask ``tl.rand(seed, row * d + col) >= p``, fp32 statistics, the mean and 1/std saved, not the
mask) and one backward kernel (the mask recomputed from the seed; weight and bias gradients as one partial sum per
program, summed after: no atomics)."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fastpals_kernels.backends import backend
from fastpals_kernels.common import (
    TritonKernel,
    cdiv,
    device_context,
    interpret_mode,
    next_power_of_2,
    per_sample_vmap,
    seed_for,
    target_arch,
)
from fastpals_kernels.dropout import dropout_add

if TYPE_CHECKING:
    import triton.language as tl

__all__ = [
    "check_dropout_layer_norm_args",
    "dropout_add_layer_norm",
    "dropout_add_layer_norm_reference",
    "dropout_add_layer_norm_triton",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: elements of one program's ``[BLOCK_M, BLOCK_D]`` tile
_TILE = 4096


def check_dropout_layer_norm_args(
    x: object,
    residual: object,
    weight: object,
    bias: object,
    eps: object,
    p: object,
    extra: object = None,
) -> None:
    """One-line errors for :func:`dropout_add_layer_norm`'s arguments."""
    named = {"x": x, "residual": residual, "weight": weight, "bias": bias, "extra": extra}
    for name, t in named.items():
        if t is None and name == "extra":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}: move it to {x.device}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., d] with d >= 1, got {list(x.shape)}")
    for name in ("residual", "extra"):
        t = named[name]
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} must have x's shape {list(x.shape)}, got {list(t.shape)}")
    d = x.shape[-1]
    for name in ("weight", "bias"):
        if named[name].shape != (d,):
            raise ValueError(f"{name} must have shape [{d}] (x's last dim), got {list(named[name].shape)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p < 1.0:
        raise ValueError(f"p must be a float in [0, 1), got {p!r}")


def dropout_add_layer_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    p: float,
    training: bool = True,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.layer_norm(dropout_add(x, residual, p, training) [+ extra])`` over the last dim: the same ops in the same
    order as BERT's sublayer output."""
    s = dropout_add(x, residual, p, training)
    if extra is not None:
        s = s + extra
    return F.layer_norm(s, (x.shape[-1],), weight, bias, eps)


def dropout_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    p: float,
    training: bool = True,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """``LayerNorm((dropout(x, p, training) + residual) [+ extra])`` over the last dim. ``x``, ``residual``,
    ``extra`` ``[..., d]`` float32/bfloat16/float16, ``weight``, ``bias`` ``[d]``. The output has the inputs'
    promoted dtype (float32 under autocast, as ``F.layer_norm``). Triton where the dispatch picks it (CUDA), else
    :func:`dropout_add_layer_norm_reference`."""
    check_dropout_layer_norm_args(x, residual, weight, bias, eps, p, extra)
    if backend("dropout_layer_norm", x) != "triton":
        return dropout_add_layer_norm_reference(x, residual, weight, bias, eps, p, training, extra)
    p = float(p) if training else 0.0
    out_dtype = torch.promote_types(x.dtype, residual.dtype)
    if extra is not None:
        out_dtype = torch.promote_types(out_dtype, extra.dtype)
    if x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):
        out_dtype = torch.float32
    y, _, _ = torch.ops.fastpals.dropout_add_layer_norm(
        x, residual, extra, weight, bias, float(eps), p, seed_for(p), out_dtype
    )
    return y


@TritonKernel
def _dropout_factor(seed, rows, cols, D, p, scale, HAS_DROPOUT: tl.constexpr):
    """What dropout multiplies the elements ``(rows[:, None], cols[None, :])`` of a ``[M, D]`` input by: ``scale``
    where ``tl.rand(seed, (row * D + col) mod 2**32) >= p``, else 0 (1 without dropout)."""
    factor = 1.0
    if HAS_DROPOUT:
        offsets = (rows.to(tl.int64)[:, None] * D + cols[None, :]).to(tl.uint32)
        factor = tl.where(tl.rand(seed, offsets) >= p, scale, 0.0)
    return factor


@TritonKernel
def _store(ptrs, value, mask, INTERP: tl.constexpr):
    """Store fp32 ``value`` rounded to nearest even to the pointers' dtype (the CPU interpreter truncates
    fp32 -> bf16; there the bits are rounded first)."""
    dtype = ptrs.dtype.element_ty
    if INTERP:
        if dtype == tl.bfloat16:
            bits = value.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            value = bits.to(tl.float32, bitcast=True)
    tl.store(ptrs, value.to(dtype), mask=mask)


@TritonKernel
def _layer_norm_input(X, R, E, offs, mask, factor, HAS_EXTRA: tl.constexpr):
    """``(x * factor + residual) [+ extra]`` of the tile in fp32 (``factor``: :func:`_dropout_factor`)."""
    s = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) * factor
    s += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_EXTRA:
        s += tl.load(E + offs, mask=mask, other=0.0).to(tl.float32)
    return s


@TritonKernel
def _dropout_add_ln_fwd_kernel(
    X, R, E, W, B, Y, MEAN, RSTD, M, D, eps, seed, p, scale,
    HAS_EXTRA: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < M
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    factor = _dropout_factor(seed, rows, cols, D, p, scale, HAS_DROPOUT)
    s = _layer_norm_input(X, R, E, offs, mask, factor, HAS_EXTRA)
    mean = tl.sum(s, axis=1) / D
    diff = tl.where(mask, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / D + eps)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = diff * rstd[:, None] * w[None, :] + b[None, :]
    _store(Y + offs, y, mask, INTERP)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@TritonKernel
def _dropout_add_ln_bwd_kernel(
    DY, X, R, E, W, MEAN, RSTD, DS, DX, DW_PART, DB_PART, M, D, seed, p, scale,
    HAS_EXTRA: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_M
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, step):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        factor = _dropout_factor(seed, rows, cols, D, p, scale, HAS_DROPOUT)
        s = _layer_norm_input(X, R, E, offs, mask, factor, HAS_EXTRA)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
        g = dy * w[None, :]
        c1 = tl.sum(xhat * g, axis=1) / D
        c2 = tl.sum(g, axis=1) / D
        ds = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        _store(DS + offs, ds, mask, INTERP)
        _store(DX + offs, ds * factor, mask, INTERP)
    tl.store(DW_PART + pid * D + cols, dw, mask=col_mask)
    tl.store(DB_PART + pid * D + cols, db, mask=col_mask)


def _launch_config(d: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_D, num_warps)`` for rows of ``d`` elements: 8 warps, 16 elements of a 4096-element tile
    per thread."""
    block_d = next_power_of_2(d)
    return max(1, _TILE // block_d), block_d, 8


def _flat(t: torch.Tensor | None, d: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1, d).contiguous()


def dropout_add_layer_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    extra: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    p: float,
    seed: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel (arguments checked): ``(y [..., d] out_dtype, mean [rows], rstd [rows])`` float32
    statistics, the keep mask drawn from ``seed``."""
    d = x.shape[-1]
    xf, rf, ef = _flat(x, d), _flat(residual, d), _flat(extra, d)
    m = xf.shape[0]
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return y, mean, rstd
    block_m, block_d, num_warps = _launch_config(d)
    with device_context(x):
        _dropout_add_ln_fwd_kernel[(cdiv(m, block_m),)](
            xf, rf, xf if ef is None else ef, weight.contiguous(), bias.contiguous(), y, mean, rstd,
            m, d, eps, seed, p, 1.0 / (1.0 - p),
            HAS_EXTRA=ef is not None, HAS_DROPOUT=p > 0.0, BLOCK_M=block_m, BLOCK_D=block_d,
            INTERP=interpret_mode(), num_warps=num_warps,
        )  # fmt: skip
    return y, mean, rstd


def _backward_programs(x: torch.Tensor, row_blocks: int) -> int:
    """Programs of the backward kernel: a few per SM on a GPU (each writes one partial weight gradient)."""
    if x.is_cuda:
        return min(row_blocks, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    return min(row_blocks, 528 if target_arch(x) is not None else 4)  # AOT target, or the interpreter


def dropout_add_layer_norm_backward_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    extra: torch.Tensor | None,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    p: float,
    seed: int,
) -> list[torch.Tensor]:
    """The backward kernel: ``[d_residual (residual's dtype), dx (x's dtype), dweight, dbias (float32)]``; the
    LayerNorm input's gradient is also ``extra``'s."""
    d = x.shape[-1]
    dyf, xf, rf, ef = _flat(dy, d), _flat(x, d), _flat(residual, d), _flat(extra, d)
    m = xf.shape[0]
    ds = torch.empty(residual.shape, dtype=residual.dtype, device=x.device)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_m, block_d, num_warps = _launch_config(d)
    programs = max(1, _backward_programs(x, cdiv(m, block_m)))
    dw_part = torch.zeros(programs, d, dtype=torch.float32, device=x.device)
    db_part = torch.zeros(programs, d, dtype=torch.float32, device=x.device)
    if m > 0:
        with device_context(x):
            _dropout_add_ln_bwd_kernel[(programs,)](
                dyf, xf, rf, xf if ef is None else ef, weight.contiguous(), mean, rstd, ds, dx, dw_part, db_part,
                m, d, seed, p, 1.0 / (1.0 - p),
                HAS_EXTRA=ef is not None, HAS_DROPOUT=p > 0.0, BLOCK_M=block_m, BLOCK_D=block_d,
                INTERP=interpret_mode(), num_warps=num_warps,
            )  # fmt: skip
    return [ds, dx, dw_part.sum(0), db_part.sum(0)]


@torch.library.custom_op("fastpals::dropout_add_layer_norm", mutates_args=())
def dropout_add_layer_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    extra: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    p: float,
    seed: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(LayerNorm((dropout(x) + residual) [+ extra]), mean, rstd)`` by the Triton kernel, the mask from ``seed``
    (int64 ``[1]`` on the CPU)."""
    return dropout_add_layer_norm_triton(
        x, residual, extra, weight, bias, eps, p, int(seed.reshape(-1)[0]), out_dtype
    )


@dropout_add_layer_norm_op.register_fake
def _(x, residual, extra, weight, bias, eps, p, seed, out_dtype):
    rows = x.numel() // x.shape[-1]
    stat = x.new_empty(rows, dtype=torch.float32)
    return x.new_empty(x.shape, dtype=out_dtype), stat, torch.empty_like(stat)


@torch.library.custom_op("fastpals::dropout_add_layer_norm_backward", mutates_args=())
def dropout_add_layer_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    extra: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    p: float,
    seed: torch.Tensor,
) -> list[torch.Tensor]:
    """``[d_residual, dx, dweight, dbias]`` of :func:`dropout_add_layer_norm_op` (the mask recomputed)."""
    ds, dx, dw, db = dropout_add_layer_norm_backward_triton(
        dy, x, residual, extra, weight, mean, rstd, p, int(seed.reshape(-1)[0])
    )
    return [ds, dx, dw.to(weight.dtype), db.to(bias.dtype)]


@dropout_add_layer_norm_backward_op.register_fake
def _(dy, x, residual, extra, weight, bias, mean, rstd, p, seed):
    return [torch.empty_like(residual), torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)]


def _setup_context(ctx, inputs, output) -> None:
    x, residual, extra, weight, bias, eps, p, seed, out_dtype = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, residual, extra, weight, bias, mean, rstd, seed)
    ctx.p = p
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, _dmean, _drstd) -> tuple:
    x, residual, extra, weight, bias, mean, rstd, seed = ctx.saved_tensors
    ds, dx, dw, db = dropout_add_layer_norm_backward_op(
        dy.contiguous(), x, residual, extra, weight, bias, mean, rstd, ctx.p, seed
    )
    d_extra = None if extra is None else ds.to(extra.dtype)
    return dx, ds, d_extra, dw, db, None, None, None, None


dropout_add_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)
dropout_add_layer_norm_op.register_vmap(per_sample_vmap(dropout_add_layer_norm_op))
dropout_add_layer_norm_backward_op.register_vmap(per_sample_vmap(dropout_add_layer_norm_backward_op))
