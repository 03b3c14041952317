"""Prediction and dev evaluation, shared by the trainer and ``fastpals predict``."""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from fastpals.data.loading import load_task
from fastpals.data.metrics import overall, task_metrics
from fastpals.data.mixed_batches import model_inputs as packed_model_inputs
from fastpals.data.mixed_batches import pack_task_rows
from fastpals.data.per_task_batches import TaskBatcher
from fastpals.data.readers import DataWarning
from fastpals.data.tasks import TaskSpec
from fastpals.encoder import precision

EVAL_BATCH = 64
INPUT_KEYS = tuple(
    f"{name}{side}" for side in ("", "_b") for name in ("input_ids", "attention_mask", "token_type_ids")
)


def padded_model_inputs(batch: dict, task_index: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The model's inputs of one task's padded batch on ``device``, ``task_ids [B]`` all ``task_index``."""
    inputs = {k: batch[k].to(device) for k in INPUT_KEYS if k in batch}
    inputs["task_ids"] = torch.full(
        (batch["input_ids"].shape[0],), task_index, dtype=torch.long, device=device
    )
    return inputs


def model_inputs(batch: dict, task_index: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The former name of :func:`padded_model_inputs` (deprecated)."""
    warnings.warn(
        "fastpals.model.evaluate.model_inputs will be removed in the next release: use padded_model_inputs "
        "(fastpals.data.model_inputs is the packed batches' one)",
        DeprecationWarning,
        stacklevel=2,
    )
    return padded_model_inputs(batch, task_index, device)


def confidence(model: torch.nn.Module, output: Any, task_index: int) -> torch.Tensor | None:
    """Probability of the predicted label (float32 ``[B]``) by the task's kind; None for regression."""
    spec = model.tasks[task_index]
    return spec.task_kind.confidence(spec, output.logits[:, : spec.num_labels])


class NonFiniteOutputs(ValueError):
    """The model gave NaN/inf logits for ``count`` example(s) of ``task`` (a NaN logit scores as class 0)."""

    def __init__(self, task: str, count: int) -> None:
        self.task, self.count = task, count
        super().__init__(
            f"the model gave non-finite outputs (NaN/inf) for {count} example(s) of task {task}: no predictions "
            "or metrics from them"
        )


@torch.no_grad()
def predict_batches(
    model: torch.nn.Module,
    batcher: TaskBatcher,
    task_index: int,
    progress: bool = False,
    desc: str | None = None,
    with_confidence: bool = False,
) -> tuple[list[str], np.ndarray, np.ndarray | None] | tuple[list[str], np.ndarray, np.ndarray | None, Any]:
    """``(ids, predictions [N], labels or None)`` of ``batcher``'s examples in order, packed, in eval mode;
    ``with_confidence`` appends :func:`confidence`; non-finite logits raise :class:`NonFiniteOutputs`."""
    was_training = model.training
    model.eval()
    ids, preds, labels, confs = [], [], [], []
    device = next(model.parameters()).device
    spec = model.tasks[task_index]
    bad = torch.zeros((), dtype=torch.int64, device=device)  # examples with a non-finite output
    with tqdm(total=len(batcher.examples), desc=desc, disable=not progress, file=sys.stderr, unit="ex",
              dynamic_ncols=True, mininterval=1.0, leave=False) as bar:  # fmt: skip
        for indices in batcher.epoch_batches(0):  # packed from the token lists, as training packs them
            rows = batcher.task_rows(indices, task_index)
            out = model(**packed_model_inputs(pack_task_rows([rows], len(model.tasks)), device))
            bad += (~torch.isfinite(out.logits[:, : spec.num_labels])).any(dim=1).sum()
            preds.append(model.predict(out).cpu().numpy())
            if with_confidence:
                c = confidence(model, out, task_index)
                confs.append(None if c is None else c.cpu().numpy())
            ids.extend(rows.ids)
            if rows.labels is not None:
                labels.append(rows.labels.numpy())
            bar.update(len(rows.ids))
    model.train(was_training)
    count = int(bad)  # one read per evaluated task, after its predictions were read
    if count:
        raise NonFiniteOutputs(spec.name, count)
    result = (ids, np.concatenate(preds), (np.concatenate(labels) if labels else None))
    if with_confidence:
        return (*result, None if not confs or confs[0] is None else np.concatenate(confs))
    return result


def eval_model(
    module: torch.nn.Module, device: torch.device, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """``module`` in ``dtype`` (default its own) where this device computes it natively, else an fp32 copy."""
    current = next(module.parameters()).dtype
    target = dtype or current
    if device.type == "cpu" and not (target == torch.bfloat16 and precision.cpu_has_native_bf16()):
        target = torch.float32
    return module if target == current else copy.deepcopy(module).to(target)


def evaluate(
    model: torch.nn.Module, dev_batchers: dict[str, TaskBatcher], task_list: list[str], progress: bool = False
) -> tuple[dict[str, float], dict[str, Any]]:
    """Dev metrics ``{task: primary metric (accuracy or Pearson r), "overall": ...}`` (each task's kind computes
    it, :func:`fastpals.data.metrics.task_metrics`) and ``{task: (ids, predictions, labels)}``."""
    dev: dict[str, float] = {}
    preds: dict[str, Any] = {}
    for t, batcher in dev_batchers.items():
        preds[t] = _, p, y = predict_batches(model, batcher, task_list.index(t), progress, desc=f"dev {t}")
        spec = model.tasks[task_list.index(t)]
        dev[t] = task_metrics(spec, y, p)[spec.metric]
    dev["overall"] = overall(dev, model.tasks)
    return dev, preds


def load_split(
    task: str | TaskSpec,
    split: str,
    data_dir: Path | None,
    limit: int | None,
    log: Callable[[str], None],
    sample: bool = False,
) -> list:
    """The examples of one split, skipped rows reported through ``log``; ``limit``: the first ones, or with
    ``sample`` a fixed (seed 0) random subset in file order, since dev files are not shuffled."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DataWarning)
        examples = load_task(task, split, data_dir, strict=False)
    for w in caught:
        if issubclass(w.category, DataWarning):
            log(f"[data] {getattr(task, 'name', task)}/{split}: {w.message}")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not limit or limit >= len(examples):
        return examples
    if sample:
        keep = np.sort(np.random.default_rng(0).choice(len(examples), size=limit, replace=False))
        return [examples[i] for i in keep]
    return examples[:limit]
