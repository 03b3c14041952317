"""The task heads, :class:`MultiTaskOutput`, and per-task losses and predictions by each task's kind."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fastpals.data.layout import BatchLayout
from fastpals.data.tasks import TaskSpec
from fastpals.functional import Dropout

TASK_WEIGHTINGS = ("examples", "equal")


class TaskHead(nn.Module):
    """Maps pooled features ``[n, in]`` to ``[n, num_labels]``."""

    def __init__(self, spec: TaskSpec, d: int, dropout: float) -> None:
        super().__init__()
        width = 3 * d if spec.pair_mode == "sbert_concat" else d
        self.dropout = Dropout(dropout)
        self.mlp = (
            nn.Sequential(nn.Linear(width, d), nn.GELU(), Dropout(dropout)) if spec.head == "mlp" else None
        )
        self.out = nn.Linear(width if self.mlp is None else d, spec.num_labels)
        nn.init.normal_(self.out.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        return self.out(x if self.mlp is None else self.mlp(x))


@dataclass
class MultiTaskOutput:
    """``logits [B, C]`` (C = the largest ``num_labels``; row b's first ``num_labels`` of its task are valid,
    the rest 0), ``task_ids [B]``, and the encoder's ``pooled [B, d]`` features of the first sentence."""

    logits: torch.Tensor
    task_ids: torch.Tensor
    pooled: torch.Tensor
    row_tokens: torch.Tensor | None = None  # unused; kept for callers that construct outputs themselves
    layout: BatchLayout | None = None  # the batch's layout (host task counts and row ranges)
    task_tokens: list[int] | None = None  # per task: tokens its rows ran (both sentences for siamese rows)


@dataclass
class TaskLosses:
    """``total`` (0-dim fp32) to back-propagate; per present task its loss, weight, examples and tokens."""

    total: torch.Tensor
    per_task: dict[str, torch.Tensor]
    weights: dict[str, float]
    examples: dict[str, int]
    tokens: dict[str, int]


def task_losses(
    tasks: Sequence[TaskSpec], output: MultiTaskOutput, labels: torch.Tensor, weighting: str = "examples"
) -> TaskLosses:
    """One loss per task present (its kind's), combined by ``weighting``: ``"examples"``, ``sum_t (n_t / B) L_t``,
    or ``"equal"``, the mean over the tasks present. ``tasks`` in task-id order; labels ``[B]`` float."""
    if weighting not in TASK_WEIGHTINGS:
        raise ValueError(f"task weighting {weighting!r}: choose one of {', '.join(TASK_WEIGHTINGS)}")
    layout = output.layout
    if layout is None:  # an output built by hand: the layout of its task ids (one host read)
        ids = np.asarray(output.task_ids.tolist(), dtype=np.int64)
        layout = BatchLayout(
            batch=int(ids.size), length=1, packed=False, lengths=np.ones(ids.size, dtype=np.int64),
            host_task_ids=ids, num_tasks=len(tasks), device=output.task_ids.device, task_ids=output.task_ids,
        )  # fmt: skip
    counts = layout.task_examples
    tokens = output.task_tokens if output.task_tokens is not None else [0] * len(counts)
    result = TaskLosses(output.logits.new_zeros((), dtype=torch.float32), {}, {}, {}, {})
    for i in layout.present:
        spec, rows = tasks[i], layout.rows_of(i)
        z = take_rows(output.logits, rows)[:, : spec.num_labels]
        loss = spec.task_kind.loss(spec, z, take_rows(labels, rows))
        w = counts[i] / sum(counts) if weighting == "examples" else 1.0 / len(layout.present)
        result.total = result.total + w * loss
        result.per_task[spec.name] = loss
        result.weights[spec.name] = w
        result.examples[spec.name] = counts[i]
        result.tokens[spec.name] = tokens[i]
    return result


def summed_loss(
    tasks: Sequence[TaskSpec], output: MultiTaskOutput, labels: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sum over the tasks present of each task's loss (0-dim), and those losses; labels ``[B]`` float."""
    per_task = task_losses(tasks, output, labels).per_task
    return sum(per_task.values(), output.logits.new_zeros(())), per_task


def predict(tasks: Sequence[TaskSpec], output: MultiTaskOutput) -> torch.Tensor:
    """Predicted labels ``[B]`` float32 by each row's task kind; no host reads."""
    preds = output.logits.new_zeros(output.logits.shape[0], dtype=torch.float32)
    for i, spec in enumerate(tasks):  # each kind predicts on every row; torch.where keeps its task's
        p = spec.task_kind.predict(spec, output.logits[:, : spec.num_labels])
        preds = torch.where(output.task_ids == i, p, preds)
    return preds


def take_rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """The rows ``rows`` of ``x`` (a slice view, or ``index_select`` of an int64 index tensor)."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
