# ruff: noqa: ANN001, ANN201 - Triton kernel parameters and device functions carry no Python annotations
# (Triton reads annotations as specialisation hints)
"""The Triton kernels of the PAL attention (:mod:`fastpals_kernels.pal_attention_triton` holds their host
wrappers, launch configurations and autograd ops, and documents the semantics).

Grid axis 0 = batch * heads (no 65535 limit), axis 1 = blocks of the sequence. Token row of position i of
sequence b: ``b * stride_b + (start_b + i) * stride_l + h * stride_h`` (varlen: ``stride_b = 0``,
``start_b = cu_seqlens[b]``; padded: ``start_b = 0``). Row statistics (m, l, delta) are fp32 ``[rows, H]`` with
``row = b * stat_stride_b + start_b + i``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastpals_kernels.tl_helpers import cast_rne, mm

# The reference's additive mask value for a padded key (softmax runs in fp32).
_MASKED_SCORE = tl.constexpr(-3.4028234663852886e38)


# ----------------------------------------------------------------------------------------------------------------
# Triton building blocks
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
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


@triton.jit
def _rows(first, start, seqlen, BLOCK: tl.constexpr):
    """Positions ``first .. first + BLOCK - 1`` of a sequence: (positions, inside the sequence, token rows)."""
    offs = first + tl.arange(0, BLOCK)
    return offs, offs < seqlen, (start + offs).to(tl.int64)


@triton.jit
def _key_bias(MASK, b64, offs_n, valid_n, stride_mb, stride_ml, HAS_MASK: tl.constexpr):
    """Additive fp32 score bias per key: 0 for a token, finfo.min for padding, -inf past the sequence end."""
    if HAS_MASK:
        keep = tl.load(MASK + b64 * stride_mb + offs_n.to(tl.int64) * stride_ml, mask=valid_n, other=1)
        bias = tl.where(keep != 0, 0.0, _MASKED_SCORE)
    else:
        bias = tl.zeros_like(offs_n).to(tl.float32)
    return tl.where(valid_n, bias, float("-inf"))


@triton.jit
def _dropout_keep(seed, bh, q_idx, k_idx, SEQ, dropout_p):
    """Keep decision of the probabilities at (query q_idx, key k_idx) of batch x head ``bh`` (broadcast 2-D).

    One Philox counter per (batch, head, query, key), so forward, backward and the debug helper agree.
    """
    offsets = (bh.to(tl.int64) * SEQ + q_idx.to(tl.int64)) * SEQ + k_idx.to(tl.int64)
    return tl.rand(seed, offsets) >= dropout_p


@triton.jit
def _head_ptr(PTR, b64, h, stride_b, stride_h, ALIGN: tl.constexpr):
    """``PTR`` advanced to (batch b, head h). ``ALIGN > 1``: the host checked that ``stride_h`` and the head dim
    are multiples of ALIGN elements (the fused PAL's zero-padded heads), the hint that lets the loads and stores
    along the head dim use 16-byte vectors and ``cp.async`` (Triton only infers divisibility by 16 itself)."""
    off = h * stride_h
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return PTR + b64 * stride_b + off


@triton.jit
def _tile_ptrs(PTR, b64, h, tok, offs_d, stride_b, stride_l, stride_h, ALIGN: tl.constexpr):
    """Pointers to the ``[len(tok), BLOCK_D]`` tile of token rows ``tok`` of (batch b, head h)."""
    return _head_ptr(PTR, b64, h, stride_b, stride_h, ALIGN) + tok[:, None] * stride_l + offs_d[None, :]


@triton.jit
def _load_rows(base, tok, stride_l, offs_d, mask):
    """The ``[len(tok), BLOCK_D]`` tile at token rows ``tok`` of a (batch, head) ``base``; zeros where masked."""
    return tl.load(base + tok[:, None] * stride_l + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _dim_mask(offs_d, HEAD_DIM, ALIGN: tl.constexpr):
    """``offs_d < HEAD_DIM``, constant over groups of ALIGN columns when the host checked HEAD_DIM % ALIGN == 0."""
    valid = offs_d < HEAD_DIM
    if ALIGN > 1:
        valid = tl.max_constancy(valid, [ALIGN])
    return valid


@triton.jit
def _row_stats(STAT_M, STAT_L, DELTA, b64, tok, h, valid, H, stat_stride_b):
    """The saved softmax max ``m`` and normaliser ``l`` and the backward's ``delta`` of rows ``tok``, head h."""
    stat = (b64 * stat_stride_b + tok) * H + h
    m = tl.load(STAT_M + stat, mask=valid, other=0.0)
    l_row = tl.load(STAT_L + stat, mask=valid, other=1.0)
    delta = tl.load(DELTA + stat, mask=valid, other=0.0)
    return m, l_row, delta


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _pal_attn_fwd_kernel(
    Q, K, V, Out, STAT_M, STAT_L, MASK, CU,
    seed, dropout_p, dropout_scale, softmax_scale,
    stride_qb, stride_ql, stride_qh,
    stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh,
    stride_ob, stride_ol, stride_oh,
    stride_mb, stride_ml, stat_stride_b,
    H, SEQ, HEAD_DIM,
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
            s = mm(q, tl.trans(k), IEEE, INTERP_BF16) * softmax_scale + bias[None, :]
            # every tile holds at least one key inside the sequence, so m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], SEQ, dropout_p)
                p = tl.where(keep, p * dropout_scale, 0.0)
            acc = acc * alpha[:, None] + mm(cast_rne(p, v.dtype, INTERP_BF16), v, IEEE, INTERP_BF16)
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


@triton.jit
def _pal_attn_bwd_delta_kernel(
    Out, DO, DELTA, CU,
    stride_ob, stride_ol, stride_oh,
    stride_dob, stride_dol, stride_doh,
    stat_stride_b,
    H, SEQ, HEAD_DIM,
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


@triton.jit
def _pal_attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, STAT_M, STAT_L, DELTA, MASK, CU,
    seed, dropout_p, dropout_scale, softmax_scale,
    stride_qb, stride_ql, stride_qh,
    stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh,
    stride_dob, stride_dol, stride_doh,
    stride_gb, stride_gl, stride_gh,
    stride_mb, stride_ml, stat_stride_b,
    H, SEQ, HEAD_DIM,
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

            s_t = mm(k, tl.trans(q), IEEE, INTERP_BF16) * softmax_scale + bias[:, None]
            p_t = tl.exp(s_t - m[None, :]) / l_row[None, :]
            dp_t = mm(v, tl.trans(do), IEEE, INTERP_BF16)
            if HAS_DROPOUT:
                keep_t = _dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], SEQ, dropout_p)
                pd_t = tl.where(keep_t, p_t * dropout_scale, 0.0)
                dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
            else:
                pd_t = p_t
            dv += mm(cast_rne(pd_t, do.dtype, INTERP_BF16), do, IEEE, INTERP_BF16)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += mm(cast_rne(ds_t, q.dtype, INTERP_BF16), q, IEEE, INTERP_BF16)
        dk = dk * softmax_scale
        dk_ptrs = _tile_ptrs(DK, b64, h, tok_n, offs_d, stride_gb, stride_gl, stride_gh, ALIGN)
        dv_ptrs = _tile_ptrs(DV, b64, h, tok_n, offs_d, stride_gb, stride_gl, stride_gh, ALIGN)
        tl.store(dk_ptrs, cast_rne(dk, DK.dtype.element_ty, INTERP_BF16), mask=kv_mask)
        tl.store(dv_ptrs, cast_rne(dv, DV.dtype.element_ty, INTERP_BF16), mask=kv_mask)


@triton.jit
def _pal_attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, STAT_M, STAT_L, DELTA, MASK, CU,
    seed, dropout_p, dropout_scale, softmax_scale,
    stride_qb, stride_ql, stride_qh,
    stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh,
    stride_dob, stride_dol, stride_doh,
    stride_gb, stride_gl, stride_gh,
    stride_mb, stride_ml, stat_stride_b,
    H, SEQ, HEAD_DIM,
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
            s = mm(q, tl.trans(k), IEEE, INTERP_BF16) * softmax_scale + bias[None, :]
            p = tl.exp(s - m[:, None]) / l_row[:, None]
            dp = mm(do, tl.trans(v), IEEE, INTERP_BF16)
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], SEQ, dropout_p)
                dp = tl.where(keep, dp * dropout_scale, 0.0)
            ds = p * (dp - delta[:, None])
            dq += mm(cast_rne(ds, k.dtype, INTERP_BF16), k, IEEE, INTERP_BF16)
        dq = dq * softmax_scale
        tl.store(
            _tile_ptrs(DQ, b64, h, tok_m, offs_d, stride_gb, stride_gl, stride_gh, ALIGN),
            cast_rne(dq, DQ.dtype.element_ty, INTERP_BF16),
            mask=q_mask,
        )


@triton.jit
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
