"""One-backward surgery with many tasks on a GPU: plain / buffer / stream steps side by side.

``python -m bench.scaling_gpu [--rehearse] [--out DIR] [--tasks 2,4,8,16]``

The GPU counterpart of ``bench/test_bench_scaling.py`` (the CPU table of docs/surgery-scaling.md); the
``many_tasks`` row of ``python -m bench.peers`` (the ``scaling`` step of ``make gpu-session``) runs it:

- model: fastpals' BERT-base (the shipped config, random weights from seed 0) with the default PALs (one per task)
  and ``T`` binary heads, fp32 weights, bf16 autocast where the GPU has bf16 (else fp16 autocast), AdamW;
- batch: one padded mixed batch of 48 sequences of up to 128 tokens split evenly over the ``T`` tasks;
- variants: ``plain`` (one forward and backward of the summed losses, the step), ``buffer`` (inside
  ``per_task_gradients`` into the ``[T, P]`` fp32 ``TaskGradientBuffer``, ``apply(pcgrad_weights)``, the step),
  ``stream`` (the same into ``StreamingTaskGradients``) and ``stream_kept`` (``--surgery-memory auto``'s
  streaming: the first layers' Linear task rows kept within ``KEEP_SHARE`` of the estimated activations);
- time: the variants interleaved round after round in one process, CUDA events around each step, medians;
- peak: ``torch.cuda.max_memory_allocated`` over one step of each variant after ``reset_peak_memory_stats`` (the
  model and optimizer states included, the same for every variant); ratios against the plain step of the same T.

``--rehearse`` (the CPU rehearsal, CI): MiniLM's config, 6 rows of 16 tokens, T = 2 and 3, one round, on the CPU
(time only; peaks are left out). Writes ``scaling_gpu_<UTC time>.json`` (:func:`bench.common.write_results`:
device, versions, commit, date) and ``scaling_gpu.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.common import results_header, write_results  # noqa: E402

VARIANTS = ("plain", "buffer", "stream", "stream_kept")
GPU_SHAPE = {"model": "bert-base-uncased", "rows": 48, "length": 128, "tasks": (2, 3, 4, 8, 16), "rounds": 5}
REHEARSAL_SHAPE = {"model": "minilm-l6", "rows": 6, "length": 16, "tasks": (2, 3), "rounds": 1}


class SurgerySteps:
    """The plain step and the one-backward surgery step of a bench model (shared by ``bench/test_bench_scaling.py``):
    needs ``model``, ``opt``, ``shared``, ``specific``, ``num_tasks``, ``batch`` (task ids third), ``generator``,
    ``surgery`` (a dict) and ``_loss()``."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    shared: list
    specific: list
    num_tasks: int
    batch: tuple
    generator: torch.Generator
    surgery: dict[str, Any]
    #: ``stream_kept``: StreamingTaskGradients's ``keep_bytes`` (auto's streaming: KEEP_SHARE of the activations)
    keep_bytes: int = 0

    def _loss(self) -> torch.Tensor:
        raise NotImplementedError

    def plain(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self._loss().backward()
        self.opt.step()

    def one_backward(self, mode: str) -> None:
        """``mode``: ``buffer`` (the ``[T, P]`` TaskGradientBuffer), ``stream`` (StreamingTaskGradients, every
        layer the policy streams streamed) or ``stream_kept`` (the first layers' rows kept within ``keep_bytes``,
        as ``--surgery-memory auto`` streams)."""
        from fastpals.surgery import (
            StreamingTaskGradients,
            TaskGradientBuffer,
            pcgrad_weights,
            per_task_gradients,
        )

        surgery = self.surgery.get(mode)
        if surgery is None:
            if mode == "buffer":
                surgery = TaskGradientBuffer(self.shared, self.num_tasks, task_params=self.specific)
            else:
                keep = self.keep_bytes if mode == "stream_kept" else 0
                surgery = StreamingTaskGradients(
                    self.shared, self.num_tasks, task_params=self.specific, keep_bytes=keep
                )
            self.surgery[mode] = surgery
        self.opt.zero_grad(set_to_none=True)
        with per_task_gradients(self.model, surgery, self.batch[2]):
            self._loss().backward()
        if not surgery.apply(pcgrad_weights, generator=self.generator).skipped:
            self.opt.step()


class Steps(SurgerySteps):
    """One model of ``num_tasks`` tasks on ``device``, its AdamW, the batch, and a step per variant."""

    def __init__(self, model_name: str, num_tasks: int, rows: int, length: int, device: torch.device) -> None:
        from fastpals.commands.memory import load_bert_config
        from fastpals.encoder.bert import PALConfig
        from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig, TaskSpec
        from fastpals.surgery import shared_parameters_by_name

        torch.manual_seed(0)
        bert = load_bert_config(model_name)
        tasks = [TaskSpec(f"task{t}", "binary") for t in range(num_tasks)]
        self.model = MultiTaskBert(MultiTaskConfig(bert, tasks, PALConfig(num_tasks=num_tasks))).to(device)
        self.model.train()
        self.device = device
        self.num_tasks = num_tasks
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.shared, self.specific = shared_parameters_by_name(self.model)
        per = max(1, rows // num_tasks)
        b = per * num_tasks
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, bert.vocab_size, (b, length), generator=gen)
        lengths = torch.randint(length // 2, length + 1, (b,), generator=gen)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        task_ids = torch.arange(num_tasks).repeat_interleave(per)
        labels = torch.randint(0, 2, (b,), generator=gen).float()
        self.batch = tuple(t.to(device) for t in (ids * mask, mask, task_ids, labels))
        self.rows_per_task = per
        self.generator = torch.Generator().manual_seed(0)  # the trainer draws PCGrad's order on the CPU
        self.surgery: dict[str, Any] = {}
        cuda = device.type == "cuda"
        self.autocast_dtype = (
            (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if cuda else None
        )
        from fastpals.train.memory_mode import keep_bytes_for

        precision = "fp32" if self.autocast_dtype is None else "bf16"
        self.keep_bytes = keep_bytes_for(bert, b * length, length, precision)
        self.steps: dict[str, Callable[[], None]] = {
            "plain": self.plain,
            "buffer": lambda: self.one_backward("buffer"),
            "stream": lambda: self.one_backward("stream"),
            "stream_kept": lambda: self.one_backward("stream_kept"),
        }

    def _loss(self) -> torch.Tensor:
        ids, mask, task_ids, labels = self.batch
        if self.autocast_dtype is None:
            return self.model.loss(self.model(ids, mask, None, task_ids), labels)[0]
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return self.model.loss(self.model(ids, mask, None, task_ids), labels)[0]


def timed(steps: Steps, rounds: int) -> dict[str, list[float]]:
    """Seconds of each step of every variant, round robin after one warm-up step each (CUDA events on a GPU)."""
    cuda = steps.device.type == "cuda"
    out: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for fn in steps.steps.values():
        fn()
    for _ in range(rounds):
        for name, fn in steps.steps.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out[name].append(start.elapsed_time(end) / 1000.0)
            else:
                t0 = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - t0)
    return out


def peaks(steps: Steps) -> dict[str, int] | None:
    """Peak allocated bytes over one step of each variant (CUDA), or None on the CPU."""
    if steps.device.type != "cuda":
        return None
    out = {}
    for name, fn in steps.steps.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        out[name] = torch.cuda.max_memory_allocated()
    return out


def measure(shape: dict[str, Any], device: torch.device, tasks: tuple[int, ...]) -> dict[str, Any]:
    """Per T: each variant's step times, median, peak, and the ratios to plain."""
    rows: dict[str, Any] = {}
    for t in tasks:
        steps = Steps(shape["model"], t, shape["rows"], shape["length"], device)
        times = timed(steps, shape["rounds"])
        peak = peaks(steps)
        med = {v: statistics.median(times[v]) for v in VARIANTS}
        rows[str(t)] = {
            "rows_per_task": steps.rows_per_task,
            "seconds": times,
            "median_s": med,
            "time_x_plain": {v: med[v] / med["plain"] for v in VARIANTS},
            "stream_time_x_buffer": med["stream"] / med["buffer"],
            "peak_bytes": peak,
            "peak_x_plain": None if peak is None else {v: peak[v] / peak["plain"] for v in VARIANTS},
        }
        del steps
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"shape": {k: list(v) if isinstance(v, tuple) else v for k, v in shape.items()}, "tasks": rows}


def markdown(result: dict[str, Any], header: dict[str, Any]) -> str:
    """The table: per T, the plain step's time and peak, and every variant against it."""
    shape = result["shape"]
    lines = [
        "# One-backward surgery scaling (GPU)",
        "",
        f"- date: {header['date']}, commit: {header['commit']}",
        f"- device: {header['device']}",
        f"- {shape['model']} (random weights), default PALs, {shape['rows']} rows of up to {shape['length']} "
        f"tokens split over T tasks, AdamW, PCGrad; {shape['rounds']} interleaved rounds, medians",
        "",
        "| T | rows/task | plain (ms) | buffer | stream | stream, kept rows (auto) | stream / buffer | "
        "plain peak (MiB) | buffer peak | stream peak | stream, kept rows peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, r in result["tasks"].items():
        x = r["time_x_plain"]
        p, px = r["peak_bytes"], r["peak_x_plain"]
        peak_cells = (
            ["-", "-", "-", "-"]
            if p is None
            else [
                f"{p['plain'] / 2**20:.0f}",
                *(f"{px[v]:.2f}x" for v in ("buffer", "stream", "stream_kept")),
            ]
        )
        lines.append(
            f"| {t} | {r['rows_per_task']} | {r['median_s']['plain'] * 1e3:.1f} | {x['buffer']:.2f}x | "
            f"{x['stream']:.2f}x | {x['stream_kept']:.2f}x | {r['stream_time_x_buffer']:.2f} | "
            + " | ".join(peak_cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes on the CPU (CI)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the JSON and table")
    parser.add_argument("--tasks", default=None, help="comma list of task counts (default: 2,3,4,8,16)")
    args = parser.parse_args(argv)
    shape = dict(REHEARSAL_SHAPE if args.rehearse else GPU_SHAPE)
    if args.tasks:
        shape["tasks"] = tuple(int(t) for t in args.tasks.split(","))
    if args.rehearse:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("bench.scaling_gpu: no CUDA device (use --rehearse on a CPU)", file=sys.stderr)
        return 2
    result = measure(shape, device, tuple(shape["tasks"]))
    os.makedirs(args.out, exist_ok=True)
    path = write_results("scaling_gpu", result, args.out)
    table = markdown(result, results_header("scaling_gpu"))
    with open(os.path.join(args.out, "scaling_gpu.md"), "w", encoding="utf-8") as f:
        f.write(table)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
