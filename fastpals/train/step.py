"""One optimizer update, shared by the trainer and the benchmarks: :func:`run_update` over a list of
:class:`MicroBatch` with a surgery strategy, one of :data:`STRATEGIES`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fastpals.encoder.bert import BertModel
from fastpals.surgery import per_task_gradients, shared_parameters_by_name
from fastpals.train.errors import NonFiniteLossError
from fastpals.train.memory_mode import task_gradients

#: ``none``: DeepSpeed accumulates; ``per_task_backward``: one backward per one-task micro-batch, captured
#: into the task's row; ``one_backward``: every task's gradient from one backward of a packed mixed batch
STRATEGIES = ("none", "per_task_backward", "one_backward")

LossHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class MicroBatch:
    """One micro-batch on the device: the model's keyword ``inputs``, ``labels`` ``[B]`` float, ``tasks``
    (model task indices, increasing), host counts per task, and ``weighting``: None for one task's batch, else
    the ``task_losses`` weighting of a mixed batch (``examples`` or ``equal``)."""

    inputs: dict[str, Any]
    labels: torch.Tensor
    tasks: tuple[int, ...]
    examples: tuple[int, ...]
    tokens: tuple[int, ...] | None = None
    weighting: str | None = None


@dataclass
class Surgery:
    """The per-task gradients (buffer or stream), the aggregator and its generator; ``exact_names``: the
    shared parameters that took the exact per-task path (set by the first one-backward update)."""

    buffer: Any
    aggregator: Callable[..., torch.Tensor]
    generator: torch.Generator | None = None
    exact_names: list[str] | None = None


@dataclass
class UpdateResult:
    """What :func:`run_update` did: host numbers per task, the ``surgery`` result (None without), whether
    ``engine.step()`` applied the update, and whether a loss scaler took a skipped surgery (``overflow``)."""

    loss: dict[str, float]
    examples: dict[str, int]
    tokens: dict[str, int] | None
    surgery: Any
    surgery_seconds: float
    stepped: bool
    overflow: bool = False


@dataclass(eq=False)
class TorchEngine:
    """What :func:`run_update` uses of a DeepSpeed engine, over a plain module and optimizer: forward under
    ``autocast`` (a dtype or None), ``backward`` through the optional ``GradScaler``, and every
    ``accumulation``-th ``step`` unscales, clips to ``max_grad_norm``, steps and zeroes the gradients."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any = None
    autocast: torch.dtype | None = None
    accumulation: int = 1
    max_grad_norm: float | None = None
    micro_steps: int = field(default=0, init=False)

    def __call__(self, **inputs: Any) -> Any:
        if self.autocast is None:
            return self.module(**inputs)
        with torch.autocast(next(self.module.parameters()).device.type, dtype=self.autocast):
            return self.module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        if self.accumulation != 1:
            loss = loss / self.accumulation
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return
        if self.max_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def skips_overflow(engine: Any) -> bool:
    """Whether ``engine.step()`` skips a non-finite update and lowers the loss scale: a :class:`TorchEngine`
    with an enabled ``GradScaler``, a DeepSpeed engine with fp16 and ``"loss_scale": 0``."""
    if isinstance(engine, TorchEngine):
        return engine.scaler is not None and engine.scaler.is_enabled()
    fp16, dynamic = getattr(engine, "fp16_enabled", None), getattr(engine, "dynamic_loss_scale", None)
    return bool(fp16 is not None and dynamic is not None and fp16() and dynamic())


def _skip_step(engine: Any, buffer: Any) -> bool:
    """End an update whose surgery was skipped: under dynamic loss scaling ``engine.step()`` gets a NaN
    gradient (the scaler counts an overflow: returns True); otherwise the gradients are dropped."""
    if not skips_overflow(engine):
        engine.module.zero_grad(set_to_none=True)
        return False
    p = buffer.params[0]
    buffer.grad_setter(p, torch.full(p.shape, math.nan, dtype=buffer.grad_dtype, device=p.device))
    engine.step()
    return True


