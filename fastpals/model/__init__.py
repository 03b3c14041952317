"""The model stage: the multi-task model on any encoder, and running it over batches.

- :mod:`.multitask` (:class:`MultiTaskBert`: encoder + PALs + one head per task; ``from_base``,
  ``save_pretrained``/``from_pretrained``, losses, predictions, :func:`count_parameters`);
- :mod:`.heads` (the heads, the batch's output, the per-task losses and predictions);
- :mod:`.hf_encoder` (an HF encoder with injected PALs as the multi-task model's encoder);
- :mod:`.evaluate` (prediction over a task's batches and dev metrics, shared by the trainer and
  ``fastpals predict``).

The names below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "MultiTaskBert": "multitask", "MultiTaskConfig": "multitask", "count_parameters": "multitask",
    "MultiTaskOutput": "heads", "TaskLosses": "heads",
    "HFEncoder": "hf_encoder",
    "predict_batches": "evaluate",
}  # fmt: skip

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"fastpals.model.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'fastpals.model' has no attribute {name!r}")
