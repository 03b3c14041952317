"""The ``fastpals memory`` command line (:func:`main`), the predicted largest-batch table of ``docs/memory.md``
(:func:`memory_table`, ``--table``) and the charts (``--chart``, drawn by :mod:`fastpals.commands.memory_chart`).
What a step holds and its peak are :mod:`fastpals.commands.memory`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fastpals.commands.memory import (
    BUFFER_DTYPES,
    CATEGORY_TEXT,
    DEVICES,
    GIB,
    PRECISIONS,
    SURGERY_MEMORIES,
    SURGERY_MODES,
    StepSpec,
    format_plan,
    largest_batches,
    plan_memory,
)
from fastpals.commands.memory_chart import plot_plan, plot_table
from fastpals.surgery import AGGREGATORS
from fastpals.train.args import PAL_PRESETS

__all__ = ["DOCS_COMMAND", "MEASURED_NOTES", "main", "memory_table"]


# ----------------------------------------------------------------------------------------------------------------
# docs/memory.md
# ----------------------------------------------------------------------------------------------------------------
DOCS_COMMAND = "fastpals memory --table docs/memory.md --chart docs/memory.png"
_TABLE_VARIANTS = (  # label, --pal, --surgery, --activation-checkpointing
    ("plain", "none", "none", False),
    ("PAL", "default", "none", False),
    ("PAL + PCGrad", "default", "pcgrad", False),
    ("PAL, checkpointed", "default", "none", True),
    ("PAL + PCGrad, checkpointed", "default", "pcgrad", True),
)
_TABLE_MODELS = ("bert-base-uncased", "bert-large-uncased")
_TABLE_GPUS = ("t4", "a100-40", "a100-80", "h100-80")


#: measured on the CPU (not produced by the command; kept in docs/memory.md below the predicted table)
MEASURED_NOTES = (
    "## Measured on the CPU: surgery rows and activation checkpointing",
    "",
    "2026-11-25, 2-core AMD EPYC shared with other jobs (load average about 14: timings would not mean much, "
    "memory does), torch 2.13 CPU, MiniLM-L6 (P = 22,713,216 shared elements), tasks sst, para, sts.",
    "",
    "**One-backward PCGrad against the plain mixed step.** The surgery rows are held per shared parameter, "
    "made when the backward reaches that parameter (while autograd frees the activations, as plain training's "
    "gradients are made) and freed once its combined gradient is handed over: aliased as `.grad` (the last row, "
    "where the rows have the gradient's dtype) or copied by the setter into DeepSpeed's fp32 gradient partition "
    "one parameter at a time (bf16 rows under bf16 training), so no `[P]` copy of the update exists beside the "
    "gradient the optimizer reads, and no row lives through the next forward.",
    "",
    "| measure | plain | PCGrad, fp32 rows | PCGrad, bf16 rows | before (fp32 / bf16 rows) |",
    "|---|---|---|---|---|",
    "| peak RSS, `bench/test_bench_onebackward.py` children (3 x 16 examples of <= 32 tokens, fp32 training) "
    "| 930 MiB | 1013 MiB (1.09x) | 936 MiB (1.01x) | 1.25x / 1.13x |",
    "| live tensor storage, `measure_step` (48 x 32 tokens, fp32, ZeRO-0) | 682 MiB | 685 MiB (1.004x) | "
    "684 MiB (1.003x) | 943 MiB (1.38x) / 813 MiB (1.19x) |",
    "| predicted, `fastpals memory` (48 x 32 tokens, bf16, ZeRO-1; default rows = bf16) | 552 MiB | 702 MiB "
    "(1.27x) | 557 MiB (1.01x) | - |",
    "",
    "Where the parameters rather than the activations make the peak (small batches: MiniLM fp32 at 6 x 32 "
    "tokens), the end of the backward holds T rows where plain training holds one gradient: 1.45x with fp32 "
    "rows there. bf16 rows change the PCGrad update by 1.7e-3 relative to fp32 rows (L2, MiniLM, "
    "`tests/test_per_task_grads.py::test_bf16_buffer_update_close_to_fp32`); the Gram and the combination "
    "accumulate in fp32. `--surgery-buffer-dtype fp32` keeps fp32 rows.",
    "",
    "**Activation checkpointing** (`--activation-checkpointing`): MiniLM with PALs, plain mixed step of 8 x 64 "
    "tokens, fp32: live tensor storage measured 438.7 MiB without, 389.1 MiB with (the prediction within 1e-7 "
    "of both); `tests/test_activation_checkpointing.py`. Predicted for 48 x 64 tokens, bf16, ZeRO-1: plain 838 "
    "-> 485 MiB, one-backward PCGrad 845 -> 551 MiB. Per-task gradients are unchanged within 1e-6.",
    "",
    "## Checked against real steps",
    "",
    "`make gpu-session` (its `memory_validate` step: `python -m bench.memory_validate`, see docs/gpu-session.md) "
    "compares the predicted peak with `torch.cuda.max_memory_allocated` over one real training step: "
    "BERT-base (shipped config, random weights), default PALs, tasks sst, para, sts, batch 32 x 128 tokens, "
    "fp16 and bf16, plain and one-backward PCGrad, each on a DeepSpeed engine built as the trainer builds it "
    "(the shipped `gpu_<precision>_zero1.json`, AdamW), the second update measured. It records predicted, "
    "measured and their ratio per case in the session's `memory.json`, with the device, torch and triton "
    "versions, commit and date. No GPU has been lent yet, so no ratio is recorded here.",
    "",
    "On the CPU the same comparison, with the planner's live-tensor tracker on real tensors as the measured "
    "side (fp32, ZeRO-0: `fastpals.memory.measure_step`), agrees within 10% for MiniLM at two batch sizes "
    "(`tests/test_memory.py`) and to 0.1% at the rehearsal's 6 x 16 tokens.",
    "",
    "**DeepSpeed's gradient buckets** are counted (`DeepSpeed gradient buckets` in the breakdown, "
    "`gradient_buckets` and `at_peak.buckets` in `--json`): DeepSpeed 0.19.8's ZeRO-1/2 optimizer "
    "(`DeepSpeedZeroOptimizer.setup_buckets`, `deepspeed/runtime/zero/stage_1_and_2.py`) allocates, at the first "
    "gradient of each backward and with `contiguous_gradients` (its default), a flat buffer of exactly "
    "`reduce_bucket_size` elements (not capped by the model's size), a second one with `overlap_comm`, in the "
    "gradient reduction dtype (the model's dtype; the accumulation dtype where it differs at ZeRO-1), and frees "
    "them at the backward's epilogue (`_release_ipg_buffers`). None at ZeRO-0, nor with bf16 ZeRO-1 and fp32 "
    "`grad_accum_dtype` (`cpu_auto.json` without surgery: DeepSpeed's `BF16_Optimizer`). The planner reads them "
    "from the run's config (`--ds-config`; default the shipped `gpu_<precision>_zero<stage>.json`: 2 x 5e7 "
    "16-bit elements, 191 MiB; `cpu_bf16.json`: DeepSpeed's default 5e8, one buffer, 954 MiB). Checked on a real "
    "DeepSpeed bf16 step on the CPU under the planner's tracker (MiniLM, 6 x 16 tokens, "
    "`tests/test_memory.py::test_prediction_matches_a_real_deepspeed_step`): ZeRO-1 with `cpu_bf16.json` "
    "measured 1342.03 MiB, predicted 1342.03 MiB (485 MiB before the buckets were counted; the 1391 MiB first "
    "measured also counted DeepSpeed's meta-device copies of the parameters, 48.5 MiB that hold no memory and "
    "that the tracker now skips); ZeRO-2 with `gpu_bf16_zero2.json` measured 579.02, predicted 579.09 MiB. "
    "With a bucket too small to make the peak (1e6 elements) the measured peak, at the optimizer step, is "
    "518 MiB against 485 MiB predicted (0.94): DeepSpeed's step flattens the 16-bit gradient partition "
    "before casting it to fp32, a copy the planner does not hold. For BERT-base at 32 x 128 tokens, bf16, "
    "ZeRO-1 (`gpu_bf16_zero1.json`) the predicted peak rises from 3.90 to 4.07 GiB (plain) and from 3.92 to "
    "4.11 GiB (one-backward PCGrad).",
    "",
)


def memory_table(max_length: int = 128, chart: str | Path | None = None) -> str:
    """The markdown of ``docs/memory.md``: the predicted largest batch at ``max_length`` on each GPU for BERT-base
    and BERT-large, plain / PAL / PAL + PCGrad (one backward), without and with activation checkpointing,
    fp16 / bf16, tasks sst, para, sts, ZeRO-1, one rank. ``chart``: also write the chart of the bf16 lines
    (:func:`fastpals.commands.memory_chart.plot_table`) there, linked from the markdown."""
    rows = []
    lines = []
    fits: dict[tuple, tuple[dict[str, int | None], dict[str, float]]] = {}
    for model in _TABLE_MODELS:
        for label, pal, surgery, ckpt in _TABLE_VARIANTS:
            for precision in ("fp16", "bf16"):
                spec = StepSpec(
                    model=model, max_length=max_length, precision=precision, pal=pal, surgery=surgery,
                    activation_checkpointing=ckpt,
                )  # fmt: skip
                # fp16 and bf16 hold the same bytes where the rows' dtype does not follow them (no surgery): one
                # trace serves both (fp16's loss scaling is a scalar and in-place multiplies)
                key = (model, pal, surgery, ckpt, spec.rows_dtype if surgery != "none" else None)
                if key not in fits:
                    fits[key] = largest_batches(spec, _TABLE_GPUS)
                largest, fit = fits[key]
                cells = [
                    "no bf16" if DEVICES[g].supports(precision) else str(largest[g] if largest[g] else "-")
                    for g in _TABLE_GPUS
                ]
                rows.append(
                    f"| {model} | {label} | {precision} | {' | '.join(cells)} | "
                    f"{fit['intercept_bytes'] / GIB:.2f} + {fit['bytes_per_example'] / 2**20:.1f} MiB x b |"
                )
                lines.append((model, label, precision, fit["intercept_bytes"], fit["bytes_per_example"]))
    chart_text: list[str] = []
    if chart is not None:
        gpus = [(DEVICES[g].label, DEVICES[g].usable_bytes) for g in _TABLE_GPUS]
        plot_table(lines, gpus, chart, "bf16", max_length)
        chart_text = [f"![predicted peak against the batch size, bf16]({Path(chart).name})", ""]
    head = " | ".join(DEVICES[g].label for g in _TABLE_GPUS)
    gpu_caps = ", ".join(f"{DEVICES[g].label} {DEVICES[g].usable_bytes / GIB:.1f} GiB" for g in _TABLE_GPUS)
    return "\n".join(
        [
            "# Memory: the largest batch per GPU (predicted)",
            "",
            f"**Predicted, not measured.** Made by `{DOCS_COMMAND}` (run it again to regenerate this file); it is "
            "to be replaced by measured values once a GPU session (`make gpu-session`) has measured them.",
            "",
            f"The largest batch of {max_length}-token examples whose predicted peak of one training step fits the "
            f"memory each GPU leaves to tensors ({gpu_caps}). Tasks sst, para, sts in packed mixed micro-batches "
            "(`--batching mixed`, every example full length: the worst case), AdamW, DeepSpeed ZeRO-1 on one rank "
            "(fp16/bf16 weights and gradients, fp32 master weights and moments; the gradient buckets of the shipped "
            "`gpu_<precision>_zero1.json` during the backward: 2 x 5e7 16-bit elements), PAL = `--pal default`, "
            "PCGrad = `--surgery pcgrad` with one backward and the default rows (`--surgery-buffer-dtype auto`: "
            "bf16 rows with bf16 training, fp32 rows with fp16); checkpointed = `--activation-checkpointing` "
            "(every encoder layer recomputed in the backward).",
            "",
            *chart_text,
            "How: `fastpals memory` runs the real training step (forward, losses, backward, surgery capture and "
            "apply, optimizer step) on fake tensors and adds up the live tensor storage; each row traces two batch "
            "sizes and uses the straight line `peak(b) = a + c b` (the peak is linear in the batch: "
            "`tests/test_memory.py`). Peak = what `torch.cuda.max_memory_allocated` counts (not the caching "
            "allocator's reserve). The T4 has no bf16.",
            "",
            f"| model | variant | precision | {head} | peak (GiB + per example) |",
            "|---|---|---|" + "---|" * len(_TABLE_GPUS) + "---|",
            *rows,
            "",
            *MEASURED_NOTES,
        ]
    )


# ----------------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastpals memory",
        description="Predict the peak memory of one training step (traced on fake tensors; no weights, no GPU) "
        "and whether it fits a T4, A100 40/80 GB, H100 80 GB and this CPU.",
    )
    p.add_argument("--model", default="minilm-l6",
                   help="bert-base-uncased, bert-large-uncased, minilm-l6 (shipped, offline), a folder with "
                   "config.json, a config.json, or a Hub name (default: minilm-l6)")  # fmt: skip
    p.add_argument(
        "--tasks",
        default="sst,para,sts",
        help="comma-separated tasks, as for train (default sst,para,sts), or a number N: N tasks (copies of sst, "
        "para and sts in turn)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="examples per micro-batch (default 32)")
    p.add_argument(
        "--max-length", type=int, default=128, help="tokens per example; all full length (default 128)"
    )
    p.add_argument(
        "--max-tokens", type=int, help="packed token budget per micro-batch instead of --batch-size"
    )
    p.add_argument(
        "--precision", choices=PRECISIONS, default="bf16", help="training precision (default bf16)"
    )
    p.add_argument(
        "--pal", choices=tuple(PAL_PRESETS), default="default", help="PAL variant (default: default)"
    )
    p.add_argument(
        "--surgery", choices=("none", *AGGREGATORS), default="none", help="gradient surgery aggregator"
    )
    p.add_argument("--surgery-mode", choices=SURGERY_MODES, default="one_backward",
                   help="one_backward (--batching mixed) or per_task backwards (--batching per_task)")  # fmt: skip
    p.add_argument("--surgery-buffer-dtype", choices=BUFFER_DTYPES, default="auto",
                   help="surgery buffer rows (default auto: bf16 with --precision bf16, else fp32)")  # fmt: skip
    p.add_argument("--surgery-memory", choices=SURGERY_MEMORIES,
                   help="one-backward surgery: the [T, P] buffer, stream, or auto (default: the plan of the buffer "
                   "and every mode's predicted peak beside it; given: that mode alone)")  # fmt: skip
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2),
                   help="DeepSpeed ZeRO stage (default: 1 with fp16/bf16 or several ranks, else 0)")  # fmt: skip
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--ds-config", metavar="JSON",
                   help="the run's DeepSpeed config (a path or a shipped name), for its gradient buckets "
                   "(zero_optimization.reduce_bucket_size, overlap_comm, contiguous_gradients; default: the "
                   "shipped gpu_<precision>_zero<stage>.json, DeepSpeed's defaults for fp32)")  # fmt: skip
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute the encoder layers in the backward (as train --activation-checkpointing)")  # fmt: skip
    p.add_argument(
        "--largest-batch", action="store_true", help="also the largest batch that fits each device"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--table", metavar="PATH",
                   help=f"write the predicted largest-batch table (docs/memory.md: `{DOCS_COMMAND}`) and exit")  # fmt: skip
    p.add_argument("--chart", metavar="PNG",
                   help="also write a chart: with --table, the peak against the batch per variant (bf16); else "
                   "this configuration's peak by part beside the GPUs")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """``fastpals memory``; returns the exit status (2 on bad input, with a one-line error)."""
    args = _parser().parse_args(argv)
    try:
        if args.table:
            text = memory_table(args.max_length, args.chart)
            Path(args.table).parent.mkdir(parents=True, exist_ok=True)
            Path(args.table).write_text(text, encoding="utf-8")
            print(f"wrote {args.table}")
            return 0
        if args.tasks.strip().isdigit():  # N tasks: copies of sst, para and sts in turn
            tasks = tuple(f"{('sst', 'para', 'sts')[i % 3]}:{i}" for i in range(int(args.tasks)))
        else:
            tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
        spec = StepSpec(
            model=args.model, tasks=tasks, max_length=args.max_length, precision=args.precision, pal=args.pal,
            surgery=args.surgery, surgery_mode=args.surgery_mode, buffer_dtype=args.surgery_buffer_dtype,
            surgery_memory=args.surgery_memory or "buffer", zero_stage=args.zero_stage, world_size=args.world_size,
            activation_checkpointing=args.activation_checkpointing, ds_config=args.ds_config,
        )  # fmt: skip
        plan = plan_memory(
            spec,
            args.batch_size,
            args.max_tokens,
            args.largest_batch,
            every_surgery_memory=not args.surgery_memory,
        )
    except ValueError as err:
        print(f"fastpals memory: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    if args.chart:
        s = plan.spec
        title = (
            f"{s.model}, batch {plan.batch_size} x {s.max_length}, {s.precision}, PAL {s.pal}, surgery {s.surgery}"
            + (", checkpointed" if s.activation_checkpointing else "")
        )
        gpus = [(d.label, d.usable_bytes) for name, d in DEVICES.items() if name != "cpu"]
        print(f"wrote {plot_plan(plan.at_peak, CATEGORY_TEXT, gpus, title, args.chart)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
