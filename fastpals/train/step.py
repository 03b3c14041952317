"""The gradient-surgery update, written once: used by the trainer and by the benchmarks
(``bench/training.py``, ``bench/test_bench_surgery.py``), so that they time this code."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SurgeryUpdate", "deepspeed_surgery_buffer", "surgery_update"]


@dataclass
class SurgeryUpdate:
    """``outputs``: what ``backward`` returned for each entry of the group, in order; ``result``: the buffer's
    ``apply`` result (``.skipped``, ``.nonfinite_tasks``, weights); ``surgery_seconds``: wall time inside the
    buffer's own calls (every ``capture`` and the ``apply``)."""

    outputs: list[Any]
    result: Any
    surgery_seconds: float


def surgery_update(
    buffer: Any,
    group: Sequence[int],
    backward: Callable[[int], Any],
    aggregator: Callable[..., torch.Tensor],
    generator: torch.Generator | None = None,
    sync: Callable[[], None] | None = None,
) -> SurgeryUpdate:
    """One surgery update's gradients: for each task index ``t`` of ``group`` (a task may appear more than
    once), ``backward(t)`` runs the forward and backward of a batch of task ``t`` and the buffer captures its
    gradients (summed over the task's batches); then ``buffer.apply(aggregator)`` writes the combined
    gradient ``sum_t w_t g_t`` of the shared parameters (and each task's own gradient of its task-specific
    parameters) back into the parameters' gradients. The caller zeroes gradients before and steps the optimizer
    after (unless ``result.skipped``: a non-finite task gradient).

    Args:
        buffer: a :class:`fastpals.surgery.TaskGradientBuffer` with one row per task.
        group: the task indices of the update's micro-batches.
        backward: runs one micro-batch of a task, returns anything (e.g. the loss value).
        aggregator: weights from the task-gradient Gram matrix (``pcgrad_weights``, ``gem_weights``, ...).
        generator: random stream of the aggregator (PCGrad's projection order).
        sync: called before reading the clock after ``apply`` (e.g. ``torch.cuda.synchronize``).
    """
    outputs = []
    captured: set[int] = set()
    seconds = 0.0
    for t in group:
        outputs.append(backward(t))
        t0 = time.perf_counter()
        buffer.capture(t, accumulate=t in captured)
        seconds += time.perf_counter() - t0
        captured.add(t)
    t0 = time.perf_counter()
    result = buffer.apply(aggregator, generator=generator)
    if sync is not None:
        sync()
    return SurgeryUpdate(outputs, result, seconds + time.perf_counter() - t0)


def deepspeed_surgery_buffer(
    module: torch.nn.Module,
    num_tasks: int,
    zero_stage: int,
    dtype: torch.dtype = torch.float32,
    all_reduce: bool = False,
) -> Any:
    """A :class:`fastpals.surgery.TaskGradientBuffer` (rows of ``dtype``, one per task) over the shared parameters
    of a DeepSpeed engine's ``module``. ``all_reduce``: average the ``[T, P]`` rows across ranks before the Gram
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

    from fastpals.surgery import TaskGradientBuffer, shared_parameters_by_name

    def setter(p: torch.nn.Parameter, g: torch.Tensor | None) -> None:
        safe_set_full_grad(p, g if g is not None else torch.zeros_like(p, dtype=torch.float32))

    shared, specific = shared_parameters_by_name(module)
    return TaskGradientBuffer(
        shared, num_tasks, dtype, task_params=specific, grad_getter=safe_get_full_grad,
        grad_setter=setter, grad_dtype=torch.float32, capture_task_params=zero_stage >= 1, all_reduce=all_reduce,
    )  # fmt: skip
