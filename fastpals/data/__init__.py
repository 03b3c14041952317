"""The data stage: tasks, their files, tokens and batches, up to the one description of a micro-batch.

- :mod:`.tasks` (:class:`TaskSpec`, built-in tasks, task files) and :mod:`.task_kinds` (loss, predictions and
  metrics of each kind of task); :mod:`.metrics` (metrics for any task kind, prediction files);
- :mod:`.readers` (CSV/TSV/JSONL rows, bad rows reported with file and line) and :mod:`.loading`
  (:func:`load_task`: split files, the Quora hash split);
- :mod:`.tokenizer` (WordPiece via ``tokenizers``) and :mod:`.hub` (the folder of a pretrained model's files);
- :mod:`.sampling` (which task each micro-batch comes from);
- :mod:`.per_task_batches` (:class:`TaskBatcher`: one task per batch, padded, resumable) and
  :mod:`.mixed_batches` (mixed-task micro-batches packed without padding, attention buckets,
  :class:`MixedBatchSampler`);
- :mod:`.layout` (:class:`BatchLayout`, built once at collate time, and every pad/unpad helper).

The names below load their module on first use, so ``fastpals.data.layout`` loads without the file readers.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "load_task": "loading", "resolve_data_dir": "loading", "split_path": "loading",
    "TaskSpec": "tasks", "get_task": "tasks", "resolve_tasks": "tasks", "TASKS": "tasks",
    "DataError": "readers", "DataWarning": "readers", "Example": "readers", "PairExample": "readers",
    "SentenceExample": "readers",
    "Tokenizer": "tokenizer",
    "TaskSampler": "sampling",
    "TaskBatcher": "per_task_batches", "merge_batches": "per_task_batches",
    "MixedBatchSampler": "mixed_batches", "collate_packed": "mixed_batches", "model_inputs": "mixed_batches",
    "pack_batches": "mixed_batches",
    "BatchLayout": "layout",
}  # fmt: skip

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"fastpals.data.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'fastpals.data' has no attribute {name!r}")
