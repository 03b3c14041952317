"""The memory planner checked against real steps: ``fastpals memory``'s predicted peak against a measured one.

``python -m bench.memory_validate [--rehearse] [--out DIR]``

For each case, the predicted peak is :func:`fastpals.commands.memory.trace_step` (what ``fastpals memory`` prints: the
real update on fake tensors with DeepSpeed's model states), and the measured peak is one real update of the
same model on the same micro-batches (:func:`fastpals.commands.memory.step_model`, :func:`fastpals.commands.memory.step_micro_batches`)
through the same step function, :func:`fastpals.train.step.run_update`, after a first update (so the optimizer
states exist, as in training):

- on CUDA: BERT-base (the shipped config, random weights), the default PALs, 3 tasks (sst, para, sts), batch 32 of
  128 tokens, fp16 and bf16, no surgery and one-backward PCGrad (``--surgery-memory buffer``). The update runs on a
  DeepSpeed engine built as the trainer builds it (the shipped ``gpu_<precision>_zero<stage>.json`` config at the
  planner's ZeRO stage, the trainer's AdamW groups, :func:`fastpals.train.step.deepspeed_surgery_buffer`), and the
  measured peak is ``torch.cuda.max_memory_allocated`` over the update, after ``torch.cuda.reset_peak_memory_stats``.
  Each case runs in its own process, so no engine of an earlier case is still allocated.
- ``--rehearse`` (the CPU rehearsal of ``make gpu-session``, CI): the MiniLM config at 16 tokens, batch 6, fp32
  (the trainer's CPU default), the same two surgery settings; the measured side is
  :func:`fastpals.commands.memory.measure_step`, the live-tensor tracker of the planner on real CPU tensors (the CPU
  validation of ``tests/test_memory.py``). It exercises every part but DeepSpeed and the CUDA allocator.

Writes ``memory_validate_<UTC time>.json`` (:func:`bench.common.write_results`: date, commit, device, versions)
with one entry per case: ``predicted_bytes``, ``measured_bytes``, ``ratio`` (predicted / measured), the predicted
breakdown at the peak, how it was measured, or ``error`` when the case failed (exit status 1). The GPU session's
``memory`` step runs it before ``bench.memory_report`` and merges both into ``memory.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from typing import Any

import torch

#: the GPU cases (docs/memory.md's setting): model, batch, tokens per example; precisions x surgery
GPU_SHAPE = {"model": "bert-base-uncased", "batch_size": 32, "max_length": 128}
GPU_PRECISIONS = ("fp16", "bf16")
#: the CPU rehearsal's: tiny shapes, the trainer's CPU precision
REHEARSAL_SHAPE = {"model": "minilm-l6", "batch_size": 6, "max_length": 16}
REHEARSAL_PRECISIONS = ("fp32",)
SURGERIES = ("none", "pcgrad")
#: seconds one CUDA case may take (it runs in its own process, killed at this limit)
CASE_TIMEOUT_S = 150.0
TASKS = ("sst", "para", "sts")


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: the planner's :class:`fastpals.commands.memory.StepSpec` fields and the batch."""

    model: str
    batch_size: int
    max_length: int
    precision: str
    surgery: str

    def spec(self) -> Any:
        from fastpals.commands.memory import StepSpec

        return StepSpec(model=self.model, tasks=TASKS, max_length=self.max_length, precision=self.precision,
                        pal="default", surgery=self.surgery, surgery_mode="one_backward",
                        surgery_memory="buffer")  # fmt: skip

    @property
    def name(self) -> str:
        return f"{self.model} {self.precision} {'pcgrad one-backward' if self.surgery != 'none' else 'plain'}"


def cases(rehearse: bool) -> list[Case]:
    """The cases of a GPU session (``rehearse``: of its CPU rehearsal)."""
    shape, precisions = (REHEARSAL_SHAPE, REHEARSAL_PRECISIONS) if rehearse else (GPU_SHAPE, GPU_PRECISIONS)
    return [Case(**shape, precision=p, surgery=s) for p in precisions for s in SURGERIES]


