"""Streaming surgery (fastpals.surgery.stream.StreamingTaskGradients) equals the [T, P] buffer mode.

The same one-backward capture feeds both; the buffer's update is itself checked against T separate backwards
(tests/test_per_task_grads.py) and the papers (tests/test_surgery.py). Here: every aggregator of the registry on a
tiny PAL model (padded and packed, siamese second sentences, trained word embeddings), MiniLM in every pair mode,
PCGrad's random order with the same generator, the float64 transcription of the PCGrad paper on the gradients of T
separate backwards, the banded token-id Gram of the embeddings against the dense per-task tables, and the
refusals. Dropout is off: exact math, fp32 within 1e-5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpals import PALConfig
from fastpals.surgery import (
    AGGREGATORS,
    StreamingTaskGradients,
    TaskGradientBuffer,
    cu_seqlens_from_mask,
    make_weighting,
    pcgrad_orders,
    pcgrad_weights,
    per_task_gradients,
    shared_parameters_by_name,
    stream,
)
from fastpals.surgery.stream import embedding_row_gram, stream_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_per_task_grads import (  # noqa: E402
    RTOL,
    T,
    _tiny_batch,
    _tiny_model,
    batch,
    minilm,
    mt_loss,
    rel,
    select,
)
from test_surgery import paper_orders, pcgrad_paper  # noqa: E402


def _surgery_buffer(mode: str, shared, specific):
    if mode == "buffer":
        return TaskGradientBuffer(shared, T, task_params=specific)
    return StreamingTaskGradients(shared, T, task_params=specific, policy=mode)


def _update(model, data, mode: str, aggregator, unpad: bool, seed: int = 5, use_kernels: bool | None = None):
    """One one-backward surgery update in ``mode`` (buffer / stream / smaller): the Gram and every gradient."""
    shared, specific = shared_parameters_by_name(model)
    buf = _surgery_buffer(mode, shared, specific)
    model.zero_grad(set_to_none=True)
    cu = None
    if unpad:  # one cu_seqlens per encoder pass (the siamese second sentences pack to other lengths)
        cu = [cu_seqlens_from_mask(data["attention_mask"]), cu_seqlens_from_mask(data["attention_mask_b"])]
    with per_task_gradients(model, buf, data["task_ids"], cu_seqlens=cu, use_kernels=use_kernels):
        mt_loss(model, data, unpad=unpad).backward()
    assert all(p.grad is None for p in shared), "shared parameters get no ordinary .grad before apply"
    result = buf.apply(aggregator, generator=torch.Generator().manual_seed(seed))
    assert not result.skipped
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return result.gram.clone(), result.weights.clone(), grads


def _check_same(ref, got, what: str) -> None:
    g_ref, w_ref, ref_grads = ref
    g_got, w_got, got_grads = got
    assert rel(g_got, g_ref) < RTOL, f"{what}: Gram relative error {rel(g_got, g_ref):.2e}"
    assert rel(w_got, w_ref) < RTOL, f"{what}: weights {w_got.tolist()} vs {w_ref.tolist()}"
    assert set(got_grads) == set(ref_grads)
    flat_ref = torch.cat([g.reshape(-1) for g in ref_grads.values() if g is not None])
    scale = float(flat_ref.norm())
    for name, g in ref_grads.items():
        assert (g is None) == (got_grads[name] is None), f"{what}: {name} gradient presence differs"
        if g is not None:
            err = float((got_grads[name] - g).norm())
            assert err < RTOL * max(float(g.norm()), 1e-3 * scale), f"{what}: {name} error {err:.2e}"


# ----------------------------------------------------------------------------------------------------------------
# every aggregator, tiny PAL model (siamese sbert_concat pairs, trained word embeddings), padded and packed
# ----------------------------------------------------------------------------------------------------------------
# the modes differ in the Gram and the combine, not in Gram -> weights: TorchJD 0.18's newer weightings
# (tests/test_weights_extra.py) add no case here
NEWER_WEIGHTINGS = {"constant", "random", "krum", "modo", "sdmgrad", "crmogm", "excessmtl"}


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", sorted(set(AGGREGATORS) - NEWER_WEIGHTINGS))
def test_every_aggregator_stream_equals_buffer(name, unpad):
    model = _tiny_model()
    data = _tiny_batch()
    results = {}
    modes = ("stream",) if unpad else ("stream", "smaller")  # (smaller's kept rows: layout-independent code)
    for mode in ("buffer", *modes):
        fn, _ = make_weighting(name)  # a fresh state for the stateful ones
        results[mode] = _update(model, data, mode, fn, unpad)
    for mode in modes:
        _check_same(results["buffer"], results[mode], f"{name} {mode} unpad={unpad}")


def test_the_tiny_model_exercises_every_path():
    """``stream`` streams every Linear weight and embedding table; under ``smaller`` the tiny model's word
    embeddings stream (T * V > rows) while its Linears keep task rows (T * M * K <= rows * (M + K)), so the
    every-aggregator test above covers the token-id Gram, the streamed Linears and the kept rows mixed with
    streamed parts. MiniLM's shapes: rows kept at T = 3, streamed at T = 16 (3000 rows)."""
    rows = int(_tiny_batch()["attention_mask"].sum())
    assert stream_policy("smaller", T, (100, 16), rows, embedding=True)
    assert not stream_policy("smaller", T, (32, 16), 10 * 6, embedding=False)
    assert stream_policy("stream", T, (32, 16), 10 * 6, embedding=False)
    assert not stream_policy("smaller", T, (384, 384), 3000, embedding=False)
    assert stream_policy("smaller", 16, (1536, 384), 3000, embedding=False)


