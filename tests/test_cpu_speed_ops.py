"""The CPU training path's own ops: :func:`fastpals.functional.dropout`, matmul attention in the model on CPU, and
:func:`fastpals.train.command.keep_freed_memory`."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from fastpals.encoder.bert import BertConfig, BertModel, PALConfig
from fastpals.functional import Dropout, dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keeps_the_right_fraction_and_is_unbiased(dtype, p):
    torch.manual_seed(0)
    x = torch.randn(1000, 1001, dtype=dtype)  # odd count: the last 64-bit word is only partly used
    y = dropout(x, p)
    kept = y != 0
    n = x.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept.float().mean().item() - (1 - p)) < 6 * sigma
    # kept values are x scaled by 1 / (1 - p) (p rounded to 1/65536), dropped ones are exactly 0
    scale = 65536 / (65536 - round(p * 65536))
    torch.testing.assert_close(y[kept], (x[kept].float() * scale).to(dtype), rtol=0, atol=0)
    # unbiased: E[y] = x, checked on ones
    ones = dropout(torch.ones(n, dtype=torch.float32), p)
    assert abs(ones.mean().item() - 1.0) < 6 * math.sqrt(p / (1 - p) / n)


def test_dropout_slices_are_independent():
    """The four 16-bit slices of one 64-bit word decide four neighbouring elements: no correlation between them."""
    torch.manual_seed(1)
    keep = (dropout(torch.ones(4 * 250_000), 0.5) != 0).float().view(-1, 4)
    centred = keep - keep.mean(0)
    corr = (centred.T @ centred) / keep.shape[0] / centred.std(0).pow(2).mean()
    off_diagonal = corr - torch.diag(torch.diag(corr))
    assert off_diagonal.abs().max().item() < 0.01  # 1 / sqrt(250k) = 0.002 per pair


def test_dropout_gradient_is_the_mask():
    torch.manual_seed(2)
    x = torch.randn(64, 33, requires_grad=True)
    y = dropout(x, 0.25)
    (y * 3.0).sum().backward()
    expected = torch.where(y != 0, torch.full_like(x, 3.0 * 65536 / (65536 - 16384)), torch.zeros_like(x))
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_dropout_follows_the_seed_and_identity_cases():
    x = torch.randn(300)
    torch.manual_seed(3)
    a = dropout(x, 0.3)
    b = dropout(x, 0.3)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.3), a)
    assert not torch.equal(a, b)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0) is x
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="dropout: p must be in"):
            dropout(x, bad)


def test_dropout_module_is_an_nn_dropout():
    m = Dropout(0.2)
    assert isinstance(m, torch.nn.Dropout) and m.p == 0.2 and m.state_dict() == {}
    x = torch.randn(50, 40)
    assert m.eval()(x) is x
    assert (m.train()(x) == 0).any()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, every NaN as one pattern (the kernel writes the quiet NaN, PyTorch keeps the payload)."""
    t = t.detach()
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return torch.where(t.isnan(), torch.zeros((), dtype=ints), t.view(ints))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_compiled_dropout_is_bit_identical_to_the_reference(dtype):
    """The one-pass kernel (csrc/dropout.cpp) against :func:`dropout_reference` and ``+ residual``: outputs and the
    gradients of x and residual equal bit for bit, signed zeros, infinities and NaNs included."""
    from fastpals_kernels import dropout as ops

    if not ops.compiled_dropout():
        pytest.skip("the compiled dropout did not build here (no C++ compiler or ninja)")
    torch.manual_seed(6)
    for shape in ((7,), (5, 1, 33), (48, 12, 29, 29)):
        x = (10 * torch.randn(shape, dtype=torch.float64)).to(dtype)
        x.view(-1)[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
        residual = torch.randn(shape, dtype=torch.float64).to(dtype)
        grad = (3 * torch.randn(shape, dtype=torch.float64)).to(dtype)
        for p, with_residual in ((0.1, True), (0.5, False), (1e-4, True)):
            runs = []
            for fused in (True, False):
                a = x.clone().requires_grad_()
                r = residual.clone().requires_grad_() if with_residual else None
                torch.manual_seed(7)
                if fused:
                    y = ops.dropout_add(a, r, p)
                else:
                    y = ops.dropout_reference(a, p) if r is None else ops.dropout_reference(a, p) + r
                y.backward(grad)
                runs.append([y, a.grad] + ([r.grad] if with_residual else []))
                if fused:
                    assert type(y.grad_fn).__name__ == "_DropoutMaskBackward"  # the kernel ran
            for got, want in zip(*runs):
                assert torch.equal(_bits(got), _bits(want)), (shape, p)


def test_compiled_dropout_words_are_torchs_random_words():
    """The kernel's bulk mt19937 draws the words ``random_`` would, from any position of the generator (across
    its 624-word twists), and leaves the generator where ``random_`` leaves it."""
    from fastpals_kernels import dropout as ops

    if not ops.compiled_dropout():
        pytest.skip("the compiled dropout did not build here (no C++ compiler or ninja)")

    def draw(n: int, ours: bool, seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        torch.empty(37 * seed + 1, dtype=torch.int64).random_(-(2**63), None)  # start mid-state
        if ours:
            words = torch.ops.fastpals.dropout_words(n)
        else:
            words = torch.empty(n, dtype=torch.int64).random_(-(2**63), None)
        return [words, torch.empty(5, dtype=torch.int64).random_(-(2**63), None), torch.rand(3)]

    for seed in (0, 1, 5):
        for n in (0, 1, 311, 312, 313, 624, 1000, 131_520):
            assert all(torch.equal(a, b) for a, b in zip(draw(n, True, seed), draw(n, False, seed))), (
                seed,
                n,
            )


def test_compiled_dropout_keeps_a_training_step_bit_identical(monkeypatch):
    """A tiny packed BERT with PALs, one forward and backward in bf16: the loss and every gradient are the same
    bits with the compiled dropout as with ``FASTPALS_DROPOUT=torch``."""
    from fastpals_kernels import dropout as ops

    if not ops.compiled_dropout():
        pytest.skip("the compiled dropout did not build here (no C++ compiler or ninja)")
    cfg = BertConfig(vocab_size=50, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=32, hidden_dropout_prob=0.2)  # fmt: skip
    torch.manual_seed(8)
    model = BertModel(cfg, PALConfig(num_tasks=2, hidden=24, num_heads=2)).to(torch.bfloat16).train()
    lengths = torch.tensor([9, 4, 7])
    cu = torch.zeros(4, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    ids = torch.randint(1, 50, (int(lengths.sum()),))

    def step(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setitem(ops._state, "ok", fused)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(9)
        out = model(ids, cu_seqlens=cu, max_seqlen=9, task_ids=torch.tensor([0, 1, 1]))
        loss = out.last_hidden_state.float().square().mean() + out.pooler_output.float().sum()
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]

    fused, reference = step(True), step(False)
    assert len(fused) == len(reference) > 20
    assert all(torch.equal(a, b) for a, b in zip(fused, reference))


def test_model_on_cpu_runs_matmul_attention_equal_to_sdpa():
    """The CPU attention of padded rows (matmul + fp32 softmax with a cached key bias) equals torch's SDPA in BERT
    and the PALs (eval), and the packed rows' attention gives the same rows."""
    cfg = BertConfig(vocab_size=50, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(4)
    model = BertModel(cfg, PALConfig(num_tasks=2, hidden=24, num_heads=2)).eval()
    for p in model.parameters():  # PAL decoders start at zero: give them weights so the PAL attention counts
        p.data.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(1, 50, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    tasks = torch.tensor([0, 1, 1])
    real = mask.bool()
    lengths = mask.sum(1)
    cu = torch.zeros(4, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        padded = model(ids, attention_mask=mask, task_ids=tasks).last_hidden_state[real]
        packed = model(ids[real], cu_seqlens=cu, max_seqlen=10, task_ids=tasks).last_hidden_state
        return padded, packed

    ours = run()
    calls = []

    def sdpa_as_reference(q, k, v, key_bias, dropout_p=0.0, softmax_scale=None):
        calls.append(q.shape)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=key_bias, scale=softmax_scale).transpose(
            1, 2
        )

    # BERT's attention and the packed PALs' reference path both call it
    modules = (sys.modules["fastpals_kernels.attention_varlen"], sys.modules["fastpals_kernels.pal"])
    originals = [m.attention_with_key_bias for m in modules]
    for m in modules:
        m.attention_with_key_bias = sdpa_as_reference
    try:
        theirs = run()
    finally:
        for m, original in zip(modules, originals):
            m.attention_with_key_bias = original
    # padded: 2 BERT layers + 2 PAL layers (the packed rows run packed_attention: tests/test_packed_attention.py)
    assert len(calls) == 4, calls
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (ours[0] - ours[1]).abs().max() < 1e-5  # and packed equals padded


def test_segment_linear_equals_the_grouped_reference():
    from fastpals.functional import grouped_linear_reference, segment_linear

    torch.manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(3, 7, 5, dtype=dtype, requires_grad=True)
        b = torch.randn(3, 7, dtype=dtype, requires_grad=True)
        for counts in ([4, 0, 3], [0, 6, 0], [2, 2, 2]):
            x = torch.randn(sum(counts), 5, dtype=dtype, requires_grad=True)
            ids = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
            for bias in (b, None):
                got, want = segment_linear(x, counts, w, bias), grouped_linear_reference(x, ids, w, bias)
                assert got.dtype == dtype and torch.equal(got, want)
                g = torch.randn_like(got)
                inputs = (x, w) if bias is None else (x, w, bias)
                for ours, theirs in zip(
                    torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)
                ):
                    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # x, weight and bias gradients
            only_x = torch.autograd.grad(segment_linear(x, counts, w.detach(), None), x, g)[0]
            full = torch.autograd.grad(segment_linear(x, counts, w, None), x, g)[0]
            torch.testing.assert_close(only_x, full, rtol=0, atol=0)
        assert segment_linear(x[:0], [0, 0, 0], w, None).shape == (0, 7)
    with pytest.raises(ValueError, match=r"counts \[2, 2\] must have one entry per task \(3\)"):
        segment_linear(torch.randn(4, 5), [2, 2], w.float(), None)
    with pytest.raises(ValueError, match=r"sum to the rows of x \(5\)"):
        segment_linear(torch.randn(5, 5), [2, 2, 0], w.float(), None)


def test_grouped_reference_equals_a_gathered_float64_transcription_with_one_weight_gradient_node():
    """grouped_linear_reference (padded ``[B, L, K]`` and ``[B, K]``, absent tasks, autocast) against the
    per-example definition ``y[b] = x[b] @ W[t_b]^T + b[t_b]`` in float64 (every gradient), and its backward writes
    the weight gradient once: no per-task ``SelectBackward`` adding ``T`` zero-padded ``[T, M, K]`` gradients (that
    made the plain step at T = 16 about 12% slower on MiniLM)."""
    from fastpals.functional import grouped_linear_reference

    def definition(x, ids, w, b):
        y = torch.einsum("b...k,bmk->b...m", x, w.index_select(0, ids))
        return (
            y
            if b is None
            else y + b.index_select(0, ids).view(ids.shape[0], *[1] * (x.dim() - 2), b.shape[1])
        )

    def nodes(fn):
        seen, todo = set(), [fn]
        while todo:
            f = todo.pop()
            if f is None or f in seen:
                continue
            seen.add(f)
            todo.extend(n for n, _ in f.next_functions)
        return [type(f).__name__ for f in seen]

    torch.manual_seed(3)
    for shape, ids in (((6, 4, 5), [2, 0, 2, 4, 0, 2]), ((5, 5), [1, 1, 1, 1, 1]), ((0, 3, 5), [])):
        ids = torch.tensor(ids, dtype=torch.int64)
        x = torch.randn(*shape, requires_grad=True)
        w = torch.randn(5, 7, 5, requires_grad=True)  # tasks 1 and 3 (and more) absent
        b = torch.randn(5, 7, requires_grad=True)
        for bias in (b, None):
            y = grouped_linear_reference(x, ids, w, bias)
            leaves = (x, w) if bias is None else (x, w, bias)
            as64 = [t.detach().double().requires_grad_() for t in leaves]
            want = definition(as64[0], ids, as64[1], as64[2] if bias is not None else None)
            assert y.shape == want.shape
            torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-5)
            if y.numel():
                names = nodes(y.grad_fn)
                assert "SelectBackward0" not in names and names.count("_SegmentLinearBackward") == 1, names
                g = torch.randn_like(y)
                for ours, theirs in zip(
                    torch.autograd.grad(y, leaves, g), torch.autograd.grad(want, as64, g.double())
                ):
                    torch.testing.assert_close(ours.double(), theirs, rtol=0, atol=1e-5)
    x = torch.randn(4, 3, 5)
    ids = torch.tensor([0, 1, 1, 0])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # follows autocast as F.linear does
        y = grouped_linear_reference(x, ids, w, b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), definition(x, ids, w, b).detach(), rtol=2e-2, atol=5e-2)


def test_keep_freed_memory_cuts_page_faults():
    """In a fresh process: 20 steps that allocate and free 64 MiB fault far less after the tuning."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc malloc tuning is Linux-only")
    script = textwrap.dedent(
        """
        import resource, sys, torch
        from fastpals.train.command import keep_freed_memory
        if sys.argv[1] == "1":
            assert keep_freed_memory()
        def step():
            a = torch.ones(4 << 20); b = torch.ones(12 << 20); s = a.sum() + b.sum(); del a, b
            return s
        step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        """
    )
    faults = {}
    for tuned in ("0", "1"):
        out = subprocess.run(
            [sys.executable, "-c", script, tuned], capture_output=True, text=True, check=True
        )
        faults[tuned] = int(out.stdout.strip().splitlines()[-1])
    assert faults["1"] * 4 < faults["0"], faults
