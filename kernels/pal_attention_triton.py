"""Flash-style multi-head attention for the PAL's projected space (small head dims, fused dropout).

The PAL of Bert-n-Pals runs softmax attention with 6 or 12 heads of 17, 34 or 46 dimensions on a
``d_s``-wide projection of the layer input. This module computes exactly what
:func:`fastpals.functional.attention_reference` / :func:`~fastpals.functional.attention_varlen_reference` define,
without ever holding an ``L x L`` matrix in memory:

- forward: one program per (batch x head, block of queries) streams over key blocks with an online softmax in
  fp32 and saves the per-row running max ``m`` and normaliser ``l`` (two fp32 numbers per query and head);
- backward: a small pass computes ``delta = rowsum(dO * O)``; one kernel per key block accumulates ``dK`` and
  ``dV`` over all query blocks, a second per query block accumulates ``dQ`` over all key blocks. The
  probabilities are recomputed from ``m`` and ``l``; no atomics, so gradients are deterministic.

Semantics shared with the reference:

- padded keys (``key_padding_mask == 0``) get ``finfo(float32).min`` added to their fp32 score, exactly like
  BERT's additive mask. A sequence whose keys are all padding therefore averages every key uniformly (as the
  reference does) instead of producing NaN; every query row, padded or not, is computed.
- the softmax scale defaults to ``1 / sqrt(Dh)``.
- dropout on the (normalised) probabilities keeps an entry with probability ``1 - dropout_p`` and scales kept
  entries by ``1 / (1 - dropout_p)``. The keep decision of entry (batch b, head h, query i, key j) is
  ``tl.rand(seed, ((b * H + h) * S + i) * S + j) >= dropout_p`` with ``S`` = ``L`` (padded) or ``max_seqlen``
  (varlen; i and j count from the start of each sequence), so the backward pass regenerates the forward mask
  and a varlen batch drops exactly what the padded batch with ``L = max_seqlen`` drops.
  :func:`pal_attention_dropout_mask` materialises that mask for tests and debugging.

Head dims up to 128 are supported; a head dim is padded inside the kernel to the next power of two >= 16
(``tl.dot`` needs 16) with masked loads and stores, so 17 runs in tiles of 32, 34 and 46 in tiles of 64.
When the head dim and every head stride are multiples of 8 elements (the fused PAL zero-pads its heads to 40, 24
and 48, see :func:`fastpals_kernels.pal_triton.pal_layout`), the kernels get an ``ALIGN`` hint so that their
16-bit loads become 16-byte vectors pipelined with ``cp.async``; otherwise they run unhinted.
Inputs are fp32, fp16 or bf16; scores, softmax and every accumulator are fp32; fp32 inputs use IEEE fp32
products (no TF32), so fp32 results match the reference to about 1e-6.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from typing import NamedTuple

import torch
import triton

from fastpals_kernels.common import (
    aligned_rows,
    aot_mode,
    check_cu_seqlens,
    cu_seqlens_int32,
    device_context,
    dot_flags,
    last_dim_contiguous,
    target_arch,
)
from fastpals_kernels.grouped_linear import target_class
from fastpals_kernels.pal_attention_kernels import (
    _pal_attn_bwd_delta_kernel,
    _pal_attn_bwd_dkdv_kernel,
    _pal_attn_bwd_dq_kernel,
    _pal_attn_dropout_mask_kernel,
    _pal_attn_fwd_kernel,
)

__all__ = [
    "MAX_HEAD_DIM",
    "attention_config",
    "PALAttentionFunction",
    "PALAttentionVarlenFunction",
    "pal_attention",
    "pal_attention_dropout_mask",
    "pal_attention_varlen",
]

MAX_HEAD_DIM = 128
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SEED_LIMIT = 2**63


# ----------------------------------------------------------------------------------------------------------------
# Host side: validation, launch configuration, autograd (the kernels are in pal_attention_kernels.py)
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def _interpreting() -> bool:
    """True when Triton built this module's kernels for its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - layout of older/newer triton
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return isinstance(_pal_attn_fwd_kernel, InterpretedFunction)


