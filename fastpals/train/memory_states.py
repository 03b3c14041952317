"""What one training step's memory is made of, for :mod:`fastpals.commands.memory`: DeepSpeed's model states
and gradient buckets, a live-tensor tracker and an engine holding those states around the real update."""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PRECISIONS = ("fp32", "bf16", "fp16")
#: what the bytes at the peak are, by category
CATEGORIES = ("parameters", "gradients", "optimizer", "buckets", "activations", "surgery", "temporaries")


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank that DeepSpeed keeps for the model after the first step: 16- or 32-bit ``params`` and
    ``gradients``, fp32 ``master`` weights and ``fp32_gradients`` (mixed precision or ZeRO >= 1), AdamW's two fp32
    moments (``optimizer``) and ZeRO-3's gathered largest layer (``gathered``)."""

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
    p, n = num_params, world_size
    part = math.ceil(p / n)  # one rank's partition
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
        return GradientBuckets(
            0, 0, accum, "bf16 ZeRO-1 with fp32 gradient accumulation: BF16_Optimizer, no buckets"
        )
    if not zero.get("contiguous_gradients", True):
        return GradientBuckets(0, 0, precision, "contiguous_gradients off: no contiguous buckets")
    elements = int(float(zero.get("reduce_bucket_size", 5e8)))
    overlap = bool(zero.get("overlap_comm", False))
    dtype = accum if zero_stage == 1 and accum != precision else precision
    why = (
        f"reduce_bucket_size {elements:,} x {2 if overlap else 1} (overlap_comm {'on' if overlap else 'off'}), "
        f"{dtype}"
    )
    return GradientBuckets(2 if overlap else 1, elements, dtype, why)


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
        world_size: int = 1,
        tracker: LiveTensorBytes | None = None,
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
        with self._phase("optimizer"):
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
            with self._phase("gradients"):
                self.grad_partition = torch.zeros(self.part, dtype=self.params[0].dtype)
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._reduce_scatter)

    def _phase(self, category: str) -> contextlib.AbstractContextManager:
        return self.tracker.phase(category) if self.tracker is not None else contextlib.nullcontext()

    def _set(self, category: str) -> None:
        if self.tracker is not None:
            self.tracker.set_phase(category)

    def _setup_buckets(self, p: torch.Tensor) -> None:
        if self._bucket_buffers or self.buckets is None:
            return
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.buckets.dtype]
        with self._phase("buckets"):
            self._bucket_buffers = [
                torch.empty(self.buckets.elements, dtype=dtype) for _ in range(self.buckets.count)
            ]

    @staticmethod
    def _reduce_scatter(p: torch.Tensor) -> None:
        p.grad = None  # reduced into the rank's partition buffer, the full 16-bit gradient freed

    def grad_setter(self, p: torch.nn.Parameter, value: torch.Tensor | None) -> None:
        """``deepspeed.utils.safe_set_full_grad`` for a surgery buffer: this rank's part of ``value`` into the fp32
        gradient partition (with a flat master), else ``value`` becomes the gradient."""
        if not self.flat_master:
            if value is None:
                self.hp_grads.pop(id(p), None)
            else:
                self.hp_grads[id(p)] = value
            return
        if self._hp_flat is None:
            with self._phase("gradients"):
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
        self._set("activations")
        return self.module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        self._set("temporaries")
        (loss * self.scale if self.scale != 1.0 else loss).backward()
        self._bucket_buffers = []  # released at the backward's epilogue

    def step(self) -> None:
        self._set("temporaries")
        if self.flat_master:
            flat, self._hp_flat = self._hp_flat, None  # written by a surgery buffer's setter, or made here
            if flat is None:
                with self._phase("gradients"):
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
