"""The PAL attention (fastpals_kernels.pal_attention: pal_attention / pal_attention_varlen), the flash-style
attention inside the fused PAL, against the attention references and float64 transcriptions: fp32 within 1e-5 of
the fp32 reference, fp16/bf16 at most 2x the same-dtype reference's error against float64, the dropout mask, the
layouts and the validation errors. Off CUDA the kernels run in Triton's interpreter, so shapes are small.
"""

import math

import pytest
import torch
from device import DEVICE, ON_CUDA, requires_cuda
from tolerances import assert_close_to_reference, assert_fp32_close

from fastpals.functional import attention_reference, attention_varlen_reference
from fastpals_kernels.pal_attention import (
    MAX_HEAD_DIM,
    pal_attention,
    pal_attention_dropout_mask,
    pal_attention_varlen,
)

pytestmark = pytest.mark.kernels

# ------------------------------------------------------------------------------------------------ helpers


def packed_qkv(batch, length, heads, head_dim, dtype=torch.float32, seed=0):
    """q, k, v as strided views of one [B, L, 3*H*Dh] projection output, as the PAL produces them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3 * heads * head_dim, generator=gen).to(DEVICE, dtype).requires_grad_()
    q, k, v = qkv.view(batch, length, 3, heads, head_dim).unbind(2)
    return qkv, q, k, v


def randn(*shape, seed, dtype=torch.float32):
    """Seeded normal tensor on DEVICE (tests do not depend on the global RNG or on test order)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def ragged_mask(lengths, length):
    return torch.arange(length, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]


def out_and_grad(out, leaf, out_grad):
    (grad,) = torch.autograd.grad(out, leaf, out_grad)
    return out.detach(), grad


def split_qkv_grad(grad):
    """The gradient of a packed [..., 3*H*Dh] projection -> {"dq": ..., "dk": ..., "dv": ...}."""
    return dict(zip(("dq", "dk", "dv"), grad.unflatten(-1, (3, -1)).unbind(-2)))


def assert_fp32_matches(name, got, ref, ref64):
    """fp32 rule: within 1e-5 of the fp32 reference and at most 2x its error against float64."""
    assert_fp32_close(name, got, ref)
    assert_close_to_reference(name, got, ref, ref64)


def float64_qkv(qkv, *view):
    """A float64 leaf copy of a packed projection output and its q, k, v views (split on dim -3)."""
    qkv64 = qkv.detach().double().requires_grad_()
    return (qkv64, *qkv64.view(*view).unbind(-3))


