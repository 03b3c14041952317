"""PAL forward+backward benchmarks (pytest-benchmark): ``make bench`` or ``pytest bench/test_bench_pal.py``.

- CUDA (skipped elsewhere): the fused PAL (``fastpals_kernels.pal``) against the PyTorch reference
  (``fastpals.functional.pal_reference``) and the best stock composition (per-task cuBLAS matmuls + SDPA,
  ``stock_sdpa``) at BERT-base shapes (B=32, L=128, d=768, d_s=204, 6 heads of 34,
  T=3 and T=16, bf16, ~15% padding, mixed tasks), with the residual add; peak memory is
  ``torch.cuda.max_memory_allocated`` over one forward+backward, minus the memory held before it.
- CPU: the reference PAL at a small shape, and the mixed-task comparison of issue 3: the grouped reference
  against two naive implementations, ``per_example`` (a Python loop running each example with its task's
  weights) and ``all_tasks`` (every task's PAL on the whole batch, then each example picks its task's rows),
  timed interleaved in one run (medians) and reported as ratios. CPU peak memory: each variant runs once in a
  fresh subprocess and reports the growth of its peak resident set (Linux ``VmHWM``, reset after a warm-up
  run) during one forward+backward, with glibc told to mmap (and unmap on free) every block over 64 KiB so
  the resident set follows the live tensors: an OS-level measure, close to but not equal to tensor bytes. Skipped where
  ``/proc/self/clear_refs`` is missing (not Linux).

With ``FASTPALS_BENCH_WRITE=1`` every test writes a JSON record (device, versions, commit, date, shapes, times,
ratios, memory) to ``bench/results/``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from fastpals.functional import attention_reference, pal_reference
from fastpals_kernels.aot import pal_weight_shapes

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HAS_CUDA = torch.cuda.is_available()
HAS_PROC_CLEAR_REFS = os.path.exists("/proc/self/clear_refs")

CPU_SHAPE = {"batch": 16, "length": 64, "d": 256, "d_s": 68, "heads": 2, "tasks": 3}
CUDA_SHAPE = {"batch": 32, "length": 128, "d": 768, "d_s": 204, "heads": 6}


# ----------------------------------------------------------------------------------------------------------------
# inputs and the implementations compared
# ----------------------------------------------------------------------------------------------------------------


def make_inputs(batch, length, d, d_s, tasks, dtype=torch.float32, device="cpu", seed=0):
    """Mixed-task PAL inputs: tasks assigned round robin, ~15% padding, weights N(0, 0.02) like the paper."""
    g = torch.Generator().manual_seed(seed)

    def param(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(device, dtype).requires_grad_()

    h = torch.randn(batch, length, d, generator=g).to(device, dtype).requires_grad_()
    residual = torch.randn(batch, length, d, generator=g).to(device, dtype).requires_grad_()
    lengths = torch.randint(int(0.7 * length), length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(device)
    task_ids = (torch.arange(batch) % tasks).to(device)
    weights = [param(*shape) for shape in pal_weight_shapes(tasks, d, d_s)]
    return h, mask, task_ids, weights, residual


def grouped_reference(h, mask, task_ids, weights, heads, residual):
    return residual + pal_reference(h, mask, task_ids, *weights, heads, True, 0.0)


def stock_sdpa(h, mask, task_ids, weights, heads, residual):
    """The best stock composition: per-task cuBLAS matmuls + SDPA, head dim padded to a multiple of 8 (what the
    dispatch runs on sm_75, ``fastpals.functional.pal_reference(attention="sdpa")``)."""
    return residual + pal_reference(h, mask, task_ids, *weights, heads, True, 0.0, attention="sdpa")


def fused(h, mask, task_ids, weights, heads, residual):
    from fastpals_kernels import pal

    return pal(h, mask, task_ids, *weights, heads, True, 0.0, residual=residual)


def naive_per_example(h, mask, task_ids, weights, heads, residual):
    """One example at a time with its own task's weights (what a per-sample adapter loop does)."""
    we, be, wq, bq, wd, bd = weights
    d_s = we.shape[1]
    outs = []
    for b, t in enumerate(task_ids.tolist()):
        s = F.linear(h[b], we[t], be[t])
        q, k, v = F.linear(s, wq[t], bq[t]).view(1, h.shape[1], 3, heads, d_s // heads).unbind(2)
        ctx = attention_reference(q, k, v, mask[b : b + 1]).reshape(h.shape[1], d_s)
        outs.append(F.gelu(F.linear(ctx, wd[t], bd[t])))
    return residual + torch.stack(outs)


def naive_all_tasks(h, mask, task_ids, weights, heads, residual):
    """Every task's PAL on the whole batch, then each example keeps its own task's output (T x the FLOPs)."""
    we, be, wq, bq, wd, bd = weights
    batch, length, _ = h.shape
    d_s = we.shape[1]
    out = torch.zeros_like(h)
    for t in range(we.shape[0]):
        s = F.linear(h, we[t], be[t])
        q, k, v = F.linear(s, wq[t], bq[t]).view(batch, length, 3, heads, d_s // heads).unbind(2)
        ctx = attention_reference(q, k, v, mask).reshape(batch, length, d_s)
        y = F.gelu(F.linear(ctx, wd[t], bd[t]))
        out = torch.where((task_ids == t)[:, None, None], y, out)
    return residual + out


VARIANTS = {
    "grouped_reference": grouped_reference,
    "stock_sdpa": stock_sdpa,
    "fused": fused,
    "naive_per_example": naive_per_example,
    "naive_all_tasks": naive_all_tasks,
}


def fwd_bwd(fn, inputs, heads):
    """One forward and backward; gradients are freed each time (``autograd.grad``, nothing accumulates)."""
    h, mask, task_ids, weights, residual = inputs
    out = fn(h, mask, task_ids, weights, heads, residual)
    torch.autograd.grad(out, [h, *weights, residual], torch.ones_like(out))


# ----------------------------------------------------------------------------------------------------------------
# measurement helpers
# ----------------------------------------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(fns: dict, device, repeats):
    """Median seconds per callable, measured round robin so that machine noise hits all of them alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up (first-use allocations, kernel compilation)
        fn()
    _sync(device)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def cuda_peak_bytes(fn, device):
    """Peak memory allocated during one call of ``fn``, above what was allocated before it."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def cpu_peak_rss_bytes(variant, shape):
    """Peak RSS growth of one forward+backward of ``variant``, run alone in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--peak-rss", variant, json.dumps(shape)]
    # glibc: serve every allocation over 64 KiB with its own mmap, returned to the OS when freed, so that the
    # resident set follows the live tensors instead of the allocator's cached heap
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=True)
    return int(proc.stdout.strip().splitlines()[-1])


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _child_peak_rss(variant, shape):
    """Print the growth of this process's peak RSS over one forward+backward after a warm-up one. Linux: the
    peak (VmHWM) is reset to the current RSS before the measured run (``/proc/self/clear_refs`` = 5);
    ``ru_maxrss`` is no use here, since Linux carries the parent's high-water mark across fork and exec."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    shape = dict(shape)
    heads = shape.pop("heads")
    inputs = make_inputs(**shape)
    fwd_bwd(VARIANTS[variant], inputs, heads)  # warm-up: first-use buffers of the CPU kernels are not counted
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    fwd_bwd(VARIANTS[variant], inputs, heads)
    print((_status_kib("VmHWM") - before) * 1024)


def _git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def record(name, payload):
    """Write ``bench/results/<name>_<utc time>.json`` when FASTPALS_BENCH_WRITE=1."""
    if os.environ.get("FASTPALS_BENCH_WRITE") != "1":
        return None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    now = datetime.datetime.now(datetime.timezone.utc)
    device = payload.get("device", "cpu")
    doc = {
        "name": name,
        "date": now.isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        **payload,
    }
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}_{now.strftime('%Y%m%dT%H%M%SZ')}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    return path


# ----------------------------------------------------------------------------------------------------------------
# benchmarks
# ----------------------------------------------------------------------------------------------------------------


def test_cpu_reference_pal_fwd_bwd(benchmark):
    shape = dict(CPU_SHAPE)
    heads = shape.pop("heads")
    inputs = make_inputs(**shape)
    benchmark.group = "pal-cpu"
    benchmark.pedantic(fwd_bwd, args=(grouped_reference, inputs, heads), rounds=10, warmup_rounds=1)
    record(
        "pal_cpu_reference", {"device": "cpu", "shape": CPU_SHAPE, "seconds": benchmark.stats.stats.median}
    )


def test_cpu_mixed_task_grouped_vs_naive(benchmark, ratio_table):
    """Issue 3: mixed-task forward+backward time and peak memory, grouped reference vs naive loops, one run."""
    shape = dict(CPU_SHAPE)
    heads = shape.pop("heads")
    inputs = make_inputs(**shape)
    names = ("grouped_reference", "naive_per_example", "naive_all_tasks")
    h, mask, task_ids, weights, residual = inputs
    with torch.no_grad():  # the three implementations compute the same function
        want = grouped_reference(h, mask, task_ids, weights, heads, residual)
        for n in names[1:]:
            torch.testing.assert_close(VARIANTS[n](h, mask, task_ids, weights, heads, residual), want)
    fns = {n: (lambda n=n: fwd_bwd(VARIANTS[n], inputs, heads)) for n in names}
    times = interleaved_medians(fns, torch.device("cpu"), repeats=5)
    peak = {n: cpu_peak_rss_bytes(n, CPU_SHAPE) for n in names} if HAS_PROC_CLEAR_REFS else {}
    info = {
        "device": "cpu",
        "shape": CPU_SHAPE,
        "median_seconds": times,
        "peak_rss_growth_bytes": peak,
        "time_ratio_naive_over_grouped": {n: times[n] / times["grouped_reference"] for n in names[1:]},
        "peak_ratio_naive_over_grouped": {
            n: peak[n] / max(peak["grouped_reference"], 1) for n in peak if n in names[1:]
        },
    }
    benchmark.group = "pal-cpu"
    benchmark.extra_info.update(info)
    benchmark.pedantic(fns["grouped_reference"], rounds=5, warmup_rounds=1)
    path = record("pal_cpu_grouped_vs_naive", info)
    lines = [f"{'implementation':20s} {'median ms':>10s} {'x grouped':>10s} {'peak x grouped':>15s}"]
    for n in names:
        peak_ratio = peak[n] / max(peak["grouped_reference"], 1) if n in peak else float("nan")
        lines.append(
            f"{n:20s} {times[n] * 1e3:10.1f} {times[n] / times['grouped_reference']:10.2f} {peak_ratio:15.2f}"
        )
    ratio_table(f"mixed-task PAL forward+backward, CPU {CPU_SHAPE}" + (f" ({path})" if path else ""), lines)
    assert all(t > 0 for t in times.values())


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (none present)")
@pytest.mark.parametrize("tasks", [3, 16])
def test_cuda_fused_vs_reference_bert_base(benchmark, tasks, ratio_table):
    device = torch.device("cuda")
    heads = CUDA_SHAPE["heads"]
    shape = {k: v for k, v in CUDA_SHAPE.items() if k != "heads"}
    inputs = make_inputs(**shape, tasks=tasks, dtype=torch.bfloat16, device=device)
    names = ("fused", "grouped_reference", "stock_sdpa", "naive_all_tasks")
    fns = {n: (lambda n=n: fwd_bwd(VARIANTS[n], inputs, heads)) for n in names}
    times = interleaved_medians(fns, device, repeats=20)
    peak = {n: cuda_peak_bytes(fns[n], device) for n in names}
    info = {
        "device": "cuda",
        "dtype": "bfloat16",
        "shape": {**CUDA_SHAPE, "tasks": tasks},
        "median_seconds": times,
        "peak_bytes": peak,
        "speedup_fused_over_reference": times["grouped_reference"] / times["fused"],
        "speedup_fused_over_stock_sdpa": times["stock_sdpa"] / times["fused"],
        "peak_ratio_reference_over_fused": peak["grouped_reference"] / max(peak["fused"], 1),
        "time_ratio_naive_all_tasks_over_reference": times["naive_all_tasks"] / times["grouped_reference"],
    }
    benchmark.group = f"pal-cuda-T{tasks}"
    benchmark.extra_info.update(info)
    # each round ends with a synchronize: the kernels' time, not their launch
    benchmark.pedantic(lambda: (fns["fused"](), _sync(device)), rounds=20, warmup_rounds=2)
    path = record(f"pal_cuda_T{tasks}", info)
    lines = [f"{'implementation':20s} {'median ms':>10s} {'x fused':>8s} {'peak MiB':>9s}"]
    for n in names:
        lines.append(
            f"{n:20s} {times[n] * 1e3:10.2f} {times[n] / times['fused']:8.2f} {peak[n] / 2**20:9.0f}"
        )
    ratio_table(
        f"PAL forward+backward, CUDA bf16, BERT-base shapes, T={tasks}" + (f" ({path})" if path else ""),
        lines,
    )


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--peak-rss":
    _child_peak_rss(sys.argv[2], json.loads(sys.argv[3]))
