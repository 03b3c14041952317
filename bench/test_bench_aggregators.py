"""Every Gram weighting of ``fastpals.surgery.AGGREGATORS`` in a whole training step, side by side with PCGrad:
``pytest bench/test_bench_aggregators.py --benchmark-only``.

Model, batches and step as ``bench/test_bench_surgery.py`` (``fastpals.MultiTaskBert`` from all-MiniLM-L6-v2, no
PALs, heads sst / para / sts, 3 tasks x 16 sentences of 32 tokens, AdamW):

- ``plain``: one forward + backward per task (the summed task losses), then the optimizer step;
- one variant per registry name: the same forwards/backwards, each followed by ``TaskGradientBuffer.capture``,
  then ``apply(weighting)`` with the weighting of :func:`fastpals.surgery.make_weighting` (default options), and
  the step. ``pcgrad`` is the reference the goal is stated against: every method at most 1.05x its step.

All variants run interleaved, round after round, in one process (medians of wall-clock and process-CPU time).
Separately, the weight solve alone (``fn(gram)``) is timed on the Gram matrix of the step's real task gradients
(median of many calls): the only part of a step that differs between methods.

``FASTPALS_BENCH_WRITE=1`` writes ``bench/results/aggregators_<device>_<UTC time>.json`` (device, versions, commit,
date: :func:`bench.common.write_results`) and the same table as Markdown beside it.
``FASTPALS_BENCH_ROUNDS`` sets the rounds (default 3), ``FASTPALS_BENCH_AGG_BATCH`` the sentences per task
(default 16).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_bench_surgery  # noqa: E402
from common import should_write, write_results  # noqa: E402
from test_bench_surgery import NUM_TASKS, build, interleaved_times, task_loss  # noqa: E402

# smaller batches make more rounds affordable on a loaded CPU (build() reads these module globals)
test_bench_surgery.BATCH = int(os.environ.get("FASTPALS_BENCH_AGG_BATCH", str(test_bench_surgery.BATCH)))

from fastpals.surgery import AGGREGATORS, TaskGradientBuffer, make_weighting, shared_parameters_by_name  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
GOAL = 1.05


def _sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


class AggRunner:
    """One model, one AdamW, one buffer; a step function for ``plain`` and for every registry name."""

    def __init__(self, device: str) -> None:
        self.model, self.batches = build(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.shared, self.specific = shared_parameters_by_name(self.model)
        self.buffer = TaskGradientBuffer(self.shared, NUM_TASKS, task_params=self.specific)
        self.generator = torch.Generator().manual_seed(0)
        self.weightings = {name: make_weighting(name)[0] for name in AGGREGATORS}
        self.last_gram: torch.Tensor | None = None
        self.skipped = 0
        self.steps = {"plain": self.plain}
        for name in AGGREGATORS:
            self.steps[name] = self._surgery_step(name)

    def plain(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for batch in self.batches:
            task_loss(self.model, batch).backward()
        self.opt.step()

    def _surgery_step(self, name: str):
        fn = self.weightings[name]

        def step() -> None:
            self.opt.zero_grad(set_to_none=True)
            for t, batch in enumerate(self.batches):
                task_loss(self.model, batch).backward()
                self.buffer.capture(t)
            result = self.buffer.apply(fn, generator=self.generator)
            self.last_gram = result.gram
            if result.skipped:
                self.skipped += 1
            else:
                self.opt.step()

        return step


def solve_seconds(fn, gram: torch.Tensor, reps: int) -> tuple[float, float]:
    """Median and minimum seconds of ``fn(gram)`` over ``reps`` calls (after two warm-up calls)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        fn(gram, generator=gen)
    _sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(gram, generator=gen)
        _sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out), min(out)


def paired_ratios(steps: dict, rounds: int) -> dict[str, list[float]]:
    """Each round, every variant's step right after a PCGrad step: the ratios of the adjacent pairs (load that
    drifts over seconds cancels out)."""
    out: dict[str, list[float]] = {k: [] for k in steps if k != "pcgrad"}
    for _ in range(rounds):
        for name in out:
            t0 = time.perf_counter()
            steps["pcgrad"]()
            _sync()
            t1 = time.perf_counter()
            steps[name]()
            _sync()
            out[name].append((time.perf_counter() - t1) / (t1 - t0))
    return out


