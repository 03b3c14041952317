"""``--surgery-memory buffer|stream|auto``: what one-backward surgery builds and what ``auto`` picks; what a
training step's memory is made of, for :mod:`fastpals.commands.memory`: DeepSpeed's model states and gradient
buckets, a live-tensor tracker and an engine holding those states around the real update."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fastpals.surgery import (
    AGGREGATORS,
    StreamingTaskGradients,
    TaskGradientBuffer,
    TaskGradients,
    shared_parameters_by_name,
)

#: ``--surgery-memory`` of one-backward surgery: the [T, P] buffer, streaming, or auto
SURGERY_MEMORIES = ("buffer", "stream", "auto")
#: what each mode of :func:`surgery_memory_mode` holds (the run's set-up line says it)
SURGERY_MEMORY_TEXT = {
    "buffer": "buffer memory mode ([tasks, shared parameters] gradient rows)",
    "stream": "stream memory mode (Gram layer by layer, no [tasks, shared parameters] rows)",
    "smaller": "auto memory mode: streaming, with a layer's task rows kept where smaller than its kept activations "
    "and the first layers' within a budget",
}

#: the buffer is kept only while its predicted peak is at most this share of the device's memory
FIT_SHARE = 0.9
#: ... and while its ``[T, P]`` rows are at most this share of the step's activations
ROWS_SHARE = 1.0
#: ``auto``'s streaming keeps the first layers' Linear task rows within this share of the activations
KEEP_SHARE = 0.5
#: bytes per saved activation element: fp32, and fp16/bf16 training (some saved tensors stay fp32 or bool)
_ELEMENT_BYTES = {"fp32": 4.0, "bf16": 2.4, "fp16": 2.4}
#: saved elements per token and layer (fitted to traces): ``_PER_HIDDEN * hidden + _PER_SCORE * heads * L``
_PER_HIDDEN, _PER_SCORE = 24.0, 3.4


@dataclass(frozen=True)
class MemoryModeChoice:
    """:func:`choose_memory_mode`'s ``mode`` (``buffer`` or ``stream``), ``why`` (one line) and, for
    ``stream``, ``keep_bytes`` (the budget of kept Linear rows)."""

    mode: str
    why: str
    keep_bytes: int = 0


def surgery_memory_mode(
    option: str, one_backward: bool, buffer_dtype: str = "fp32", auto_pick: str | None = None
) -> str:
    """``--surgery-memory`` -> ``buffer``, ``stream`` or ``smaller`` (``auto``'s streaming); ``auto`` is the
    buffer with per-task backwards, bf16 rows, or where ``auto_pick`` is ``buffer``."""
    if option != "auto":
        return option
    return "buffer" if not one_backward or buffer_dtype == "bf16" or auto_pick == "buffer" else "smaller"


def task_gradients(
    memory: str,
    params: list[torch.nn.Parameter],
    num_tasks: int,
    dtype: torch.dtype | None = None,
    keep_bytes: int = 0,
    **kwargs: Any,
) -> TaskGradients:
    """The per-task gradients of a :func:`surgery_memory_mode`: a ``TaskGradientBuffer`` of ``dtype`` rows or
    ``StreamingTaskGradients`` (``smaller``: ``keep_bytes`` of kept Linear rows); ``kwargs`` go to either."""
    if memory not in SURGERY_MEMORY_TEXT:
        raise ValueError(f"surgery memory {memory!r}: choose one of {', '.join(SURGERY_MEMORY_TEXT)}")
    if memory == "buffer":
        return TaskGradientBuffer(params, num_tasks, dtype, **kwargs)
    policy, keep = ("stream", 0) if memory == "stream" else ("smaller", keep_bytes)
    return StreamingTaskGradients(params, num_tasks, policy=policy, keep_bytes=keep, **kwargs)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def choose_memory_mode(
    rows_bytes: int,
    activation_bytes: int,
    buffer_peak_bytes: int,
    device_bytes: int,
    fit_share: float = FIT_SHARE,
    rows_share: float = ROWS_SHARE,
    keep_share: float = KEEP_SHARE,
) -> MemoryModeChoice:
    """``auto``'s pick from byte counts per rank (``device_bytes`` 0: fit not checked); streaming keeps
    ``keep_share`` of the activations in Linear rows, at most what the device leaves above its peak."""
    keep = keep_bytes(activation_bytes, keep_share)
    if device_bytes > 0:  # the kept rows come on top of the streamed peak (about the buffer's, less its rows)
        keep = max(0, min(keep, int(fit_share * device_bytes) - (buffer_peak_bytes - rows_bytes)))
    kept = f"; the first layers' Linear task rows kept within {_mib(keep)}" if keep else ""
    if device_bytes > 0 and buffer_peak_bytes > fit_share * device_bytes:
        why = f"the buffer's predicted peak {_mib(buffer_peak_bytes)} is over {fit_share:.0%} of the device's"
        return MemoryModeChoice("stream", f"{why} {_mib(device_bytes)}{kept}", keep)
    activations = f"of the activations (~{_mib(activation_bytes)})"
    if rows_bytes > rows_share * activation_bytes:
        why = f"the [T, P] rows ({_mib(rows_bytes)}) are over {rows_share:.0%} {activations}{kept}"
        return MemoryModeChoice("stream", why, keep)
    why = f"the buffer's peak {_mib(buffer_peak_bytes)} fits and its rows ({_mib(rows_bytes)}) are at most"
    return MemoryModeChoice("buffer", f"{why} {rows_share:.0%} {activations}")


def keep_bytes(activation_bytes: int, share: float = KEEP_SHARE) -> int:
    """``auto``'s streaming budget of kept Linear task rows: ``share`` of the step's activations, in bytes."""
    return int(share * activation_bytes)


def keep_bytes_for(config: Any, tokens: int, length: int, precision: str = "fp32") -> int:
    """:func:`keep_bytes` of a step of ``tokens`` tokens in sequences of ``length`` through the encoder of
    ``config``: ``auto``'s budget on one rank."""
    return keep_bytes(estimate_activation_bytes(config, tokens, length, precision))


def estimate_activation_bytes(config: Any, tokens: int, length: int, precision: str = "fp32") -> int:
    """Saved activation bytes of one forward of ``tokens`` tokens in sequences of ``length`` through the
    encoder of ``config`` (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``; PALs and heads
    included): the fitted formula."""
    per_token_layer = _PER_HIDDEN * config.hidden_size + _PER_SCORE * config.num_attention_heads * length
    return int(tokens * config.num_hidden_layers * per_token_layer * _ELEMENT_BYTES.get(precision, 4.0))


def device_memory_bytes(device: torch.device | str) -> int:
    """The memory of ``device``: a CUDA device's total memory, or this host's memory for the CPU (0: unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def run_memory_mode(
    module: torch.nn.Module,
    num_tasks: int,
    shared_elements: int,
    row_bytes: int,
    tokens: int,
    length: int,
    precision: str,
    zero_stage: int,
    world_size: int,
    device: torch.device | str,
) -> MemoryModeChoice:
    """The trainer's ``auto``: :func:`choose_memory_mode` with the device's memory and analytic estimates
    (``module``: the multi-task model; ``tokens``: a micro-batch's, rows full length; ``row_bytes``: 4 or 2)."""
    activations = estimate_activation_bytes(module.bert.config, tokens, length, precision)
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    states = model_state_bytes(trained, precision, zero_stage, world_size).total
    rows = num_tasks * shared_elements * row_bytes
    return choose_memory_mode(
        rows, activations, states + activations + rows, device_memory_bytes(device),
        keep_share=KEEP_SHARE if world_size == 1 else 0.0,
    )  # fmt: skip


def trainer_memory_mode(trainer: Any) -> tuple[str, torch.dtype, MemoryModeChoice | None]:
    """A ``Trainer``'s :func:`surgery_memory_mode`, the rows' dtype (``auto``: bf16 with bf16 training, else
    fp32) and ``auto``'s :func:`run_memory_mode` choice (None where it did not run)."""
    args, ds_config, module = trainer.args, trainer.ds_config, trainer.engine.module
    bf16 = ds_config.get("bf16", {}).get("enabled")
    rows = args.surgery_buffer_dtype if args.surgery_buffer_dtype != "auto" else "bf16" if bf16 else "fp32"
    one_backward, choice, option = args.batching == "mixed", None, args.surgery_memory
    if getattr(AGGREGATORS.get(args.surgery), "reads_rows", False):  # ExcessMTL: the [T, P] rows themselves
        option = "buffer"
    if surgery_memory_mode(option, one_backward, args.surgery_buffer_dtype) == "smaller":
        precision = "bf16" if bf16 else "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32"
        shared = sum(p.numel() for p in shared_parameters_by_name(module)[0])
        tokens, n = args.max_tokens or args.batch_size * args.max_length, len(args.task_list)
        row_bytes = 2 if rows == "bf16" else 4
        choice = run_memory_mode(
            module, n, shared, row_bytes, tokens, args.max_length, precision, trainer.zero_stage,
            trainer.world_size, trainer.device,
        )  # fmt: skip
    memory = surgery_memory_mode(option, one_backward, args.surgery_buffer_dtype, choice and choice.mode)
    return memory, torch.bfloat16 if rows == "bf16" else torch.float32, choice


def plan_auto_modes(
    bert: Any,
    num_tasks: int,
    shared_elements: int,
    tokens: int,
    length: int,
    precision: str,
    rows_dtype: str,
    buffer_dtype: str,
    buffer_peak_bytes: int,
    devices: dict[str, int],
) -> dict[str, dict[str, str]]:
    """``fastpals memory``'s ``auto`` per device, ``{name: {"mode", "why"}}``: :func:`choose_memory_mode` with
    the traced buffer peak and each device's usable bytes; ``bert``: the encoder config."""
    if buffer_dtype == "bf16":
        return {n: {"mode": "buffer", "why": "bf16 rows asked for"} for n in devices}
    activations = estimate_activation_bytes(bert, tokens, length, precision)
    rows = num_tasks * shared_elements * (2 if rows_dtype == "bf16" else 4)
    choices = {
        name: choose_memory_mode(rows, activations, buffer_peak_bytes, n) for name, n in devices.items()
    }
    return {name: {"mode": c.mode, "why": c.why} for name, c in choices.items()}


PRECISIONS = ("fp32", "bf16", "fp16")
#: what the bytes at the peak are, by category
CATEGORIES = ("parameters", "gradients", "optimizer", "buckets", "activations", "surgery", "temporaries")


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank that DeepSpeed keeps for the model after the first step: 16- or 32-bit ``params`` and
    ``gradients``, fp32 ``master`` weights and ``fp32_gradients`` (mixed precision or ZeRO >= 1), AdamW's two
    fp32 moments (``optimizer``) and ZeRO-3's gathered largest layer (``gathered``)."""

    params: int
    gradients: int
    master: int
    fp32_gradients: int
    optimizer: int
    gathered: int = 0

    @property
    def total(self) -> int:
        return sum(vars(self).values())


def model_state_bytes(
    num_params: int, precision: str, zero_stage: int, world_size: int = 1, largest_layer_params: int = 0
) -> ModelStates:
    """DeepSpeed's per-rank model-state bytes for ``num_params`` trainable parameters with AdamW, counted as
    its ``estimate_zero2/3_model_states_mem_needs`` do."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage {zero_stage}: choose 0, 1, 2 or 3")
    if world_size < 1:
        raise ValueError(f"--world-size {world_size}: give 1 or more ranks")
    p, part = num_params, math.ceil(num_params / world_size)  # part: one rank's partition
    width = 4 if precision == "fp32" else 2
    params = width * (part if zero_stage == 3 else p)
    grads = 0 if zero_stage == 3 else width * (part if zero_stage == 2 else p)
    sharded = zero_stage >= 1
    master = fp32_grads = 4 * (part if sharded else 0 if precision == "fp32" else p)
    optimizer = 8 * (part if sharded else p)
    gathered = 2 * width * largest_layer_params if zero_stage == 3 else 0
    return ModelStates(params, grads, master, fp32_grads, optimizer, gathered)


_DS_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
              "fp16": "fp16", "float16": "fp16", "half": "fp16"}  # fmt: skip
_WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class GradientBuckets:
    """ZeRO-1/2's contiguous gradient buckets of one backward: ``count`` flat buffers of ``elements`` in
    ``dtype`` (``fp32``/``bf16``/``fp16``); ``why``: where that comes from, one line."""

    count: int
    elements: int
    dtype: str
    why: str

    @property
    def bytes(self) -> int:
        return self.count * self.elements * _WIDTH[self.dtype]


def gradient_buckets(
    ds_config: dict[str, Any] | None, precision: str, zero_stage: int, surgery: str = "none"
) -> GradientBuckets:
    """What DeepSpeed 0.19.8's ``setup_buckets`` allocates per backward for ``ds_config`` (None: defaults):
    one ``reduce_bucket_size`` buffer (two with ``overlap_comm``) in the reduction dtype; none at ZeRO-0,
    without ``contiguous_gradients``, nor for bf16 ZeRO-1 with fp32 ``grad_accum_dtype``."""
    cfg = ds_config or {}
    zero = cfg.get("zero_optimization") or {}
    if zero_stage not in (1, 2):
        return GradientBuckets(0, 0, precision, f"ZeRO-{zero_stage}: no gradient buckets")
    accum = (cfg.get("data_types") or {}).get("grad_accum_dtype")
    if accum == "auto":
        accum = "fp32" if precision == "bf16" and zero_stage == 1 and surgery == "none" else None
    accum = precision if accum is None else _DS_DTYPES.get(str(accum).lower(), precision)
    if precision == "bf16" and accum == "fp32" and zero_stage == 1:
        why = "bf16 ZeRO-1 with fp32 gradient accumulation: BF16_Optimizer, no buckets"
        return GradientBuckets(0, 0, accum, why)
    if not zero.get("contiguous_gradients", True):
        return GradientBuckets(0, 0, precision, "contiguous_gradients off: no contiguous buckets")
    elements = int(float(zero.get("reduce_bucket_size", 5e8)))
    count = 2 if zero.get("overlap_comm", False) else 1
    dtype = accum if zero_stage == 1 and accum != precision else precision
    why = f"reduce_bucket_size {elements:,} x {count} (overlap_comm {'on' if count == 2 else 'off'}), {dtype}"
    return GradientBuckets(count, elements, dtype, why)


class LiveTensorBytes(TorchDispatchMode):
    """Adds up the live tensor storages made under this mode, once each under the current :meth:`phase` until
    freed; ``peak`` and ``at_peak`` since :meth:`reset_peak`. ``stub_host_reads``: ``.item()`` returns 1."""

    def __init__(self, stub_host_reads: bool = False) -> None:
        super().__init__()
        self.live: dict[int, list[Any]] = {}  # storage key -> [bytes, category]
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.current = self.peak = 0
        self.at_peak: dict[str, int] = dict(self.by_category)
        self.peak_phase = ""
        self.category = "temporaries"
        self.stub_host_reads = stub_host_reads

    @contextlib.contextmanager
    def phase(self, category: str) -> Iterator[None]:
        """Count what is made inside the block as ``category`` (one of :data:`CATEGORIES`)."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        before, self.category = self.category, category
        try:
            yield
        finally:
            self.category = before

    def set_phase(self, category: str) -> None:
        """Count what is made from now on as ``category``."""
        self.category = category

    def reset_peak(self) -> None:
        """Start a new peak at the current total."""
        self.peak = self.current
        self.at_peak = dict(self.by_category)
        self.peak_phase = self.category

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
            self.by_category[entry[1]] -= entry[0]

    def add(self, t: torch.Tensor, category: str | None = None) -> None:
        """Count ``t``'s storage (once) under ``category`` (default: the current phase). Meta tensors hold no
        memory and are not counted (DeepSpeed's ZeRO optimizer makes a meta copy of every parameter)."""
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        nbytes = st.nbytes()
        cat = category or self.category
        self.live[key] = [nbytes, cat]
        self.current += nbytes
        self.by_category[cat] += nbytes
        weakref.finalize(st, self._free, key)
        if self.current > self.peak:
            self.reset_peak()

    def tag(self, t: torch.Tensor, category: str) -> None:
        """Move ``t``'s storage (counted or not) to ``category``."""
        key = t.untyped_storage()._cdata
        entry = self.live.get(key)
        if entry is None:
            self.add(t, category)
        elif entry[1] != category:
            self.by_category[entry[1]] -= entry[0]
            self.by_category[category] += entry[0]
            entry[1] = category

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.stub_host_reads and func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.add(t)
        return out


class DeepSpeedLikeEngine:
    """What :func:`~fastpals.train.step.run_update` needs of a DeepSpeed engine, holding DeepSpeed's model
    states for ``precision`` and ``zero_stage`` on one of ``world_size`` ranks (no collectives); ``step``
    makes the fp32 gradient partition, unscales, clips, steps and copies back, as DeepSpeed's does."""

    def __init__(
        self,
        module: torch.nn.Module,
        precision: str,
        zero_stage: int,
        world_size: int,
        tracker: LiveTensorBytes,
        buckets: GradientBuckets | None = None,
    ) -> None:
        self.module, self.precision = module, precision
        self.zero_stage, self.world_size = zero_stage, world_size
        self.buckets = buckets if buckets is not None and buckets.count else None
        self._bucket_buffers: list[torch.Tensor] = []
        self.tracker = tracker
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.part = math.ceil(self.numel / world_size)
        self.scale = 2.0**16 if precision == "fp16" else 1.0
        self.hp_grads: dict[int, torch.Tensor] = {}  # id(param) -> fp32 gradient written by a surgery buffer
        starts = itertools.accumulate((p.numel() for p in self.params), initial=0)
        self._offsets = {id(p): start for p, start in zip(self.params, starts)}
        self._hp_flat: torch.Tensor | None = None  # the fp32 gradient partition a surgery buffer wrote into
        self._hp_set: set[int] = set()  # the parameters it wrote
        self.flat_master = precision != "fp32" or zero_stage >= 1
        self._drop_grads = zero_stage == 2 and world_size > 1
        with self.tracker.phase("optimizer"):
            if self.flat_master:
                self.master = [torch.nn.Parameter(torch.zeros(self.part if zero_stage >= 1 else self.numel))]
            else:
                self.master = self.params
            self.optimizer = torch.optim.AdamW(self.master, lr=2e-5, weight_decay=0.01, eps=1e-6, fused=True)
            for p in self.master:  # the moments as after the first step
                self.optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                    "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32),
                }
        if self.buckets is not None:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._setup_buckets)
        if self._drop_grads:
            with self.tracker.phase("gradients"):
                self.grad_partition = torch.zeros(self.part, dtype=self.params[0].dtype)
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._reduce_scatter)

    def _setup_buckets(self, p: torch.Tensor) -> None:
        if self._bucket_buffers or self.buckets is None:
            return
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.buckets.dtype]
        with self.tracker.phase("buckets"):
            self._bucket_buffers = [
                torch.empty(self.buckets.elements, dtype=dtype) for _ in range(self.buckets.count)
            ]

    @staticmethod
    def _reduce_scatter(p: torch.Tensor) -> None:
        p.grad = None  # reduced into the rank's partition buffer, the full 16-bit gradient freed

    def grad_setter(self, p: torch.nn.Parameter, value: torch.Tensor | None) -> None:
        """``deepspeed.utils.safe_set_full_grad`` for a surgery buffer: this rank's part of ``value`` into the
        fp32 gradient partition (with a flat master), else ``value`` becomes the gradient."""
        if not self.flat_master:
            if value is None:
                self.hp_grads.pop(id(p), None)
            else:
                self.hp_grads[id(p)] = value
            return
        if self._hp_flat is None:
            with self.tracker.phase("gradients"):
                self._hp_flat = torch.zeros(self.master[0].numel(), dtype=torch.float32)
        self._hp_set.add(id(p))
        lo = self._offsets[id(p)]
        hi = min(lo + p.numel(), self._hp_flat.numel())
        if hi > lo:
            part = self._hp_flat[lo:hi]
            if value is None:
                part.zero_()
            else:
                part.copy_(value.reshape(-1)[: hi - lo])

    def __call__(self, **inputs: Any) -> Any:
        self.tracker.set_phase("activations")
        return self.module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        self.tracker.set_phase("temporaries")
        (loss * self.scale if self.scale != 1.0 else loss).backward()
        self._bucket_buffers = []  # released at the backward's epilogue

    def step(self) -> None:
        self.tracker.set_phase("temporaries")
        if self.flat_master:
            flat, self._hp_flat = self._hp_flat, None  # written by a surgery buffer's setter, or made here
            if flat is None:
                with self.tracker.phase("gradients"):
                    flat = torch.zeros(self.master[0].numel(), dtype=torch.float32)
            for p in self.params:  # this rank's partition of the flattened gradients, in fp32
                lo = self._offsets[id(p)]
                hi = min(lo + p.numel(), flat.numel())
                g = None if id(p) in self._hp_set else self.hp_grads.get(id(p), p.grad)
                if hi > lo and g is not None and not self._drop_grads:
                    flat[lo:hi].copy_(g.reshape(-1)[: hi - lo])
            grads = [flat]
        else:
            grads = []
            for p in self.params:
                g = self.hp_grads.get(id(p), p.grad)
                if g is not None and p.grad is None:
                    p.grad = g
                grads.append(p.grad)
        grads = [g for g in grads if g is not None]
        if self.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        torch._foreach_mul_(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
        if self.flat_master:
            self.master[0].grad = grads[0]
        self.optimizer.step()
        if self.flat_master:
            self.master[0].grad = None
            with torch.no_grad():
                for p in self.params:  # all-gather of the updated weights into the module
                    lo = self._offsets[id(p)]
                    hi = min(lo + p.numel(), self.master[0].numel())
                    if hi > lo:
                        p.reshape(-1)[: hi - lo].copy_(self.master[0][lo:hi])
        for p in self.params:
            p.grad = None
        self.hp_grads.clear()
        self._hp_set.clear()
