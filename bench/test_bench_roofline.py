"""Roofline row: the main job's training step against the machine's measured matrix-product peak
(``pytest bench/test_bench_roofline.py --benchmark-only``).

- Peak: the best GFLOP/s of ``a @ b`` in bf16 and in fp32 on the device the bench runs on, at 2048³ and at the
  step's FFN shape (tokens x d x 4d), best of ``FASTPALS_BENCH_ROUNDS`` calls after one warm-up.
- Step: forward + backward of one packed mixed micro-batch under bf16 autocast (the optimizer step excluded), and
  as ``make train`` runs it: bf16 weights without autocast (DeepSpeed's bf16 mode; row ``job_bf16_weights``).
  Shape ``main`` is ``make train``'s: the Makefile's ``train`` options parsed by the trainer's own
  ``parse_args``, the model of ``build_model`` (MiniLM-L6 + PALs in layers 1-5, word embeddings and layer 0
  frozen) and the first micro-batch of its sampler (48 examples of at most 128 tokens from the task files).
  Shape ``tiny`` is a random 3-layer model (d = 64) on 3 tasks x 4 rows x 16 tokens, for CI's quick mode.
- FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over one step, twice: with the parameters trainable as the
  job trains them (``job``) and with every parameter trainable (``all_trainable``); each row is timed with its
  own setting. GFLOP/s = FLOPs / the best step time; the fractions divide it by the bf16 and fp32 peaks.

``FASTPALS_BENCH_ROOFLINE_SHAPE`` (``main`` or ``tiny``) picks the shape; by default ``tiny`` when
``FASTPALS_BENCH_ROUNDS=1`` (CI's quick run), else ``main``. With ``FASTPALS_BENCH_WRITE=1`` the row goes to
``bench/results/roofline_<device>_<UTC time>.{json,md}`` with the load average at the time. The same code runs on
CUDA (the device is ``cuda`` when one is visible), against that GPU's peak.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.common import StepTimer, should_write, sync, write_results

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
ROUNDS = int(os.environ.get("FASTPALS_BENCH_ROUNDS", "10" if HAS_CUDA else "3"))
SHAPE = os.environ.get("FASTPALS_BENCH_ROOFLINE_SHAPE", "tiny" if ROUNDS == 1 else "main")
if ROUNDS < 1 or SHAPE not in ("main", "tiny"):
    raise ValueError(
        f"FASTPALS_BENCH_ROUNDS={ROUNDS} / FASTPALS_BENCH_ROOFLINE_SHAPE={SHAPE!r}: use rounds >= 1 and "
        f"shape main or tiny"
    )
REPO = Path(__file__).resolve().parent.parent
PEAK_SIDE = 2048
# tiny: d, layers, heads, FFN width, PAL width d_s, PAL heads, PAL layers (top), frozen bottom layers;
# rows per task and row length (one length: the packed attention then has no padding)
TINY = {"d": 64, "layers": 3, "heads": 2, "ffn": 256, "pal": 24, "pal_heads": 2, "pal_layers": 2, "frozen": 1}
TINY_ROWS, TINY_LENGTH = 4, 16
TINY_HEAD_OUTPUTS = (5, 1, 1)  # sst, para, sts


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, rounds: int) -> float:
    """Best GFLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` (2·m·n·k FLOPs a call) over ``rounds`` calls after one
    warm-up call."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * m * n * k / best / 1e9


def makefile_train_argv(makefile: Path = REPO / "Makefile") -> list[str]:
    """The options ``make train`` gives ``train.py`` (the ``train:`` recipe, continuation lines joined)."""
    match = re.search(r"^train:.*\n((?:\t.*\n)+)", makefile.read_text(), re.M)
    if match is None:
        raise ValueError(f"{makefile}: no train target with a recipe; restore the Makefile's `train:` target")
    words = shlex.split(match.group(1).replace("\\\n", " "))
    return words[words.index("train.py") + 1 :]


def main_job_step(device: torch.device) -> tuple[torch.nn.Module, Any]:
    """``make train``'s model (train mode) and the first packed micro-batch of its sampler, on ``device``."""
    from fastpals.train.command import parse_args
    from fastpals.train.data_setup import packed_micro_batches, setup_data
    from fastpals.train.optimizer_setup import build_model

    cwd = os.getcwd()
    os.chdir(REPO)  # the Makefile's paths are relative to the repository
    try:
        args = parse_args(makefile_train_argv())
        model = build_model(args).to(device).train()
        data = setup_data(args, 0, 1, lambda line: None)
    finally:
        os.chdir(cwd)
    selections = data.sampler.next_update()
    batchers = list(data.train_batchers.values())
    return model, next(packed_micro_batches(batchers, selections, device, args.task_weighting))


def tiny_step(device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The ``TINY`` model (random weights, word embeddings and the bottom layer frozen as in the job) and a packed
    micro-batch of 3 tasks x ``TINY_ROWS`` rows of ``TINY_LENGTH`` random tokens, on ``device``."""
    from fastpals import BertConfig, MultiTaskBert, MultiTaskConfig, PALConfig
    from fastpals.data.mixed_batches import model_inputs, pack_batches
    from fastpals.model.multitask import get_task
    from fastpals.train.optimizer_setup import freeze_bottom_layers
    from fastpals.train.step import MicroBatch

    torch.manual_seed(0)
    bert = BertConfig(
        hidden_size=TINY["d"],
        num_hidden_layers=TINY["layers"],
        num_attention_heads=TINY["heads"],
        intermediate_size=TINY["ffn"],
    )
    pal = PALConfig(num_tasks=3, hidden=TINY["pal"], num_heads=TINY["pal_heads"], layers=TINY["pal_layers"])
    tasks = [get_task(name) for name in ("sst", "para", "sts")]
    model = MultiTaskBert(MultiTaskConfig(bert, tasks, pal)).to(device).train()
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    freeze_bottom_layers(model, TINY["frozen"])
    g = torch.Generator().manual_seed(0)
    batches = []
    for outputs in TINY_HEAD_OUTPUTS:
        ids = torch.randint(1000, 30000, (TINY_ROWS, TINY_LENGTH), generator=g)
        labels = torch.randint(0, max(outputs, 2), (TINY_ROWS,), generator=g).float()
        batches.append(
            {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
             "labels": labels}
        )  # fmt: skip
    batch = pack_batches(batches, [0, 1, 2], 3)
    rows = (TINY_ROWS,) * 3
    return model, MicroBatch(
        inputs=model_inputs(batch, device), labels=batch["labels"].to(device), tasks=(0, 1, 2), examples=rows,
        tokens=tuple(r * TINY_LENGTH for r in rows), weighting="examples",
    )  # fmt: skip


def train_step(model: torch.nn.Module, mb: Any, autocast: bool = True) -> Callable[[], None]:
    """Forward (bf16 autocast, or as the model's dtype is) and backward of ``mb``'s loss as the trainer forms it;
    gradients reset each call."""

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        with torch.autocast(mb.labels.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model.task_losses(model(**mb.inputs), mb.labels, weighting=mb.weighting).total
        loss.backward()

    return step


def counted_flops(step: Callable[[], None]) -> int:
    """FLOPs of one call of ``step`` as ``FlopCounterMode`` counts them (matrix products and attention)."""
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops()


def analytic_tiny_flops(all_trainable: bool) -> int:
    """FLOPs of the ``tiny`` step, written out: every matrix product ``[m, k] @ [k, n]`` costs 2·m·n·k forward
    and the same again in the backward for each operand that needs a gradient (the input through ``A^T``, the
    weight through ``B^T``), so 1x (frozen), 2x (only one operand) or 3x its forward.

    Products per layer over N tokens: Q, K, V, O (N·d·d each) and the FFN (2·N·d·F); attention QK^T and PV per
    row (2 x 2·L²·d); in PAL layers the task's V^E (N·d·d_s), its Q, K, V (N·d_s·3d_s), attention in d_s
    (2 x 2·L²·d_s) and V^D (N·d_s·d). Then the pooler on the B first tokens (B·d·d) and each task's head on its
    rows (rows·d·outputs). As the job trains, the frozen bottom layers run forward only and the first trainable
    layer's input needs no gradient: its Q, K, V and V^E products take 2x.
    """
    d, f, ds, layers = TINY["d"], TINY["ffn"], TINY["pal"], TINY["layers"]
    rows, length = 3 * TINY_ROWS, TINY_LENGTH
    n = rows * length
    total = 0
    for layer in range(layers):
        frozen = not all_trainable and layer < TINY["frozen"]
        first = not all_trainable and layer == TINY["frozen"]  # its input needs no gradient
        inner, entry = (1, 1) if frozen else (3, 2 if first else 3)
        total += entry * 3 * 2 * n * d * d  # Q, K, V
        total += inner * (2 * n * d * d + 2 * 2 * n * d * f)  # O, FFN in and out
        total += inner * 2 * 2 * rows * length * length * d  # QK^T and PV
        if layer >= layers - TINY["pal_layers"]:
            total += entry * 2 * n * d * ds  # V^E
            total += inner * (2 * n * ds * 3 * ds + 2 * 2 * rows * length * length * ds + 2 * n * ds * d)
    total += 3 * 2 * rows * d * d  # pooler
    total += sum(3 * 2 * TINY_ROWS * d * outputs for outputs in TINY_HEAD_OUTPUTS)
    return total


def _set_all_trainable(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(True)


def test_step_flops_match_analytic_count(benchmark):
    """``FlopCounterMode``'s count of the tiny step equals the count written out by hand, as the job trains and
    with every parameter trainable."""
    model, mb = tiny_step(torch.device("cpu"))
    step = train_step(model, mb)
    job = benchmark.pedantic(counted_flops, args=(step,), rounds=1, iterations=1)
    _set_all_trainable(model)
    everything = counted_flops(step)
    assert job == analytic_tiny_flops(all_trainable=False)
    assert everything == analytic_tiny_flops(all_trainable=True)
    assert job < everything


def _markdown(doc: dict[str, Any], name: str) -> str:
    lines = [
        f"# Roofline: training step vs matmul peak, {doc['device']} ({name})",
        "",
        f"Shape `{doc['shape']}`: {doc['examples']} examples, {doc['tokens']} tokens; {doc['threads']} torch "
        f"threads; load average {' / '.join(map(str, doc['load_average']))} (1, 5, 15 min); commit {doc['commit']}, {doc['date']}.",
        "",
        "| matmul | dtype | best GFLOP/s |",
        "| --- | --- | ---: |",
    ]
    lines += [f"| {p['m']}x{p['k']}x{p['n']} | {p['dtype']} | {p['gflops']:.1f} |" for p in doc["peaks"]]
    lines += [
        "",
        "| step (forward + backward, bf16 autocast) | GFLOP | best s | median s | GFLOP/s | x bf16 peak "
        "| x fp32 peak |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['trainable']} | {r['flops'] / 1e9:.2f} | {r['best_s']:.3f} | {r['median_s']:.3f} | "
            f"{r['gflops']:.1f} | {r['fraction_bf16']:.3f} | {r['fraction_fp32']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def test_roofline_row(benchmark, ratio_table):
    """The step's GFLOP/s as the job trains and with every parameter trainable, against the measured peaks;
    each fraction of the bf16 peak must lie in (0, 1.5]."""
    model, mb = main_job_step(DEVICE) if SHAPE == "main" else tiny_step(DEVICE)
    tokens = sum(mb.tokens)
    d = model.config.bert.hidden_size
    ffn = model.config.bert.intermediate_size
    shapes = [(PEAK_SIDE, PEAK_SIDE, PEAK_SIDE), (tokens, d, ffn)]
    peaks = [
        {"dtype": name, "m": m, "k": k, "n": n, "gflops": matmul_gflops(m, k, n, dtype, DEVICE, ROUNDS)}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
        for m, k, n in shapes
    ]
    peak = {name: max(p["gflops"] for p in peaks if p["dtype"] == name) for name in ("bf16", "fp32")}
    rows = []
    # job_bf16_weights: the job's bf16 weights without autocast, as DeepSpeed's bf16 mode trains them
    for trainable in ("job", "job_bf16_weights", "all_trainable"):
        if trainable == "all_trainable":
            _set_all_trainable(model)
        if trainable == "job_bf16_weights":
            step = train_step(copy.deepcopy(model).to(torch.bfloat16), mb, autocast=False)
        else:
            step = train_step(model, mb)
        timer = StepTimer(step, DEVICE)
        timer()  # warm-up
        flops = counted_flops(timer.fn)
        if trainable == "job":
            benchmark.pedantic(timer, rounds=ROUNDS, iterations=1, warmup_rounds=0)
        else:
            for _ in range(ROUNDS):
                timer()
        times = timer.measured(1)
        gflops = flops / min(times) / 1e9
        rows.append(
            {"trainable": trainable, "flops": flops, "best_s": min(times), "median_s": timer.median(1),
             "times_s": times, "gflops": gflops, "fraction_bf16": gflops / peak["bf16"],
             "fraction_fp32": gflops / peak["fp32"]}
        )  # fmt: skip
    doc = {
        "suite": "roofline",
        "shape": SHAPE,
        "examples": sum(mb.examples),
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "rounds": ROUNDS,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "peaks": peaks,
        "peak_gflops": peak,
        "rows": rows,
        "peak_ratio": {
            f"{r['trainable']}_{dt}": r[f"fraction_{dt}"] for r in rows for dt in ("bf16", "fp32")
        },
    }
    benchmark.extra_info.update({r["trainable"]: r["fraction_bf16"] for r in rows})
    table = [f"{'step':16s} {'GFLOP':>7s} {'best s':>7s} {'GFLOP/s':>8s} {'x bf16':>7s} {'x fp32':>7s}"]
    table += [
        f"{r['trainable']:16s} {r['flops'] / 1e9:7.2f} {r['best_s']:7.3f} {r['gflops']:8.1f} "
        f"{r['fraction_bf16']:7.3f} {r['fraction_fp32']:7.3f}"
        for r in rows
    ]
    table.append(
        f"peak GFLOP/s: bf16 {peak['bf16']:.1f}, fp32 {peak['fp32']:.1f} ({DEVICE.type}, shape {SHAPE}, "
        f"{tokens} tokens, load average {doc['load_average'][0]})"
    )
    ratio_table("roofline: training step (forward + backward in bf16) vs measured matmul peak", table)
    if should_write():
        path = write_results(f"roofline_{DEVICE.type}", doc)
        path.with_suffix(".md").write_text(_markdown({**json.loads(path.read_text()), **doc}, path.name))
    for r in rows:  # the step runs in bf16: above its peak by half is a measuring or counting error
        assert 0 < r["fraction_bf16"] <= 1.5, r
        assert math.isfinite(r["fraction_fp32"]) and r["fraction_fp32"] > 0, r