@pytest.mark.parametrize("missing", [False, True], ids=["all-tasks", "task-1-absent"])
def test_streamed_gram_in_output_row_blocks_equals_buffer(monkeypatch, missing):
    """The streamed Linears' Gram, built in blocks of output rows: with a 1000-byte budget every Linear takes
    several blocks and a shorter last one (3 tasks x 5 rows x 16 inputs x 4 bytes), over both siamese passes;
    a task with no rows in the batch is left out of the blocks. Equals the buffer's Gram and update."""
    seen = []
    blocked = stream.StreamingTaskGradients._blocked_gram

    def spy(self, k, calls):
        seen.append((len(calls), len({t for rows, _, _ in calls for t in rows.tasks})))
        return blocked(self, k, calls)

    monkeypatch.setattr(stream, "GRAM_CHUNK_BYTES", 1000)
    monkeypatch.setattr(stream.StreamingTaskGradients, "_blocked_gram", spy)
    model = _tiny_model()
    data = _tiny_batch()
    if missing:
        data = select(data, torch.tensor([0, 1, 4, 5, 6, 8, 9]))
    ref = _update(model, data, "buffer", pcgrad_weights, unpad=True)
    got = _update(model, data, "stream", pcgrad_weights, unpad=True)
    _check_same(ref, got, f"blocked Gram missing={missing}")
    assert seen and all(calls == 2 and tasks == (2 if missing else T) for calls, tasks in seen)