def markdown(result: dict) -> str:
    lines = [
        f"# Gram weightings in a MiniLM training step ({result['device_label']})",
        "",
        f"T = {NUM_TASKS} tasks x {test_bench_surgery.BATCH} sentences x {test_bench_surgery.LENGTH} tokens, all-MiniLM-L6-v2 (P(shared) = "
        f"{result['shared_elements']}), AdamW; {result['rounds']} interleaved rounds, "
        f"{result['threads']} torch threads. Commit {result['commit']}, torch {result['torch']}, {result['date']}.",
        "Step ratios: medians (and minima) of wall-clock and medians of process-CPU time over the rounds; the solve is "
        "`fn(gram)` alone on the step's float32 Gram (30 calls). Adjacent pairs: each round, every variant's step "
        "right after a PCGrad step, median of the pair ratios. "
        + (
            f"Load average (1 min) before / after the run: {result['load_before']:.2f} / {result['load_after']:.2f} "
            f"on {os.cpu_count()} cores (this benchmark alone gives about 1-2); a higher load means other jobs "
            "shared the machine: compare within one run."
            if "load_before" in result
            else "Compare within one run."
        ),
        "",
        "| method | step median (s) | x plain | x pcgrad, adjacent pairs (median) | x pcgrad median (wall) "
        "| x pcgrad min (wall) | x pcgrad median (CPU) | solve alone median / min (ms) | solve / pcgrad step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["methods"].items():
        solve = r.get("solve_ms")
        lines.append(
            f"| {name} | {r['wall_median_s']:.2f} | {r['x_plain_wall']:.3f} | "
            + (f"{r['x_pcgrad_paired_median']:.3f} | " if "x_pcgrad_paired_median" in r else "1 | ")
            + (
                f"{r['x_pcgrad_wall']:.3f} | {r['x_pcgrad_wall_min']:.3f} | {r['x_pcgrad_cpu']:.3f} | "
                if name != "plain"
                else "- | - | - | "
            )
            + (
                f"{solve:.3f} / {r['solve_min_ms']:.3f} | {r['solve_over_pcgrad_step']:.5f} |"
                if solve is not None
                else "- | - |"
            )
        )
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def agg_runner():
    return AggRunner("cuda" if HAS_CUDA else "cpu")


def test_aggregators_side_by_side(benchmark, agg_runner, ratio_table):
    """Interleaved step times of plain and of every registry method; weight-solve times alone."""
    rounds = int(os.environ.get("FASTPALS_BENCH_ROUNDS", "3"))
    measured: dict = {}
    load_before = os.getloadavg()[0]

    def compare() -> None:
        measured["times"] = interleaved_times(agg_runner.steps, rounds)
        measured["paired"] = paired_ratios(agg_runner.steps, rounds)

    benchmark.pedantic(compare, rounds=1, iterations=1)
    wall, cpu = measured["times"]
    gram = agg_runner.last_gram
    assert gram is not None and agg_runner.skipped == 0
    med = {k: statistics.median(v) for k, v in wall.items()}
    low = {k: min(v) for k, v in wall.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    solves = {name: solve_seconds(fn, gram, reps=30) for name, fn in agg_runner.weightings.items()}
    device_label = torch.cuda.get_device_name() if HAS_CUDA else "CPU"
    methods: dict = {}
    for name in ("plain", *AGGREGATORS):
        r = {
            "wall_s": wall[name],
            "cpu_s": cpu[name],
            "wall_median_s": med[name],
            "cpu_median_s": cpu_med[name],
            "x_plain_wall": med[name] / med["plain"],
            "x_plain_cpu": cpu_med[name] / cpu_med["plain"],
            "wall_min_s": low[name],
            "x_plain_wall_min": low[name] / low["plain"],
        }
        if name != "pcgrad":
            r["x_pcgrad_paired"] = measured["paired"][name]
            r["x_pcgrad_paired_median"] = statistics.median(measured["paired"][name])
        if name != "plain":
            r["x_pcgrad_wall"] = med[name] / med["pcgrad"]
            r["x_pcgrad_cpu"] = cpu_med[name] / cpu_med["pcgrad"]
            r["x_pcgrad_wall_min"] = low[name] / low["pcgrad"]
            r["solve_ms"] = solves[name][0] * 1e3
            r["solve_min_ms"] = solves[name][1] * 1e3
            r["solve_over_pcgrad_step"] = solves[name][0] / med["pcgrad"]
        methods[name] = r
    result = {
        "device_label": device_label,
        "num_tasks": NUM_TASKS,
        "batch": test_bench_surgery.BATCH,
        "length": test_bench_surgery.LENGTH,
        "shared_elements": sum(p.numel() for p in agg_runner.shared),
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "goal_x_pcgrad": GOAL,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "gram": gram.double().cpu().tolist(),
        "methods": methods,
    }
    lines = [
        f"{'method':11s} {'step s':>7s} {'x plain':>8s} {'x pcg pair':>10s} {'x pcgrad':>9s} {'x pcg min':>9s} "
        f"{'x pcg cpu':>9s} {'solve ms':>9s}"
    ]
    for name, r in methods.items():
        lines.append(
            f"{name:11s} {r['wall_median_s']:7.2f} {r['x_plain_wall']:8.3f} "
            f"{r.get('x_pcgrad_paired_median', 1.0):10.3f} "
            f"{r.get('x_pcgrad_wall', float('nan')):9.3f} {r.get('x_pcgrad_wall_min', float('nan')):9.3f} "
            f"{r.get('x_pcgrad_cpu', float('nan')):9.3f} "
            f"{r.get('solve_ms', float('nan')):9.3f}"
        )
    ratio_table(f"Gram weightings in a whole step, x PCGrad ({rounds} interleaved rounds)", lines)
    benchmark.extra_info.update({k: {"x_pcgrad_wall": v.get("x_pcgrad_wall")} for k, v in methods.items()})
    if should_write():
        stem = "aggregators_" + ("cuda" if HAS_CUDA else "cpu")
        path = write_results(stem, result)
        doc = json.loads(path.read_text())
        result.update(
            commit=doc["commit"], date=doc["date"], device_label=doc["device"], torch=torch.__version__
        )
        path.with_suffix(".md").write_text(markdown(result))
    # the solve is the only per-method work: it must stay within the goal's 5% of PCGrad's step
    for name in AGGREGATORS:
        assert solves[name][0] <= (GOAL - 1.0) * med["pcgrad"], (name, solves[name], med["pcgrad"])
