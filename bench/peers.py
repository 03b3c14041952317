"""fastpals against its peers, side by side in one process on one device: one table of ratios.

``python -m bench.peers --out DIR [--shapes bert-base|tiny] [--rows pal,packing,pcgrad,bandwidth,sync,memory,many_tasks]``

Every row says what it compares, the ratio measured and the ratio the project's goal asks for:

- ``pal``: the fused Triton PAL forward+backward against the PyTorch reference (``fastpals.functional``, and its
  SDPA-attention composition of stock ops), per dtype (fp16, bf16, fp32); BERT-base shapes B 32, L 128, d 768,
  d_s 204, 6 heads, T 3. Goal: at least 5x the reference, 1.5x the stock composition (issue 4);
- ``packing``: a packed mixed-task training step of ``fastpals.MultiTaskBert`` (no padding, ``cu_seqlens``)
  against Hugging Face ``transformers.BertModel`` on the same rows padded to the longest, same dimensions, same
  heads and losses, AdamW; real (non-padding) tokens per second. Goal: at least 1.5x (issue 12);
- ``pcgrad``: one-backward PCGrad (``per_task_gradients`` + ``buffer.apply(pcgrad_weights)``) against the plain
  mixed step (goal: at most 1.15x its time, issue 13), against Pytorch-PCGrad's algorithm (T retained backwards,
  per-parameter flattening, host-synced projections; re-implemented from its published algorithm in
  ``bench/pcgrad_reference.py``, credit: Yu et al. 2020 and the Pytorch-PCGrad package by Wei-Cheng Tseng) and
  against TorchJD 0.18's autogram engine with ``PCGradWeighting`` (when importable);
- ``bandwidth``: ``fastpals_kernels.gram`` and ``combine`` on a ``[T, P]`` buffer (P = BERT-base's shared
  parameters) as a share of a device-to-device copy's bandwidth (bytes read + written). Goal: at least 80%
  (issue 5);
- ``sync``: the plain and the one-backward PCGrad training step under ``torch.cuda.set_sync_debug_mode("error")``:
  pass, or the first synchronisation's stack. Goal: pass (the trainer reads the losses once per step, outside);
- ``memory``: ``torch.cuda.max_memory_allocated`` over two fp32 steps of full-length rows (plain and one-backward
  PCGrad) beside the memory planner's prediction for the same encoder and batch
  (``fastpals.commands.memory.plan_memory``). Goal: within 10% (issue 31);
- ``many_tasks``: plain / ``[T, P]`` buffer / streamed one-backward PCGrad at T = 2, 3, 4, 8, 16 (BERT-base, 48
  rows of up to 128 tokens; ``bench/scaling_gpu.py``, every T's times and peaks in the row). Goal: streaming at
  T = 16 at most 1.30x the plain step's time and 1.15x its peak, at T = 3 at most 1.10x the buffer's time
  (issue 35).

Times are medians over interleaved rounds (each round runs every variant once, the order rotated) after warm-up.
On a machine without CUDA (``--shapes tiny``, the session's rehearsal) the same code runs at tiny shapes and the
device-only calls have CPU stand-ins: the fused PAL runs in Triton's interpreter (``TRITON_INTERPRET=1``), the
sync check runs the step under ``FakeTensorMode`` (any host read of a tensor value raises), the peak is the
planner's live-tensor tracker on the real CPU step. Such rows say ``"cpu_figures": true``: their numbers describe a CPU, not the goal.

The table is written to ``DIR/peers.json`` after every row (a run cut short keeps the rows it finished).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import env_var  # noqa: E402

ROWS = ("pal", "packing", "pcgrad", "bandwidth", "sync", "memory", "many_tasks")
TASKS = ("sst", "para", "sts")


@dataclass(frozen=True)
class Shapes:
    name: str
    batch: int  # examples, spread evenly over the tasks
    length: int  # the longest row; rows hold 50-100% of it
    hidden: int
    layers: int
    heads: int
    intermediate: int
    pal_hidden: int
    pal_heads: int
    buffer_elements: int  # P of the bandwidth row
    rounds: int
    warmup: int

    def bert_config(self) -> dict[str, int]:
        return {
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "intermediate_size": self.intermediate,
        }


SHAPES = {
    # BERT-base: B 32 x L 128, d 768, 12 layers, PAL d_s 204 / 6 heads; P ~ BERT-base's 109M shared parameters
    "bert-base": Shapes("bert-base", 32, 128, 768, 12, 12, 3072, 204, 6, 109_000_000, 10, 3),
    # the rehearsal's: every code path, seconds on a CPU
    "tiny": Shapes("tiny", 6, 16, 64, 2, 2, 128, 34, 1, 200_000, 2, 1),
}


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    fns: dict[str, Callable[[], Any]], rounds: int, warmup: int, device: torch.device
) -> dict[str, float]:
    """Median seconds of each function over ``rounds`` round-robin rounds (order rotated), after ``warmup``."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    _sync(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            _sync(device)
            t0 = time.perf_counter()
            fns[n]()
            _sync(device)
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 mixed precision on CUDA (as users train); fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def task_rows(shapes: Shapes, vocab: int, seed: int = 0, full_length: bool = False) -> list:
    """Per task (sst 5-way, para binary, sts regression), ``batch / 3`` rows of 50-100% of ``length`` tokens
    (``full_length``: every row ``length`` tokens)."""
    from fastpals.data.mixed_batches import TaskRows

    rng = np.random.default_rng(seed)
    per = shapes.batch // len(TASKS)
    parts = []
    for t in range(len(TASKS)):
        lengths = rng.integers(max(2, shapes.length // 2), shapes.length + 1, size=per)
        if full_length:
            lengths[:] = shapes.length
        ids = [[101, *rng.integers(1000, vocab, size=k - 1).tolist()] for k in lengths]
        labels = [rng.integers(0, 5, per), rng.integers(0, 2, per), rng.random(per) * 5][t]
        parts.append(
            TaskRows(t, ids, [[0] * len(x) for x in ids], labels=torch.as_tensor(labels, dtype=torch.float32))
        )
    return parts


def build_fastpals(shapes: Shapes, device: torch.device, pal: bool = False, seed: int = 0) -> torch.nn.Module:
    from fastpals import MultiTaskBert
    from fastpals.data.tasks import get_task
    from fastpals.encoder.bert import BertConfig, PALConfig
    from fastpals.model.multitask import MultiTaskConfig

    torch.manual_seed(seed)
    cfg = BertConfig(**shapes.bert_config())
    pal_cfg = PALConfig(hidden=shapes.pal_hidden, num_heads=shapes.pal_heads) if pal else None
    model = MultiTaskBert(MultiTaskConfig(cfg, [get_task(t) for t in TASKS], pal_cfg))
    if (
        device.type != "cpu"
    ):  # (under FakeTensorMode, .to() of a CPU model to the CPU cannot swap its tensors)
        model = model.to(device)
    return model.train()


class FastpalsStep:
    """A packed mixed-task step of ``MultiTaskBert``: plain, one-backward PCGrad, Pytorch-PCGrad's algorithm or
    TorchJD's autogram engine (``kind``), with its own model copy and AdamW; ``precision`` ``auto``: bf16
    autocast on CUDA, ``fp32``: none."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: dict,
        device: torch.device,
        kind: str = "plain",
        precision: str = "auto",
    ) -> None:
        from fastpals.data.mixed_batches import model_inputs

        self.model, self.device, self.kind, self.precision = model, device, kind, precision
        self.inputs = model_inputs(batch, device)
        self.labels = batch["labels"].to(device)
        self.opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
        self.generator = torch.Generator().manual_seed(0)
        self.buffer = self.reference = self.engine = None
        if kind == "onebwd":
            from fastpals.surgery import TaskGradientBuffer, shared_parameters_by_name

            shared, specific = shared_parameters_by_name(model)
            self.buffer = TaskGradientBuffer(shared, len(TASKS), task_params=specific)
        elif kind == "reference":
            sys.path.insert(0, HERE)
            from pcgrad_reference import ReferencePCGrad

            self.reference = ReferencePCGrad(self.opt, seed=0)
        elif kind == "torchjd":
            from torchjd.autogram import Engine

            self.engine = Engine(model.bert, batch_dim=None)

    def losses(self) -> Any:
        with _autocast(self.device) if self.precision == "auto" else contextlib.nullcontext():
            return self.model.task_losses(self.model(**self.inputs), self.labels, weighting="equal")

    def __call__(self, sync: bool = True) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.kind == "plain":
            self.losses().total.backward()
        elif self.kind == "onebwd":
            from fastpals.surgery import pcgrad_weights, per_task_gradients

            with per_task_gradients(self.model, self.buffer, self.inputs["layout"]):
                res = self.losses()
                sum(res.per_task.values()).backward()
            result = self.buffer.apply(pcgrad_weights, generator=self.generator, sync=sync)
            if sync and result.skipped:
                return
        elif self.kind == "reference":
            self.reference.pc_backward(list(self.losses().per_task.values()))
        elif self.kind == "torchjd":
            from torchjd.aggregation import PCGradWeighting

            losses = torch.stack(list(self.losses().per_task.values()))
            weights = PCGradWeighting()(self.engine.compute_gramian(losses))
            losses.backward(weights)
        else:
            raise ValueError(f"unknown step kind {self.kind!r}")
        self.opt.step()


def _row(name: str, compares: str, goal: str, device: torch.device, **fields: Any) -> dict[str, Any]:
    return {
        "row": name,
        "compares": compares,
        "goal": goal,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu_figures": device.type != "cuda",
        **fields,
    }


# ----------------------------------------------------------------------------------------------------------------
# the rows
# ----------------------------------------------------------------------------------------------------------------


def _pal_fns(x: torch.Tensor, mask: torch.Tensor, args: tuple, grad: torch.Tensor) -> dict[str, Callable]:
    """forward+backward of the fused PAL, the reference and the SDPA composition (each adds the residual)."""
    import fastpals_kernels
    from fastpals import functional

    def fused() -> None:
        with env_var("FASTPALS_KERNELS", "triton"):
            fastpals_kernels.pal(x, mask, *args, residual=x).backward(grad)

    def reference(attention: str = "reference") -> None:
        (x + functional.pal_reference(x, mask, *args, attention=attention)).backward(grad)

    return {"fused": fused, "reference": reference, "sdpa": lambda: reference("sdpa")}


def row_pal(shapes: Shapes, device: torch.device) -> list[dict[str, Any]]:
    """Fused PAL forward+backward against the reference and the SDPA composition, per dtype."""
    from fastpals_kernels.aot import pal_weight_shapes

    rows = []
    b, n, d, ds, h, t = shapes.batch, shapes.length, shapes.hidden, shapes.pal_hidden, shapes.pal_heads, 3
    for dtype_name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
        g = torch.Generator().manual_seed(0)

        def rand(*shape: int, scale: float = 0.05, g: torch.Generator = g, dtype: torch.dtype = dtype) -> Any:
            return (torch.randn(*shape, generator=g) * scale).to(device, dtype).requires_grad_()

        x = rand(b, n, d, scale=1.0)
        lengths = torch.randint(n // 2, n + 1, (b,), generator=g)
        mask = (torch.arange(n)[None] < lengths[:, None]).long().to(device)
        task_ids = (torch.arange(b) % t).to(device)
        weights = [rand(*shape) for shape in pal_weight_shapes(t, d, ds)]
        args = (task_ids, *weights, h, True, 0.0)
        grad = torch.randn(b, n, d, generator=g).to(device, dtype)
        fns = _pal_fns(x, mask, args, grad)
        med = interleaved(fns, shapes.rounds, shapes.warmup, device)
        rows.append(
            _row(
                f"pal_{dtype_name}",
                f"fused Triton PAL fwd+bwd vs the PyTorch reference and the SDPA composition, {dtype_name}, "
                f"B {b} x L {n}, d {d}, d_s {ds}, {h} heads, T {t}",
                ">= 5x the reference, >= 1.5x the stock composition (speed-up = their time / fused time)",
                device,
                seconds=med,
                ratio=_ratio(med["reference"], med["fused"]),
                ratio_vs_stock=_ratio(med["sdpa"], med["fused"]),
                met=None if device.type != "cuda" else bool(_ratio(med["reference"], med["fused"]) >= 5),
            )
        )
    return rows


def hf_padded_step(shapes: Shapes, parts: list, device: torch.device) -> Callable[[], None]:
    """Hugging Face ``BertModel`` on the rows padded to the longest, the same three heads and losses, AdamW."""
    import torch.nn.functional as F
    from transformers import BertConfig as HFConfig
    from transformers import BertModel

    torch.manual_seed(0)
    cfg = HFConfig(**shapes.bert_config())
    model = BertModel(cfg).to(device).train()
    heads = torch.nn.ModuleList([torch.nn.Linear(shapes.hidden, c) for c in (5, 1, 1)]).to(device)
    opt = torch.optim.AdamW([*model.parameters(), *heads.parameters()], lr=2e-5, weight_decay=0.01)
    rows = [(t, ids) for t, p in enumerate(parts) for ids in p.input_ids]
    longest = max(len(ids) for _, ids in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (_, r) in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r)
        mask[i, : len(r)] = 1
    ids, mask = ids.to(device), mask.to(device)
    per = [len(p.input_ids) for p in parts]
    starts = np.cumsum([0, *per])
    labels = [p.labels.to(device) for p in parts]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with _autocast(device):
            pooled = model(input_ids=ids, attention_mask=mask).pooler_output
            z = [heads[t](pooled[starts[t] : starts[t + 1]]) for t in range(len(parts))]
            loss = (
                F.cross_entropy(z[0].float(), labels[0].long())
                + F.binary_cross_entropy_with_logits(z[1][:, 0].float(), labels[1])
                + F.mse_loss(z[2][:, 0].float(), labels[2] / 5.0)
            ) / 3
        loss.backward()
        opt.step()

    return step


def row_packing(shapes: Shapes, device: torch.device) -> list[dict[str, Any]]:
    from fastpals.data.mixed_batches import pack_task_rows

    vocab = 30522
    parts = task_rows(shapes, vocab)
    batch = pack_task_rows(parts, len(TASKS))
    layout = batch["layout"]
    real = layout.total + (layout.second.total if layout.second is not None else 0)
    longest = max(len(x) for p in parts for x in p.input_ids)
    fns = {
        "fastpals_packed": FastpalsStep(build_fastpals(shapes, device), batch, device),
        "hf_bert_padded": hf_padded_step(shapes, parts, device),
    }
    med = interleaved(fns, shapes.rounds, shapes.warmup, device)
    tps = {k: real / v for k, v in med.items()}
    ratio = _ratio(tps["fastpals_packed"], tps["hf_bert_padded"])
    return [
        _row(
            "packing",
            f"packed mixed-task step (fastpals MultiTaskBert, no PALs) vs HF BertModel padded step, same rows "
            f"({shapes.batch} examples, {real} real tokens, padded {shapes.batch} x {longest}), "
            f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}, AdamW; real tokens/s",
            ">= 1.5x the real tokens/s of the padded step",
            device,
            seconds=med,
            tokens_per_s=tps,
            padding_fraction=1 - real / (shapes.batch * longest),
            ratio=ratio,
            met=None if device.type != "cuda" else bool(ratio >= 1.5),
        )
    ]


def row_pcgrad(shapes: Shapes, device: torch.device) -> list[dict[str, Any]]:
    from fastpals.data.mixed_batches import pack_task_rows

    batch = pack_task_rows(task_rows(shapes, 30522), len(TASKS))
    base = build_fastpals(shapes, device)
    kinds = ["plain", "onebwd", "reference"]
    torchjd_reason = None
    if importlib.util.find_spec("torchjd") is None:
        torchjd_reason = "torchjd is not importable (carried in .whl/ as torchjd 0.18.0)"
    else:
        kinds.append("torchjd")
    fns = {k: FastpalsStep(copy.deepcopy(base), batch, device, k) for k in kinds}
    del base
    med = interleaved(fns, shapes.rounds, shapes.warmup, device)
    vs_plain = _ratio(med["onebwd"], med["plain"])
    return [
        _row(
            "pcgrad",
            f"one-backward PCGrad step vs the plain mixed step, vs Pytorch-PCGrad's algorithm "
            f"(bench/pcgrad_reference.py) and vs TorchJD autogram + PCGradWeighting; MultiTaskBert, "
            f"{shapes.batch} examples over 3 tasks, packed, {'bf16 autocast' if device.type == 'cuda' else 'fp32'}",
            "one-backward PCGrad <= 1.15x the plain step's time; the peers' ratios reported (onebwd / peer)",
            device,
            seconds=med,
            ratio=vs_plain,
            ratio_vs_pytorch_pcgrad=_ratio(med["onebwd"], med["reference"]),
            ratio_vs_torchjd=_ratio(med["onebwd"], med.get("torchjd")),
            **({"torchjd": torchjd_reason} if torchjd_reason else {}),
            met=None if device.type != "cuda" else bool(vs_plain <= 1.15),
        )
    ]


def row_bandwidth(shapes: Shapes, device: torch.device) -> list[dict[str, Any]]:
    import fastpals_kernels

    rows = []
    t, p = 3, shapes.buffer_elements
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        buf = torch.randn(t, p, device=device).to(dtype)
        dst = torch.empty_like(buf)
        out = torch.empty(p, device=device, dtype=torch.float32)
        w = torch.full((t,), 1.0 / t, device=device)
        es = buf.element_size()
        fns = {
            "copy": lambda buf=buf, dst=dst: dst.copy_(buf),
            "gram": lambda buf=buf: fastpals_kernels.gram(buf),
            "combine": lambda buf=buf, w=w, out=out: fastpals_kernels.combine(buf, w, out),
        }
        med = interleaved(fns, shapes.rounds, shapes.warmup, device)
        moved = {"copy": 2 * t * p * es, "gram": t * p * es, "combine": t * p * es + p * 4}
        gbps = {k: moved[k] / med[k] / 1e9 for k in med}
        share = {k: _ratio(gbps[k], gbps["copy"]) for k in ("gram", "combine")}
        rows.append(
            _row(
                f"bandwidth_{dtype_name}",
                f"Gram and combine bandwidth on a [{t}, {p}] {dtype_name} buffer as a share of a device-to-device "
                f"copy of it (bytes read + written); backend {fastpals_kernels.backend('gram', buf)}",
                ">= 0.80 of the copy's bandwidth, each",
                device,
                seconds=med,
                gb_per_s=gbps,
                ratio=min(share.values()),
                share=share,
                met=None if device.type != "cuda" else bool(min(share.values()) >= 0.8),
            )
        )
        del buf, dst
    return rows


def _sync_check(step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """Run ``step`` where a host synchronisation raises; pass, or the first one's stack."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        _sync(device) if device.type != "cuda" else None
        return {"passed": True}
    except Exception as exc:  # noqa: BLE001 - the first sync's exception is the result
        return {
            "passed": False,
            "error": f"{type(exc).__name__}: {str(exc)[:300]}",
            "stack": traceback.format_exc()[-4000:],
        }
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)


def row_sync(shapes: Shapes, device: torch.device) -> list[dict[str, Any]]:
    from fastpals.data.mixed_batches import pack_task_rows

    results = {}
    for kind in ("plain", "onebwd"):
        if device.type == "cuda":
            batch = pack_task_rows(task_rows(shapes, 30522), len(TASKS))
            step = FastpalsStep(build_fastpals(shapes, device), batch, device, kind)
            step(sync=False)  # warm-up (the optimizer's state, the kernels' compilation)
            _sync(device)
            results[kind] = _sync_check(lambda step=step: step(sync=False), device)
        else:  # stand-in: the step under FakeTensorMode, where a host read of any tensor value raises
            from torch._subclasses.fake_tensor import FakeTensorMode

            def fake_step(kind: str = kind) -> None:
                with FakeTensorMode():  # every tensor made inside is fake, the batch's too
                    batch = pack_task_rows(task_rows(shapes, 30522), len(TASKS))
                    FastpalsStep(build_fastpals(shapes, device), batch, device, kind)(sync=False)

            results[kind] = _sync_check(fake_step, device)
    passed = all(r["passed"] for r in results.values())
    return [
        _row(
            "sync",
            "the plain and the one-backward PCGrad training step (deferred surgery check, sync=False) under "
            + (
                'torch.cuda.set_sync_debug_mode("error")'
                if device.type == "cuda"
                else "a CPU stand-in: FakeTensorMode, where any host read of a tensor value raises"
            ),
            "pass: no synchronisation inside the step",
            device,
            results=results,
            ratio=None,
            met=passed,
        )
    ]


def _predict(shapes: Shapes, surgery: str, config_dir: str) -> tuple[int | None, str]:
    """The memory planner's predicted peak of the row's step (``fastpals.commands.memory.plan_memory`` on a
    ``StepSpec`` of the same encoder, written as a config file, no PALs, fp32, the batch's examples of
    ``shapes.length`` tokens); (bytes, how it was called) or (None, why not)."""
    from fastpals.commands.memory import StepSpec, plan_memory
    from fastpals.encoder.bert import BertConfig

    path = os.path.join(config_dir, f"{shapes.name}.json")
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(BertConfig(**shapes.bert_config())), f)
    spec = StepSpec(model=path, tasks=TASKS, max_length=shapes.length, precision="fp32", pal="none",
                    surgery=surgery)  # fmt: skip
    try:
        plan = plan_memory(spec, batch_size=shapes.batch)
    except Exception as exc:  # noqa: BLE001 - reported in the row, the others still run
        return None, f"plan_memory failed: {type(exc).__name__}: {str(exc)[:200]}"
    return (
        plan.peak_bytes,
        f"plan_memory(StepSpec(fp32, pal none, surgery {surgery}), batch_size={shapes.batch})",
    )