@pytest.mark.kernels
@pytest.mark.parametrize("missing", [False, True], ids=["all-tasks", "task-1-absent"])
def test_streamed_linears_on_the_multi_linear_ops(monkeypatch, missing):
    """The op library's path (the Triton kernels of fastpals_kernels.stream_linear; here in Triton's
    interpreter): the Gram of every streamed Linear weight and its bias, both siamese calls each, in one launch,
    and their update in one more. Equals the buffer on the torch path (Gram and update)."""
    from device import DEVICE, ON_CUDA, TRITON_INTERPRETED

    from fastpals_kernels import stream_linear
    from fastpals_kernels.dispatch import available

    ok, reason = available()
    if not ok or not (ON_CUDA or TRITON_INTERPRETED):
        pytest.skip(f"Triton kernels cannot run here: {reason or 'no CUDA and TRITON_INTERPRET unset'}")
    launches = []

    def spy(name):
        kernel = getattr(stream_linear, name)

        def run(dy, x, row_index, offsets, problem, bias, arg):
            launches.append((name, len(dy), max(problem) + 1, sum(bias)))
            return kernel(dy, x, row_index, offsets, problem, bias, arg)

        return run

    model = _tiny_model().to(DEVICE)
    data = {k: v.to(DEVICE) for k, v in _tiny_batch().items()}
    if missing:
        data = select(data, torch.tensor([0, 1, 4, 5, 6, 8, 9], device=DEVICE))
    ref = _update(model, data, "buffer", pcgrad_weights, unpad=True)
    monkeypatch.setenv("FASTPALS_BACKENDS", "grouped_wgrad=triton")
    for name in ("stream_linear_gram_triton", "stream_linear_combine_triton"):
        monkeypatch.setattr(stream_linear, name, spy(name))
    got = _update(model, data, "stream", pcgrad_weights, unpad=True, use_kernels=True)
    _check_same(ref, got, f"multi-Linear ops missing={missing}")
    # one launch each over every streamed Linear weight (2 layers x 6), each called by both siamese passes
    (gram, calls, weights, biases), combine = launches
    assert (gram, combine) == (
        "stream_linear_gram_triton",
        ("stream_linear_combine_triton", calls, weights, biases),
    )
    assert weights >= 12 and calls == 2 * weights and biases == weights, launches


# ----------------------------------------------------------------------------------------------------------------
# MiniLM: pair modes, PALs, padded / packed, sorted / unsorted rows
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pair_mode,pals,unpad,order",
    [
        ("joint", False, False, "sorted"),
        ("sbert_cosine", True, True, "unsorted"),  # sts as sbert_cosine, para as sbert_concat
    ],
)
def test_minilm_pcgrad_stream_equals_buffer(pair_mode, pals, unpad, order):
    pal = PALConfig(num_tasks=T, hidden=24, num_heads=2, gate=True) if pals else None
    model = minilm(pair_mode, pal, word_embeddings=True)
    tids = [0, 0, 1, 1, 1, 2, 2] if order == "sorted" else [1, 0, 2, 1, 0, 2, 1]
    data = batch(tids)
    ref = _update(model, data, "buffer", pcgrad_weights, unpad)
    got = _update(model, data, "stream", pcgrad_weights, unpad)
    _check_same(ref, got, f"MiniLM {pair_mode} pals={pals} unpad={unpad} {order}")


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "packed"])
def test_kept_rows_within_keep_bytes_are_a_forward_order_prefix_and_equal_buffer(unpad):
    """``keep_bytes`` (auto's streaming): the Linear weights whose rows are kept instead of streamed are the first
    ones of the forward whose rows, less the ``dY`` and ``X`` they spare, fit the budget (the next one would not);
    the update equals the buffer's (PCGrad, and MGDA whose weights depend on every Gram entry)."""
    pal = PALConfig(num_tasks=T, hidden=24, num_heads=2, gate=True)
    model = minilm("joint", pal)
    data = batch([0, 0, 1, 1, 1, 2, 2])
    shared, specific = shared_parameters_by_name(model)
    budget = 25 << 20  # a few of MiniLM's 37 Linear weights at these 7 x 8 rows
    for aggregator in (pcgrad_weights, make_weighting("mgda")[0]):
        ref = _update(model, data, "buffer", aggregator, unpad)
        buf = StreamingTaskGradients(shared, T, task_params=specific, keep_bytes=budget)
        model.zero_grad(set_to_none=True)
        cu = [cu_seqlens_from_mask(data["attention_mask"]), cu_seqlens_from_mask(data["attention_mask_b"])]
        with per_task_gradients(model, buf, data["task_ids"], cu_seqlens=cu if unpad else None):
            mt_loss(model, data, unpad=unpad).backward()
        order = list(buf._linear_order)
        kept = buf._kept_linears
        assert len(order) == 37 and kept is not None  # 6 x 6 in the encoder, the pooler
        assert 0 < len(kept) < len(order)
        needs = []
        for k in order:
            m, kk = buf.params[k].shape
            needs.append(T * m * kk * 4 - buf._row_counts[k] * (m + kk) * 4)
        assert set(order[: len(kept)]) == kept, "the kept weights are the forward's first ones"
        assert sum(needs[: len(kept)]) <= budget < sum(needs[: len(kept) + 1])
        assert all(not buf._decided[k] for k in kept) and all(buf._decided[k] for k in order if k not in kept)
        assert set(kept) <= set(buf._rows), "kept weights hold [T, M, K] rows until apply"
        result = buf.apply(aggregator, generator=torch.Generator().manual_seed(5))
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        _check_same(ref, (result.gram, result.weights, grads), f"keep_bytes unpad={unpad}")


