# ruff: noqa: ANN001, ANN202 - Triton kernel parameters and autograd hooks
"""The PAL attention: flash-style multi-head softmax attention over a padded ``[B, L, H, Dh]`` or packed ``[N,
H, Dh]`` batch (head dims up to 128), inside the fused PAL. Online fp32 softmax forward; the backward
recomputes the probabilities (one dK/dV kernel per key block, one dQ kernel per query block; no atomics).
Dropout keeps (b, h, i, j) when ``tl.rand(seed, ((b * H + h) * S + i) * S + j) >= p`` (``S``: ``L`` or
``max_seqlen``), so a packed batch drops what the padded one does (:func:`pal_attention_dropout_mask`)."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, NamedTuple

import torch

from fastpals_kernels.backends import require_triton
from fastpals_kernels.common import (
    TritonKernel,
    aligned_rows,
    aot_mode,
    cdiv,
    check_cu_seqlens,
    check_like,
    device_context,
    dot_flags,
    last_dim_contiguous,
    next_power_of_2,
    target_arch,
)
from fastpals_kernels.grouped_linear import target_class
from fastpals_kernels.tl_helpers import cast_rne, dot_acc

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["MAX_HEAD_DIM", "pal_attention", "pal_attention_dropout_mask", "pal_attention_varlen"]

MAX_HEAD_DIM = 128
_MAX_SEQ = 65535 * 16  # grid axis 1 (blocks of >= 16 rows) is limited to 65535 on CUDA


def _interpreting() -> bool:
    """True when Triton defines (or defined) the attention kernels for its CPU interpreter."""
    kernel = _pal_attn_fwd_kernel
    kernel = kernel.jit() if isinstance(kernel, TritonKernel) else kernel
    return type(kernel).__name__ == "InterpretedFunction"


class _Layout(NamedTuple):
    """How the kernels address one call's tokens."""

    is_varlen: bool
    batch: int
    seq: int  # L (padded) or max_seqlen (varlen)
    heads: int
    head_dim: int
    rows: int  # B * L (padded) or N (varlen): rows of the fp32 statistics
    stat_stride_b: int  # L (padded) or 0 (varlen)
    mask: torch.Tensor | None  # [B, L] integer view of key_padding_mask
    cu_seqlens: torch.Tensor | None


def _strides(x: torch.Tensor, is_varlen: bool) -> tuple[int, int, int]:
    """(batch, token, head) element strides; varlen tensors have no batch dim (stride 0)."""
    return (0, x.stride(0), x.stride(1)) if is_varlen else (x.stride(0), x.stride(1), x.stride(2))


# GPU tiles per (kernel, fp32): (block_m for padded head dims 32 and 64, block_m for 128, warps for 32 and 64);
# block_n 32, 4 warps at 128, two stages (one on sm_75). The ahead-of-time compile of every launch fits each
# target's shared memory and the 16-bit kernels do not spill on sm_80/sm_90 (tests/test_aot.py asserts both).
_TILES = {("fwd", False): (64, 32, 4), ("dkdv", False): (64, 16, 8), ("dq", False): (64, 32, 4)}
_TILES |= {(kernel, True): (32, 16, 4) for kernel in ("fwd", "dkdv", "dq")}


def _launch_config(kernel: str, layout: _Layout, q: torch.Tensor) -> dict:
    """Tile sizes and launch options of ``kernel`` ("fwd", "dkdv", "dq") for this call; tiles never exceed the
    sequence (>= 16). sm_75 (64 KiB of shared memory per block) runs one stage."""
    block_d = max(16, next_power_of_2(layout.head_dim))
    if _interpreting():  # small tiles keep the CPU interpreter fast
        block_m = block_n = 16
        warps, stages = 4, 1
    else:
        block_m, block_m_128, warps = _TILES[(kernel, q.dtype == torch.float32)]
        if block_d > 64:
            block_m, warps = block_m_128, 4
        block_n, stages = 32, 1 if target_class(target_arch(q)) == "sm75" else 2
    seq = next_power_of_2(max(layout.seq, 1))
    return {
        "BLOCK_M": max(16, min(block_m, seq)),
        "BLOCK_N": max(16, min(block_n, seq)),
        "BLOCK_D": block_d,
        "num_warps": warps,
        "num_stages": stages,
    }