def row_memory(shapes: Shapes, device: torch.device) -> list[dict[str, Any]]:
    """Peak over two fp32 training steps with the trainer's optimizer (model built inside, every row
    ``shapes.length`` tokens long, as the planner assumes) beside the planner's prediction, plain and one-backward
    PCGrad."""
    import tempfile

    from bench.common import CudaPeakMemory
    from fastpals.data.mixed_batches import pack_task_rows
    from fastpals.train.memory_mode import LiveTensorBytes
    from fastpals.train.optimizer_setup import make_optimizer, optimizer_param_groups

    measured, predicted, notes = {}, {}, {}
    with tempfile.TemporaryDirectory() as config_dir:
        for kind in ("plain", "onebwd"):
            batch = pack_task_rows(task_rows(shapes, 30522, full_length=True), len(TASKS))
            meter = CudaPeakMemory(device) if device.type == "cuda" else LiveTensorBytes()
            with meter:
                step = FastpalsStep(build_fastpals(shapes, device), batch, device, kind, precision="fp32")
                # the trainer's optimizer (fused AdamW), which the planner models
                step.opt = make_optimizer(optimizer_param_groups(step.model, 2e-5, 2e-5, 2e-5, 0.01), "adamw")
                for _ in range(2):
                    step()
            measured[kind] = meter.peak_bytes - meter.start_bytes if device.type == "cuda" else meter.peak
            del step
            predicted[kind], notes[kind] = _predict(
                shapes, "pcgrad" if kind == "onebwd" else "none", config_dir
            )
    ratios = {k: _ratio(measured[k], predicted[k]) for k in measured}
    known = [r for r in ratios.values() if r is not None]
    return [
        _row(
            "memory",
            "peak over two fp32 training steps (model built inside, full-length rows) beside the memory planner's "
            "prediction (fastpals.commands.memory.plan_memory), plain and one-backward PCGrad: "
            + (
                "torch.cuda.max_memory_allocated"
                if device.type == "cuda"
                else "CPU stand-in: the planner's live-tensor tracker (LiveTensorBytes) on the real CPU step"
            ),
            "measured / predicted within 0.90-1.10",
            device,
            measured_bytes=measured,
            predicted_bytes=predicted,
            planner=notes,
            ratio=max(known, key=lambda r: abs(r - 1)) if known else None,
            ratios=ratios,
            met=None if device.type != "cuda" or not known else all(0.9 <= r <= 1.1 for r in known),
        )
    ]