def _check_strategy(strategy: str, surgery: Surgery | None, mb: MicroBatch) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if (strategy == "none") != (surgery is None):
        raise ValueError(f"strategy {strategy!r} {'takes no' if surgery is not None else 'needs a'} surgery")
    if len(mb.examples) != len(mb.tasks) or (mb.tokens is not None and len(mb.tokens) != len(mb.tasks)):
        raise ValueError(f"a micro-batch of tasks {mb.tasks} has counts {mb.examples} / {mb.tokens}")
    if mb.weighting is None and len(mb.tasks) != 1:
        raise ValueError(f"a micro-batch without a weighting holds one task, not {mb.tasks}")
    if strategy == "per_task_backward" and mb.weighting is not None:
        raise ValueError("per_task_backward captures one task per backward: give one-task micro-batches")
    if strategy == "one_backward" and mb.weighting is None:
        raise ValueError("one_backward runs packed mixed micro-batches: give them a weighting")


def _forward_backward(
    engine: Any,
    mb: MicroBatch,
    strategy: str,
    surgery: Surgery | None,
    step: int,
    loss_hooks: Sequence[LossHook],
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """One micro-batch's forward, loss, hooks and ``engine.backward``: the differentiated loss, and each
    task's loss (None for a one-task micro-batch, whose loss is its task's)."""
    module, per_task = engine.module, None
    one_backward = strategy == "one_backward"
    context = (
        per_task_gradients(module, surgery.buffer, mb.inputs["layout"]) if one_backward else nullcontext()
    )
    with context as block:
        out = engine(**mb.inputs)
        if one_backward:
            per_task = module.task_losses(out, mb.labels, weighting="equal").per_task
            loss = sum(per_task.values())  # each task's gradient is that of its own mean loss
            if not isinstance(getattr(module, "bert", None), BertModel):  # HF: what one backward cannot split
                names = block.exact_task_gradients([(module.task_index(n), v) for n, v in per_task.items()])
                if surgery.exact_names is None:
                    surgery.exact_names = names
        elif mb.weighting is None:
            loss, _ = module.loss(out, mb.labels)
        else:
            res = module.task_losses(out, mb.labels, weighting=mb.weighting)
            loss, per_task = res.total, res.per_task
        for hook in loss_hooks:
            loss = hook(step, loss)
        engine.backward(loss)
    return loss, per_task


def run_update(
    engine: Any,
    micro_batches: Iterable[MicroBatch],
    strategy: str = "none",
    *,
    surgery: Surgery | None = None,
    step: int = 1,
    loss_hooks: Sequence[LossHook] = (),
    record: Callable[[dict[str, Any]], None] | None = None,
    sync: Callable[[], None] | None = None,
) -> UpdateResult:
    """One optimizer update over ``micro_batches`` (consumed one at a time) with ``strategy`` (``surgery``
    required by all but ``none``); ``loss_hooks`` (``hook(step, loss) -> loss``) are test faults; ``sync``
    runs before the clock is read after ``apply``. One host read per update (two with a data-parallel
    buffer), after the last backward: a NaN/inf loss raises :class:`NonFiniteLossError` before
    ``engine.step()``. A skipped surgery applies nothing: an ``overflow`` under dynamic loss scaling, else the
    caller decides."""
    module = engine.module
    names = [spec.name for spec in module.tasks]
    values: list[torch.Tensor] = []  # device scalars, read once after the last backward
    checked: list[tuple[int, dict[str, int]]] = []  # per micro-batch: where its loss is, and each task's
    loss_at: dict[str, list[int]] = {}
    examples: dict[str, int] = {}
    tokens: dict[str, int] = {}
    all_tokens = True
    captured: set[int] = set()
    seconds = 0.0
    batches = iter(micro_batches)
    mb = next(batches, None)
    if mb is None:
        raise ValueError("an update needs at least one micro-batch")
    while mb is not None:
        _check_strategy(strategy, surgery, mb)
        loss, per_task = _forward_backward(engine, mb, strategy, surgery, step, loss_hooks)
        if strategy == "per_task_backward":
            t0 = time.perf_counter()
            (t,) = mb.tasks
            surgery.buffer.capture(t, accumulate=t in captured)
            seconds += time.perf_counter() - t0
            captured.add(t)
        where = len(values)
        values.append(loss.detach())
        at = {names[mb.tasks[0]]: where}  # one task: its loss is the micro-batch's
        if per_task is not None:
            at = {name: where + 1 + k for k, name in enumerate(per_task)}
            values.extend(value.detach() for value in per_task.values())
        checked.append((where, at))
        for name, i in at.items():
            loss_at.setdefault(name, []).append(i)
        all_tokens = all_tokens and mb.tokens is not None
        for k, t in enumerate(mb.tasks):
            examples[names[t]] = examples.get(names[t], 0) + mb.examples[k]
            if mb.tokens is not None:
                tokens[names[t]] = tokens.get(names[t], 0) + mb.tokens[k]
        mb = next(batches, None)
        if strategy == "none" and mb is not None:
            engine.step()  # not the accumulation boundary: DeepSpeed only counts the micro-batch
    result = None
    deferred = surgery is not None and not surgery.buffer.all_reduce
    if deferred:  # one rank: apply without its own read; its finite flags join the update's one read
        t0 = time.perf_counter()
        result = surgery.buffer.apply(surgery.aggregator, generator=surgery.generator, sync=False)
        seconds += time.perf_counter() - t0
        values.append(result.flags)
    n_losses = len(values) - (1 if deferred else 0)
    host = torch.cat([v.to(torch.float64).reshape(-1) for v in values]).tolist()  # the update's one read
    for i, at in checked:
        if not math.isfinite(host[i]):
            bad = [name for name, j in at.items() if not math.isfinite(host[j])] or list(at)
            if record is not None:
                record({"type": "nonfinite", "step": step, "task": ",".join(bad), "loss": host[i]})
            raise NonFiniteLossError(step, ",".join(bad), host[i])
    if deferred:
        result.resolve(host[n_losses:])
        if sync is not None:
            sync()
    elif surgery is not None:
        t0 = time.perf_counter()
        result = surgery.buffer.apply(surgery.aggregator, generator=surgery.generator)
        if sync is not None:
            sync()
        seconds += time.perf_counter() - t0
    stepped = result is None or not result.skipped
    overflow = not stepped and _skip_step(engine, surgery.buffer)
    if stepped:
        engine.step()
    loss = {name: float(np.mean([host[i] for i in at])) for name, at in loss_at.items()}
    return UpdateResult(loss, examples, tokens if all_tokens else None, result, seconds, stepped, overflow)


def deepspeed_surgery_buffer(
    module: torch.nn.Module,
    num_tasks: int,
    zero_stage: int,
    dtype: torch.dtype = torch.float32,
    all_reduce: bool = False,
    memory: str = "buffer",
    keep_bytes: int = 0,
) -> Any:
    """:func:`~fastpals.train.memory_mode.task_gradients` over the shared parameters of a DeepSpeed engine's
    ``module`` via ``safe_get/set_full_grad``, task parameters captured from ZeRO-1 on; ``all_reduce``:
    mean of the rows across ranks (one backward bypasses DeepSpeed's reduction)."""
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad  # optional: the trainer's engine

    def setter(p: torch.nn.Parameter, g: torch.Tensor | None) -> None:
        safe_set_full_grad(p, g if g is not None else torch.zeros_like(p, dtype=torch.float32))

    shared, specific = shared_parameters_by_name(module)
    return task_gradients(
        memory, shared, num_tasks, dtype, keep_bytes, task_params=specific, grad_getter=safe_get_full_grad,
        grad_setter=setter, grad_dtype=torch.float32, capture_task_params=zero_stage >= 1, all_reduce=all_reduce,
    )  # fmt: skip
