"""``fastpals memory``'s planner (``docs/memory.md``): the trainer's own update run on fake tensors with
DeepSpeed's model states, adding up the live tensor storage ``torch.cuda.max_memory_allocated`` would read."""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastpals.data.hub import resolve_model_dir
from fastpals.data.mixed_batches import TaskRows, model_inputs, pack_task_rows
from fastpals.data.tasks import resolve_tasks
from fastpals.encoder.bert import BertConfig, PALConfig
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig
from fastpals.surgery import AGGREGATORS, shared_parameters_by_name
from fastpals.train import memory_mode
from fastpals.train.args import PAL_PRESETS, SURGERY_BUFFER_DTYPES
from fastpals.train.dsconfig import check_ds_config, initialize, load_ds_config
from fastpals.train.errors import ConfigError
from fastpals.train.memory_mode import (
    PRECISIONS,
    SURGERY_MEMORIES,
    GradientBuckets,
    LiveTensorBytes,
    ModelStates,
)
from fastpals.train.optimizer_setup import make_optimizer, optimizer_param_groups
from fastpals.train.step import MicroBatch, Surgery, TorchEngine, run_update

__all__ = [
    "CATEGORY_TEXT",
    "DEVICES",
    "Device",
    "MemoryPlan",
    "StepSpec",
    "StepTrace",
    "load_bert_config",
    "measure_deepspeed_step",
    "measure_step",
    "plan_memory",
    "step_micro_batches",
    "step_model",
    "trace_step",
]

GIB = 2**30
SURGERY_MODES = ("one_backward", "per_task")
#: the parts of the peak (:data:`CATEGORIES`), as printed
CATEGORY_TEXT = {
    "parameters": "parameters (module weights)",
    "gradients": "gradients",
    "optimizer": "optimizer + master states",
    "buckets": "DeepSpeed gradient buckets",
    "activations": "activations (saved by the forward)",
    "surgery": "surgery buffer",
    "temporaries": "temporaries at the peak",
}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SHIPPED_MODELS = ("bert-base-uncased", "bert-large-uncased", "minilm-l6")
_ALIASES = {"sentence-transformers/all-MiniLM-L6-v2": "minilm-l6"}


@dataclass(frozen=True)
class Device:
    """A target: ``usable_bytes`` what it leaves to tensors (GPUs: less the CUDA context and workspaces, the
    caps of ``bench/memory_report.py``); ``why_not``: per precision that does not train there, why."""

    label: str
    usable_bytes: int
    why_not: dict[str, str] = field(default_factory=dict)


#: the targets of ``fastpals memory`` (usable memory: the caps of ``bench/memory_report.py``; ``cpu``: this host)
DEVICES: dict[str, Device] = {
    "t4": Device(
        "T4 16GB", int(14.0 * GIB), {"bf16": "T4 (Turing) has no bf16: train in fp16 (--precision fp16)"}
    ),
    "a100-40": Device("A100 40GB", int(38.5 * GIB)),
    "a100-80": Device("A100 80GB", int(78.0 * GIB)),
    "h100-80": Device("H100 80GB", int(78.0 * GIB)),
    "cpu": Device(
        "this CPU host",
        memory_mode.device_memory_bytes("cpu"),
        {"fp16": "fp16 training needs a CUDA GPU (the trainer refuses it on CPU)"},
    ),
}