def _check_qkv(q: object, k: object, v: object, ndim: int, form: str) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != ndim:
            raise ValueError(f"{name} must have shape {form}, got {list(x.shape)} ({x.dim()} dims)")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {list(q.shape)}, got {list(x.shape)}")
    check_like("q", q, k=k, v=v)
    head_dim = q.shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (last dim of q) must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if q.device.type != "cuda" and not _interpreting() and not aot_mode():
        raise RuntimeError(
            f"q is on {q.device}: the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set before their "
            "first launch (CPU interpreter); use fastpals.functional.attention_reference on CPU"
        )


def _check_options(dropout_p: object, softmax_scale: object, generator_seed: object) -> None:
    is_real = lambda x: not isinstance(x, bool) and isinstance(x, numbers.Real)
    if not is_real(dropout_p):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is not None and not is_real(softmax_scale):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if softmax_scale is not None and not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if generator_seed is None:
        return
    if isinstance(generator_seed, bool) or not isinstance(generator_seed, numbers.Integral):
        raise TypeError(f"generator_seed must be an int or None, got {type(generator_seed).__name__}")
    if not 0 <= int(generator_seed) < 2**63:
        raise ValueError(f"generator_seed must be in [0, 2**63), got {generator_seed}")


def _check_grid_rows(seq: int, name: str) -> None:
    if seq > _MAX_SEQ:
        raise ValueError(f"{name} = {seq} exceeds the longest supported sequence ({_MAX_SEQ} tokens)")


def _head_align(head_dim: int, *tensors: torch.Tensor) -> int:
    """The kernels' ALIGN hint: 16 or 8 when the head dim and every tensor's head stride are multiples of it (8
    elements are 16 bytes in 16-bit: the fused PAL pads its heads so), else 1 (no hint)."""
    for align in (16, 8):
        if head_dim % align == 0 and all(t.stride(-2) % align == 0 for t in tensors):
            return align
    return 1


def _launch_args(layout: _Layout, q: torch.Tensor, dropout_p: float, *tensors: torch.Tensor) -> tuple:
    """``(mask, cu_seqlens, mask strides, constexpr flags)`` shared by the kernel launches; placeholders (q) where
    the layout has no mask or no cu_seqlens."""
    mask = layout.mask if layout.mask is not None else q
    cu = layout.cu_seqlens if layout.cu_seqlens is not None else q
    mask_strides = (mask.stride(0), mask.stride(1)) if layout.mask is not None else (0, 0)
    flags = {
        "IS_VARLEN": layout.is_varlen,
        "HAS_MASK": layout.mask is not None,
        "HAS_DROPOUT": dropout_p > 0.0,
        "ALIGN": _head_align(layout.head_dim, q, *tensors),
        **dot_flags(q.dtype),
    }
    return mask, cu, mask_strides, flags


def _attention_forward(q, k, v, layout: _Layout, dropout_p: float, scale: float, seed: int, aligned: bool):
    """Launch the forward kernel: (out like q, contiguous or with 16-element-aligned rows when ``aligned``;
    stat_m [rows, H]; stat_l [rows, H])."""
    if aligned:  # rows of H * Dh values at a 16-element stride (the PAL's V^D reads them as [R, d_s])
        out = aligned_rows(layout.rows, layout.heads * layout.head_dim, q.dtype, q.device).view(q.shape)
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    stat_m = torch.empty(layout.rows, layout.heads, dtype=torch.float32, device=q.device)
    stat_l = torch.empty_like(stat_m)
    if out.numel() == 0 or layout.seq == 0:
        return out, stat_m, stat_l
    cfg = _launch_config("fwd", layout, q)
    mask, cu, mask_strides, flags = _launch_args(layout, q, dropout_p, k, v, out)
    varlen = layout.is_varlen
    grid = (layout.batch * layout.heads, cdiv(layout.seq, cfg["BLOCK_M"]))
    with device_context(q):
        _pal_attn_fwd_kernel[grid](
            q, k, v, out, stat_m, stat_l, mask, cu,
            seed, dropout_p, 1.0 / (1.0 - dropout_p), scale,
            *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(out, varlen),
            *mask_strides, layout.stat_stride_b, layout.heads, layout.seq, layout.head_dim, **flags, **cfg,
        )  # fmt: skip
    return out, stat_m, stat_l