def row_many_tasks(shapes: Shapes, device: torch.device) -> list[dict[str, Any]]:
    from bench import scaling_gpu

    shape = dict(scaling_gpu.GPU_SHAPE if shapes.name == "bert-base" else scaling_gpu.REHEARSAL_SHAPE)
    result = scaling_gpu.measure(shape, device, tuple(shape["tasks"]))
    per_t = result["tasks"]
    most, few = str(max(shape["tasks"])), "3" if "3" in per_t else str(min(shape["tasks"]))
    top = per_t[most]
    time_x = top["time_x_plain"]["stream"]
    peak_x = None if top["peak_x_plain"] is None else top["peak_x_plain"]["stream"]
    vs_buffer = per_t[few]["stream_time_x_buffer"]
    met = None
    if device.type == "cuda" and peak_x is not None:
        met = bool(time_x <= 1.30 and peak_x <= 1.15 and vs_buffer <= 1.10)
    return [
        _row(
            "many_tasks",
            f"streamed one-backward PCGrad (--surgery-memory stream) vs the plain step at T = {most}, and vs the "
            f"[T, P] buffer at T = {few}; {shape['model']} (random weights), default PALs, {shape['rows']} rows "
            f"of up to {shape['length']} tokens split over T tasks, "
            f"{'bf16/fp16 autocast' if device.type == 'cuda' else 'fp32'}; every T in `tasks`",
            "stream at the most tasks <= 1.30x the plain step's time and <= 1.15x its peak; at T = 3 <= 1.10x "
            "the buffer's time",
            device,
            seconds=top["median_s"],
            ratio=time_x,
            ratio_peak=peak_x,
            ratio_vs_buffer_at_few=vs_buffer,
            ratio_kept=top["time_x_plain"]["stream_kept"],  # auto's streaming (first layers' rows kept)
            ratio_peak_kept=None if top["peak_x_plain"] is None else top["peak_x_plain"]["stream_kept"],
            tasks=per_t,
            met=met,
        )
    ]