class _Layout(NamedTuple):
    """How the kernels address one call's tokens (see :mod:`fastpals_kernels.pal_attention_kernels`)."""

    is_varlen: bool
    batch: int
    seq: int  # L (padded) or max_seqlen (varlen)
    heads: int
    head_dim: int
    rows: int  # B * L (padded) or N (varlen): rows of the fp32 statistics
    stat_stride_b: int  # L (padded) or 0 (varlen)
    mask: torch.Tensor | None  # [B, L] integer view of key_padding_mask
    cu_seqlens: torch.Tensor | None


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int


def _strides(x: torch.Tensor, is_varlen: bool) -> tuple[int, int, int]:
    """(batch, token, head) element strides; varlen tensors have no batch dim (stride 0)."""
    if is_varlen:
        return 0, x.stride(0), x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _clamp_block(block: int, seq: int) -> int:
    return max(16, min(block, triton.next_power_of_2(max(seq, 1))))


# GPU launch configurations (block_m = queries, block_n = keys, warps, stages) per kernel, "fp32 or 16-bit" and
# padded head dim; sm_75 takes one stage (see attention_config). Chosen from the
# ahead-of-time compile of every launch (Triton 3.9, ptxas -v, every feature on: mask/varlen + dropout) so that
# the shared memory fits each target and the 16-bit kernels do not spill on sm_80/sm_90 (tests/test_aot.py
# asserts both); not yet timed on a GPU.
_BASE_CONFIGS: dict[tuple[str, bool, int], tuple[int, int, int, int]] = {
    # 16-bit (tensor-core mma / wgmma): 64 x 64 tiles spilled 44-308 B on sm_80; dK/dV at head dim 17 with 32 x 32
    # tiles and 4 warps spilled 8 B there (varlen + dropout), 64 x 32 with 8 warps does not; dK/dV at the PAL's
    # padded head dims 40/48 (16-byte cp.async loads) spilled 4 B on sm_80 with 4 warps (varlen), 8 warps do not
    ("fwd", False, 32): (64, 32, 4, 2),
    ("fwd", False, 64): (64, 32, 4, 2),
    ("fwd", False, 128): (32, 32, 4, 2),
    ("dkdv", False, 32): (64, 32, 8, 2),
    ("dkdv", False, 64): (64, 32, 8, 2),
    ("dkdv", False, 128): (16, 32, 4, 2),
    ("dq", False, 32): (64, 32, 4, 2),
    ("dq", False, 64): (64, 32, 4, 2),
    ("dq", False, 128): (32, 32, 4, 2),
    # fp32 (IEEE products on CUDA cores): smaller tiles, the operands take twice the registers
    ("fwd", True, 32): (32, 32, 4, 2),
    ("fwd", True, 64): (32, 32, 4, 2),
    ("fwd", True, 128): (16, 32, 4, 2),
    ("dkdv", True, 32): (32, 32, 4, 2),
    ("dkdv", True, 64): (32, 32, 4, 2),
    ("dkdv", True, 128): (16, 32, 4, 2),
    ("dq", True, 32): (32, 32, 4, 2),
    ("dq", True, 64): (32, 32, 4, 2),
    ("dq", True, 128): (16, 32, 4, 2),
}
_INTERPRETER_BLOCK = 16  # small tiles keep the CPU interpreter fast; never autotuned there