def attention_with_keep_mask(q, k, v, key_padding_mask, keep=None, dropout_p=0.0, softmax_scale=None):
    """attention_reference's op order with F.dropout replaced by a given keep mask [B, H, L, L] (or none); the
    softmax in fp32, or in float64 for float64 inputs (attention_reference computes it in fp32 always)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    softmax_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-1, -2)).to(softmax_dtype) * scale
    if key_padding_mask is not None:
        bias = torch.zeros(scores.shape[0], 1, 1, scores.shape[-1], dtype=softmax_dtype, device=scores.device)
        bias = bias.masked_fill(~key_padding_mask.bool()[:, None, None, :], torch.finfo(torch.float32).min)
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if keep is not None:
        probs = probs * (keep.to(q.dtype) / (1.0 - dropout_p))
    return torch.matmul(probs, vh).transpose(1, 2)


def varlen_attention_float64(q, k, v, cu_seqlens):
    """attention_with_keep_mask over each packed sequence of float64 q, k, v [N, H, Dh] -> [N, H, Dh]."""
    bounds = cu_seqlens.tolist()
    rows = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat([attention_with_keep_mask(q[r][None], k[r][None], v[r][None], None)[0] for r in rows])


def varlen_inputs(lengths, heads, head_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    qkv = torch.randn(total, 3 * heads * head_dim, generator=gen).to(DEVICE, dtype).requires_grad_()
    q, k, v = qkv.view(total, 3, heads, head_dim).unbind(1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return qkv, q, k, v, cu


# ------------------------------------------------------------------------------------------------ fp32 exactness


@pytest.mark.parametrize(
    "heads, head_dim, lengths, scale",
    [
        (
            4,
            17,
            [21, 9, 1],
            None,
        ),  # 12 heads of 17 in the "top" PAL variant; ragged padding, a 1-token sequence
        (
            2,
            34,
            [16, 0, 11],
            None,
        ),  # 6 heads of 34; a sequence with no token at all (uniform average, no NaN)
        (3, 46, None, 0.3),  # 6 heads of 46 ("half" PALs); no mask; a custom softmax scale
        (1, 64, [24, 5], None),
    ],
)
def test_padded_fp32_matches_reference(heads, head_dim, lengths, scale):
    batch = 3 if lengths is None else len(lengths)
    length = 21 if lengths is None else max(lengths)
    qkv, q, k, v = packed_qkv(batch, length, heads, head_dim, seed=head_dim)
    mask = None if lengths is None else ragged_mask(lengths, length)
    out_grad = randn(batch, length, heads, head_dim, seed=100)
    out, grad = out_and_grad(pal_attention(q, k, v, mask, softmax_scale=scale), qkv, out_grad)
    ref, ref_grad = out_and_grad(attention_reference(q, k, v, mask, softmax_scale=scale), qkv, out_grad)
    qkv64, q64, k64, v64 = float64_qkv(qkv, batch, length, 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(
        attention_with_keep_mask(q64, k64, v64, mask, softmax_scale=scale), qkv64, out_grad.double()
    )
    assert (
        out.shape == (batch, length, heads, head_dim) and out.is_contiguous() and out.dtype == torch.float32
    )
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    assert_fp32_matches("out", out, ref, ref64)
    for name in ("dq", "dk", "dv"):
        g, r, r64 = (split_qkv_grad(x)[name] for x in (grad, ref_grad, ref64_grad))
        assert_fp32_matches(name, g, r, r64)


def test_varlen_fp32_matches_reference():
    lengths, heads, head_dim = (
        [7, 1, 0, 19, 3],
        3,
        34,
    )  # a 1-token and an empty sequence; max_seqlen > longest
    qkv, q, k, v, cu = varlen_inputs(lengths, heads, head_dim, seed=1)
    out_grad = randn(sum(lengths), heads, head_dim, seed=101)
    out, grad = out_and_grad(pal_attention_varlen(q, k, v, cu, 20), qkv, out_grad)
    ref, ref_grad = out_and_grad(attention_varlen_reference(q, k, v, cu, 20), qkv, out_grad)
    qkv64, q64, k64, v64 = float64_qkv(qkv, sum(lengths), 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(varlen_attention_float64(q64, k64, v64, cu), qkv64, out_grad.double())
    assert out.shape == (sum(lengths), heads, head_dim) and out.is_contiguous()
    assert_fp32_matches("out", out, ref, ref64)
    assert_fp32_matches("dq, dk, dv", grad, ref_grad, ref64_grad)


def test_head_dim_extremes_fp32():
    """Head dims 1 (padded to 16), 100 (to 128, not a power of two) and 128 (the limit)."""
    for seed, head_dim in enumerate((1, 100, 128)):
        qkv, q, k, v = packed_qkv(2, 7, 2, head_dim, seed=seed)
        mask = ragged_mask([7, 3], 7)
        out_grad = randn(2, 7, 2, head_dim, seed=200 + seed)
        out, grad = out_and_grad(pal_attention(q, k, v, mask), qkv, out_grad)
        ref, ref_grad = out_and_grad(attention_reference(q, k, v, mask), qkv, out_grad)
        qkv64, q64, k64, v64 = float64_qkv(qkv, 2, 7, 3, 2, head_dim)
        ref64, ref64_grad = out_and_grad(
            attention_with_keep_mask(q64, k64, v64, mask), qkv64, out_grad.double()
        )
        assert_fp32_matches(f"Dh={head_dim} out", out, ref, ref64)
        assert_fp32_matches(f"Dh={head_dim} dq, dk, dv", grad, ref_grad, ref64_grad)


def test_layouts_and_partial_gradients():
    """Last dim not contiguous (copied), grad-output with zero strides, only q requiring a gradient, empty batch."""
    q = randn(2, 9, 17, 2, seed=1).transpose(-1, -2).requires_grad_()  # [2, 9, 2, 17], stride(-1) != 1
    k = randn(2, 9, 2, 17, seed=2)
    v = randn(2, 9, 2, 17, seed=3)
    mask = ragged_mask([9, 4], 9).to(torch.int64)
    out = pal_attention(q, k, v, mask)
    ref = attention_reference(q, k, v, mask)
    q64 = q.detach().double().requires_grad_()
    ref64 = attention_with_keep_mask(q64, k.double(), v.double(), mask)
    assert_fp32_matches("out", out, ref, ref64)
    (dq,) = torch.autograd.grad(out.sum(), q)  # sum().backward() hands in an expanded, stride-0 gradient
    (ref_dq,) = torch.autograd.grad(ref.sum(), q)
    (ref64_dq,) = torch.autograd.grad(ref64.sum(), q64)
    assert_fp32_matches("dq", dq, ref_dq, ref64_dq)
    empty = torch.randn(0, 5, 2, 17, device=DEVICE, requires_grad=True)
    out = pal_attention(empty, empty, empty)
    assert out.shape == (0, 5, 2, 17)
    out.sum().backward()
    assert empty.grad.shape == empty.shape


# ------------------------------------------------------------------------------------------------ fp16 / bf16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_2x_reference_error(dtype):
    """On CPU the interpreter runs fp16 natively and bf16 through fp32-widened tiles (its bf16 tl.dot is broken)."""
    heads, head_dim, lengths = 3, 46, [20, 13, 1]
    qkv, q, k, v = packed_qkv(len(lengths), 20, heads, head_dim, dtype=dtype, seed=7)
    mask = ragged_mask(lengths, 20)
    out_grad = randn(len(lengths), 20, heads, head_dim, seed=102, dtype=dtype)
    qkv64, q64, k64, v64 = float64_qkv(qkv, len(lengths), 20, 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(attention_with_keep_mask(q64, k64, v64, mask), qkv64, out_grad.double())
    ref, ref_grad = out_and_grad(attention_reference(q, k, v, mask), qkv, out_grad)
    out, grad = out_and_grad(pal_attention(q, k, v, mask), qkv, out_grad)
    assert out.dtype == dtype and grad.dtype == dtype
    assert_close_to_reference("out", out, ref, ref64, rtol=0.0, atol=1e-4)
    for name in ("dq", "dk", "dv"):
        g, r, r64 = (split_qkv_grad(x)[name] for x in (grad, ref_grad, ref64_grad))
        assert_close_to_reference(name, g, r, r64, rtol=0.0, atol=1e-4)

    lengths = [5, 1, 17]
    qkv, q, k, v, cu = varlen_inputs(lengths, 2, 17, dtype=dtype, seed=8)
    qkv64, q64, k64, v64 = float64_qkv(qkv, sum(lengths), 3, 2, 17)
    out_grad = randn(sum(lengths), 2, 17, seed=103, dtype=dtype)
    ref64, ref64_grad = out_and_grad(varlen_attention_float64(q64, k64, v64, cu), qkv64, out_grad.double())
    ref, ref_grad = out_and_grad(attention_varlen_reference(q, k, v, cu, 17), qkv, out_grad)
    out, grad = out_and_grad(pal_attention_varlen(q, k, v, cu, 17), qkv, out_grad)
    assert_close_to_reference("varlen out", out, ref, ref64, rtol=0.0, atol=1e-4)
    for name in ("dq", "dk", "dv"):
        g, r, r64 = (split_qkv_grad(x)[name] for x in (grad, ref_grad, ref64_grad))
        assert_close_to_reference("varlen " + name, g, r, r64, rtol=0.0, atol=1e-4)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim", [(12, 17), (6, 34), (6, 46), (4, 64), (2, 128)])
def test_gpu_sizes_within_2x_reference_error(dtype, heads, head_dim):
    """GPU launch configurations (blocks of 64-128, several tiles per sequence) on BERT-sized batches."""
    lengths = [300, 128, 77, 1]
    qkv, q, k, v = packed_qkv(len(lengths), 300, heads, head_dim, dtype=dtype, seed=head_dim)
    mask = ragged_mask(lengths, 300)
    out_grad = randn(len(lengths), 300, heads, head_dim, seed=104, dtype=dtype)
    qkv64, q64, k64, v64 = float64_qkv(qkv, len(lengths), 300, 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(attention_with_keep_mask(q64, k64, v64, mask), qkv64, out_grad.double())
    ref, ref_grad = out_and_grad(attention_reference(q, k, v, mask), qkv, out_grad)
    out, grad = out_and_grad(pal_attention(q, k, v, mask), qkv, out_grad)
    floor = {"rtol": 0.0, "atol": 1e-5 if dtype == torch.float32 else 1e-4}
    if dtype == torch.float32:
        assert_fp32_close("out", out, ref)
    assert_close_to_reference("out", out, ref, ref64, **floor)
    for name in ("dq", "dk", "dv"):
        g, r, r64 = (split_qkv_grad(x)[name] for x in (grad, ref_grad, ref64_grad))
        assert_close_to_reference(name, g, r, r64, **floor)


# ------------------------------------------------------------------------------------------------ dropout


def test_dropout_mask_statistics_and_determinism():
    p = 0.3
    keep = pal_attention_dropout_mask(2, 3, 64, p, seed=1234, device=DEVICE)
    assert keep.shape == (2, 3, 64, 64) and keep.dtype == torch.bool
    fraction = keep.float().mean().item()
    assert abs(fraction - (1 - p)) < 0.02, fraction  # 24,576 draws: std 0.003
    assert torch.equal(keep, pal_attention_dropout_mask(2, 3, 64, p, seed=1234, device=DEVICE))
    other_seed = pal_attention_dropout_mask(2, 3, 64, p, seed=1235, device=DEVICE)
    assert (keep != other_seed).float().mean().item() > 0.3  # independent masks differ in 2p(1-p) = 42%
    flat = keep.view(6, -1).float()
    assert (
        (flat[:, None] - flat[None]).abs().mean(-1) + torch.eye(6, device=DEVICE)
    ).min().item() > 0.3  # heads/batches differ


def test_dropout_matches_masked_reference():
    p, heads, head_dim, lengths = 0.25, 2, 34, [19, 6, 1]
    qkv, q, k, v = packed_qkv(3, 19, heads, head_dim, seed=3)
    mask = ragged_mask(lengths, 19)
    keep = pal_attention_dropout_mask(3, heads, 19, p, seed=99, device=DEVICE)
    out_grad = randn(3, 19, heads, head_dim, seed=105)
    out, grad = out_and_grad(pal_attention(q, k, v, mask, dropout_p=p, generator_seed=99), qkv, out_grad)
    ref, ref_grad = out_and_grad(attention_with_keep_mask(q, k, v, mask, keep, p), qkv, out_grad)
    qkv64, q64, k64, v64 = float64_qkv(qkv, 3, 19, 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(
        attention_with_keep_mask(q64, k64, v64, mask, keep, p), qkv64, out_grad.double()
    )
    assert_fp32_matches("out", out, ref, ref64)
    assert_fp32_matches("dq, dk, dv", grad, ref_grad, ref64_grad)
    no_drop = attention_reference(q, k, v, mask)
    assert (out - no_drop).abs().max().item() > 0.1  # dropout did something

    # varlen: position (i, j) of sequence b draws the same counter as the padded batch with L = max_seqlen
    packed_rows = ragged_mask(lengths, 19).flatten().nonzero().squeeze(1)
    qv, kv, vv = (t.reshape(3 * 19, heads, head_dim)[packed_rows] for t in (q, k, v))
    cu = torch.tensor([0, 19, 25, 26], dtype=torch.int32, device=DEVICE)
    out_v = pal_attention_varlen(qv, kv, vv, cu, 19, dropout_p=p, generator_seed=99)
    # rows of padded keys never contribute, so the packed rows of the padded output must agree
    assert_fp32_close("varlen out", out_v, out.reshape(3 * 19, heads, head_dim)[packed_rows])
    (grad_v,) = torch.autograd.grad(out_v, qkv, out_grad.reshape(3 * 19, heads, head_dim)[packed_rows])
    (grad_p,) = torch.autograd.grad(
        attention_with_keep_mask(q, k, v, mask, keep, p).reshape(3 * 19, heads, head_dim)[packed_rows],
        qkv,
        out_grad.reshape(3 * 19, heads, head_dim)[packed_rows],
    )
    assert_fp32_close("varlen dq, dk, dv", grad_v, grad_p)


def test_dropout_seed_comes_from_torch_generator():
    qkv, q, k, v = packed_qkv(1, 16, 2, 17, seed=5)
    torch.manual_seed(11)
    first = pal_attention(q, k, v, dropout_p=0.5)
    second = pal_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(11)
    replay = pal_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(first, replay)
    assert not torch.equal(first, second)
    # p = 0: plain attention, no seed drawn
    state = torch.get_rng_state()
    assert_fp32_matches(
        "p=0",
        pal_attention(q, k, v, dropout_p=0.0),
        attention_reference(q, k, v),
        attention_with_keep_mask(q.double(), k.double(), v.double(), None),
    )
    assert torch.equal(state, torch.get_rng_state())


# ------------------------------------------------------------------------------------------------ validation


def test_validation_errors():
    q = torch.randn(2, 5, 2, 17, device=DEVICE)
    mask = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    with pytest.raises(TypeError, match="q must be float32"):
        pal_attention(q.double(), q.double(), q.double())
    with pytest.raises(TypeError, match="k has dtype"):
        pal_attention(q, q.half(), q)
    with pytest.raises(ValueError, match="v must have the shape of q"):
        pal_attention(q, q, q[:, :4])
    with pytest.raises(ValueError, match=r"q must have shape \[B, L, H, Dh\]"):
        pal_attention(q[0], q[0], q[0])
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        pal_attention(q, None, q)
    big = torch.randn(1, 2, 1, MAX_HEAD_DIM + 1, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        pal_attention(big, big, big)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        pal_attention(q, q, q, mask[:, :4])
    with pytest.raises(TypeError, match="key_padding_mask must be bool or integer"):
        pal_attention(q, q, q, mask.float())
    with pytest.raises(ValueError, match="dropout_p"):
        pal_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(TypeError, match="generator_seed"):
        pal_attention(q, q, q, dropout_p=0.1, generator_seed=1.5)
    with pytest.raises(ValueError, match="softmax_scale"):
        pal_attention(q, q, q, softmax_scale=float("nan"))

    packed = torch.randn(6, 2, 17, device=DEVICE)
    good = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    pal_attention_varlen(packed, packed, packed, good, 4)  # the valid call works
    # int32 and int64 boundaries follow one rule and give the same result
    assert torch.equal(
        pal_attention_varlen(packed, packed, packed, good.long(), 4),
        pal_attention_varlen(packed, packed, packed, good, 4),
    )
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        pal_attention_varlen(packed, packed, packed, good.float(), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[B\+1\]"):
        pal_attention_varlen(packed, packed, packed, good[None], 4)
    with pytest.raises(ValueError, match="non-decreasing"):
        pal_attention_varlen(
            packed, packed, packed, torch.tensor([0, 4, 2, 6], dtype=torch.int32, device=DEVICE), 4
        )
    with pytest.raises(ValueError, match="end at the number of packed rows 6"):
        pal_attention_varlen(
            packed, packed, packed, torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE), 4
        )
    with pytest.raises(ValueError, match="must start at 0"):
        pal_attention_varlen(
            packed, packed, packed, torch.tensor([1, 2, 6], dtype=torch.int32, device=DEVICE), 5
        )
    with pytest.raises(ValueError, match="max_seqlen"):
        pal_attention_varlen(packed, packed, packed, good, 3)
    with pytest.raises(ValueError, match=r"q must have shape \[N, H, Dh\]"):
        pal_attention_varlen(q, q, q, good, 4)
    if ON_CUDA:  # device mismatches need two devices
        with pytest.raises(ValueError, match="k is on cpu"):
            pal_attention(q, q.cpu(), q)  # host: a deliberate device mismatch
        with pytest.raises(ValueError, match="key_padding_mask is on cpu"):
            pal_attention(q, q, q, mask.cpu())  # host: a deliberate device mismatch
        with pytest.raises(ValueError, match="cu_seqlens is on cpu"):
            pal_attention_varlen(packed, packed, packed, good.cpu(), 4)  # host: a deliberate device mismatch


def test_reference_dropout_agrees_in_distribution():
    """Sanity link to F.dropout: the kernel's expected output equals the no-dropout output (unbiased scaling)."""
    torch.manual_seed(0)
    qkv, q, k, v = packed_qkv(1, 24, 1, 17, seed=2)
    outs = torch.stack([pal_attention(q, k, v, dropout_p=0.2, generator_seed=s) for s in range(48)])
    mean_err = (outs.mean(0) - attention_reference(q, k, v)).abs().mean().item()
    ref_outs = torch.stack([attention_reference(q, k, v, dropout_p=0.2) for _ in range(48)])
    ref_err = (ref_outs.mean(0) - attention_reference(q, k, v)).abs().mean().item()
    assert mean_err < 2 * ref_err + 1e-3, (mean_err, ref_err)