def test_keep_bytes_is_checked_and_off_under_data_parallel():
    model = _tiny_model()
    shared, specific = shared_parameters_by_name(model)
    for bad in (-1, 1.5, "1"):
        with pytest.raises(ValueError, match="keep_bytes must be an int >= 0"):
            StreamingTaskGradients(shared, T, keep_bytes=bad)
    one = StreamingTaskGradients(shared, T, keep_bytes=1 << 20)
    dp = StreamingTaskGradients(shared, T, keep_bytes=1 << 20, all_reduce=True)
    assert one.keep_bytes == 1 << 20 and dp.keep_bytes == 0, (
        "data parallel all-reduces kept rows in one piece"
    )
    assert "keep_bytes=1048576" in repr(one)


def test_stream_pcgrad_equals_the_paper_on_separate_backwards():
    """The streamed PCGrad update against Algorithm 1 of Yu et al. in float64 on the T task gradients of T plain
    autograd backwards (each task's examples alone), with the projection orders of the same generator."""
    model = _tiny_model()
    data = _tiny_batch()
    shared, specific = shared_parameters_by_name(model)
    rows = []
    for t in range(T):
        model.zero_grad(set_to_none=True)
        idx = (data["task_ids"] == t).nonzero(as_tuple=True)[0]
        mt_loss(model, select(data, idx)).backward()
        rows.append(
            torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in shared])
        )
    grads = torch.stack(rows).double().numpy()
    want = pcgrad_paper(grads, paper_orders(T, 5))
    assert pcgrad_orders(T, torch.Generator().manual_seed(5)).tolist() == paper_orders(T, 5)
    _, _, got = _update(model, data, "stream", pcgrad_weights, unpad=False, seed=5)
    named = dict(model.named_parameters())
    index = {id(p): n for n, p in named.items()}
    flat = torch.cat([got[index[id(p)]].reshape(-1) for p in shared]).double().numpy()
    err = np.linalg.norm(flat - want) / np.linalg.norm(want)
    assert err < RTOL, f"stream PCGrad vs the paper: relative error {err:.2e}"


# ----------------------------------------------------------------------------------------------------------------
# the pieces
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1, 4], ids=["one-block", "column-blocks"])
def test_embedding_row_gram_equals_the_dense_tables(t):
    """T = 4, d = 5: the [T, N, cols] table in blocks of 2, 2 and 1 columns (no larger than the rows)."""
    gen = torch.Generator().manual_seed(0)
    n, v, d = 200, 13, 5
    ids = torch.randint(0, v, (n,), generator=gen)
    dy = torch.randn(n, d, generator=gen, dtype=torch.float64).float()
    task = torch.randint(0, t, (n,), generator=gen)
    tables = torch.zeros(t, v, d, dtype=torch.float64)
    keep = ids != 3
    for r in range(n):
        if keep[r]:
            tables[task[r], ids[r]] += dy[r].double()
    flat = tables.reshape(t, -1)
    want = flat @ flat.T
    got = embedding_row_gram(ids, dy, task, t, padding_idx=3)
    assert rel(got.double(), want) < 1e-6