def load_bert_config(model: str) -> Any:
    """The :class:`fastpals.encoder.bert.BertConfig` of ``model``: a shipped name (``bert-base-uncased``,
    ``bert-large-uncased``, ``minilm-l6``; offline), a ``config.json`` path, a folder holding one, or a Hugging
    Face Hub name (only its ``config.json`` is fetched). Raises ``ValueError`` (one line) when none is found."""
    name = _ALIASES.get(model, model)
    if name in _SHIPPED_MODELS:
        return BertConfig.from_json(Path(__file__).parents[1] / "configs" / "models" / f"{name}.json")
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
        raise ValueError(
            f"--model {model}: no config.json found ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
            f"use a shipped model ({', '.join(_SHIPPED_MODELS)}), a local folder or a config.json"
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
        """The surgery rows' dtype: ``buffer_dtype``; ``auto``: bf16 with bf16 training, else fp32."""
        auto = "bf16" if self.precision == "bf16" else "fp32"
        return auto if self.buffer_dtype == "auto" else self.buffer_dtype

    @property
    def stage(self) -> int:
        """The ZeRO stage; None means the shipped configs' ``auto``: 1 with fp16/bf16 or several ranks, else 0."""
        auto = int(self.precision != "fp32" or self.world_size > 1)
        return auto if self.zero_stage is None else self.zero_stage

    @property
    def ds_config_name(self) -> str | None:
        """:attr:`ds_config`, or the shipped ``gpu_<precision>_zero<stage>.json`` (fp32: None, defaults)."""
        if self.ds_config is None and self.precision != "fp32":
            return f"gpu_{self.precision}_zero{self.stage}.json"
        return self.ds_config

    def gradient_buckets(self) -> GradientBuckets:
        """The gradient buckets DeepSpeed allocates for each backward (of :attr:`ds_config_name`)."""
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
        return memory_mode.gradient_buckets(cfg, self.precision, self.stage, self.surgery)

    def check(self) -> None:
        """Raise ``ValueError`` (one line naming the option) on a bad field."""
        for option, value, choices in (
            ("--precision", self.precision, PRECISIONS),
            ("--surgery", self.surgery, ("none", *AGGREGATORS)),
            ("--surgery-mode", self.surgery_mode, SURGERY_MODES),
            ("--surgery-memory", self.surgery_memory, SURGERY_MEMORIES),
            ("--surgery-buffer-dtype", self.buffer_dtype, SURGERY_BUFFER_DTYPES),
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
    """The model :func:`trace_step` runs (``spec.model``'s config or ``bert``, seed 0, train mode), cast to
    ``spec.precision`` as DeepSpeed casts it, or fp32 with ``cast=False`` (for a real DeepSpeed engine)."""
    torch.manual_seed(0)
    bert = load_bert_config(spec.model) if bert is None else bert
    # "sst:3": a copy of a built-in task under its own name (``--tasks N`` plans N tasks)
    specs = [
        replace(resolve_tasks([name.split(":")[0]])[0], name=name) if ":" in name else None
        for name in spec.tasks
    ]
    if not any(specs):
        specs = resolve_tasks(list(spec.tasks))
    elif not all(specs):
        raise ValueError("--tasks: give built-in names and files, or a number of tasks, not both")
    preset = PAL_PRESETS[spec.pal]
    pal = None if preset is None else PALConfig(num_tasks=len(specs), **preset)
    if pal is not None:
        pal.validate(bert.num_hidden_layers)
    model = MultiTaskBert(MultiTaskConfig(bert, specs, pal))
    model.bert.set_activation_checkpointing(spec.activation_checkpointing)
    # as DeepSpeed's module.half() / .bfloat16(), in place (fake tensors cannot be swapped by Module.to)
    if cast and spec.precision != "fp32":
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(_DTYPES[spec.precision])
    return model.train()


def step_micro_batches(spec: StepSpec, model: torch.nn.Module, batch_size: int, vocab: int = 0) -> list[Any]:
    """The CPU micro-batches of the update :func:`trace_step` runs: ``batch_size`` examples of
    ``spec.max_length`` tokens (id 1000, label 0); ``vocab``: the vocabulary size (0: ``spec.model``'s)."""
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


def trace_step(spec: StepSpec, batch_size: int, fake: bool = True) -> StepTrace:
    """The predicted peak of one update of ``spec`` at ``batch_size`` examples (per rank): the real update on
    fake tensors with DeepSpeed's model states (``DeepSpeedLikeEngine``); ``fake=False``: ``measure_step``."""
    spec.check()
    bert = load_bert_config(spec.model)
    start = time.perf_counter()
    tracker = LiveTensorBytes(stub_host_reads=fake)
    with FakeTensorMode() if fake else contextlib.nullcontext(), tracker:
        with tracker.phase("parameters"):
            model = step_model(spec, bert=bert)
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:  # a gradient is counted as one from the moment it lands in .grad
            p.register_post_accumulate_grad_hook(
                lambda q: q.grad is not None and tracker.tag(q.grad, "gradients")
            )
        if fake:
            engine: Any = memory_mode.DeepSpeedLikeEngine(
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
            half = fake and spec.precision != "fp32"
            kw = {"grad_setter": engine.grad_setter, "grad_dtype": torch.float32} if half else {}
            memory = memory_mode.surgery_memory_mode(spec.surgery_memory, spec.surgery_mode == "one_backward")
            smaller = memory == "smaller" and spec.world_size == 1  # auto's streaming keeps rows (one rank)
            tokens = batch_size * spec.max_length
            keep = memory_mode.keep_bytes_for(bert, tokens, spec.max_length, spec.precision) if smaller else 0
            rows_dtype = _DTYPES[spec.rows_dtype]
            with tracker.phase("surgery"):
                buffer = memory_mode.task_gradients(
                    memory, shared, len(spec.tasks), rows_dtype, keep, task_params=specific, **kw
                )
            # the buffer's own allocations are the surgery's
            for name in [n for n in ("capture", "apply", "_new_block") if hasattr(buffer, n)]:
                setattr(buffer, name, tracker.phase("surgery")(getattr(buffer, name)))
            surgery = Surgery(buffer, AGGREGATORS[spec.surgery], torch.Generator().manual_seed(0))
        strategy = "none" if surgery is None else (
            "one_backward" if spec.surgery_mode == "one_backward" else "per_task_backward"
        )  # fmt: skip
        updates = 1 if fake else 2
        for u in range(updates):
            with tracker.phase("activations"):
                micro = step_micro_batches(spec, model, batch_size, bert.vocab_size)
            if u == updates - 1:
                # the trainer's optimizer made its moments in the first update
                states = getattr(getattr(engine, "optimizer", None), "state", {}).values()
                for value in [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]:
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


def measure_step(spec: StepSpec, batch_size: int) -> StepTrace:
    """The measured live-tensor peak of the same update on real CPU tensors (fp32, ZeRO-0, the trainer's
    optimizer, after a first update): the CPU validation of :func:`trace_step`."""
    return trace_step(spec, batch_size, fake=False)


def measure_deepspeed_step(spec: StepSpec, batch_size: int, ds_config: str | dict[str, Any]) -> StepTrace:
    """The measured live-tensor peak of the second plain update of ``spec`` on a real DeepSpeed engine on the
    CPU, built as the trainer builds it (``ds_config``: a path, a shipped name or a dict): the CPU check of
    :func:`trace_step`'s DeepSpeed states and buckets. ``at_peak`` is all ``temporaries`` but the weights."""
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
        out = asdict(self)
        out = {"spec": out.pop("spec"), **out, "trace_seconds": out["seconds"]}
        del out["seconds"], out["fake"]
        out["spec"]["zero_stage"] = self.spec.stage
        out["model_states"]["total"] = self.model_states.total
        if self.gradient_buckets is not None:
            out["gradient_buckets"]["bytes"] = self.gradient_buckets.bytes
        out["predicted"] = True
        return out


def _fits(peak: int, device: Device, precision: str) -> dict[str, Any]:
    why = device.why_not.get(precision)
    fits = None if why else peak <= device.usable_bytes
    note = why or f"{(device.usable_bytes - peak) / GIB:+.2f} GiB left"
    return {"label": device.label, "usable_bytes": device.usable_bytes, "fits": fits, "note": note}


def _fit_line(traces: Sequence[StepTrace]) -> tuple[float, float]:
    (b1, p1), (b2, p2) = [(t.batch_size, t.peak_bytes) for t in traces]
    slope = (p2 - p1) / (b2 - b1)
    return p1 - slope * b1, slope


_MAX_PROBE = 32768  # the largest batch largest_batches traces


def largest_batches(
    spec: StepSpec, devices: Sequence[str] = tuple(DEVICES), probes: tuple[int, int] | None = None
) -> tuple[dict[str, int | None], dict[str, float]]:
    """Per device the largest batch that fits, from the line through traces at ``probes`` (16, 32 per task),
    refit at the predicted limit. Returns ``(largest, {"intercept_bytes", "bytes_per_example"})``."""
    t = 1 if spec.surgery_mode == "per_task" and spec.surgery != "none" else len(spec.tasks)
    probes = probes or (16 * t, 32 * t)
    traces = [trace_step(spec, b) for b in probes]
    a, c = _fit_line(traces[-2:])
    usable = [DEVICES[n].usable_bytes for n in devices if spec.precision not in DEVICES[n].why_not]
    # refits where the first two traces sit below the batch-dependent part of the peak
    for _ in range(3 if usable else 0):
        limit = (max(usable) - a) / c if c > 0 else math.inf
        last = traces[-1].batch_size
        if c * last >= 0.5 * traces[-1].peak_bytes or limit <= 2 * last or last >= _MAX_PROBE:
            break  # the batch makes most of the peak already, or the limit is near
        traces.append(trace_step(spec, int(min(limit, _MAX_PROBE))))
        a, c = _fit_line(traces[-2:])
    runs = {n: c > 0 and spec.precision not in DEVICES[n].why_not for n in devices}
    largest = {n: math.floor((DEVICES[n].usable_bytes - a) / c) if runs[n] else 0 for n in devices}
    fit = {"intercept_bytes": a, "bytes_per_example": c}
    return {n: b if b >= 1 else None for n, b in largest.items()}, fit


def plan_memory(
    spec: StepSpec,
    batch_size: int | None = 32,
    max_tokens: int | None = None,
    largest_batch: bool = False,
    every_surgery_memory: bool = False,
) -> MemoryPlan:
    """Predict the peak memory per rank of one training step of ``spec`` at ``batch_size`` examples (or
    ``max_tokens // max_length`` rows), with the largest batch per device and every ``--surgery-memory``
    mode's peak when asked. Raises a one-line ``ValueError`` naming the option on bad input."""
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
    states = memory_mode.model_state_bytes(trace.num_params, spec.precision, spec.stage, spec.world_size)
    devices = {name: _fits(trace.peak_bytes, d, spec.precision) for name, d in DEVICES.items()}
    plan = MemoryPlan(**vars(trace), spec=spec, model_states=states, devices=devices)
    plan.gradient_buckets = spec.gradient_buckets()
    if largest_batch:
        plan.largest_batch, plan.fit = largest_batches(spec)
    if every_surgery_memory and spec.surgery != "none" and spec.surgery_mode == "one_backward":
        plan.surgery_modes = {
            mode: trace.peak_bytes if mode == spec.surgery_memory else
            trace_step(replace(spec, surgery_memory=mode), batch_size).peak_bytes
            for mode in SURGERY_MEMORIES
        }  # fmt: skip
        plan.auto_modes = memory_mode.plan_auto_modes(
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
    mode = s.surgery_mode.replace("_", " ")
    surgery = "none" if s.surgery == "none" else f"{s.surgery} ({mode}, {s.rows_dtype} rows)"
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
    for cat in memory_mode.CATEGORIES:
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
        lb = (plan.largest_batch or {}).get(name)
        extra = "" if plan.largest_batch is None else f"; largest batch {'-' if lb is None else lb}"
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
