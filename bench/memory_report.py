"""What fits where: the largest batch that trains on a 16 GB T4, a 40 GB A100 and an 80 GB A100/H100.

``python -m bench.memory_report [--precisions bf16,fp16] [--tasks 3,8] [--variants ...] [--caps ...]`` (CUDA only)

For every configuration of ``bench/training.py`` (plain BERT, BERT + PAL reference / fused, + PCGrad reference /
fastpals, + GEM) at BERT-base shapes (random weights), ``--length`` tokens (128) per example:

1. the peak of ``torch.cuda.max_memory_allocated`` over two training steps (the first allocates the optimizer
   state) at batch 16 and at batch 32, with no cap: the "peak at batch 32" column, and a straight-line fit
   ``peak(b) = a + c b`` that predicts where each cap is reached;
2. for each GPU, the caching allocator is capped with ``torch.cuda.set_per_process_memory_fraction`` at what
   that GPU leaves to PyTorch (see :data:`CAPS`) and the largest batch that runs two steps without running out
   of memory is searched from the prediction: up until a batch fails, then bisection between the largest batch
   that trained and the smallest that failed, to ``--resolution`` (1 = exact). After a failure the model and
   optimizer are rebuilt, so every probe starts from a clean allocator.

A cap larger than the GPU present cannot be emulated: its column says so. ``--rehearse`` (the GPU session's CPU
rehearsal) runs the same search on the CPU at the ``tiny`` model's shapes, the device-only calls swapped for
stand-ins: the peak is the process's resident-set growth (:class:`bench.common.CpuPeakMemory`) and a cap
(scaled by ``--cap-scale``) is enforced by failing a probe whose peak exceeds it as an out-of-memory error would. Results go to
``bench/results/memory_<precision>_<UTC time>.json`` (``python -m bench.report`` merges files of the same device
and precision, newest entry per configuration, into ``REPORT.md`` and a chart). On a machine without CUDA the
command prints why it cannot run and exits with status 1.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from typing import Any

import torch

from bench.common import CpuPeakMemory, CudaPeakMemory, cpu_rss_bytes, write_results
from bench.training import PRECISIONS, VARIANTS, StepConfig, TrainingStep

GIB = 2**30

#: Memory the caching allocator may use on each GPU: the memory CUDA reports (T4 ~14.7 GiB, A100 40GB ~39.4 GiB,
#: A100/H100 80GB ~79.1-79.3 GiB) minus ~0.5-1 GiB for the CUDA context and the cuBLAS/cuDNN workspaces, which
#: torch.cuda.max_memory_allocated does not count but the card must hold.
CAPS: dict[str, int] = {
    "T4 16GB": int(14.0 * GIB),
    "A100 40GB": int(38.5 * GIB),
    "80GB A100/H100": int(78.0 * GIB),
}

METHOD = (
    "Largest batch that runs two full training steps (forward, backward, surgery, AdamW step) with the PyTorch "
    "caching allocator capped by torch.cuda.set_per_process_memory_fraction at the memory each GPU leaves to "
    "PyTorch (T4 14.0 GiB, A100 40GB 38.5 GiB, 80GB cards 78.0 GiB); peak = torch.cuda.max_memory_allocated "
    "over two steps at batch 32, uncapped. BERT-base shapes, random weights, mixed-task batches (round robin), "
    "50-100% real tokens per row."
)


#: the emulated cap of a CPU rehearsal (None: no cap)
_CPU_CAP: dict[str, int | None] = {"bytes": None}


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _set_cap(cap_bytes: int | None, device: torch.device) -> None:
    if device.type != "cuda":  # CPU stand-in: the probe checks its peak against the cap
        _CPU_CAP["bytes"] = cap_bytes
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = 1.0 if cap_bytes is None else min(1.0, cap_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)


class Prober:
    """Runs configurations at given batch sizes, rebuilding the model after an out-of-memory failure."""

    def __init__(self, cfg: StepConfig, steps: int = 2) -> None:
        self.cfg = cfg
        self.steps = steps
        self.device = torch.device(cfg.device)
        self.step: TrainingStep | None = None
        self.log: list[dict[str, Any]] = []

    def _ensure(self) -> TrainingStep:
        if self.step is None:
            self.step = TrainingStep(self.cfg)
        return self.step

    def reset(self) -> None:
        self.step = None
        _release()

    def run(self, batch: int, cap_name: str | None = None) -> tuple[bool, int | None]:
        """Two steps at ``batch``: (trained without running out of memory, peak allocated bytes or None)."""
        failed: str | None = None
        peak = None
        start = time.perf_counter()
        try:
            step = self._ensure()
            step.set_batch(batch)
            _release()
            if self.device.type == "cuda":
                with CudaPeakMemory(self.device) as mem:
                    for _ in range(self.steps):
                        step()
                peak = mem.peak_bytes
            else:  # CPU stand-in: resident-set growth over the steps; over the emulated cap = out of memory
                base = cpu_rss_bytes()
                with CpuPeakMemory() as mem:
                    for _ in range(self.steps):
                        step()
                peak = mem.peak_bytes - base
                cap = _CPU_CAP["bytes"]
                if cap is not None and peak > cap:
                    raise torch.OutOfMemoryError(f"emulated cap: peak {peak} B > cap {cap} B (CPU rehearsal)")
        except torch.OutOfMemoryError as exc:
            failed = str(exc).splitlines()[0][:200]
        if failed is not None:
            self.reset()  # the failed step may have left gradients and buffer rows half-written
        self.log.append(
            {
                "cap": cap_name,
                "batch": batch,
                "ok": failed is None,
                "peak_bytes": peak,
                "seconds": round(time.perf_counter() - start, 3),
                **({"error": failed} if failed else {}),
            }
        )
        return failed is None, peak


def largest_batch(
    fits: Any, predicted: int, max_batch: int, resolution: int = 1, min_batch: int = 1
) -> tuple[int | None, int | None]:
    """Search the largest ``b`` in ``[min_batch, max_batch]`` with ``fits(b)`` true (``fits`` is monotone: true up
    to some batch, false beyond), starting at ``predicted``. Returns ``(largest that fits or None, smallest that
    failed or None)``; the gap between them is at most ``resolution``."""
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    b = max(min_batch, min(max_batch, predicted))
    good: int | None = None
    bad: int | None = None
    delta = max(1, b // 32)
    if fits(b):
        good = b
        while bad is None and good < max_batch:  # walk up, doubling the step, until a batch fails
            nxt = min(max_batch, good + delta)
            if fits(nxt):
                good = nxt
                delta *= 2
            else:
                bad = nxt
    else:
        bad = b
        while good is None and bad > min_batch:  # walk down, doubling the step, until a batch trains
            nxt = max(min_batch, bad - delta)
            if fits(nxt):
                good = nxt
            else:
                bad = nxt
                delta *= 2
        if good is None:
            return None, bad
    while bad is not None and bad - good > resolution:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, bad


def measure(
    cfg: StepConfig,
    caps: dict[str, int],
    max_batch: int,
    resolution: int,
) -> dict[str, Any]:
    """Peak at batch 16 and 32 (uncapped) and the largest batch under each cap, for one configuration."""
    device = torch.device(cfg.device)
    total = _total_memory(device)
    prober = Prober(cfg)
    _set_cap(None, device)
    ok16, peak16 = prober.run(16)
    ok32, peak32 = prober.run(32)
    entry: dict[str, Any] = {
        "variant": cfg.variant,
        "num_tasks": cfg.num_tasks,
        "precision": cfg.precision,
        "model": cfg.model,
        "length": cfg.length,
        "peak_at_16_bytes": peak16,
        "peak_at_32_bytes": peak32,
        "max_batch": {},
    }
    if prober.step is not None:
        entry["pal_path"] = prober.step.pal_path()
        entry["parameters"] = prober.step.parameter_count()
    slope = (peak32 - peak16) / 16 if ok16 and ok32 and peak32 > peak16 else None
    entry["fit"] = (
        None if slope is None else {"intercept_bytes": peak32 - 32 * slope, "bytes_per_example": slope}
    )
    for name, cap in sorted(caps.items(), key=lambda kv: kv[1]):
        if cap > 0.98 * total:
            entry["max_batch"][name] = {
                "batch": None,
                "note": f"cap {cap / GIB:.1f} GiB > this GPU ({total / GIB:.1f} GiB)",
            }
            continue
        _set_cap(cap, device)
        prober.reset()
        if slope is not None:
            predicted = max(1, math.floor((0.97 * cap - entry["fit"]["intercept_bytes"]) / slope))
        else:
            predicted = 32
        good, bad = largest_batch(
            lambda b, n=name: prober.run(b, n)[0], predicted, max_batch, resolution, min_batch=cfg.num_tasks
        )  # a batch holds at least one example per task
        entry["max_batch"][name] = {
            "batch": good,
            "first_failing_batch": bad,
            "predicted": predicted,
            "cap_bytes": cap,
            **(
                {"note": f"nothing up to batch {max_batch} failed"}
                if bad is None and good is not None
                else {}
            ),
            **({"note": "batch 1 does not fit"} if good is None else {}),
        }
        if good is None:
            entry["max_batch"][name]["batch"] = None
    _set_cap(None, device)
    prober.reset()
    entry["probes"] = prober.log
    return entry


def _csv(value: str, allowed: tuple, what: str, cast: Any = str) -> list:
    items = [cast(v.strip()) for v in value.split(",") if v.strip()]
    bad = [v for v in items if allowed and v not in allowed]
    if bad or not items:
        raise SystemExit(f"error: --{what} {value!r}: choose from {', '.join(map(str, allowed))}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory_report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--precisions", default="bf16,fp16", help=f"comma list of {', '.join(PRECISIONS)}")
    parser.add_argument("--tasks", default="3,8", help="comma list of task counts")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of configurations")
    parser.add_argument("--caps", default=",".join(CAPS), help="comma list of GPUs to emulate")
    parser.add_argument("--length", type=int, default=128, help="tokens per example")
    parser.add_argument("--max-batch", type=int, default=4096, help="largest batch tried")
    parser.add_argument("--resolution", type=int, default=1, help="search until the gap is this (1: exact)")
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="CPU rehearsal: tiny model, fp32, resident-set peaks, emulated caps",
    )
    parser.add_argument(
        "--cap-scale", type=float, default=1.0, help="multiply every cap (rehearsal: tiny caps)"
    )
    args = parser.parse_args(argv)
    if args.rehearse:
        args.precisions = "fp32"
    elif not torch.cuda.is_available():
        print("memory report not run: it needs a CUDA GPU (none here) to cap and measure", file=sys.stderr)
        return 1
    precisions = _csv(args.precisions, PRECISIONS, "precisions")
    tasks = _csv(args.tasks, (), "tasks", int)
    variants = _csv(args.variants, VARIANTS, "variants")
    cap_names = _csv(args.caps, tuple(CAPS), "caps")
    caps = {name: int(CAPS[name] * args.cap_scale) for name in cap_names}
    from fastpals_kernels import available

    triton_ok, triton_reason = available()
    device = torch.device("cpu" if args.rehearse else "cuda")
    model, device_name = ("tiny", "cpu") if args.rehearse else ("bert-base", "cuda")
    total = _total_memory(device)
    for precision in precisions:
        entries = []
        for t in tasks:
            for variant in variants:
                if variant == "pal_fused" and (not triton_ok or args.rehearse):
                    print(f"skip {variant} T={t}: {triton_reason}", file=sys.stderr)
                    continue
                cfg = StepConfig(variant, t, 32, args.length, precision, model, device_name)
                start = time.perf_counter()
                entry = measure(cfg, caps, args.max_batch, args.resolution)
                entry["seconds"] = round(time.perf_counter() - start, 1)
                entries.append(entry)
                fits = ", ".join(f"{k}: {v['batch']}" for k, v in entry["max_batch"].items())
                peak = entry["peak_at_32_bytes"]
                peak_text = "n/a" if peak is None else f"{peak / GIB:.2f} GiB"
                print(
                    f"{precision} T={t} {variant}: peak@32 {peak_text}; {fits} ({entry['seconds']} s)",
                    flush=True,
                )
        path = write_results(
            f"memory_{precision}",
            {
                "suite": "memory_report",
                "precision": precision,
                "length": args.length,
                "method": METHOD,
                "device_total_memory_bytes": total,
                "caps": {
                    name: {"cap_bytes": cap, "fraction": min(1.0, cap / total)} for name, cap in caps.items()
                },
                "entries": entries,
            },
            args.out,
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