def test_refusals_are_clear():
    model = _tiny_model()
    shared, specific = shared_parameters_by_name(model)
    with pytest.raises(ValueError, match="policy must be one of"):
        StreamingTaskGradients(shared, T, policy="sometimes")
    buf = StreamingTaskGradients(shared, T, task_params=specific)
    data = _tiny_batch()
    with per_task_gradients(model, buf, data["task_ids"]):
        mt_loss(model, data).backward()
    with pytest.raises(RuntimeError, match="one per_task_gradients block per apply"):
        with per_task_gradients(model, buf, data["task_ids"]):
            pass
    buf.apply(pcgrad_weights)  # the step ends; the next block is accepted
    with per_task_gradients(model, buf, data["task_ids"]):
        mt_loss(model, data).backward()
    assert not buf.apply(pcgrad_weights).skipped


def test_a_non_finite_task_gradient_skips_the_step():
    model = _tiny_model()
    shared, specific = shared_parameters_by_name(model)
    buf = StreamingTaskGradients(shared, T, task_params=specific)
    data = _tiny_batch()
    with per_task_gradients(model, buf, data["task_ids"]):
        out = model(data["input_ids"], data["attention_mask"], None, data["task_ids"],
                    input_ids_b=data["input_ids_b"], attention_mask_b=data["attention_mask_b"])  # fmt: skip
        per = model.loss(out, data["labels"])[1]
        (per["sst"] * float("inf") + per["para"] + per["sts"]).backward()
    result = buf.apply(pcgrad_weights)
    assert result.skipped and 0 in result.nonfinite_tasks
    assert all(p.grad is None for p in shared)
    assert buf.skipped_steps == 1


# ----------------------------------------------------------------------------------------------------------------
# run_update (the trainer's update) and the trainer's option
# ----------------------------------------------------------------------------------------------------------------
def test_run_update_stream_reads_once_and_equals_buffer():
    """``run_update(..., "one_backward")`` with the streaming surgery: one host read per update (the losses and
    apply's flags together; none in stream.py), and the same parameters after the step as the buffer mode."""
    from host_read_counter import READS, HostReads
    from test_train_update import _micro_batches, _model

    from fastpals.train.step import Surgery, TorchEngine, run_update

    after = {}
    for mode in ("buffer", "stream", "smaller"):
        model = _model()
        model.eval()  # no dropout: the modes see the same forward
        engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
        shared, specific = shared_parameters_by_name(model)
        buf = TaskGradientBuffer(shared, 3, task_params=specific) if mode == "buffer" else (
            StreamingTaskGradients(shared, 3, task_params=specific, policy=mode))  # fmt: skip
        surgery = Surgery(buf, pcgrad_weights, torch.Generator().manual_seed(3))
        gen = torch.Generator().manual_seed(0)
        for k in range(2):
            micro = _micro_batches("mixed", gen)[:1]  # one mixed micro-batch per update
            with HostReads(READS) as reads:
                reads.active = k == 1
                update = run_update(engine, micro, "one_backward", surgery=surgery)
                reads.active = False
        assert update.stepped
        assert sum(reads.under("/fastpals/train/").values()) == 1, reads.under("/fastpals/")
        assert sum(reads.under("/fastpals/surgery/").values()) == 0, reads.under("/fastpals/")
        after[mode] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for mode in ("stream", "smaller"):
        assert rel(after[mode], after["buffer"]) < RTOL


def test_surgery_memory_option():
    from fastpals.train.memory_mode import surgery_memory_mode

    assert surgery_memory_mode("auto", one_backward=True) == "smaller"
    assert surgery_memory_mode("auto", one_backward=False) == "buffer"
    assert surgery_memory_mode("auto", one_backward=True, buffer_dtype="bf16") == "buffer"
    assert surgery_memory_mode("stream", one_backward=True) == "stream"


