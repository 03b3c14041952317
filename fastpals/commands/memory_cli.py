"""``fastpals memory``'s command line (:func:`main`), the largest-batch table of ``docs/memory.md``
(:func:`memory_table`) and the charts, over the planner of :mod:`fastpals.commands.memory`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastpals.commands import memory
from fastpals.commands.memory import CATEGORY_TEXT, DEVICES, GIB, SURGERY_MODES, StepSpec
from fastpals.surgery import AGGREGATORS
from fastpals.train.args import PAL_PRESETS, SURGERY_BUFFER_DTYPES
from fastpals.train.memory_mode import PRECISIONS, SURGERY_MEMORIES

__all__ = ["main", "memory_table", "plot_plan", "plot_table"]

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


def memory_table(max_length: int = 128, chart: str | Path | None = None) -> str:
    """The markdown of ``docs/memory.md``: the predicted largest batch at ``max_length`` per GPU for each
    variant of :data:`_TABLE_VARIANTS`; ``chart``: also write the chart of the bf16 lines there."""
    rows, lines = [], []
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
                    fits[key] = memory.largest_batches(spec, _TABLE_GPUS)
                largest, fit = fits[key]
                cells = [
                    "no bf16" if precision in DEVICES[g].why_not else str(largest[g] if largest[g] else "-")
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
            "Measured on the CPU, and the checks against real steps: [measurements.md](measurements.md#memory).",
            "",
        ]
    )


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # start-up: matplotlib's import is slow
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    return fig, FigureCanvasAgg(fig)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_table(
    lines: Sequence[tuple[str, str, str, float, float]],
    gpus: Sequence[tuple[str, int]],
    path: str | Path,
    precision: str = "bf16",
    max_length: int = 128,
) -> Path:
    """Write the chart of ``docs/memory.md``: per model a panel of ``peak(b) = a + c b`` for each line
    ``(model, variant, precision, a, c)`` in ``precision``; a dashed line per GPU ``(label, bytes)``."""
    models = list(dict.fromkeys(line[0] for line in lines))
    fig, _ = _figure(5.2 * len(models), 4.2)
    top = max(u for _, u in gpus) / GIB
    for i, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), i + 1)
        mine = [line for line in lines if line[0] == model and line[2] == precision]
        b_max = max(max((top * GIB - a) / c for *_, a, c in mine), 1.0)
        b = np.linspace(1, b_max, 200)
        for k, (_, label, _, a, c) in enumerate(mine):
            style = "--" if "checkpointed" in label else "-"
            ax.plot(b, (a + c * b) / GIB, style, color=f"C{k % 10}", label=label)
        for label, usable in gpus:
            ax.axhline(usable / GIB, color="grey", linestyle=":", linewidth=1)
            ax.text(b_max, usable / GIB, f" {label}", va="bottom", ha="right", fontsize=7, color="dimgrey")
        ax.set_title(f"{model}, {precision}, {max_length} tokens", fontsize=9)
        ax.set(xlabel="batch size (examples)", ylabel="predicted peak (GiB)", ylim=(0, top * 1.05))
        ax.set_xlim(0, b_max)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("fastpals memory: predicted peak of one training step (fake-tensor trace)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_plan(
    at_peak: dict[str, int],
    labels: dict[str, str],
    gpus: Sequence[tuple[str, int]],
    title: str,
    path: str | Path,
) -> Path:
    """Write one configuration's chart: a stacked bar of ``at_peak`` (bytes per part, in the order of
    ``labels``, which names them) and a dashed line per GPU ``(label, usable bytes)``. Returns the path."""
    fig, _ = _figure(6.4, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    bottom = 0.0
    for k, (cat, text) in enumerate(labels.items()):
        value = at_peak.get(cat, 0) / GIB
        if value > 0:
            ax.bar([0], [value], 0.5, bottom=bottom, color=f"C{k % 10}", label=f"{text}: {value:.2f} GiB")
            bottom += value
    shown = [(label, u / GIB) for label, u in gpus if u / GIB <= max(bottom * 3, 1.0)]
    for label, usable in shown:
        ax.axhline(usable, color="grey", linestyle=":", linewidth=1)
        ax.text(0.45, usable, f"{label}", va="bottom", ha="right", fontsize=7, color="dimgrey")
    ax.set_xticks([0], ["predicted peak"])
    ax.set(xlim=(-0.5, 1.8), ylim=(0, max([bottom * 1.15] + [u * 1.05 for _, u in shown])), ylabel="GiB")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return _save(fig, path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastpals memory",
        description="Predict the peak memory of one training step (traced on fake tensors; no weights, no GPU) "
        "and whether it fits a T4, A100 40/80 GB, H100 80 GB and this CPU.",
    )
    arg = p.add_argument
    arg("--model", default="minilm-l6",
        help="bert-base-uncased, bert-large-uncased, minilm-l6 (shipped, offline), a folder with "
        "config.json, a config.json, or a Hub name (default: minilm-l6)")  # fmt: skip
    arg(
        "--tasks",
        default="sst,para,sts",
        help="comma-separated tasks, as for train (default sst,para,sts), or a number N: N tasks (copies of sst, "
        "para and sts in turn)",
    )
    arg("--batch-size", type=int, default=32, help="examples per micro-batch (default 32)")
    arg("--max-length", type=int, default=128, help="tokens per example; all full length (default 128)")
    arg("--max-tokens", type=int, help="packed token budget per micro-batch instead of --batch-size")
    arg("--precision", choices=PRECISIONS, default="bf16", help="training precision (default bf16)")
    arg("--pal", choices=tuple(PAL_PRESETS), default="default", help="PAL variant (default: default)")
    arg("--surgery", choices=("none", *AGGREGATORS), default="none", help="the surgery's aggregator")
    arg("--surgery-mode", choices=SURGERY_MODES, default="one_backward",
        help="one_backward (--batching mixed) or per_task backwards (--batching per_task)")  # fmt: skip
    arg("--surgery-buffer-dtype", choices=SURGERY_BUFFER_DTYPES, default="auto",
        help="surgery buffer rows (default auto: bf16 with --precision bf16, else fp32)")  # fmt: skip
    arg("--surgery-memory", choices=SURGERY_MEMORIES,
        help="one-backward surgery: the [T, P] buffer, stream, or auto (default: the plan of the buffer "
        "and every mode's predicted peak beside it; given: that mode alone)")  # fmt: skip
    arg("--zero-stage", type=int, choices=(0, 1, 2),
        help="DeepSpeed ZeRO stage (default: 1 with fp16/bf16 or several ranks, else 0)")  # fmt: skip
    arg("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    arg("--ds-config", metavar="JSON",
        help="the run's DeepSpeed config (a path or a shipped name), for its gradient buckets "
        "(zero_optimization.reduce_bucket_size, overlap_comm, contiguous_gradients; default: the "
        "shipped gpu_<precision>_zero<stage>.json, DeepSpeed's defaults for fp32)")  # fmt: skip
    arg("--activation-checkpointing", action="store_true",
        help="recompute the encoder layers in the backward "
        "(as train --activation-checkpointing)")  # fmt: skip
    arg("--largest-batch", action="store_true", help="also the largest batch that fits each device")
    arg("--json", action="store_true", help="print the plan as JSON")
    arg("--table", metavar="PATH",
        help=f"write the predicted largest-batch table (docs/memory.md: `{DOCS_COMMAND}`) "
        "and exit")  # fmt: skip
    arg("--chart", metavar="PNG",
        help="also write a chart: with --table, the peak against the batch per variant (bf16); else "
        "this configuration's peak by part beside the GPUs")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """``fastpals memory``; returns the exit status (2 on bad input, with a one-line error)."""
    args = _parser().parse_args(argv)
    try:
        if args.table:
            Path(args.table).parent.mkdir(parents=True, exist_ok=True)
            Path(args.table).write_text(memory_table(args.max_length, args.chart), encoding="utf-8")
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
        plan = memory.plan_memory(
            spec, args.batch_size, args.max_tokens, args.largest_batch, not args.surgery_memory
        )
    except ValueError as err:
        print(f"fastpals memory: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else memory.format_plan(plan))
    if args.chart:
        s = plan.spec
        title = (
            f"{s.model}, batch {plan.batch_size} x {s.max_length}, {s.precision}, PAL {s.pal}, surgery {s.surgery}"
            + (", checkpointed" if s.activation_checkpointing else "")
        )
        gpus = [(d.label, d.usable_bytes) for name, d in DEVICES.items() if name != "cpu"]
        print(f"wrote {plot_plan(plan.at_peak, CATEGORY_TEXT, gpus, title, args.chart)}", file=sys.stderr)
    return 0
