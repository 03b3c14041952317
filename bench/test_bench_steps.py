"""Whole training steps (pytest-benchmark): ``pytest bench/test_bench_steps.py --benchmark-only``.

Configurations (see ``bench/training.py``): plain multi-task BERT, BERT + PAL (PyTorch reference; fused Triton on
CUDA), BERT + PAL + PCGrad (Pytorch-PCGrad-style reference; fastpals buffer path), BERT + PAL + GEM (fastpals),
for T = 3 and T = 8 tasks.

- CPU (CI): all-MiniLM-L6-v2 (pretrained), fp32, batch 16 x 32 tokens, one torch thread (``FASTPALS_BENCH_THREADS``);
  the fused PAL is skipped (CUDA only).
  The T = 8 cases are marked ``slow`` on CPU (eight backward passes and surgery over all 22.7M weights take tens
  of seconds per step there): CI runs ``-m "not slow"``, a full CPU run includes them.
- CUDA: BERT-base shapes with random weights, batch 32 x 128 tokens, mixed precision ``bf16`` and ``fp16``
  (``FASTPALS_BENCH_PRECISIONS=bf16,fp16,bf16_pure`` to choose; ``bf16_pure`` keeps weights and optimizer state in
  bf16, the way the fused PAL runs in bf16: under autocast it receives the fp32 LayerNorm outputs).

Each test builds its configuration, runs one warm-up step while measuring peak memory (CUDA:
``torch.cuda.max_memory_allocated``, absolute, over the warm-up and the timed rounds; CPU: the growth of the
process's peak resident set over its resident set before the model was built, during the warm-up step, which
allocates the optimizer state), then ``benchmark.pedantic`` times the steps (``FASTPALS_BENCH_ROUNDS``, default
1 on CPU, 10 on CUDA). Then ``test_side_by_side_interleaved`` runs the group's configurations round robin
(``FASTPALS_BENCH_INTERLEAVED_ROUNDS``, default 3 on CPU, 10 on CUDA; 0 turns it off), so that the time ratios
do not depend on how busy the machine was when each configuration ran. The session's terminal summary and, with
``FASTPALS_BENCH_WRITE=1``, ``bench/results/steps_<device>_*.json`` put each variant beside plain BERT and the
fused/fastpals variants beside their references (``bench/conftest.py``): times are the interleaved medians when
the group has them, else each configuration's own median; peak memory comes from each configuration's own test.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from bench.common import CpuPeakMemory, CudaPeakMemory, StepTimer, cpu_peak_supported, cpu_rss_bytes
from bench.training import VARIANTS, StepConfig, TrainingStep

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
TASK_COUNTS = (3, 8)
CPU_SHAPE = {"model": "minilm-l6", "batch": 16, "length": 32}
CUDA_SHAPE = {"model": "bert-base", "batch": 32, "length": 128}
ROUNDS = int(os.environ.get("FASTPALS_BENCH_ROUNDS", "10" if HAS_CUDA else "1"))
INTERLEAVED_ROUNDS = int(os.environ.get("FASTPALS_BENCH_INTERLEAVED_ROUNDS", "10" if HAS_CUDA else "3"))
if ROUNDS < 1 or INTERLEAVED_ROUNDS < 0:
    raise ValueError(
        f"FASTPALS_BENCH_ROUNDS must be >= 1 and FASTPALS_BENCH_INTERLEAVED_ROUNDS >= 0, got {ROUNDS}, "
        f"{INTERLEAVED_ROUNDS}"
    )

# the steps of the group being measured, kept alive for its interleaved side-by-side test
_LIVE: dict[tuple[str, int], dict[str, TrainingStep]] = {}


def _precisions() -> tuple[str, ...]:
    if not HAS_CUDA:
        return ("fp32",)
    raw = os.environ.get("FASTPALS_BENCH_PRECISIONS", "bf16,fp16")
    values = tuple(p.strip() for p in raw.split(",") if p.strip())
    bad = [p for p in values if p not in ("fp32", "bf16", "fp16", "bf16_pure")]
    if bad or not values:
        raise ValueError(
            f"FASTPALS_BENCH_PRECISIONS={raw!r}: use a comma list of fp32, bf16, fp16, bf16_pure"
        )
    return values


def _cases() -> list:
    cases = []
    for precision in _precisions():
        for tasks in TASK_COUNTS:
            for variant in VARIANTS:
                marks = []
                if tasks > 3 and not HAS_CUDA:
                    # T backward passes and O(T^2) products over all 22.7M MiniLM weights: tens of seconds on CPU
                    marks.append(pytest.mark.slow)
                if variant == "pal_fused" and not HAS_CUDA:
                    marks.append(
                        pytest.mark.skip(reason="the fused Triton PAL runs on CUDA only (no GPU here)")
                    )
                cases.append(
                    pytest.param(precision, tasks, variant, id=f"{precision}-T{tasks}-{variant}", marks=marks)
                )
    return cases


def _groups() -> list:
    return [
        pytest.param(
            precision,
            tasks,
            id=f"{precision}-T{tasks}",
            marks=[pytest.mark.slow] if tasks > 3 and not HAS_CUDA else [],
        )
        for precision in _precisions()
        for tasks in TASK_COUNTS
    ]


def _release() -> None:
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


@pytest.fixture(scope="module", autouse=True)
def cpu_threads():
    """CPU: ``FASTPALS_BENCH_THREADS`` torch threads (default 1) for this module, restored afterwards. One
    thread keeps step times stable on shared machines (OpenMP teams slow down many-fold when other processes
    take their cores); the count is recorded with every result."""
    if HAS_CUDA:
        yield
        return
    old = torch.get_num_threads()
    threads = int(os.environ.get("FASTPALS_BENCH_THREADS", "1"))
    if threads < 1:
        raise ValueError(f"FASTPALS_BENCH_THREADS must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def warm_process():
    """One small step before any measurement, so that one-time allocations of the libraries (thread pools,
    kernel caches, cuBLAS handles) are not charged to the first configuration's peak memory."""
    shape = CUDA_SHAPE if HAS_CUDA else CPU_SHAPE
    step = TrainingStep(StepConfig("pal_reference", 3, precision=_precisions()[0], device=DEVICE, **shape))
    step()
    del step
    _release()