def _attention_backward(dout, saved: tuple, layout: _Layout, dropout_p, scale, seed, need_dq, need_dkdv):
    """Launch the delta, dK/dV and dQ kernels over ``saved = (q, k, v, out, stat_m, stat_l)``; the gradients
    come back contiguous in q's dtype."""
    q, k, v, out, stat_m, stat_l = saved
    dout = last_dim_contiguous(dout.to(q.dtype))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dq else None
    dk = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dkdv else None
    dv = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dkdv else None
    if q.numel() == 0 or layout.seq == 0:
        return dq, dk, dv
    cfg_kv, cfg_q = _launch_config("dkdv", layout, q), _launch_config("dq", layout, q)
    grads = [g for g in (dq, dk, dv) if g is not None]
    mask, cu, mask_strides, flags = _launch_args(layout, q, dropout_p, k, v, out, dout, *grads)
    varlen = layout.is_varlen
    delta = torch.empty_like(stat_m)
    bh = layout.batch * layout.heads
    sizes = (layout.stat_stride_b, layout.heads, layout.seq, layout.head_dim)
    common = (
        seed, dropout_p, 1.0 / (1.0 - dropout_p), scale,
        *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(dout, varlen),
        *_strides(grads[0], varlen), *mask_strides, *sizes,  # dq, dk and dv share one layout
    )  # fmt: skip
    with device_context(q):
        _pal_attn_bwd_delta_kernel[(bh, cdiv(layout.seq, cfg_q["BLOCK_M"]))](
            out, dout, delta, cu, *_strides(out, varlen), *_strides(dout, varlen), *sizes,
            IS_VARLEN=varlen, ALIGN=flags["ALIGN"], BLOCK_M=cfg_q["BLOCK_M"], BLOCK_D=cfg_q["BLOCK_D"],
            num_warps=cfg_q["num_warps"],
        )  # fmt: skip
        if need_dkdv:
            _pal_attn_bwd_dkdv_kernel[(bh, cdiv(layout.seq, cfg_kv["BLOCK_N"]))](
                q, k, v, dout, dk, dv, stat_m, stat_l, delta, mask, cu, *common, **flags, **cfg_kv
            )
        if need_dq:
            _pal_attn_bwd_dq_kernel[(bh, cdiv(layout.seq, cfg_q["BLOCK_M"]))](
                q, k, v, dout, dq, stat_m, stat_l, delta, mask, cu, *common, **flags, **cfg_q
            )
    return dq, dk, dv


class _AttentionFunction(torch.autograd.Function):
    """Autograd op behind :func:`pal_attention` and :func:`pal_attention_varlen` (arguments checked there),
    the tokens addressed as ``layout`` says."""

    @staticmethod
    def forward(
        ctx, q, k, v, layout: _Layout, dropout_p, softmax_scale, generator_seed, aligned
    ) -> torch.Tensor:
        dropout_p = float(dropout_p)
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(layout.head_dim)
        # without a generator_seed, one draw from the CPU generator: no device sync, replayed by checkpoint
        seed = generator_seed if dropout_p > 0.0 else 0
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item() if seed is None else seed)
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        out, stat_m, stat_l = _attention_forward(q, k, v, layout, dropout_p, scale, seed, aligned)
        ctx.save_for_backward(q, k, v, out, stat_m, stat_l, layout.mask, layout.cu_seqlens)
        ctx.layout = layout._replace(mask=None, cu_seqlens=None)
        ctx.dropout_p, ctx.scale, ctx.seed = dropout_p, scale, seed
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *saved, mask, cu_seqlens = ctx.saved_tensors
        layout = ctx.layout._replace(mask=mask, cu_seqlens=cu_seqlens)
        need_dq, need_dk, need_dv = ctx.needs_input_grad[:3]
        nones = (None,) * (len(ctx.needs_input_grad) - 3)
        dq, dk, dv = _attention_backward(
            dout, tuple(saved), layout, ctx.dropout_p, ctx.scale, ctx.seed, need_dq, need_dk or need_dv
        )
        return dq, dk if need_dk else None, dv if need_dv else None, *nones


