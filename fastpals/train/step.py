"""One optimizer update, written once: :func:`run_update` is the update of the trainer (``--batching per_task``
and ``mixed``, with or without ``--surgery``) and of the benchmarks (``bench/training.py``,
``bench/test_bench_surgery.py``), so that they time this code.

An update is a list of :class:`MicroBatch` (each already on the device, with the host's counts of its examples
and tokens) and a surgery strategy:

- ``none``: per micro-batch a forward and ``engine.backward``, then ``engine.step()`` (DeepSpeed accumulates the
  micro-batches and updates at the accumulation boundary, the last one);
- ``per_task_backward``: per micro-batch (one task each) a forward and backward, whose gradients of the shared
  weights :meth:`fastpals.surgery.TaskGradientBuffer.capture` takes into the task's row (summed over the task's
  micro-batches); then ``buffer.apply(aggregator)`` and ``engine.step()``;
- ``one_backward``: per packed mixed micro-batch one forward and one backward inside
  :func:`fastpals.surgery.per_task_gradients` (every task's gradient from that backward); then ``buffer.apply``
  and ``engine.step()``.

The losses stay on the device until the update's backwards are done; see :func:`run_update` for the one read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastpals.train.errors import NonFiniteLossError

__all__ = [
    "STRATEGIES",
    "MicroBatch",
    "Surgery",
    "TorchEngine",
    "UpdateResult",
    "deepspeed_surgery_buffer",
    "run_update",
    "skips_overflow",
]

#: the surgery strategies of :func:`run_update`
STRATEGIES = ("none", "per_task_backward", "one_backward")

LossHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class MicroBatch:
    """One micro-batch of an update, described the same way for every batching.

    Attributes:
        inputs: the model's keyword inputs, on the device (``fastpals.data.mixed_batches.model_inputs`` of a packed batch,
            or ``fastpals.model.evaluate.padded_model_inputs`` of one task's padded batch).
        labels: ``[B]`` float, on the device.
        tasks: the model's indices of the tasks it holds, increasing (one for a per-task batch).
        examples: examples of each task of ``tasks`` (host ints, known at collate time).
        tokens: tokens of each task of ``tasks`` (host ints), or None where not counted.
        weighting: how its loss is formed: None for one task's batch (the task's mean loss,
            ``module.loss``); for a mixed batch the ``task_losses(..., weighting=...)`` name (``examples``,
            ``equal``), whose ``total`` is the loss (with ``one_backward``: the sum of the task means instead).
    """

    inputs: dict[str, Any]
    labels: torch.Tensor
    tasks: tuple[int, ...]
    examples: tuple[int, ...]
    tokens: tuple[int, ...] | None = None
    weighting: str | None = None


@dataclass
class Surgery:
    """The gradient-surgery parts of an update: a :class:`fastpals.surgery.TaskGradientBuffer` with one row per
    task, the aggregator (weights from the task-gradient Gram matrix: ``pcgrad_weights``, ``gem_weights``, ...)
    and its random stream (PCGrad's projection order)."""

    buffer: Any
    aggregator: Callable[..., torch.Tensor]
    generator: torch.Generator | None = None
    #: shared parameters whose per-task gradients took the exact path (set by the first one-backward update)
    exact_names: list[str] | None = None


@dataclass
class UpdateResult:
    """What :func:`run_update` did.

    Attributes:
        loss: per task, the mean of its loss over the micro-batches holding it (host floats).
        examples: per task, its examples in the update (host ints).
        tokens: per task, its tokens, or None when a micro-batch did not count them.
        surgery: the buffer's ``apply`` result (``.skipped``, ``.nonfinite_tasks``, ``.weights``), None without
            surgery.
        surgery_seconds: wall time inside the buffer's own calls (every ``capture`` and the ``apply``).
        stepped: whether the update was handed to ``engine.step()`` to apply (False when ``surgery.skipped``: a
            non-finite task gradient, nothing applied).
        overflow: ``surgery.skipped`` under dynamic loss scaling (fp16): the engine's loss scaler took the step
            as an overflow (skipped it, lowered the scale, zeroed the gradients); training goes on.
    """

    loss: dict[str, float]
    examples: dict[str, int]
    tokens: dict[str, int] | None
    surgery: Any
    surgery_seconds: float
    stepped: bool
    overflow: bool = False


class TorchEngine:
    """The part of a DeepSpeed engine that :func:`run_update` uses (``module``, forward, ``backward``, ``step``)
    over a plain module and optimizer, for benchmarks and tests: the forward runs under ``autocast`` (a dtype, or
    None for none); ``backward`` scales the loss by ``1 / accumulation`` and with ``scaler`` (a
    ``torch.amp.GradScaler``, or None); every ``accumulation``-th ``step`` (the accumulation boundary) unscales
    the gradients, clips their norm to ``max_grad_norm`` (if given), steps the optimizer (through the scaler,
    which skips the step and lowers the scale when a gradient is non-finite) and then zeroes the gradients, as
    DeepSpeed's ``step`` does; the others only count."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        autocast: torch.dtype | None = None,
        accumulation: int = 1,
        max_grad_norm: float | None = None,
    ) -> None:
        self.module, self.optimizer, self.scaler, self.autocast = module, optimizer, scaler, autocast
        self.accumulation = accumulation
        self.max_grad_norm = max_grad_norm
        self.micro_steps = 0

    def _autocast(self) -> AbstractContextManager:
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(next(self.module.parameters()).device.type, dtype=self.autocast)

    def __call__(self, **inputs: Any) -> Any:
        """The module's forward."""
        with self._autocast():
            return self.module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        """The backward of ``loss`` (divided by ``accumulation``, scaled by the scaler, if any)."""
        if self.accumulation != 1:
            loss = loss / self.accumulation
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> None:
        """At the accumulation boundary: the optimizer step (through the scaler, if any), then
        ``zero_grad(set_to_none=True)``; elsewhere nothing but the count."""
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
    """Whether ``engine.step()`` itself skips an update with a non-finite gradient and lowers the loss scale
    (dynamic loss scaling): a :class:`TorchEngine` with an enabled ``GradScaler``, a DeepSpeed engine with
    fp16 and ``"loss_scale": 0``."""
    if isinstance(engine, TorchEngine):
        return engine.scaler is not None and engine.scaler.is_enabled()
    fp16, dynamic = getattr(engine, "fp16_enabled", None), getattr(engine, "dynamic_loss_scale", None)
    return bool(fp16 is not None and dynamic is not None and fp16() and dynamic())


def _skip_step(engine: Any, buffer: Any) -> bool:
    """End an update whose surgery was skipped without applying anything: under dynamic loss scaling hand
    ``engine.step()`` a NaN gradient (the first shared parameter's, through the buffer's setter), so that the loss
    scaler counts the overflow, lowers the scale and zeroes the gradients itself; otherwise drop the module's
    gradients (as DeepSpeed's ``zero_grad``). Returns whether the loss scaler took it."""
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


def _runs_minbert(module: Any) -> bool:
    from fastpals.encoder.bert import BertModel

    return isinstance(getattr(module, "bert", None), BertModel)


def _forward_backward(
    engine: Any,
    mb: MicroBatch,
    strategy: str,
    surgery: Surgery | None,
    step: int,
    loss_hooks: Sequence[LossHook],
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """One micro-batch's forward, loss, hooks and ``engine.backward``: the differentiated loss, and each task's
    loss (None for a one-task micro-batch, whose loss is its task's)."""
    module = engine.module
    if strategy == "one_backward":
        from fastpals.surgery import per_task_gradients

        inputs = mb.inputs
        with per_task_gradients(module, surgery.buffer, inputs["layout"]) as block:
            res = module.task_losses(engine(**inputs), mb.labels, weighting="equal")
            loss = sum(res.per_task.values())  # each task's gradient is that of its own mean loss
            if not _runs_minbert(
                module
            ):  # HF encoders: parameters one backward cannot split take the exact path
                terms = [(module.task_index(name), value) for name, value in res.per_task.items()]
                names = block.exact_task_gradients(terms)
                if surgery.exact_names is None:
                    surgery.exact_names = names
            for hook in loss_hooks:
                loss = hook(step, loss)
            engine.backward(loss)
        return loss, res.per_task
    out = engine(**mb.inputs)
    per_task = None
    if mb.weighting is None:
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
    """One optimizer update over ``micro_batches`` (consumed one at a time, so a generator may collate each
    while the device runs the previous one).

    Each micro-batch runs its forward (``engine(**inputs)``), its loss (see :attr:`MicroBatch.weighting`), the
    ``loss_hooks`` (``hook(step, loss) -> loss``, in order: test faults) and ``engine.backward``; ``strategy``
    (:data:`STRATEGIES`, see the module docstring) says what happens around the backward and before the
    ``engine.step()`` that ends the update (with ``none``, also one ``engine.step()`` after each earlier
    micro-batch, which only counts micro-batches towards DeepSpeed's accumulation boundary).

    Host reads: none per micro-batch. The loss of every backward (after the hooks) and each task's loss stay on
    the device until the last backward is done; then ONE ``.tolist()`` of one stacked float64 tensor reads them
    all, once per update, because the host needs them before ``engine.step()``: to stop on a NaN/inf loss before
    the step applies anything, and to log the per-task losses. With surgery on one rank, ``buffer.apply(sync=
    False)`` runs before that read and its finite flags (whether to skip the step) are read with the losses:
    still one read. Data parallel (an all-reducing buffer), ``apply`` reads once more after the loss check.
    Examples and tokens come from the micro-batches' host counts.

    A non-finite loss (of the first micro-batch that had one) is recorded (``record({"type": "nonfinite",
    "step", "task", "loss"})``) and raised as :class:`NonFiniteLossError` naming the tasks whose loss was
    non-finite (or all of the micro-batch's tasks, when only the combined loss was), before the ``engine.step()``
    that would update: the parameters and the last checkpoint are untouched.

    Args:
        engine: a DeepSpeed engine (or :class:`TorchEngine`) whose ``module`` is a
            :class:`fastpals.MultiTaskBert`; gradients zero at the start (DeepSpeed's ``step`` zeroes them).
        micro_batches: the update's micro-batches (at least one).
        strategy: ``none``, ``per_task_backward`` or ``one_backward``.
        surgery: buffer, aggregator and generator; required by the surgery strategies, refused by ``none``.
        step: the update's number (from 1), for the hooks, the record and the error.
        loss_hooks: functions of ``(step, loss)`` returning the loss to differentiate.
        record: receives the ``"nonfinite"`` record.
        sync: called before reading the clock after ``apply`` (e.g. ``torch.cuda.synchronize``).

    Returns an :class:`UpdateResult`; when ``result.surgery.skipped`` (a non-finite task gradient) nothing was
    applied and the gradients are dropped. Under dynamic loss scaling (:func:`skips_overflow`: fp16) that is an
    overflow, ``result.overflow``: ``engine.step()`` runs on a NaN gradient, so that the loss scaler skips the
    step and lowers the scale, and the next update goes on. Otherwise the caller decides (the trainer raises).
    """
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
    overflow = False
    if stepped:
        engine.step()
    else:
        overflow = _skip_step(engine, surgery.buffer)
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
    """A :class:`fastpals.surgery.TaskGradientBuffer` (rows of ``dtype``, one per task) over the shared parameters
    of a DeepSpeed engine's ``module`` (``memory``: ``buffer``; ``stream`` / ``smaller``: a
    :class:`fastpals.surgery.StreamingTaskGradients` with that policy, same getter/setter and all-reduce). ``all_reduce``: average the ``[T, P]`` rows across ranks before the Gram
    (for :func:`fastpals.surgery.per_task_gradients`, whose shared gradients bypass DeepSpeed's reduction: one
    all-reduce of ``T * P`` elements per update).

    Gradients under DeepSpeed 0.19.8 are read with ``deepspeed.utils.safe_get_full_grad`` and written with
    ``safe_set_full_grad`` (a zero tensor where the buffer clears one). Checked on CPU, one rank: ZeRO-0 fp32
    (``safe_*`` fall through to ``p.grad``) and ZeRO-1 bf16, where they are the fp32 gradients of the optimizer's
    partitions (the bf16 module's ``p.grad`` is not where the reduced gradient lives), so the buffer is fp32.
    ZeRO-2 uses the same calls (not run here: no GPU). ZeRO-1/2 backwards replace the reduced gradients instead of
    adding to them, so each task's head/PAL gradients are taken out at capture time too.
    """
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    from fastpals.surgery import shared_parameters_by_name
    from fastpals.train.memory_mode import task_gradients

    def setter(p: torch.nn.Parameter, g: torch.Tensor | None) -> None:
        safe_set_full_grad(p, g if g is not None else torch.zeros_like(p, dtype=torch.float32))

    shared, specific = shared_parameters_by_name(module)
    return task_gradients(
        memory, shared, num_tasks, dtype, keep_bytes, task_params=specific, grad_getter=safe_get_full_grad,
        grad_setter=setter, grad_dtype=torch.float32, capture_task_params=zero_stage >= 1, all_reduce=all_reduce,
    )  # fmt: skip
