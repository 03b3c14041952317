"""The CPU attention over packed rows (fastpals_kernels.attention_varlen.packed_attention): the compiled kernel of
csrc/attention.cpp against a float64 transcription of its reference (error at most twice the same-dtype PyTorch
reference's), the reference against BERT's padded attention, its dropout words, strided inputs and bad input."""

import math

import pytest
import torch

from fastpals_kernels import attention_varlen as A
from fastpals_kernels.attention_varlen import (
    attention_varlen_reference,
    bucketed_attention,
    packed_attention,
    packed_attention_reference,
    packed_words,
    padded_attention,
)
from fastpals_kernels.padding import attention_plan

pytestmark = pytest.mark.skipif(not A.compiled_attention(), reason="no C++ compiler: the kernel is not built")

LENGTHS = [5, 17, 1, 33, 64, 9, 130]


def _inputs(dtype, heads=3, head_dim=34, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    qkv = torch.randn(int(cu[-1]), 3, heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(int(cu[-1]), heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    return qkv, grad, cu


def _run(fn, qkv, grad):
    """fn's output and the gradient of <output, grad> wrt the stacked q, k, v (q, k, v: strided views)."""
    x = qkv.detach().clone().requires_grad_(True)
    out = fn(*x.unbind(1))
    out.backward(grad)
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.15])
@pytest.mark.parametrize("head_dim", [32, 17])
def test_kernel_against_float64(dtype, p, head_dim):
    qkv, grad, cu = _inputs(dtype, head_dim=head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    torch.manual_seed(3)
    words = packed_words(cu, qkv.shape[2], p, attention_plan(cu)) if p else None

    def kernel(q, k, v):
        if p == 0.0:
            return packed_attention(q, k, v, cu, 0.0)
        return A._PackedAttention.apply(
            q, k, v, cu, words.words, words.layout, words.threshold, words.scale, scale
        )

    def reference(q, k, v):
        return packed_attention_reference(q, k, v, cu, p, scale, words=words)

    got, got_grad = _run(kernel, qkv, grad)
    ref, ref_grad = _run(reference, qkv, grad)
    exact, exact_grad = _run(reference, qkv.double(), grad.double())
    for a, r, e in ((got, ref, exact), (got_grad, ref_grad, exact_grad)):
        err, ref_err = (a.double() - e).abs().max().item(), (r.double() - e).abs().max().item()
        assert err <= 2 * ref_err + (1e-6 if dtype == torch.float32 else 1e-3), (err, ref_err)
        if dtype == torch.float32:
            torch.testing.assert_close(a, r, rtol=0, atol=1e-5)


def test_reference_is_bert_attention_without_dropout():
    qkv, _, cu = _inputs(torch.float64, heads=2, head_dim=8)
    q, k, v = qkv.unbind(1)
    want = attention_varlen_reference(q, k, v, cu, max(LENGTHS))
    torch.testing.assert_close(
        packed_attention_reference(q, k, v, cu), want, rtol=0, atol=1e-6
    )  # its softmax: fp32
    torch.testing.assert_close(
        packed_attention(q.float(), k.float(), v.float(), cu), want.float(), rtol=0, atol=1e-5
    )


def test_dropout_mask_is_the_bucketed_attentions():
    """With a length-bucket plan the kernel draws the words the bucketed attention draws (one mask per padded
    bucket, the generator left where it leaves it) and keeps the same probabilities: fp32 outputs and gradients
    equal within 1e-6."""
    qkv, grad, cu = _inputs(torch.float32, heads=2, head_dim=8, lengths=[3, 9, 4, 1, 8, 2])
    plan = attention_plan(cu)
    assert len(plan.buckets) > 1
    torch.manual_seed(11)
    got = _run(lambda q, k, v: packed_attention(q, k, v, cu, 0.5, plan=plan), qkv, grad)
    after = torch.rand(3)
    torch.manual_seed(11)

    def buckets(q, k, v):
        attend = lambda qb, kb, vb, b: padded_attention(qb, kb, vb, b.mask, 0.5, key_bias=b.key_bias)  # noqa: E731
        return bucketed_attention(q, k, v, plan, attend)

    want = _run(buckets, qkv, grad)
    assert torch.equal(torch.rand(3), after)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_dropout_mask_without_a_plan():
    """Without a plan: one block [H, L, L] of slices per sequence, back to back (sequence 1, head 1, query 2 by
    hand)."""
    qkv, grad, cu = _inputs(torch.float32, heads=2, head_dim=8, lengths=[3, 4])
    q, k, v = qkv.unbind(1)
    torch.manual_seed(11)
    got = packed_attention(q, k, v, cu, 0.5)
    torch.manual_seed(11)
    words = packed_words(cu, 2, 0.5)
    assert words.layout.tolist() == [[0, 3], [18, 4]]
    keep = words.words.view(torch.int16)[18 + (1 * 4 + 2) * 4 :][:4] >= words.threshold
    qs, ks, vs = (t[3:7, 1] for t in (q, k, v))
    probs = torch.softmax((qs[2] @ ks.T) / math.sqrt(8), -1)
    torch.testing.assert_close(got[3 + 2, 1], (probs * keep * 2.0) @ vs, rtol=0, atol=1e-6)


def test_without_the_kernel_the_reference_runs(monkeypatch):
    qkv, grad, cu = _inputs(torch.bfloat16, heads=2, head_dim=16)
    torch.manual_seed(5)
    got = _run(lambda q, k, v: packed_attention(q, k, v, cu, 0.1), qkv, grad)
    monkeypatch.setitem(A._state, "ok", False)
    torch.manual_seed(5)
    ref = _run(lambda q, k, v: packed_attention(q, k, v, cu, 0.1), qkv, grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-2)


def test_model_step_uses_the_kernel(monkeypatch):
    """A packed CPU training step of BERT with PALs runs the kernel for BERT's and the PALs' attention, and its loss
    and gradients (fp32) equal those of the reference path within 1e-5."""
    from fastpals.encoder.bert import BertConfig, BertModel, PALConfig

    cfg = BertConfig(vocab_size=50, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(8)
    model = BertModel(cfg, PALConfig(num_tasks=2, hidden=24, num_heads=2)).train()
    for p in model.parameters():  # PAL decoders start at zero: give them weights so the PAL attention counts
        p.data.add_(0.05 * torch.randn_like(p))
    lengths = torch.tensor([9, 4, 7])
    cu = torch.zeros(4, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    ids = torch.randint(1, 50, (int(lengths.sum()),))
    calls = []
    real = A._PackedAttention.apply
    monkeypatch.setattr(A._PackedAttention, "apply", lambda *a: calls.append(a[0].shape) or real(*a))

    def step(compiled: bool) -> list[torch.Tensor]:
        monkeypatch.setitem(A._state, "ok", compiled)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(9)
        out = model(ids, cu_seqlens=cu, max_seqlen=9, task_ids=torch.tensor([0, 1, 1]))
        loss = out.last_hidden_state.square().mean() + out.pooler_output.sum()
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]

    got = step(True)
    assert len(calls) == 4  # 2 BERT layers, 2 PALs
    want = step(False)
    assert len(calls) == 4 and len(got) == len(want) > 20
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_bad_input():
    q = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4])
    op = torch.ops.fastpals.packed_attention
    layout = torch.tensor([[0, 4]])
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
        op(q, q.double(), q, cu, None, None, 0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="one shape"):
        op(q, q[:3], q, cu, None, None, 0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="unit stride"):
        op(q.transpose(1, 2).contiguous().transpose(1, 2), q, q, cu, None, None, 0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="words must be"):
        op(q, q, q, cu, torch.zeros(3, dtype=torch.int64), layout, 0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="words need their words_layout"):
        op(q, q, q, cu, torch.zeros(8, dtype=torch.int64), None, 0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, q, q, cu, torch.zeros(8, dtype=torch.int64), torch.tensor([[0, 3]]), 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        packed_attention(q, q, q, cu, 1.0)