def test_task_gradients_builds_each_memory_mode_on_the_one_core():
    """``memory_mode.task_gradients``: the buffer with its row dtype, or the stream with the mode's policy and
    budget (``stream`` keeps no rows); both run the one ``TaskGradients.apply``."""
    from fastpals.surgery import StreamingTaskGradients, TaskGradientBuffer, TaskGradients
    from fastpals.train.memory_mode import task_gradients

    params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(4))]
    head = torch.nn.Parameter(torch.zeros(2))
    buf = task_gradients("buffer", params, 3, torch.bfloat16, 10, task_params=[head])
    assert type(buf) is TaskGradientBuffer and buf.dtype == torch.bfloat16 and buf.task_params == [head]
    for memory, policy, keep in (("stream", "stream", 0), ("smaller", "smaller", 10)):
        got = task_gradients(memory, params, 3, torch.bfloat16, 10)
        assert type(got) is StreamingTaskGradients and (got.policy, got.keep_bytes) == (policy, keep)
    assert TaskGradientBuffer.apply is StreamingTaskGradients.apply is TaskGradients.apply
    with pytest.raises(ValueError, match="surgery memory 'auto'"):
        task_gradients("auto", params, 3)


def test_bf16_model_stream_close_to_the_fp32_buffer():
    """A bf16 module (as DeepSpeed's bf16 engine runs it): the kept dY / X are bf16, the update's products fp32;
    the streamed update is within bf16 rounding of the fp32-row buffer's, for both policies."""
    data = _tiny_batch()
    updates = {}
    for mode in ("buffer", "stream", "smaller"):
        model = _tiny_model().bfloat16()
        shared, specific = shared_parameters_by_name(model)
        kw = {"task_params": specific}
        buf = TaskGradientBuffer(shared, T, **kw) if mode == "buffer" else (
            StreamingTaskGradients(shared, T, policy=mode, **kw))  # fmt: skip
        with per_task_gradients(model, buf, data["task_ids"]):
            mt_loss(model, data).backward()
        assert not buf.apply(pcgrad_weights, generator=torch.Generator().manual_seed(1)).skipped
        updates[mode] = torch.cat([p.grad.float().reshape(-1) for p in shared])
    for mode in ("stream", "smaller"):
        err = rel(updates[mode], updates["buffer"])
        assert err < 1e-2, f"{mode}: bf16 update relative error {err:.2e}"


# ----------------------------------------------------------------------------------------------------------------
# the memory planner models every mode
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # three fake traces (about 35 s on the loaded 2-core CPU); the planner's stream step runs below
def test_memory_planner_shows_every_mode(tmp_path):
    """``fastpals memory`` traces every ``--surgery-memory`` mode of one-backward surgery and prints them."""
    from train_fixtures import make_tiny_model

    from fastpals.commands.memory import StepSpec, format_plan, plan_memory

    model = str(make_tiny_model(tmp_path / "model"))
    spec = StepSpec(model=model, precision="fp32", surgery="pcgrad", max_length=16)
    plan = plan_memory(spec, 3, every_surgery_memory=True)
    assert set(plan.surgery_modes) == {"buffer", "stream", "auto"}
    assert all(v > 0 for v in plan.surgery_modes.values())
    assert "surgery memory modes" in format_plan(plan)


def test_stream_step_saves_the_rows_on_real_tensors(tmp_path):
    """On real tensors (the planner's CPU validation step) the streamed step's peak is below the buffer's by most
    of the ``[T, P]`` rows. (The fake trace models DeepSpeed's step, whose fp32 gradient partition sets the
    streamed step's peak on this tiny model.)"""
    from train_fixtures import make_tiny_model

    from fastpals.commands.memory import StepSpec, measure_step

    model = str(make_tiny_model(tmp_path / "model"))
    peaks, shared = {}, 0
    for mode in ("buffer", "stream"):
        spec = StepSpec(model=model, precision="fp32", surgery="pcgrad", max_length=16, surgery_memory=mode)
        trace = measure_step(spec, 6)
        peaks[mode], shared = trace.peak_bytes, trace.shared_params
    assert peaks["stream"] <= peaks["buffer"] - 3 * shared * 4 // 2, (peaks, shared)
