"""Data parallel surgery: 2 CPU processes (gloo) each holding half of every task's batch give the same update as
one process holding the whole batch, because the [T, P] buffer is averaged before the Gram."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastpals.surgery import TaskGradientBuffer, gem_weights, pcgrad_weights

pytestmark = pytest.mark.distributed

NUM_TASKS = 3
BATCH = 8  # per task, split 4 + 4 over the two ranks


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12))
        self.heads = torch.nn.ModuleList([torch.nn.Linear(12, 1) for _ in range(NUM_TASKS)])

    def loss(self, x: torch.Tensor, y: torch.Tensor, task: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.heads[task](self.encoder(x)).squeeze(-1), y)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for t in range(NUM_TASKS):
        x = torch.randn(BATCH, 6, generator=gen)
        y = torch.randn(BATCH, generator=gen) * (-2.0) ** t
        out.append((x, y))
    return out


def surgery_step(rows: slice, aggregator, all_reduce: bool) -> dict[str, torch.Tensor]:
    model = Model()
    buf = TaskGradientBuffer(
        list(model.encoder.parameters()),
        NUM_TASKS,
        task_params=list(model.heads.parameters()),
        all_reduce=all_reduce,
    )
    for t, (x, y) in enumerate(batches()):
        model.loss(x[rows], y[rows], t).backward()
        buf.capture(t)
    result = buf.apply(aggregator, generator=torch.Generator().manual_seed(7))
    assert not result.skipped
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        half = BATCH // world
        rows = slice(rank * half, (rank + 1) * half)
        out = {
            "pcgrad": surgery_step(rows, pcgrad_weights, all_reduce=True),
            "gem": surgery_step(rows, gem_weights, all_reduce=True),
        }
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_process_with_the_whole_batch(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    whole = slice(0, BATCH)
    refs = {}
    for name, agg in (("pcgrad", pcgrad_weights), ("gem", gem_weights)):
        ref = refs[name] = surgery_step(whole, agg, all_reduce=False)
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}.pt")[name]
            assert set(got) == set(ref)
            for n in ref:
                assert torch.allclose(got[n], ref[n], rtol=1e-5, atol=1e-7), (name, rank, n)
    # and surgery on the global gradients is not surgery on one rank's gradients
    local = surgery_step(slice(0, BATCH // 2), pcgrad_weights, all_reduce=False)
    assert not torch.allclose(local["encoder.0.weight"], refs["pcgrad"]["encoder.0.weight"], rtol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO 0/1/2 (CPU accelerator, gloo): per-task engine.backward, gradients read and written through
# safe_get_full_grad / safe_set_full_grad. DeepSpeed already averages the gradients over the ranks in each
# backward, so the buffer does not all-reduce; ZeRO-1/2 backwards replace (not accumulate) the reduced gradients,
# so the task-specific ones are captured too (capture_task_params=True).


def _deepspeed_rank(rank: int, world: int, port: int) -> Any:
    """A spawned rank's launcher variables and one torch thread; the ``deepspeed`` module."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    import deepspeed

    return deepspeed