def attention_config(target: str, kernel: str, fp32: bool, block_d: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, warps, stages) of ``kernel`` ("fwd", "dkdv", "dq") on ``target`` ("sm75", "sm80",
    "sm90") for fp32 or 16-bit inputs and a padded head dim ``block_d`` (16 is launched as 32). sm_75 (64 KiB of
    shared memory per block) runs one stage."""
    block_m, block_n, warps, stages = _BASE_CONFIGS[(kernel, fp32, max(32, block_d))]
    return block_m, block_n, warps, 1 if target == "sm75" else stages


def _launch_config(kernel: str, layout: _Layout, q: torch.Tensor) -> _Config:
    """Tile sizes of ``kernel`` ("fwd", "dkdv", "dq") for this call; tiles never exceed the sequence (>= 16)."""
    block_d = max(16, triton.next_power_of_2(layout.head_dim))
    if _interpreting():
        block = _clamp_block(_INTERPRETER_BLOCK, layout.seq)
        return _Config(block, block, block_d, 4, 1)
    target = target_class(target_arch(q))
    block_m, block_n, warps, stages = attention_config(target, kernel, q.dtype == torch.float32, block_d)
    return _Config(
        _clamp_block(block_m, layout.seq), _clamp_block(block_n, layout.seq), block_d, warps, stages
    )


def _check_qkv(q: object, k: object, v: object, ndim: int, form: str) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != ndim:
            raise ValueError(f"{name} must have shape {form}, got {list(x.shape)} ({x.dim()} dims)")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {list(q.shape)}, got {list(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but q has {q.dtype}; q, k and v must share one dtype"
            )
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    head_dim = q.shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (last dim of q) must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if q.device.type != "cuda" and not _interpreting() and not aot_mode():
        raise RuntimeError(
            f"q is on {q.device}: the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set before "
            "triton is imported (CPU interpreter); use fastpals.functional.attention_reference on CPU"
        )


def _check_common(dropout_p: object, softmax_scale: object, generator_seed: object) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(float(softmax_scale)):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if generator_seed is not None:
        if isinstance(generator_seed, bool) or not isinstance(generator_seed, numbers.Integral):
            raise TypeError(f"generator_seed must be an int or None, got {type(generator_seed).__name__}")
        if not 0 <= int(generator_seed) < _SEED_LIMIT:
            raise ValueError(f"generator_seed must be in [0, 2**63), got {generator_seed}")


_MAX_SEQ = 65535 * 16  # grid axis 1 (blocks of >= 16 rows) is limited to 65535 on CUDA


def _check_grid_rows(seq: int, name: str) -> None:
    if seq > _MAX_SEQ:
        raise ValueError(f"{name} = {seq} exceeds the longest supported sequence ({_MAX_SEQ} tokens)")


def _padded_layout(q: torch.Tensor, key_padding_mask: object) -> _Layout:
    batch, length, heads, head_dim = q.shape
    mask = None
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(
                f"key_padding_mask must be a torch.Tensor or None, got {type(key_padding_mask).__name__}"
            )
        if key_padding_mask.shape != (batch, length):
            raise ValueError(
                f"key_padding_mask must have shape [B, L] = [{batch}, {length}], got {list(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")
        if key_padding_mask.dtype == torch.bool:
            mask = key_padding_mask.view(torch.uint8)
        elif key_padding_mask.is_floating_point() or key_padding_mask.is_complex():
            raise TypeError(
                f"key_padding_mask must be bool or integer (1 = token, 0 = padding), got {key_padding_mask.dtype}; "
                "an additive float mask is not accepted (convert it with `mask == 0`)"
            )
        else:
            mask = key_padding_mask
    _check_grid_rows(length, "L (q.shape[1])")
    return _Layout(False, batch, length, heads, head_dim, batch * length, length, mask, None)


def _varlen_layout(q: torch.Tensor, cu_seqlens: object, max_seqlen: object) -> _Layout:
    total, heads, head_dim = q.shape
    # The shared rule (int32 or int64, 0 first, non-decreasing, N last, max_seqlen >= longest): one host read
    # per cu_seqlens tensor, not per call, so the PAL of every layer of one forward syncs once.
    batch = check_cu_seqlens(cu_seqlens, total, q.device, max_seqlen=max_seqlen)
    _check_grid_rows(int(max_seqlen), "max_seqlen")
    return _Layout(
        True, batch, int(max_seqlen), heads, head_dim, total, 0, None, cu_seqlens_int32(cu_seqlens)
    )


def _draw_seed(dropout_p: float, generator_seed: int | None) -> int:
    """The Philox seed: ``generator_seed``, else one draw from torch's default (CPU) generator; 0 without dropout.

    Drawing on the CPU generator costs no device sync, follows ``torch.manual_seed`` and is replayed by
    ``torch.utils.checkpoint`` (which restores the CPU RNG state before recomputing).
    """
    if dropout_p == 0.0:
        return 0
    if generator_seed is not None:
        return int(generator_seed)
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _head_align(head_dim: int, *tensors: torch.Tensor) -> int:
    """The kernels' ALIGN hint: 16 or 8 when the head dim and every tensor's head stride are multiples of it (8
    elements are 16 bytes in 16-bit: the fused PAL pads its heads so), else 1 (no hint)."""
    for align in (16, 8):
        if head_dim % align == 0 and all(t.stride(-2) % align == 0 for t in tensors):
            return align
    return 1


def _flags(layout: _Layout, dtype: torch.dtype, dropout_p: float, *tensors: torch.Tensor) -> dict:
    return {
        "IS_VARLEN": layout.is_varlen,
        "HAS_MASK": layout.mask is not None,
        "HAS_DROPOUT": dropout_p > 0.0,
        "ALIGN": _head_align(layout.head_dim, *tensors),
        **dot_flags(dtype),
    }


def _attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: _Layout,
    dropout_p: float,
    scale: float,
    seed: int,
    aligned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns (out like q but contiguous, or with 16-element-aligned rows when
    ``aligned``; stat_m [rows, H]; stat_l [rows, H])."""
    if aligned:  # rows of H * Dh values at a 16-element stride (the PAL's V^D reads them as [R, d_s])
        out = aligned_rows(layout.rows, layout.heads * layout.head_dim, q.dtype, q.device).view(q.shape)
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    stat_m = torch.empty(layout.rows, layout.heads, dtype=torch.float32, device=q.device)
    stat_l = torch.empty_like(stat_m)
    if out.numel() == 0 or layout.seq == 0:
        return out, stat_m, stat_l
    cfg = _launch_config("fwd", layout, q)
    mask = layout.mask if layout.mask is not None else q
    cu = layout.cu_seqlens if layout.cu_seqlens is not None else q
    mask_strides = (mask.stride(0), mask.stride(1)) if layout.mask is not None else (0, 0)
    dropout_scale = 1.0 / (1.0 - dropout_p)
    grid = (layout.batch * layout.heads, triton.cdiv(layout.seq, cfg.block_m))
    with device_context(q):
        _pal_attn_fwd_kernel[grid](
            q, k, v, out, stat_m, stat_l, mask, cu,
            seed, dropout_p, dropout_scale, scale,
            *_strides(q, layout.is_varlen), *_strides(k, layout.is_varlen), *_strides(v, layout.is_varlen),
            *_strides(out, layout.is_varlen), *mask_strides, layout.stat_stride_b,
            layout.heads, layout.seq, layout.head_dim,
            **_flags(layout, q.dtype, dropout_p, q, k, v, out),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out, stat_m, stat_l


def _attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stat_m: torch.Tensor,
    stat_l: torch.Tensor,
    layout: _Layout,
    dropout_p: float,
    scale: float,
    seed: int,
    need_dq: bool,
    need_dkdv: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Launch delta, dK/dV and dQ kernels; gradients come back contiguous in q's dtype."""
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dq else None
    dk = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dkdv else None
    dv = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dkdv else None
    if q.numel() == 0 or layout.seq == 0:
        return dq, dk, dv
    cfg_kv = _launch_config("dkdv", layout, q)
    cfg_q = _launch_config("dq", layout, q)
    mask = layout.mask if layout.mask is not None else q
    cu = layout.cu_seqlens if layout.cu_seqlens is not None else q
    mask_strides = (mask.stride(0), mask.stride(1)) if layout.mask is not None else (0, 0)
    varlen = layout.is_varlen
    delta = torch.empty_like(stat_m)
    dropout_scale = 1.0 / (1.0 - dropout_p)
    bh = layout.batch * layout.heads
    grads = [g for g in (dq, dk, dv) if g is not None]
    flags = _flags(layout, q.dtype, dropout_p, q, k, v, out, dout, *grads)
    # dq, dk and dv share one contiguous layout; any of them gives the strides.
    grad_strides = _strides(grads[0], varlen)
    common = (
        seed, dropout_p, dropout_scale, scale,
        *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(dout, varlen),
        *grad_strides, *mask_strides, layout.stat_stride_b,
        layout.heads, layout.seq, layout.head_dim,
    )  # fmt: skip
    with device_context(q):
        _pal_attn_bwd_delta_kernel[(bh, triton.cdiv(layout.seq, cfg_q.block_m))](
            out, dout, delta, cu,
            *_strides(out, varlen), *_strides(dout, varlen), layout.stat_stride_b,
            layout.heads, layout.seq, layout.head_dim,
            IS_VARLEN=varlen, ALIGN=flags["ALIGN"], BLOCK_M=cfg_q.block_m, BLOCK_D=cfg_q.block_d,
            num_warps=cfg_q.num_warps,
        )  # fmt: skip
        if need_dkdv:
            _pal_attn_bwd_dkdv_kernel[(bh, triton.cdiv(layout.seq, cfg_kv.block_n))](
                q, k, v, dout, dk, dv, stat_m, stat_l, delta, mask, cu, *common, **flags,
                BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, BLOCK_D=cfg_kv.block_d,
                num_warps=cfg_kv.num_warps, num_stages=cfg_kv.num_stages,
            )  # fmt: skip
        if need_dq:
            _pal_attn_bwd_dq_kernel[(bh, triton.cdiv(layout.seq, cfg_q.block_m))](
                q, k, v, dout, dq, stat_m, stat_l, delta, mask, cu, *common, **flags,
                BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, BLOCK_D=cfg_q.block_d,
                num_warps=cfg_q.num_warps, num_stages=cfg_q.num_stages,
            )  # fmt: skip
    return dq, dk, dv


def _run_forward(
    ctx,  # noqa: ANN001 - autograd context
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: _Layout,
    dropout_p: float,
    softmax_scale: float | None,
    generator_seed: int | None,
    aligned: bool = False,
) -> torch.Tensor:
    dropout_p = float(dropout_p)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(layout.head_dim)
    seed = _draw_seed(dropout_p, generator_seed)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    out, stat_m, stat_l = _attention_forward(q, k, v, layout, dropout_p, scale, seed, aligned)
    ctx.save_for_backward(q, k, v, out, stat_m, stat_l, layout.mask, layout.cu_seqlens)
    ctx.layout = layout._replace(mask=None, cu_seqlens=None)
    ctx.dropout_p, ctx.scale, ctx.seed = dropout_p, scale, seed
    return out


def _run_backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
    q, k, v, out, stat_m, stat_l, mask, cu_seqlens = ctx.saved_tensors
    layout = ctx.layout._replace(mask=mask, cu_seqlens=cu_seqlens)
    need_dq = ctx.needs_input_grad[0]
    need_dkdv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    if not (need_dq or need_dkdv):
        return None, None, None
    dq, dk, dv = _attention_backward(
        dout, q, k, v, out, stat_m, stat_l, layout, ctx.dropout_p, ctx.scale, ctx.seed, need_dq, need_dkdv
    )
    return dq, dk if ctx.needs_input_grad[1] else None, dv if ctx.needs_input_grad[2] else None


class PALAttentionFunction(torch.autograd.Function):
    """Autograd op behind :func:`pal_attention`.

    ``apply(q, k, v, key_padding_mask, dropout_p, softmax_scale, generator_seed)``; arguments as in
    :func:`pal_attention` (validated here too).
    """

    @staticmethod
    def forward(
        ctx,  # noqa: ANN001
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        dropout_p: float,
        softmax_scale: float | None,
        generator_seed: int | None,
        aligned_rows: bool = False,
    ) -> torch.Tensor:
        _check_qkv(q, k, v, 4, "[B, L, H, Dh]")
        _check_common(dropout_p, softmax_scale, generator_seed)
        layout = _padded_layout(q, key_padding_mask)
        return _run_forward(ctx, q, k, v, layout, dropout_p, softmax_scale, generator_seed, aligned_rows)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        return (*_run_backward(ctx, dout), None, None, None, None, None)


class PALAttentionVarlenFunction(torch.autograd.Function):
    """Autograd op behind :func:`pal_attention_varlen`.

    ``apply(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, generator_seed)``; arguments as in
    :func:`pal_attention_varlen` (validated here too).
    """

    @staticmethod
    def forward(
        ctx,  # noqa: ANN001
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        dropout_p: float,
        softmax_scale: float | None,
        generator_seed: int | None,
        aligned_rows: bool = False,
    ) -> torch.Tensor:
        _check_qkv(q, k, v, 3, "[N, H, Dh]")
        _check_common(dropout_p, softmax_scale, generator_seed)
        layout = _varlen_layout(q, cu_seqlens, max_seqlen)
        return _run_forward(ctx, q, k, v, layout, dropout_p, softmax_scale, generator_seed, aligned_rows)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        return (*_run_backward(ctx, dout), None, None, None, None, None, None)


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
    """Multi-head softmax attention over a padded batch; the fused form of ``attention_reference``.

    Args:
        q, k, v: ``[B, L, H, Dh]`` fp32, fp16 or bf16, one dtype and device; any strides on the first three
            dims (e.g. the ``unbind`` of a ``[B, L, 3, H, Dh]`` view of one packed QKV projection), last dim
            contiguous (otherwise copied). ``Dh <= 128``.
        key_padding_mask: ``[B, L]`` bool or integer, 1 = token, 0 = padding; None = no padding. Padded keys
            get ``finfo(float32).min`` added to their score (a sequence with no token averages all keys, as the
            reference does); padded query rows are computed too.
        dropout_p: probability in ``[0, 1)`` of zeroing an attention probability (kept ones scaled by
            ``1 / (1 - dropout_p)``); pass 0 at evaluation.
        softmax_scale: score scale; default ``1 / sqrt(Dh)``.
        generator_seed: Philox seed of the dropout mask (see :func:`pal_attention_dropout_mask`); default: one
            draw from torch's default CPU generator per call.
        aligned_rows: return the ``[B*L, H*Dh]`` rows at a stride padded to 16 elements (the fused PAL's V^D then
            reads 16-byte-aligned rows) instead of contiguous.

    Returns:
        ``[B, L, H, Dh]`` contiguous (or row-aligned), q's dtype. Differentiable in q, k and v.
    """
    return PALAttentionFunction.apply(
        q, k, v, key_padding_mask, dropout_p, softmax_scale, generator_seed, aligned_rows
    )


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
    """Packed (varlen) form of :func:`pal_attention`; the fused form of ``attention_varlen_reference``.

    Args:
        q, k, v: ``[N, H, Dh]`` with the B sequences back to back (any strides on the first two dims, last dim
            contiguous); dtypes and ``Dh`` as in :func:`pal_attention`.
        cu_seqlens: ``[B+1]`` int32 or int64 on q's device, ``cu_seqlens[0] == 0``, non-decreasing,
            ``cu_seqlens[-1] == N`` (empty sequences are allowed). Checked on the host once per tensor (see
            :func:`fastpals_kernels.common.check_cu_seqlens`): one device sync for the first call on it.
        max_seqlen: an int >= the longest sequence; it sizes the grid and the dropout counters.
        dropout_p, softmax_scale, generator_seed: as in :func:`pal_attention`. Position i, j of sequence b uses
            the same dropout counter as in a padded batch with ``L = max_seqlen``.

    Returns:
        ``[N, H, Dh]`` contiguous, q's dtype. Differentiable in q, k and v.
    """
    return PALAttentionVarlenFunction.apply(
        q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, generator_seed, aligned_rows
    )


def pal_attention_dropout_mask(
    batch: int, num_heads: int, seqlen: int, dropout_p: float, seed: int, device: torch.device | str
) -> torch.Tensor:
    """The exact keep mask the kernels use for ``generator_seed=seed`` (for tests and debugging).

    ``seqlen`` is ``L`` for :func:`pal_attention` and ``max_seqlen`` for :func:`pal_attention_varlen`.
    Returns bool ``[batch, num_heads, seqlen, seqlen]`` indexed (b, h, query, key); True = kept. The
    reference output is ``softmax(scores) * keep / (1 - dropout_p) @ v``.
    """
    for name, value in (("batch", batch), ("num_heads", num_heads), ("seqlen", seqlen)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    _check_common(dropout_p, None, seed)
    _check_grid_rows(int(seqlen), "seqlen")
    device = torch.device(device)
    if device.type != "cuda" and not _interpreting() and not aot_mode():
        raise RuntimeError(f"device {device} needs TRITON_INTERPRET=1 (CPU interpreter) or a CUDA device")
    keep = torch.empty(batch, num_heads, seqlen, seqlen, dtype=torch.int8, device=device)
    if keep.numel() == 0:
        return keep.bool()
    block = 16 if _interpreting() else 64
    grid = (batch * num_heads, triton.cdiv(seqlen, block), triton.cdiv(seqlen, block))
    with device_context(keep):
        _pal_attn_dropout_mask_kernel[grid](
            keep, int(seed), float(dropout_p), num_heads, seqlen, BLOCK_M=block, BLOCK_N=block
        )
    return keep.bool()