def _to_device(mb: Any, device: torch.device) -> Any:
    def move(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v

    return dataclasses.replace(mb, inputs={k: move(v) for k, v in mb.inputs.items()}, labels=move(mb.labels))


def measure_cuda(case: Case) -> dict[str, Any]:
    """The peak of ``torch.cuda.max_memory_allocated`` over one update of ``case`` on a DeepSpeed engine (after a
    first update), as the trainer runs it: ``{"measured_bytes", "allocated_before_bytes", "reserved_bytes",
    "engine"}``."""
    from fastpals.commands.memory import step_micro_batches, step_model
    from fastpals.surgery import AGGREGATORS
    from fastpals.train.dsconfig import check_ds_config, initialize, load_ds_config
    from fastpals.train.optimizer_setup import make_optimizer, optimizer_param_groups
    from fastpals.train.step import Surgery, deepspeed_surgery_buffer, run_update

    spec = case.spec()
    config_name = f"gpu_{spec.precision}_zero{spec.stage}.json"
    config = check_ds_config(load_ds_config(config_name), case.batch_size, 1, surgery=spec.surgery, cuda=True)
    model = step_model(spec, cast=False)  # fp32: DeepSpeed casts it, as in training
    optimizer = make_optimizer(optimizer_param_groups(model, 2e-5, 2e-5, 2e-5, 0.01), "adamw")
    engine, *_ = initialize(model, optimizer, None, config)
    surgery = None
    if spec.surgery != "none":
        rows = torch.bfloat16 if spec.rows_dtype == "bf16" else torch.float32
        buffer = deepspeed_surgery_buffer(engine.module, len(spec.tasks), spec.stage, rows, memory="buffer")
        surgery = Surgery(buffer, AGGREGATORS[spec.surgery], torch.Generator().manual_seed(0))
    strategy = "none" if surgery is None else "one_backward"
    device = engine.device
    for _ in range(2):  # the first update makes the optimizer states; the second is measured
        micro = [_to_device(mb, device) for mb in step_micro_batches(spec, engine.module, case.batch_size)]
        gc.collect()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_update(engine, micro, strategy, surgery=surgery)
        torch.cuda.synchronize(device)
        del micro
    return {
        "measured_bytes": torch.cuda.max_memory_allocated(device),
        "allocated_before_bytes": before,
        "reserved_bytes": torch.cuda.max_memory_reserved(device),
        "measured_by": f"torch.cuda.max_memory_allocated over the second update of run_update on a DeepSpeed "
        f"engine ({config_name}, AdamW)",
    }


def measure_cpu(case: Case) -> dict[str, Any]:
    """The live-tensor peak of one update of ``case`` on real CPU tensors (:func:`fastpals.commands.memory.measure_step`)."""
    from fastpals.commands.memory import measure_step

    return {
        "measured_bytes": measure_step(case.spec(), case.batch_size).peak_bytes,
        "measured_by": "live tensor bytes of the second update of run_update on real CPU tensors "
        "(fastpals.commands.memory.measure_step: the planner's tracker, the trainer's AdamW)",
    }


def run_case(case: Case, device: str) -> dict[str, Any]:
    """Predict and measure ``case`` (``device``: ``cuda`` or ``cpu``): the entry of the results file."""
    from fastpals.commands.memory import trace_step

    entry: dict[str, Any] = {
        "case": case.name,
        **dataclasses.asdict(case),
        "tasks": list(TASKS),
        "pal": "default",
    }
    start = time.perf_counter()
    trace = trace_step(case.spec(), case.batch_size)
    entry.update(predicted_bytes=trace.peak_bytes, predicted_at_peak=trace.at_peak,
                 predicted_phase=trace.peak_phase, trace_seconds=round(trace.seconds, 2))  # fmt: skip
    measured = measure_cuda(case) if device == "cuda" else measure_cpu(case)
    entry.update(measured)
    entry["ratio"] = trace.peak_bytes / measured["measured_bytes"]
    entry["seconds"] = round(time.perf_counter() - start, 2)
    return entry


def _isolated(case: Case, timeout_s: float = CASE_TIMEOUT_S) -> dict[str, Any]:
    """:func:`run_case` on CUDA in a fresh process (the allocator holds nothing of an earlier case), killed with its
    children after ``timeout_s`` seconds (the entry then says so and the next case runs)."""
    from bench.common import run_killable

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "bench.memory_validate", "--case", json.dumps(dataclasses.asdict(case))]
    proc = run_killable(cmd, timeout_s, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    if proc.timed_out:
        error = f"killed after {timeout_s:g} s (--case-timeout-s): {' | '.join(tail)}"
    else:
        error = f"exit {proc.returncode}: {' | '.join(tail)}"
    return {"case": case.name, **dataclasses.asdict(case), "error": error}


def validate(
    rehearse: bool, out: str | None = None, case_timeout_s: float = CASE_TIMEOUT_S
) -> tuple[Any, list[dict[str, Any]]]:
    """Run every case, write the results file into ``out`` (default ``bench/results``); returns its path and the
    entries."""
    from bench.common import write_results

    device = "cpu" if rehearse else "cuda"
    versions: dict[str, Any] = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    entries: list[dict[str, Any]] = []
    path = None
    for case in cases(rehearse):
        if device == "cuda":
            entry = _isolated(case, case_timeout_s)
        else:
            try:
                entry = run_case(case, device)
            except Exception as exc:  # noqa: BLE001 - recorded per case, the others still run
                entry = {
                    "case": case.name,
                    **dataclasses.asdict(case),
                    "error": f"{type(exc).__name__}: {exc}",
                }
        entries.append(entry)
        if "error" in entry:
            print(f"{case.name}: FAILED {entry['error']}", flush=True)
        else:
            print(f"{case.name} batch {case.batch_size} x {case.max_length}: predicted "
                  f"{entry['predicted_bytes'] / 2**20:.1f} MiB, measured {entry['measured_bytes'] / 2**20:.1f} MiB, "
                  f"ratio {entry['ratio']:.3f} ({entry['seconds']} s)", flush=True)  # fmt: skip
        # rewritten after every case: a run killed at the session's budget keeps the cases it finished
        path = write_results("memory_validate", {
            "suite": "memory_validate", "rehearsal": rehearse, "measured_on": device, **versions,
            "method": "predicted = fastpals.commands.memory.trace_step (fake tensors, DeepSpeed's model states); measured "
            "= one real update of the same model and micro-batches through fastpals.train.step.run_update after a "
            "first update; ratio = predicted / measured",
            "entries": entries,
        }, out, path)  # fmt: skip
    return path, entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory_validate", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--rehearse", action="store_true", help="the CPU rehearsal: tiny shapes, fp32, live tensors"
    )
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    parser.add_argument(
        "--case-timeout-s",
        type=float,
        default=CASE_TIMEOUT_S,
        help="seconds a CUDA case's process may run before it is killed and reported",
    )
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one CUDA case, JSON on stdout
    args = parser.parse_args(argv)
    if args.case is not None:
        entry = run_case(Case(**json.loads(args.case)), "cuda")
        print(json.dumps(entry))
        return 0
    if not args.rehearse and not torch.cuda.is_available():
        print("memory validation not run: it needs a CUDA GPU (none here); --rehearse runs it on the CPU",
              file=sys.stderr)  # fmt: skip
        return 1
    path, entries = validate(args.rehearse, args.out, args.case_timeout_s)
    print(f"wrote {path}")
    return 1 if any("error" in e for e in entries) else 0


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