def pal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    generator_seed: int | None = None,
    *,
    aligned_rows: bool = False,
) -> torch.Tensor:
    """Multi-head softmax attention over a padded batch, the fused ``attention_reference``: ``[B, L, H, Dh]``
    in q's dtype.

    q, k, v: ``[B, L, H, Dh]`` fp32/fp16/bf16, one dtype and device, ``Dh <= 128``, any strides on the first
    three dims (a last dim that is not contiguous is copied); key_padding_mask: ``[B, L]`` bool or integer
    (1 = token) or None; dropout_p: in ``[0, 1)``; softmax_scale: default ``1 / sqrt(Dh)``; generator_seed:
    Philox seed of the dropout mask (:func:`pal_attention_dropout_mask`), default one draw from torch's CPU
    generator; aligned_rows: the ``[B*L, H*Dh]`` rows at a stride padded to 16 elements (what V^D reads)."""
    require_triton("pal_attention")
    _check_qkv(q, k, v, 4, "[B, L, H, Dh]")
    _check_options(dropout_p, softmax_scale, generator_seed)
    batch, length, heads, head_dim = q.shape
    mask = key_padding_mask
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.shape != (batch, length):
            raise ValueError(
                f"key_padding_mask must have shape [B, L] = [{batch}, {length}], got {list(mask.shape)}"
            )
        check_like("q", q, dtype=False, key_padding_mask=mask)
        if mask.is_floating_point() or mask.is_complex():
            raise TypeError(
                f"key_padding_mask must be bool or integer (1 = token, 0 = padding), got {mask.dtype}; "
                "an additive float mask is not accepted (convert it with `mask == 0`)"
            )
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
    _check_grid_rows(length, "L (q.shape[1])")
    layout = _Layout(False, batch, length, heads, head_dim, batch * length, length, mask, None)
    return _AttentionFunction.apply(q, k, v, layout, dropout_p, softmax_scale, generator_seed, aligned_rows)


def pal_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    generator_seed: int | None = None,
    *,
    aligned_rows: bool = False,
) -> torch.Tensor:
    """Packed form of :func:`pal_attention`, the fused ``attention_varlen_reference``: q, k, v ``[N, H, Dh]``,
    cu_seqlens ``[B+1]`` int32/int64 (checked on the host once per tensor), max_seqlen an int >= the longest
    sequence (dropout draws as in a padded batch with ``L = max_seqlen``) → ``[N, H, Dh]``."""
    require_triton("pal_attention_varlen")
    _check_qkv(q, k, v, 3, "[N, H, Dh]")
    _check_options(dropout_p, softmax_scale, generator_seed)
    # one host read per cu_seqlens tensor, not per call, so the PAL of every layer of one forward syncs once
    batch = check_cu_seqlens(cu_seqlens, q.shape[0], q.device, max_seqlen=max_seqlen)
    _check_grid_rows(int(max_seqlen), "max_seqlen")
    seq, cu = int(max_seqlen), cu_seqlens.to(torch.int32)
    layout = _Layout(True, batch, seq, q.shape[1], q.shape[2], q.shape[0], 0, None, cu)
    return _AttentionFunction.apply(q, k, v, layout, dropout_p, softmax_scale, generator_seed, aligned_rows)