def _deepspeed_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    deepspeed = _deepspeed_rank(rank, world, port)
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    def setter(p, g):
        safe_set_full_grad(p, g if g is not None else torch.zeros_like(p, dtype=torch.float32))

    deepspeed.init_distributed(dist_backend="gloo")
    half = BATCH // world
    rows = slice(rank * half, (rank + 1) * half)
    out = {}
    for stage in (0, 1, 2):
        model = Model()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        config = {
            "train_micro_batch_size_per_gpu": half,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config
        )
        module = engine.module
        buf = TaskGradientBuffer(
            list(module.encoder.parameters()),
            NUM_TASKS,
            task_params=list(module.heads.parameters()),
            grad_getter=safe_get_full_grad,
            grad_setter=setter,
            capture_task_params=True,
        )
        for t, (x, y) in enumerate(batches()):
            engine.backward(module.loss(x[rows], y[rows], t))
            buf.capture(t)
        result = buf.apply(pcgrad_weights, generator=torch.Generator().manual_seed(7))
        assert not result.skipped
        engine.step()  # SGD with lr 1: the update is before - after
        out[stage] = {n: before[n] - p.detach() for n, p in module.named_parameters()}
    torch.save(out, os.path.join(out_dir, f"ds_rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_deepspeed_zero_0_1_2_two_ranks_equal_one_process(tmp_path):
    pytest.importorskip("deepspeed")
    mp.spawn(_deepspeed_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ref = surgery_step(slice(0, BATCH), pcgrad_weights, all_reduce=False)
    for rank in range(2):
        got = torch.load(tmp_path / f"ds_rank{rank}.pt")
        for stage in (0, 1, 2):
            for n in ref:
                assert torch.allclose(got[stage][n], ref[n], rtol=1e-5, atol=1e-6), (stage, rank, n)


# ---------------------------------------------------------------------------------------------------------------
# Streaming surgery (fastpals.surgery.stream) on one backward per rank: each streamed layer's [T, layer] scratch
# is averaged over the ranks as it is produced (buckets of 4096 elements here: several all-reduces per step), the
# kept rows before their Gram, the token-id embedding rows gathered; the combined gradient is each rank's
# sum_t c_t g_t with the global c, averaged. Two ranks holding half of a mixed batch each (tiny PAL model,
# siamese pairs, trained word embeddings) equal one process holding all of it, in the buffer mode.


def _stream_update(rows: torch.Tensor, aggregator, mode: str, all_reduce: bool) -> dict[str, torch.Tensor]:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_per_task_grads import _dp_update

    return _dp_update(rows, aggregator, all_reduce, mode)


def _stream_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = torch.arange(rank, 10, world)  # interleaved halves: every task on both ranks
        out = {
            (name, mode): _stream_update(rows, agg, mode, all_reduce=True)
            for name, agg in (("pcgrad", pcgrad_weights),)
            for mode in ("stream", "smaller")
        }
        torch.save(out, os.path.join(out_dir, f"stream_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_processes_streaming_equal_one_process_buffer(tmp_path):
    mp.spawn(_stream_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for name, agg in (("pcgrad", pcgrad_weights),):
        ref = _stream_update(torch.arange(10), agg, "buffer", False)
        for rank in range(2):
            for mode in ("stream", "smaller"):
                got = torch.load(tmp_path / f"stream_rank{rank}.pt")[(name, mode)]
                assert set(got) == set(ref), (name, mode)
                for n in ref:
                    err = float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30))
                    assert err < 1e-5 or float((got[n] - ref[n]).abs().max()) < 1e-7, (
                        name,
                        mode,
                        rank,
                        n,
                        err,
                    )


# ---------------------------------------------------------------------------------------------------------------
# Streaming under DeepSpeed ZeRO-1/2, 2 ranks (CPU accelerator, gloo), fp32, as the trainer builds it
# (fastpals.train.step.deepspeed_surgery_buffer): one engine.backward inside per_task_gradients per rank, each
# rank half of a mixed batch. The streamed update equals the buffer's within 1e-5, and the per-rank peak of the
# live tensors the update makes (fastpals.train.memory_mode.LiveTensorBytes around the backward and the apply) grows
# with T by one layer's T x (layer) scratch for streaming, while the buffer's grows by its (T2 - T1) * P * 4 bytes
# of rows.

ZERO_ROWS = 16  # mixed rows in all, 8 per rank, split evenly over the T tasks


def _wide_model(num_tasks: int) -> torch.nn.Module:
    from fastpals import MultiTaskBert, PALConfig
    from fastpals.encoder.bert import BertConfig
    from fastpals.model.multitask import MultiTaskConfig, TaskSpec

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16,
    )  # fmt: skip
    pal = PALConfig(num_tasks=num_tasks, hidden=8, num_heads=2, zero_init_decoder=False, dropout=0.0)
    tasks = [TaskSpec(f"t{i}", "binary") for i in range(num_tasks)]
    return MultiTaskBert(MultiTaskConfig(cfg, tasks, pal, head_dropout=0.0)).eval()


def _zero_update(engine, num_tasks: int, rank: int, world: int, memory: str) -> tuple[dict, int]:
    from deepspeed.utils import safe_get_full_grad

    from fastpals.surgery import per_task_gradients
    from fastpals.train.memory_mode import LiveTensorBytes
    from fastpals.train.step import deepspeed_surgery_buffer

    module = engine.module
    stage = engine.zero_optimization_stage()
    buf = deepspeed_surgery_buffer(module, num_tasks, stage, all_reduce=True, memory=memory)
    if (
        memory == "stream"
    ):  # a bucket of the scratches' all-reduce is fixed in T; the default one (4 M elements)
        buf.bucket_elements = 4096  # would hold all T * P scratch elements of this small model at once
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (ZERO_ROWS, 8), generator=gen)
    task_ids = torch.arange(num_tasks).repeat_interleave(ZERO_ROWS // num_tasks)
    labels = torch.randint(0, 2, (ZERO_ROWS,), generator=gen).float()
    mine = torch.arange(rank, ZERO_ROWS, world)  # interleaved halves: every task on both ranks
    ids, task_ids, labels = ids[mine], task_ids[mine], labels[mine]
    tracker = LiveTensorBytes()
    with tracker:
        tracker.reset_peak()
        with per_task_gradients(module, buf, task_ids):
            res = module.task_losses(
                module(ids, torch.ones_like(ids), None, task_ids), labels, weighting="equal"
            )
            engine.backward(sum(res.per_task.values()))
        assert not buf.apply(pcgrad_weights, generator=torch.Generator().manual_seed(7)).skipped
    grads = {n: safe_get_full_grad(p).float().clone() for n, p in module.named_parameters()}
    return grads, tracker.peak


def _zero_stream_worker(rank: int, world: int, port: int, out_dir: str, stages, tasks) -> None:
    deepspeed = _deepspeed_rank(rank, world, port)

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for stage in stages:
        for t in tasks:
            for memory in ("buffer", "stream"):
                model = _wide_model(t)
                config = {
                    "train_micro_batch_size_per_gpu": ZERO_ROWS // world,
                    "gradient_accumulation_steps": 1,
                    "gradient_clipping": 0.0,
                    # small reduce buckets: DeepSpeed's default (5e8 elements) would make its bucket the peak
                    "zero_optimization": {
                        "stage": stage,
                        "reduce_bucket_size": 4096,
                        "allgather_bucket_size": 4096,
                    },
                    "zero_allow_untested_optimizer": True,
                }
                engine, *_ = deepspeed.initialize(
                    model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config
                )
                grads, peak = _zero_update(engine, t, rank, world, memory)
                shared = [p.numel() for p in _shared(engine.module)]
                out[(stage, t, memory)] = {
                    "grads": grads,
                    "peak": peak,
                    "shared": sum(shared),
                    "largest": max(shared),
                }
    torch.save(out, os.path.join(out_dir, f"zero_stream_rank{rank}.pt"))
    dist.destroy_process_group()


def _shared(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    from fastpals.surgery import shared_parameters_by_name

    return shared_parameters_by_name(module)[0]


def _check_zero_stream(tmp_path, stages, tasks) -> None:
    pytest.importorskip("deepspeed")
    mp.spawn(_zero_stream_worker, args=(2, _free_port(), str(tmp_path), stages, tasks), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"zero_stream_rank{rank}.pt")
        for stage in stages:
            for t in tasks:
                ref, new = got[(stage, t, "buffer")]["grads"], got[(stage, t, "stream")]["grads"]
                assert set(ref) == set(new)
                for n in ref:
                    err = float((new[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30))
                    assert err < 1e-5 or float((new[n] - ref[n]).abs().max()) < 1e-7, (stage, t, rank, n, err)
            if len(tasks) > 1:
                lo, hi = min(tasks), max(tasks)
                peak = {(t, m): got[(stage, t, m)]["peak"] for t in (lo, hi) for m in ("buffer", "stream")}
                rows = (hi - lo) * got[(stage, hi, "buffer")]["shared"] * 4
                print(f"ZeRO-{stage} rank {rank}: peaks {peak}, extra rows {rows}")
                # the buffer grows by most of its extra rows; the streamed peak by about the one layer's T x
                # (layer) scratch that it holds at a time (its largest layer is 11 % of P in this small model):
                # 134-162 KB against a 197 KB scratch. With the other core busy, about 1 run in 4 reads 211-268 KB
                # on one rank: gloo's worker thread drops its reference to an all-reduced scratch after wait()
                # returns, so when that thread is late the previous FFN scratch is still alive as the next one is
                # made, and the peak moves into the backward (two [8, 64, 128] scratches live; traced by storage).
                # Hence 1.5x, far below the buffer's 1.8 MB
                scratch = (hi - lo) * got[(stage, hi, "stream")]["largest"] * 4
                grown = peak[(hi, "stream")] - peak[(lo, "stream")]
                assert peak[(hi, "buffer")] - peak[(lo, "buffer")] > 0.7 * rows, (stage, rank, peak, rows)
                assert grown <= 1.5 * scratch and grown < 0.15 * rows, (stage, rank, peak, scratch)


def test_deepspeed_zero_2_streaming_equals_buffer_and_stays_flat_in_tasks(tmp_path):
    """ZeRO-2 (gradients partitioned), T = 2 and 8 (about 20 s on the loaded 2-core CPU; ZeRO-1 in the slow test)."""
    _check_zero_stream(tmp_path, (2,), (2, 8))


@pytest.mark.slow
def test_deepspeed_zero_1_streaming_equals_buffer_and_stays_flat_in_tasks(tmp_path):
    _check_zero_stream(tmp_path, (1,), (2, 8))