@pytest.mark.train_step
@pytest.mark.parametrize(("precision", "num_tasks", "variant"), _cases())
def test_train_step(benchmark, step_records, warm_process, precision, num_tasks, variant):
    shape = CUDA_SHAPE if HAS_CUDA else CPU_SHAPE
    if variant == "pal_fused":
        from fastpals_kernels import available

        ok, reason = available()
        if not ok:
            pytest.skip(f"the fused PAL cannot run: {reason}")
    cfg = StepConfig(variant, num_tasks, precision=precision, device=DEVICE, **shape)
    _release()
    cpu_ok, cpu_reason = cpu_peak_supported() if not HAS_CUDA else (False, "")
    rss_before = cpu_rss_bytes() if cpu_ok else None
    cuda_before = torch.cuda.memory_allocated() if HAS_CUDA else 0
    step = TrainingStep(cfg)
    timer = StepTimer(step, DEVICE)
    benchmark.group = f"train-step {cfg.model} {precision} T={num_tasks}"
    process_peak = None
    if HAS_CUDA:
        with CudaPeakMemory(DEVICE) as mem:
            step()  # warm-up: optimizer state, autotuning, first-use allocations
            benchmark.pedantic(timer, rounds=ROUNDS, iterations=1, warmup_rounds=0)
        peak = mem.peak_bytes - cuda_before  # other live configurations excluded
        peak_kind = "cuda_max_memory_allocated"
    elif cpu_ok:
        with CpuPeakMemory() as mem:
            step()
        peak = mem.peak_bytes - rss_before
        process_peak = mem.peak_bytes
        peak_kind = "cpu_peak_rss_growth"
        benchmark.pedantic(timer, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    else:
        step()
        peak, peak_kind = None, f"not measured: {cpu_reason}"
        benchmark.pedantic(timer, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    median = timer.median(warmup=0)
    record = {
        **cfg.to_dict(),
        "device_type": torch.device(DEVICE).type,
        "pal_path": step.pal_path(),
        "median_s": median,
        "times_s": timer.measured(0),
        "rounds": len(timer.measured(0)),
        "peak_bytes": peak,
        "peak_kind": peak_kind,
        "process_peak_rss_bytes": process_peak,
        "parameters": step.parameter_count(),
        "skipped_steps": step.skipped_steps,
        "examples_per_s": cfg.batch / median,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    benchmark.extra_info.update(
        {k: record[k] for k in ("peak_bytes", "peak_kind", "pal_path", "skipped_steps")}
    )
    step_records.append(record)
    if INTERLEAVED_ROUNDS:
        _LIVE.setdefault((precision, num_tasks), {})[variant] = step
    del step, timer
    _release()
    assert median > 0
    # fp16 may skip a step on an overflow; fp32/bf16 steps on random data must all be finite
    if precision != "fp16":
        assert record["skipped_steps"] == 0, f"{variant}: surgery skipped steps on non-finite gradients"


@pytest.mark.train_step
@pytest.mark.parametrize(("precision", "num_tasks"), _groups())
def test_side_by_side_interleaved(benchmark, interleaved_records, precision, num_tasks):
    """Time ratios robust to machine-load drift: the group's configurations (built by ``test_train_step``, which
    ``bench/conftest.py`` orders just before this test) run round robin, one step each per round, the order
    rotated every round; the medians per configuration go into the session's side-by-side ratios."""
    steps = _LIVE.pop((precision, num_tasks), {})
    try:
        if INTERLEAVED_ROUNDS == 0:
            pytest.skip("FASTPALS_BENCH_INTERLEAVED_ROUNDS=0")
        if len(steps) < 2:
            pytest.skip("needs at least two configurations of this group measured in the same session")
        timers = {name: StepTimer(step, DEVICE) for name, step in steps.items()}
        names = list(timers)
        rounds_done = []

        def one_round():
            k = len(rounds_done) % len(names)
            for name in names[k:] + names[:k]:
                timers[name]()
            rounds_done.append(k)

        benchmark.group = f"train-step interleaved {precision} T={num_tasks}"
        benchmark.pedantic(one_round, rounds=INTERLEAVED_ROUNDS, iterations=1, warmup_rounds=0)
        shape = CUDA_SHAPE if HAS_CUDA else CPU_SHAPE
        entry = {
            "model": shape["model"],
            "device_type": torch.device(DEVICE).type,
            "precision": precision,
            "num_tasks": num_tasks,
            "batch": shape["batch"],
            "length": shape["length"],
            "rounds": len(rounds_done),
            "medians_s": {name: t.median(warmup=0) for name, t in timers.items()},
            "times_s": {name: t.measured(0) for name, t in timers.items()},
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        }
        benchmark.extra_info["medians_s"] = entry["medians_s"]
        interleaved_records.append(entry)
    finally:
        del steps
        _release()