def pal_attention_dropout_mask(
    batch: int, num_heads: int, seqlen: int, dropout_p: float, seed: int, device: torch.device | str
) -> torch.Tensor:
    """The exact keep mask the kernels use for ``generator_seed=seed``: bool ``[batch, num_heads, seqlen, seqlen]``
    indexed (b, h, query, key), True = kept; ``seqlen`` is ``L`` (padded) or ``max_seqlen`` (packed). The
    reference output is ``softmax(scores) * keep / (1 - dropout_p) @ v``."""
    for name, value in (("batch", batch), ("num_heads", num_heads), ("seqlen", seqlen)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    _check_options(dropout_p, None, seed)
    _check_grid_rows(int(seqlen), "seqlen")
    device = torch.device(device)
    if device.type != "cuda" and not _interpreting() and not aot_mode():
        raise RuntimeError(f"device {device} needs TRITON_INTERPRET=1 (CPU interpreter) or a CUDA device")
    keep = torch.empty(batch, num_heads, seqlen, seqlen, dtype=torch.int8, device=device)
    if keep.numel() == 0:
        return keep.bool()
    block = 16 if _interpreting() else 64
    grid = (batch * num_heads, cdiv(seqlen, block), cdiv(seqlen, block))
    with device_context(keep):
        _pal_attn_dropout_mask_kernel[grid](
            keep, int(seed), float(dropout_p), num_heads, seqlen, BLOCK_M=block, BLOCK_N=block
        )
    return keep.bool()


@TritonKernel
def _program(CU, H, SEQ, IS_VARLEN: tl.constexpr):
    """This program's (batch x head, batch as int64, head, first token row, sequence length): the sequence
    bounds come from ``cu_seqlens`` (varlen) or are ``(0, L)`` (padded)."""
    bh = tl.program_id(0)
    b = bh // H
    if IS_VARLEN:
        start = tl.load(CU + b)
        seqlen = tl.load(CU + b + 1) - start
    else:
        start = b * 0
        seqlen = b * 0 + SEQ
    return bh, b.to(tl.int64), bh % H, start, seqlen


@TritonKernel
def _rows(first, start, seqlen, BLOCK: tl.constexpr):
    """Positions ``first .. first + BLOCK - 1`` of a sequence: (positions, inside the sequence, token rows)."""
    offs = first + tl.arange(0, BLOCK)
    return offs, offs < seqlen, (start + offs).to(tl.int64)


@TritonKernel
def _key_bias(MASK, b64, offs_n, valid_n, stride_mb, stride_ml, HAS_MASK: tl.constexpr):
    """Additive fp32 score bias per key: 0 for a token, finfo.min for padding, -inf past the sequence end."""
    if HAS_MASK:
        keep = tl.load(MASK + b64 * stride_mb + offs_n.to(tl.int64) * stride_ml, mask=valid_n, other=1)
        bias = tl.where(keep != 0, 0.0, -3.4028234663852886e38)
    else:
        bias = tl.zeros_like(offs_n).to(tl.float32)
    return tl.where(valid_n, bias, float("-inf"))


@TritonKernel
def _dropout_keep(seed, bh, q_idx, k_idx, SEQ, dropout_p):
    """Keep decision at (query q_idx, key k_idx) of batch x head ``bh``: one Philox counter per (b, h, i, j)."""
    offsets = (bh.to(tl.int64) * SEQ + q_idx.to(tl.int64)) * SEQ + k_idx.to(tl.int64)
    return tl.rand(seed, offsets) >= dropout_p


@TritonKernel
def _head_ptr(PTR, b64, h, stride_b, stride_h, ALIGN: tl.constexpr):
    """``PTR`` advanced to (batch b, head h). ``ALIGN > 1``: ``stride_h`` and the head dim are multiples of ALIGN
    (host-checked), the hint for 16-byte vector loads and ``cp.async`` (Triton infers only divisibility by 16)."""
    off = h * stride_h
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return PTR + b64 * stride_b + off


@TritonKernel
def _tile_ptrs(PTR, b64, h, tok, offs_d, stride_b, stride_l, stride_h, ALIGN: tl.constexpr):
    """Pointers to the ``[len(tok), BLOCK_D]`` tile of token rows ``tok`` of (batch b, head h)."""
    return _head_ptr(PTR, b64, h, stride_b, stride_h, ALIGN) + tok[:, None] * stride_l + offs_d[None, :]


@TritonKernel
def _load_rows(base, tok, stride_l, offs_d, mask):
    """The ``[len(tok), BLOCK_D]`` tile at token rows ``tok`` of a (batch, head) ``base``; zeros where masked."""
    return tl.load(base + tok[:, None] * stride_l + offs_d[None, :], mask=mask, other=0.0)


@TritonKernel
def _dim_mask(offs_d, HEAD_DIM, ALIGN: tl.constexpr):
    """``offs_d < HEAD_DIM``, constant over groups of ALIGN columns when the host checked HEAD_DIM % ALIGN == 0."""
    valid = offs_d < HEAD_DIM
    if ALIGN > 1:
        valid = tl.max_constancy(valid, [ALIGN])
    return valid


@TritonKernel
def _row_stats(STAT_M, STAT_L, DELTA, b64, tok, h, valid, H, stat_stride_b):
    """The saved softmax max ``m`` and normaliser ``l`` and the backward's ``delta`` of rows ``tok``, head h."""
    stat = (b64 * stat_stride_b + tok) * H + h
    m = tl.load(STAT_M + stat, mask=valid, other=0.0)
    l_row = tl.load(STAT_L + stat, mask=valid, other=1.0)
    delta = tl.load(DELTA + stat, mask=valid, other=0.0)
    return m, l_row, delta


@TritonKernel
def _pal_attn_fwd_kernel(
    Q, K, V, Out, STAT_M, STAT_L, MASK, CU, seed, dropout_p, dropout_scale, softmax_scale,
    stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
    stride_ob, stride_ol, stride_oh, stride_mb, stride_ml, stat_stride_b, H, SEQ, HEAD_DIM,
    IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, INTERP_BF16: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Output and softmax statistics of one query block (online softmax over the key blocks)."""
    bh, b64, h, start, seqlen = _program(CU, H, SEQ, IS_VARLEN)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M < seqlen:
        offs_m, valid_m, tok_m = _rows(pid_m * BLOCK_M, start, seqlen, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        valid_d = _dim_mask(offs_d, HEAD_DIM, ALIGN)
        q_mask = valid_m[:, None] & valid_d[None, :]
        q = _load_rows(_head_ptr(Q, b64, h, stride_qb, stride_qh, ALIGN), tok_m, stride_ql, offs_d, q_mask)
        k_base = _head_ptr(K, b64, h, stride_kb, stride_kh, ALIGN)
        v_base = _head_ptr(V, b64, h, stride_vb, stride_vh, ALIGN)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, seqlen, BLOCK_N):
            offs_n, valid_n, tok_n = _rows(start_n, start, seqlen, BLOCK_N)
            kv_mask = valid_n[:, None] & valid_d[None, :]
            k = _load_rows(k_base, tok_n, stride_kl, offs_d, kv_mask)
            v = _load_rows(v_base, tok_n, stride_vl, offs_d, kv_mask)
            bias = _key_bias(MASK, b64, offs_n, valid_n, stride_mb, stride_ml, HAS_MASK)
            s = dot_acc(q, tl.trans(k), None, IEEE, INTERP_BF16) * softmax_scale + bias[None, :]
            # every tile holds at least one key inside the sequence, so m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], SEQ, dropout_p)
                p = tl.where(keep, p * dropout_scale, 0.0)
            acc = dot_acc(cast_rne(p, v.dtype, INTERP_BF16), v, acc * alpha[:, None], IEEE, INTERP_BF16)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(
            _tile_ptrs(Out, b64, h, tok_m, offs_d, stride_ob, stride_ol, stride_oh, ALIGN),
            cast_rne(acc, Out.dtype.element_ty, INTERP_BF16),
            mask=q_mask,
        )
        stat = (b64 * stat_stride_b + tok_m) * H + h
        tl.store(STAT_M + stat, m_i, mask=valid_m)
        tl.store(STAT_L + stat, l_i, mask=valid_m)


@TritonKernel
def _pal_attn_bwd_delta_kernel(
    Out, DO, DELTA, CU, stride_ob, stride_ol, stride_oh, stride_dob, stride_dol, stride_doh,
    stat_stride_b, H, SEQ, HEAD_DIM,
    IS_VARLEN: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``delta = rowsum(dO * O)`` of one query block."""
    bh, b64, h, start, seqlen = _program(CU, H, SEQ, IS_VARLEN)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M < seqlen:
        offs_m, valid_m, tok_m = _rows(pid_m * BLOCK_M, start, seqlen, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask = valid_m[:, None] & _dim_mask(offs_d, HEAD_DIM, ALIGN)[None, :]
        o = _load_rows(_head_ptr(Out, b64, h, stride_ob, stride_oh, ALIGN), tok_m, stride_ol, offs_d, mask)
        do = _load_rows(_head_ptr(DO, b64, h, stride_dob, stride_doh, ALIGN), tok_m, stride_dol, offs_d, mask)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + (b64 * stat_stride_b + tok_m) * H + h, delta, mask=valid_m)


@TritonKernel
def _pal_attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, STAT_M, STAT_L, DELTA, MASK, CU, seed, dropout_p, dropout_scale, softmax_scale,
    stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
    stride_dob, stride_dol, stride_doh, stride_gb, stride_gl, stride_gh,
    stride_mb, stride_ml, stat_stride_b, H, SEQ, HEAD_DIM,
    IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, INTERP_BF16: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block (transposed tiles: keys on rows, queries on columns)."""
    bh, b64, h, start, seqlen = _program(CU, H, SEQ, IS_VARLEN)
    pid_n = tl.program_id(1)
    if pid_n * BLOCK_N < seqlen:
        offs_n, valid_n, tok_n = _rows(pid_n * BLOCK_N, start, seqlen, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        valid_d = _dim_mask(offs_d, HEAD_DIM, ALIGN)
        kv_mask = valid_n[:, None] & valid_d[None, :]
        k = _load_rows(_head_ptr(K, b64, h, stride_kb, stride_kh, ALIGN), tok_n, stride_kl, offs_d, kv_mask)
        v = _load_rows(_head_ptr(V, b64, h, stride_vb, stride_vh, ALIGN), tok_n, stride_vl, offs_d, kv_mask)
        bias = _key_bias(MASK, b64, offs_n, valid_n, stride_mb, stride_ml, HAS_MASK)
        q_base = _head_ptr(Q, b64, h, stride_qb, stride_qh, ALIGN)
        do_base = _head_ptr(DO, b64, h, stride_dob, stride_doh, ALIGN)

        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for start_m in range(0, seqlen, BLOCK_M):
            offs_m, valid_m, tok_m = _rows(start_m, start, seqlen, BLOCK_M)
            q_mask = valid_m[:, None] & valid_d[None, :]
            q = _load_rows(q_base, tok_m, stride_ql, offs_d, q_mask)
            do = _load_rows(do_base, tok_m, stride_dol, offs_d, q_mask)
            m, l_row, delta = _row_stats(STAT_M, STAT_L, DELTA, b64, tok_m, h, valid_m, H, stat_stride_b)

            s_t = dot_acc(k, tl.trans(q), None, IEEE, INTERP_BF16) * softmax_scale + bias[:, None]
            p_t = tl.exp(s_t - m[None, :]) / l_row[None, :]
            dp_t = dot_acc(v, tl.trans(do), None, IEEE, INTERP_BF16)
            if HAS_DROPOUT:
                keep_t = _dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], SEQ, dropout_p)
                pd_t = tl.where(keep_t, p_t * dropout_scale, 0.0)
                dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
            else:
                pd_t = p_t
            dv = dot_acc(cast_rne(pd_t, do.dtype, INTERP_BF16), do, dv, IEEE, INTERP_BF16)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = dot_acc(cast_rne(ds_t, q.dtype, INTERP_BF16), q, dk, IEEE, INTERP_BF16)
        dk = dk * softmax_scale
        dk_ptrs = _tile_ptrs(DK, b64, h, tok_n, offs_d, stride_gb, stride_gl, stride_gh, ALIGN)
        dv_ptrs = _tile_ptrs(DV, b64, h, tok_n, offs_d, stride_gb, stride_gl, stride_gh, ALIGN)
        tl.store(dk_ptrs, cast_rne(dk, DK.dtype.element_ty, INTERP_BF16), mask=kv_mask)
        tl.store(dv_ptrs, cast_rne(dv, DV.dtype.element_ty, INTERP_BF16), mask=kv_mask)


@TritonKernel
def _pal_attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, STAT_M, STAT_L, DELTA, MASK, CU, seed, dropout_p, dropout_scale, softmax_scale,
    stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
    stride_dob, stride_dol, stride_doh, stride_gb, stride_gl, stride_gh,
    stride_mb, stride_ml, stat_stride_b, H, SEQ, HEAD_DIM,
    IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, INTERP_BF16: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dQ of one query block."""
    bh, b64, h, start, seqlen = _program(CU, H, SEQ, IS_VARLEN)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M < seqlen:
        offs_m, valid_m, tok_m = _rows(pid_m * BLOCK_M, start, seqlen, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        valid_d = _dim_mask(offs_d, HEAD_DIM, ALIGN)
        q_mask = valid_m[:, None] & valid_d[None, :]
        q = _load_rows(_head_ptr(Q, b64, h, stride_qb, stride_qh, ALIGN), tok_m, stride_ql, offs_d, q_mask)
        do = _load_rows(
            _head_ptr(DO, b64, h, stride_dob, stride_doh, ALIGN), tok_m, stride_dol, offs_d, q_mask
        )
        m, l_row, delta = _row_stats(STAT_M, STAT_L, DELTA, b64, tok_m, h, valid_m, H, stat_stride_b)
        k_base = _head_ptr(K, b64, h, stride_kb, stride_kh, ALIGN)
        v_base = _head_ptr(V, b64, h, stride_vb, stride_vh, ALIGN)

        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, seqlen, BLOCK_N):
            offs_n, valid_n, tok_n = _rows(start_n, start, seqlen, BLOCK_N)
            kv_mask = valid_n[:, None] & valid_d[None, :]
            k = _load_rows(k_base, tok_n, stride_kl, offs_d, kv_mask)
            v = _load_rows(v_base, tok_n, stride_vl, offs_d, kv_mask)
            bias = _key_bias(MASK, b64, offs_n, valid_n, stride_mb, stride_ml, HAS_MASK)
            s = dot_acc(q, tl.trans(k), None, IEEE, INTERP_BF16) * softmax_scale + bias[None, :]
            p = tl.exp(s - m[:, None]) / l_row[:, None]
            dp = dot_acc(do, tl.trans(v), None, IEEE, INTERP_BF16)
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], SEQ, dropout_p)
                dp = tl.where(keep, dp * dropout_scale, 0.0)
            ds = p * (dp - delta[:, None])
            dq = dot_acc(cast_rne(ds, k.dtype, INTERP_BF16), k, dq, IEEE, INTERP_BF16)
        dq = dq * softmax_scale
        tl.store(
            _tile_ptrs(DQ, b64, h, tok_m, offs_d, stride_gb, stride_gl, stride_gh, ALIGN),
            cast_rne(dq, DQ.dtype.element_ty, INTERP_BF16),
            mask=q_mask,
        )


@TritonKernel
def _pal_attn_dropout_mask_kernel(
    KEEP, seed, dropout_p, H, SEQ, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """The dropout keep mask ``[B, H, SEQ, SEQ]`` int8 of one (query block, key block) tile."""
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], SEQ, dropout_p)
    out = (bh.to(tl.int64) * SEQ + offs_m[:, None].to(tl.int64)) * SEQ + offs_n[None, :]
    tl.store(KEEP + out, keep.to(tl.int8), mask=(offs_m[:, None] < SEQ) & (offs_n[None, :] < SEQ))
