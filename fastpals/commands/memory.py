"""``fastpals memory``: the peak memory of one training step, predicted before a GPU is rented (``docs/memory.md``).

:func:`plan_memory` runs the trainer's own update (:func:`fastpals.train.step.run_update`) on fake tensors of a
model built from its ``config.json``, with DeepSpeed's model states (:class:`DeepSpeedLikeEngine`), and adds up the
live tensor storage (:class:`LiveTensorBytes`): the peak ``torch.cuda.max_memory_allocated`` would read. Also the
command line (:func:`main`), the largest-batch table of ``docs/memory.md`` (:func:`memory_table`) and the charts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastpals.data.hub import resolve_model_dir
from fastpals.data.mixed_batches import TaskRows, model_inputs, pack_task_rows
from fastpals.data.tasks import resolve_tasks
from fastpals.encoder.bert import BertConfig, PALConfig
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig
from fastpals.surgery import AGGREGATORS, shared_parameters_by_name
from fastpals.train.args import PAL_PRESETS
from fastpals.train.distributed import initialize
from fastpals.train.dsconfig import check_ds_config, load_ds_config
from fastpals.train.errors import ConfigError
from fastpals.train.memory_mode import (
    SURGERY_MEMORIES,
    device_memory_bytes,
    keep_bytes_for,
    plan_auto_modes,
    surgery_memory_mode,
    task_gradients,
)
from fastpals.train.memory_states import (
    CATEGORIES,
    PRECISIONS,
    DeepSpeedLikeEngine,
    GradientBuckets,
    LiveTensorBytes,
    ModelStates,
    gradient_buckets,
    model_state_bytes,
)
from fastpals.train.optimizer_setup import make_optimizer, optimizer_param_groups
from fastpals.train.step import MicroBatch, Surgery, TorchEngine, run_update

__all__ = [
    "CATEGORIES",
    "CATEGORY_TEXT",
    "DEVICES",
    "DOCS_COMMAND",
    "Device",
    "GradientBuckets",
    "DeepSpeedLikeEngine",
    "LiveTensorBytes",
    "MemoryPlan",
    "ModelStates",
    "StepSpec",
    "StepTrace",
    "TableLine",
    "load_bert_config",
    "main",
    "measure_deepspeed_step",
    "measure_step",
    "memory_table",
    "model_state_bytes",
    "plan_memory",
    "plot_plan",
    "plot_table",
    "predict_peak_bytes",
    "step_micro_batches",
    "step_model",
    "trace_step",
]

GIB = 2**30
SURGERY_MODES = ("one_backward", "per_task")
BUFFER_DTYPES = ("auto", "fp32", "bf16")
#: the parts of the peak (:data:`CATEGORIES`), as printed
_CATEGORY_LABELS = (
    "parameters (module weights)",
    "gradients",
    "optimizer + master states",
    "DeepSpeed gradient buckets",
    "activations (saved by the forward)",
    "surgery buffer",
    "temporaries at the peak",
)
CATEGORY_TEXT = dict(zip(CATEGORIES, _CATEGORY_LABELS))
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SHIPPED_MODELS = {
    "bert-base-uncased": "bert-base-uncased.json",
    "bert-large-uncased": "bert-large-uncased.json",
    "minilm-l6": "minilm-l6.json",
    "sentence-transformers/all-MiniLM-L6-v2": "minilm-l6.json",
}


@dataclass(frozen=True)
class Device:
    """A target: ``usable_bytes`` is what the device leaves to tensors (for GPUs the card's memory less the CUDA
    context and library workspaces, as ``bench/memory_report.py`` caps the allocator); ``bf16``/``fp16``: whether
    training in that precision runs there."""

    name: str
    label: str
    usable_bytes: int
    bf16: bool = True
    fp16: bool = True
    why_not: dict[str, str] = field(default_factory=dict)

    def supports(self, precision: str) -> str | None:
        """None when ``precision`` trains on this device, else why not (one line)."""
        if getattr(self, precision, True):
            return None
        return self.why_not.get(precision, f"no {precision}")


#: the targets of ``fastpals memory`` (usable memory: the caps of ``bench/memory_report.py``; ``cpu``: this host)
DEVICES: dict[str, Device] = {
    "t4": Device(
        "t4",
        "T4 16GB",
        int(14.0 * GIB),
        bf16=False,
        why_not={"bf16": "T4 (Turing) has no bf16: train in fp16 (--precision fp16)"},
    ),  # fmt: skip
    "a100-40": Device("a100-40", "A100 40GB", int(38.5 * GIB)),
    "a100-80": Device("a100-80", "A100 80GB", int(78.0 * GIB)),
    "h100-80": Device("h100-80", "H100 80GB", int(78.0 * GIB)),
    "cpu": Device(
        "cpu",
        "this CPU host",
        device_memory_bytes("cpu"),
        fp16=False,
        why_not={"fp16": "fp16 training needs a CUDA GPU (the trainer refuses it on CPU)"},
    ),  # fmt: skip
}


def load_bert_config(model: str) -> Any:
    """The :class:`fastpals.encoder.bert.BertConfig` of ``model``: a shipped name (``bert-base-uncased``,
    ``bert-large-uncased``, ``minilm-l6``; offline), a ``config.json`` path, a folder holding one, or a Hugging
    Face Hub name (only its ``config.json`` is fetched). Raises ``ValueError`` (one line) when none is found."""
    if model in _SHIPPED_MODELS:
        return BertConfig.from_json(Path(__file__).parents[1] / "configs" / "models" / _SHIPPED_MODELS[model])
    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(
            f"--model {model}: the folder has no config.json; give the folder of a BERT checkpoint"
        )
    if path.exists():
        return BertConfig.from_json(path / "config.json" if path.is_dir() else path)
    try:
        return BertConfig.from_json(resolve_model_dir(model, files=("config.json",)) / "config.json")
    except Exception as err:  # noqa: BLE001 - any failure to fetch is the same advice
        shipped = ", ".join(n for n in _SHIPPED_MODELS if "/" not in n)
        raise ValueError(
            f"--model {model}: no config.json found ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
            f"use a shipped model ({shipped}), a local folder or a config.json"
        ) from None


@dataclass(frozen=True)
class StepSpec:
    """One training configuration of :func:`plan_memory` (the fields: ``fastpals memory --help``). Every example
    is ``max_length`` tokens (the worst case of a packed batch); ``surgery_mode`` ``one_backward`` is
    ``--batching mixed``, ``per_task`` one backward per task's micro-batch; ``ds_config`` sets the gradient
    buckets (None: the shipped ``gpu_<precision>_zero<stage>.json`` for fp16/bf16, DeepSpeed's defaults for fp32)."""

    model: str = "minilm-l6"
    tasks: tuple[str, ...] = ("sst", "para", "sts")
    max_length: int = 128
    precision: str = "bf16"
    pal: str = "default"
    surgery: str = "none"
    surgery_mode: str = "one_backward"
    buffer_dtype: str = "auto"
    surgery_memory: str = "buffer"
    zero_stage: int | None = None
    world_size: int = 1
    activation_checkpointing: bool = False
    ds_config: str | None = None

    @property
    def rows_dtype(self) -> str:
        """The surgery rows' dtype: ``buffer_dtype``, where ``auto`` follows the training precision as the trainer
        does (bf16 rows with bf16 training, else fp32)."""
        if self.buffer_dtype != "auto":
            return self.buffer_dtype
        return "bf16" if self.precision == "bf16" else "fp32"

    @property
    def stage(self) -> int:
        """The ZeRO stage; None means the shipped configs' ``auto``: 1 with fp16/bf16 or several ranks, else 0."""
        if self.zero_stage is not None:
            return self.zero_stage
        return int(self.precision != "fp32" or self.world_size > 1)

    @property
    def ds_config_name(self) -> str | None:
        """:attr:`ds_config`, or the shipped ``gpu_<precision>_zero<stage>.json`` for fp16/bf16 (None for fp32:
        DeepSpeed's defaults)."""
        if self.ds_config is None and self.precision != "fp32":
            return f"gpu_{self.precision}_zero{self.stage}.json"
        return self.ds_config

    def gradient_buckets(self) -> GradientBuckets:
        """The gradient buckets DeepSpeed allocates for each backward of this run
        (:func:`fastpals.train.memory_states.gradient_buckets` of :attr:`ds_config`)."""
        name = self.ds_config_name
        try:
            cfg = load_ds_config(name) if name is not None else None
        except ConfigError as err:
            raise ValueError(str(err).splitlines()[0]) from None
        stage = ((cfg or {}).get("zero_optimization") or {}).get("stage", self.stage)
        if self.ds_config is not None and isinstance(stage, int) and stage != self.stage:
            raise ValueError(
                f"--ds-config {self.ds_config} has zero_optimization.stage {stage} but the plan is ZeRO-{self.stage}:"
                f" give --zero-stage {stage}"
            )
        return gradient_buckets(cfg, self.precision, self.stage, self.surgery)

    def check(self) -> None:
        """Raise ``ValueError`` (one line naming the option) on a bad field."""
        for option, value, choices in (
            ("--precision", self.precision, PRECISIONS),
            ("--surgery", self.surgery, ("none", *AGGREGATORS)),
            ("--surgery-mode", self.surgery_mode, SURGERY_MODES),
            ("--surgery-memory", self.surgery_memory, SURGERY_MEMORIES),
            ("--surgery-buffer-dtype", self.buffer_dtype, BUFFER_DTYPES),
            ("--pal", self.pal, tuple(PAL_PRESETS)),
        ):
            if value not in choices:
                raise ValueError(f"{option} {value!r}: choose one of {', '.join(choices)}")
        if self.surgery != "none" and len(self.tasks) < 2:
            raise ValueError("--surgery needs at least two --tasks")
        if self.surgery_memory != "buffer" and self.surgery_mode != "one_backward":
            raise ValueError(
                "--surgery-memory stream/auto is for one-backward surgery (--surgery-mode one_backward)"
            )
        if not 8 <= self.max_length <= 512:
            raise ValueError(f"--max-length must be in [8, 512], got {self.max_length}")
        if self.stage not in (0, 1, 2):
            raise ValueError(
                f"--zero-stage {self.stage}: fastpals trains with ZeRO 0, 1 or 2 (ZeRO-3 partitions the stacked "
                f"per-task PAL weights and is not supported)"
            )
        if self.world_size < 1:
            raise ValueError(f"--world-size {self.world_size}: give 1 or more ranks")


def step_model(spec: StepSpec, cast: bool = True, bert: Any = None) -> torch.nn.Module:
    """The model :func:`trace_step` runs (``spec.model``'s config or ``bert``, random weights from seed 0, train
    mode, on the default device): cast to ``spec.precision`` as DeepSpeed casts it, or fp32 with ``cast=False`` (for
    a real DeepSpeed engine to cast)."""
    torch.manual_seed(0)
    bert = load_bert_config(spec.model) if bert is None else bert
    # "sst:3": a copy of a built-in task under its own name (``--tasks N`` plans N tasks)
    specs = [
        dataclasses.replace(resolve_tasks([name.split(":")[0]])[0], name=name) if ":" in name else None
        for name in spec.tasks
    ]
    if not any(specs):
        specs = resolve_tasks(list(spec.tasks))
    elif not all(specs):
        raise ValueError("--tasks: give built-in names and files, or a number of tasks, not both")
    preset = PAL_PRESETS[spec.pal]
    pal = None
    if preset is not None:
        pal = PALConfig(num_tasks=len(specs), **preset)
        pal.validate(bert.num_hidden_layers)
    model = MultiTaskBert(MultiTaskConfig(bert, specs, pal))
    model.bert.set_activation_checkpointing(spec.activation_checkpointing)
    # as DeepSpeed's module.half() / .bfloat16(), in place (fake tensors cannot be swapped by Module.to)
    if cast and spec.precision != "fp32":
        dtype = _DTYPES[spec.precision]
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    t.data = t.data.to(dtype)
    return model.train()


def step_micro_batches(spec: StepSpec, model: torch.nn.Module, batch_size: int, vocab: int = 0) -> list[Any]:
    """The micro-batches (:class:`fastpals.train.step.MicroBatch`, on the CPU) of the update :func:`trace_step`
    runs at ``batch_size`` examples of ``spec.max_length`` tokens (token id 1000, valid label 0); ``vocab``: the
    vocabulary size (0: ``spec.model``'s)."""
    vocab = vocab or load_bert_config(spec.model).vocab_size
    num_tasks = len(model.tasks)
    ids = [min(1000, vocab - 1)] * spec.max_length
    types = [0] * spec.max_length

    def rows(t: int, n: int) -> Any:
        return TaskRows(t, [ids] * n, [types] * n, labels=torch.zeros(n))

    def micro(parts: list[Any], weighting: str | None) -> Any:
        batch = pack_task_rows(parts, num_tasks)
        tasks = tuple(p.task for p in parts)
        return MicroBatch(
            model_inputs(batch, "cpu"), batch["labels"], tasks, tuple(len(p.input_ids) for p in parts),
            tuple(len(p.input_ids) * spec.max_length for p in parts), weighting,
        )  # fmt: skip

    if spec.surgery != "none" and spec.surgery_mode == "per_task":
        return [micro([rows(t, batch_size)], None) for t in range(num_tasks)]
    counts = [batch_size // num_tasks + (t < batch_size % num_tasks) for t in range(num_tasks)]
    return [micro([rows(t, n) for t, n in enumerate(counts) if n], "equal")]


class _PhasedTorchEngine(TorchEngine):
    """:class:`fastpals.train.step.TorchEngine` (fp32, no accumulation) telling ``tracker`` the phases."""

    tracker: LiveTensorBytes

    def __call__(self, **inputs: Any) -> Any:
        self.tracker.set_phase("activations")
        return super().__call__(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        self.tracker.set_phase("temporaries")
        super().backward(loss)

    def step(self) -> None:
        self.tracker.set_phase("temporaries")
        super().step()


@dataclass
class StepTrace:
    """One traced (or measured) step: ``peak_bytes`` of live tensor storage during the update, ``at_peak`` its
    parts (:data:`CATEGORIES`), ``peak_phase`` where it happened, ``num_params`` (trainable), ``seconds``."""

    batch_size: int
    peak_bytes: int
    at_peak: dict[str, int]
    peak_phase: str
    num_params: int
    shared_params: int
    seconds: float
    fake: bool


def _run_step(spec: StepSpec, batch_size: int, fake: bool, warmup: bool = False) -> StepTrace:
    """Build and run one update of ``spec`` (see :func:`trace_step`); ``fake=False``: real tensors, the trainer's
    optimizer (fp32 only) and, with ``warmup``, a first update before the measured one."""
    spec.check()
    bert = load_bert_config(spec.model)
    start = time.perf_counter()
    tracker = LiveTensorBytes(stub_host_reads=fake)
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode, tracker:
        with tracker.phase("parameters"):
            model = step_model(spec, bert=bert)
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:  # a gradient is counted as one from the moment it lands in .grad
            p.register_post_accumulate_grad_hook(
                lambda q: q.grad is not None and tracker.tag(q.grad, "gradients")
            )
        if fake:
            engine: Any = DeepSpeedLikeEngine(
                model, spec.precision, spec.stage, spec.world_size, tracker, spec.gradient_buckets()
            )
        else:
            if spec.precision != "fp32" or spec.stage != 0 or spec.world_size != 1:
                raise ValueError("measure_step runs fp32, ZeRO-0, one rank (the trainer's CPU default)")
            opt = make_optimizer(optimizer_param_groups(model, 2e-5, 2e-5, 2e-5, 0.01), "adamw")
            engine = _PhasedTorchEngine(model, opt)
            engine.tracker = tracker
        surgery = None
        if spec.surgery != "none":
            shared, specific = shared_parameters_by_name(model)
            kw: dict[str, Any] = {}
            if fake and spec.precision != "fp32":
                kw = {"grad_setter": engine.grad_setter, "grad_dtype": torch.float32}
            with tracker.phase("surgery"):
                memory = surgery_memory_mode(spec.surgery_memory, spec.surgery_mode == "one_backward")
                keep = 0
                if memory == "smaller" and spec.world_size == 1:  # auto's streaming (one rank)
                    keep = keep_bytes_for(bert, batch_size * spec.max_length, spec.max_length, spec.precision)
                rows_dtype = _DTYPES[spec.rows_dtype]
                buffer = task_gradients(
                    memory, shared, len(spec.tasks), rows_dtype, keep, task_params=specific, **kw
                )
            # the buffer's own allocations are the surgery's
            for name in [n for n in ("capture", "apply", "_new_block") if hasattr(buffer, n)]:
                method = getattr(buffer, name)

                def wrapped(*a: Any, _m: Any = method, **k: Any) -> Any:
                    with tracker.phase("surgery"):
                        return _m(*a, **k)

                setattr(buffer, name, wrapped)
            surgery = Surgery(buffer, AGGREGATORS[spec.surgery], torch.Generator().manual_seed(0))
        strategy = "none" if surgery is None else (
            "one_backward" if spec.surgery_mode == "one_backward" else "per_task_backward"
        )  # fmt: skip
        updates = 2 if warmup else 1
        for u in range(updates):
            with tracker.phase("activations"):
                micro = step_micro_batches(spec, model, batch_size, bert.vocab_size)
            if u == updates - 1:
                for state in getattr(getattr(engine, "optimizer", None), "state", {}).values():
                    # the trainer's optimizer made its moments in the first update
                    for value in state.values():
                        if isinstance(value, torch.Tensor):
                            tracker.tag(value, "optimizer")
                tracker.set_phase("temporaries")
                tracker.reset_peak()
            engine_phase = tracker.category
            run_update(engine, micro, strategy, surgery=surgery)
            tracker.set_phase(engine_phase)
            del micro
        shared_numel = sum(p.numel() for p in shared) if surgery is not None else 0
        peak, at_peak, phase = tracker.peak, dict(tracker.at_peak), tracker.peak_phase
        numel = sum(p.numel() for p in trainable)
    return StepTrace(batch_size, peak, at_peak, phase, numel, shared_numel, time.perf_counter() - start, fake)


def trace_step(spec: StepSpec, batch_size: int) -> StepTrace:
    """The predicted peak of one update of ``spec`` at ``batch_size`` examples (per rank): the real update on
    fake tensors with DeepSpeed's model states (:class:`DeepSpeedLikeEngine`). Takes seconds, needs no weights."""
    return _run_step(spec, batch_size, fake=True)


def measure_step(spec: StepSpec, batch_size: int) -> StepTrace:
    """The measured peak of live tensor storage of the same update on real CPU tensors (fp32, ZeRO-0: the
    trainer's CPU default), with the trainer's optimizer and a first update before the measured one (its
    optimizer states exist, as in training). The CPU validation of :func:`trace_step`."""
    return _run_step(spec, batch_size, fake=False, warmup=True)


def measure_deepspeed_step(spec: StepSpec, batch_size: int, ds_config: str | dict[str, Any]) -> StepTrace:
    """The measured peak of live tensor storage of one update of ``spec`` on a real DeepSpeed engine on the CPU
    (``ds_config``: a path, a shipped name or a dict; checked as the trainer checks it), built as the trainer
    builds it (fp32 model that DeepSpeed casts, the trainer's AdamW groups), after a first update: the CPU check
    of :func:`trace_step`'s DeepSpeed states and gradient buckets with the same tracker. No surgery; ``at_peak``
    is all ``temporaries`` but the module's weights."""

    if spec.surgery != "none":
        raise ValueError("measure_deepspeed_step runs the plain step (--surgery none)")
    cfg = load_ds_config(ds_config) if not isinstance(ds_config, dict) else ds_config
    cfg = check_ds_config(cfg, batch_size, 1, cuda=False, native_bf16=True)
    start = time.perf_counter()
    tracker = LiveTensorBytes()
    with tracker:
        with tracker.phase("parameters"):
            model = step_model(spec, cast=False)
        optimizer = make_optimizer(optimizer_param_groups(model, 2e-5, 2e-5, 2e-5, 0.01), "adamw")
        engine, *_ = initialize(model, optimizer, None, cfg)
        numel = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        for update in range(2):  # the first makes the optimizer states; the second is measured
            micro = step_micro_batches(spec, engine.module, batch_size)
            gc.collect()
            if update == 1:
                tracker.set_phase("temporaries")
                tracker.reset_peak()
            run_update(engine, micro, "none")
            del micro
    return StepTrace(
        batch_size, tracker.peak, dict(tracker.at_peak), tracker.peak_phase, numel, 0,
        time.perf_counter() - start, False,
    )  # fmt: skip


def predict_peak_bytes(
    model: str = "bert-base-uncased",
    batch_size: int = 32,
    max_length: int = 128,
    precision: str = "bf16",
    surgery: str = "none",
    **spec_fields: Any,
) -> int:
    """Predicted peak bytes of tensor storage per rank for one update (what ``torch.cuda.max_memory_allocated``
    measures over a steady-state update): the function a GPU session compares its measurement with.
    ``spec_fields``: the other :class:`StepSpec` fields (``tasks``, ``pal``, ``surgery_mode``, ``zero_stage``...)."""
    spec = StepSpec(model=model, max_length=max_length, precision=precision, surgery=surgery, **spec_fields)
    return trace_step(spec, batch_size).peak_bytes


@dataclass
class MemoryPlan(StepTrace):
    """What :func:`plan_memory` predicts for one configuration (bytes are per rank): the traced step, and
    ``model_states``: DeepSpeed's steady model states (:func:`model_state_bytes`); ``devices``: per :data:`DEVICES`
    name ``{"label", "usable_bytes", "fits" (bool, or None where the precision does not run there), "note"}``;
    ``fit``: ``{"intercept_bytes", "bytes_per_example"}`` of ``peak(b) = a + c b`` (with ``largest_batch``);
    ``largest_batch``: per device the largest batch that fits (None: not even 1, or the precision does not run)."""

    spec: StepSpec
    model_states: ModelStates
    devices: dict[str, dict[str, Any]]
    fit: dict[str, float] | None = None
    largest_batch: dict[str, int | None] | None = None
    surgery_modes: dict[str, int] | None = None
    #: per device, what ``--surgery-memory auto`` picks there (fastpals.train.memory_mode.plan_auto_modes)
    auto_modes: dict[str, dict[str, str]] | None = None
    #: DeepSpeed's gradient buckets of each backward (counted in the trace, ``at_peak["buckets"]`` where live)
    gradient_buckets: GradientBuckets | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``--json``)."""
        out = dataclasses.asdict(self)
        out = {"spec": out.pop("spec"), **out, "trace_seconds": out["seconds"]}
        del out["seconds"], out["fake"]
        out["spec"]["zero_stage"] = self.spec.stage
        out["model_states"]["total"] = self.model_states.total
        if self.gradient_buckets is not None:
            out["gradient_buckets"]["bytes"] = self.gradient_buckets.bytes
        out["predicted"] = True
        return out


def _fits(peak: int, device: Device, precision: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"label": device.label, "usable_bytes": device.usable_bytes}
    if why := device.supports(precision):
        return {**entry, "fits": None, "note": why}
    return {
        **entry,
        "fits": peak <= device.usable_bytes,
        "note": f"{(device.usable_bytes - peak) / GIB:+.2f} GiB left",
    }


def _fit_line(traces: Sequence[StepTrace]) -> tuple[float, float]:
    (b1, p1), (b2, p2) = [(t.batch_size, t.peak_bytes) for t in traces]
    slope = (p2 - p1) / (b2 - b1)
    return p1 - slope * b1, slope


#: extra traces of :func:`largest_batches` where the first two sit below the batch-dependent part of the peak
_REFINE_STEPS = 3
#: the largest batch :func:`largest_batches` traces
_MAX_PROBE = 32768


def largest_batches(
    spec: StepSpec, devices: Sequence[str] = tuple(DEVICES), probes: tuple[int, int] | None = None
) -> tuple[dict[str, int | None], dict[str, float]]:
    """Per device the largest batch whose predicted peak fits, from the straight line through two traces at
    ``probes`` (default 16 and 32 examples per task; the peak is linear in the batch, ``tests/test_memory.py``).
    Where the batch-proportional part of the line is under half the last trace's peak (model states and surgery
    rows dominate), up to :data:`_REFINE_STEPS` more traces at the predicted limit refit the line. Returns
    ``(largest, {"intercept_bytes", "bytes_per_example"})``."""
    t = len(spec.tasks)
    probes = probes or (
        (16, 32) if spec.surgery_mode == "per_task" and spec.surgery != "none" else (16 * t, 32 * t)
    )
    traces = [trace_step(spec, b) for b in probes]
    a, c = _fit_line(traces[-2:])
    usable = [DEVICES[n].usable_bytes for n in devices if DEVICES[n].supports(spec.precision) is None]
    for _ in range(_REFINE_STEPS if usable else 0):
        limit = (max(usable) - a) / c if c > 0 else math.inf
        last = traces[-1].batch_size
        if c * last >= 0.5 * traces[-1].peak_bytes or limit <= 2 * last or last >= _MAX_PROBE:
            break  # the batch makes most of the peak already, or the limit is near
        traces.append(trace_step(spec, int(min(limit, _MAX_PROBE))))
        a, c = _fit_line(traces[-2:])
    runs = {n: c > 0 and DEVICES[n].supports(spec.precision) is None for n in devices}
    largest = {n: math.floor((DEVICES[n].usable_bytes - a) / c) if runs[n] else 0 for n in devices}
    return {n: b if b >= 1 else None for n, b in largest.items()}, {
        "intercept_bytes": a,
        "bytes_per_example": c,
    }


def plan_memory(
    spec: StepSpec,
    batch_size: int | None = 32,
    max_tokens: int | None = None,
    largest_batch: bool = False,
    every_surgery_memory: bool = False,
) -> MemoryPlan:
    """Predict the peak memory per rank of one training step of ``spec`` at ``batch_size`` examples (or
    ``max_tokens // max_length`` full-length rows), traced on fake tensors (:func:`trace_step`).
    ``largest_batch`` adds the largest batch per device; ``every_surgery_memory`` traces every
    ``--surgery-memory`` mode too. Raises a one-line ``ValueError`` naming the option on bad input."""
    spec.check()
    if max_tokens is not None:
        if max_tokens < spec.max_length:
            raise ValueError(
                f"--max-tokens {max_tokens} holds no row of --max-length {spec.max_length}: give at least that many"
            )
        batch_size = max_tokens // spec.max_length
    if batch_size is None or batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if spec.surgery_mode == "one_backward" and spec.surgery != "none" and batch_size < len(spec.tasks):
        raise ValueError(
            f"--batch-size {batch_size} is smaller than the {len(spec.tasks)} tasks: a mixed micro-batch needs one "
            f"example per task for one-backward surgery; give --batch-size >= {len(spec.tasks)}"
        )
    trace = trace_step(spec, batch_size)
    states = model_state_bytes(trace.num_params, spec.precision, spec.stage, spec.world_size)
    devices = {name: _fits(trace.peak_bytes, d, spec.precision) for name, d in DEVICES.items()}
    plan = MemoryPlan(**vars(trace), spec=spec, model_states=states, devices=devices)
    plan.gradient_buckets = spec.gradient_buckets()
    if largest_batch:
        plan.largest_batch, plan.fit = largest_batches(spec)
    if every_surgery_memory and spec.surgery != "none" and spec.surgery_mode == "one_backward":
        plan.surgery_modes = {
            mode: trace.peak_bytes if mode == spec.surgery_memory else
            trace_step(dataclasses.replace(spec, surgery_memory=mode), batch_size).peak_bytes
            for mode in SURGERY_MEMORIES
        }  # fmt: skip

        plan.auto_modes = plan_auto_modes(
            load_bert_config(spec.model), len(spec.tasks), trace.shared_params, batch_size * spec.max_length,
            spec.max_length, spec.precision, spec.rows_dtype, spec.buffer_dtype, plan.surgery_modes["buffer"],
            {name: d.usable_bytes for name, d in DEVICES.items()},
        )  # fmt: skip
    return plan


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def format_plan(plan: MemoryPlan) -> str:
    """The text ``fastpals memory`` prints."""
    s = plan.spec
    surgery = (
        "none"
        if s.surgery == "none"
        else f"{s.surgery} ({s.surgery_mode.replace('_', ' ')}, {s.rows_dtype} rows)"
    )
    batch = (
        f"{plan.batch_size} examples per task micro-batch ({len(s.tasks)} backwards)"
        if s.surgery != "none" and s.surgery_mode == "per_task"
        else f"batch {plan.batch_size}"
    )
    lines = [
        f"model {s.model}: {plan.num_params / 1e6:.1f} M trainable parameters; tasks {','.join(s.tasks)}; "
        f"PAL {s.pal}; surgery {surgery}",
        f"{batch} x {s.max_length} tokens; {s.precision}; ZeRO-{s.stage} on {s.world_size} rank(s)"
        + ("; activation checkpointing" if s.activation_checkpointing else ""),
        f"predicted peak of one training step, per rank: {_gib(plan.peak_bytes)} (tensor storage, as "
        f"torch.cuda.max_memory_allocated; traced on fake tensors in {plan.seconds:.1f} s)",
        "at the peak:",
    ]
    for cat in CATEGORIES:
        lines.append(f"  {CATEGORY_TEXT[cat]:<38} {_gib(plan.at_peak.get(cat, 0)):>11}")
    m = plan.model_states
    lines.append(
        f"DeepSpeed model states (steady, per rank): weights {_gib(m.params)}, gradients {_gib(m.gradients)}, "
        f"fp32 master {_gib(m.master)}, fp32 gradient partition {_gib(m.fp32_gradients)} (made at the step), "
        f"AdamW moments {_gib(m.optimizer)}: {_gib(m.total)}"
    )
    if plan.gradient_buckets is not None:
        b = plan.gradient_buckets
        lines.append(
            f"DeepSpeed gradient buckets (each backward, per rank): {_gib(b.bytes)} ({b.why}; "
            f"{s.ds_config_name or 'DeepSpeed defaults'})"
            if b.count
            else f"DeepSpeed gradient buckets: none ({b.why})"
        )
    if plan.surgery_modes is not None:
        rows = len(s.tasks) * plan.shared_params * (2 if s.rows_dtype == "bf16" else 4)
        lines.append(
            f"surgery memory modes (--surgery-memory; predicted peak per rank): buffer "
            f"{_gib(plan.surgery_modes['buffer'])} ([T, P] rows: {_gib(rows)}), stream "
            f"{_gib(plan.surgery_modes['stream'])}, auto's streaming {_gib(plan.surgery_modes['auto'])} (each "
            f"layer's task rows kept where smaller than its kept activations, and the first layers' within half "
            f"the activations); this plan: {s.surgery_memory}; "
            f"auto picks per device (below): the buffer where its peak fits with a margin and its rows are small "
            f"beside the activations, else streaming"
        )
    lines.append("fits (memory left to tensors):")
    for name, d in plan.devices.items():
        verdict = "n/a" if d["fits"] is None else ("fits" if d["fits"] else "does NOT fit")
        extra = ""
        if plan.largest_batch is not None:
            lb = plan.largest_batch.get(name)
            extra = f"; largest batch {lb if lb is not None else '-'}"
        if plan.auto_modes is not None:
            pick = plan.auto_modes[name]
            extra += f"; auto: {pick['mode']} ({pick['why']})"
        lines.append(
            f"  {name:<8} {d['label']:<14} {_gib(d['usable_bytes']):>10}  {verdict:<12} {d['note']}{extra}"
        )
    if plan.fit is not None:
        lines.append(
            f"largest batch: peak(b) = {_gib(plan.fit['intercept_bytes'])} + b x "
            f"{plan.fit['bytes_per_example'] / 2**20:.1f} MiB (two traces; linear in b)"
        )
    return "\n".join(lines)


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
    """The markdown of ``docs/memory.md``: the predicted largest batch at ``max_length`` on each GPU for BERT-base
    and BERT-large, plain / PAL / PAL + PCGrad (one backward), without and with activation checkpointing,
    fp16 / bf16, tasks sst, para, sts, ZeRO-1, one rank. ``chart``: also write the chart of the bf16 lines
    (:func:`plot_table`) there, linked from the markdown."""
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
            "Measured on the CPU, and the checks against real steps: [measurements.md](measurements.md#memory).",
            "",
        ]
    )


#: one line of :func:`plot_table`: model, variant label, precision, intercept bytes ``a``, bytes per example ``c``
TableLine = tuple[str, str, str, float, float]


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
    lines: Sequence[TableLine],
    gpus: Sequence[tuple[str, int]],
    path: str | Path,
    precision: str = "bf16",
    max_length: int = 128,
) -> Path:
    """Write the chart of ``docs/memory.md``: per model a panel with ``peak(b) = a + c b`` (GiB) for every variant
    of ``lines`` in ``precision`` over the batch sizes up to the largest that fits the largest GPU, and a dashed
    line at each GPU's ``(label, usable bytes)`` of ``gpus``. Returns the path written."""

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
        ax.set_xlabel("batch size (examples)")
        ax.set_ylabel("predicted peak (GiB)")
        ax.set_ylim(0, top * 1.05)
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
    ax.set_xlim(-0.5, 1.8)
    ax.set_ylim(0, max([bottom * 1.15] + [u * 1.05 for _, u in shown]))
    ax.set_ylabel("GiB")
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
        "--surgery", choices=("none", *AGGREGATORS), default="none", help="the surgery's aggregator"
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
            spec, args.batch_size, args.max_tokens, args.largest_batch, not args.surgery_memory
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