RUNNERS = {
    "pal": row_pal,
    "packing": row_packing,
    "pcgrad": row_pcgrad,
    "bandwidth": row_bandwidth,
    "sync": row_sync,
    "memory": row_memory,
    "many_tasks": row_many_tasks,
}


# ----------------------------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    return "n/a" if v is None else f"{v:.2f}x" if isinstance(v, float) else str(v)


def markdown(doc: dict[str, Any]) -> str:
    """The table: one line per row (what it compares, the ratio, the goal, met?)."""
    cpu = any(r.get("cpu_figures") for r in doc["rows"])
    lines = [
        f"## Peers side by side ({doc['device']}, shapes {doc['shapes']})",
        "",
        *(
            ["**CPU figures (rehearsal at tiny shapes): they test the code paths, not the goals.**", ""]
            if cpu
            else []
        ),
        "| row | compares | ratio | goal | met |",
        "|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if "error" in r and "compares" not in r:
            lines.append(f"| {r['row']} | (failed) | n/a | | {r['error'][:120]} |")
            continue
        extra = [
            f"{k.replace('ratio_', '')} {_fmt(r[k])}"
            for k in r
            if k.startswith("ratio_") and r[k] is not None
        ]
        ratio = _fmt(r.get("ratio")) + (f" ({', '.join(extra)})" if extra else "")
        if r["row"] == "sync":
            ratio = ", ".join(
                f"{k}: {'pass' if v['passed'] else 'sync: ' + v['error'][:80]}"
                for k, v in r["results"].items()
            )
        if r["row"] == "memory" and not any(v is not None for v in r["predicted_bytes"].values()):
            ratio = f"measured {r['measured_bytes']}; {r['planner'] if isinstance(r['planner'], str) else 'no prediction'}"
        met = (
            "cpu"
            if r.get("cpu_figures") and r["row"] not in ("sync",)
            else {True: "yes", False: "no"}.get(r.get("met"), "n/a")
        )
        lines.append(f"| {r['row']} | {r['compares']} | {ratio} | {r['goal']} | {met} |")
    return "\n".join(lines) + "\n"


def _row_group(row: str) -> str:
    """The ``--rows`` name a table row comes from (``pal_bf16`` -> ``pal``)."""
    return next((name for name in ROWS if row == name or row.startswith(name + "_")), row)


def run(rows: list[str], shapes: Shapes, device: torch.device, out: str | None) -> dict[str, Any]:
    """Run ``rows`` and write ``out/peers.json`` after each; rows of other names already in a ``peers.json`` there
    for the same device and shapes are kept (the GPU session runs the rows in several steps)."""
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shapes": shapes.name,
        "torch": torch.__version__,
        "rows": [],
    }
    path = os.path.join(out, "peers.json") if out is not None else None
    if path is not None and os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        if (earlier.get("device"), earlier.get("shapes")) == (doc["device"], doc["shapes"]):
            doc["rows"] = [r for r in earlier.get("rows", []) if _row_group(r["row"]) not in rows]
    for name in rows:
        start = time.perf_counter()
        try:
            got = RUNNERS[name](shapes, device)
        except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
            got = [
                {
                    "row": name,
                    "error": f"{type(exc).__name__}: {exc}",
                    "stack": traceback.format_exc()[-4000:],
                }
            ]
        for r in got:
            r["seconds_to_run"] = round(time.perf_counter() - start, 1)
        doc["rows"].extend(got)
        print(f"peers: {name} done in {time.perf_counter() - start:.1f} s", flush=True)
        if path is not None:
            with open(path, "w") as f:
                json.dump(doc, f, indent=1, default=str)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for peers.json")
    parser.add_argument(
        "--shapes", choices=tuple(SHAPES), default=None, help="default: bert-base on CUDA, else tiny"
    )
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        parser.error(f"unknown row(s) {bad}; choose from {', '.join(ROWS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SHAPES[args.shapes or ("bert-base" if device.type == "cuda" else "tiny")]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    doc = run(rows, shapes, device, args.out)
    print(markdown(doc))
    failed = [r["row"] for r in doc["rows"] if "error" in r and _row_group(r["row"]) in rows]
    if failed:
        print(f"rows that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
