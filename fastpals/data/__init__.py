"""The data stage: tasks, their files, tokens and batches, up to the one description of a micro-batch.

- :mod:`.tasks` (:class:`TaskSpec`, built-in tasks, task files) and :mod:`.task_kinds` (loss, predictions and
  metrics of each kind of task); :mod:`.metrics` (metrics for any task kind, prediction files);
- :mod:`.readers` (CSV/TSV/JSONL rows, bad rows reported with file and line) and :mod:`.loading`
  (:func:`load_task`: split files, the Quora hash split);
- :mod:`.tokenizer` (WordPiece via ``tokenizers``) and :mod:`.hub` (the folder of a pretrained model's files);
- :mod:`.sampling` (which task each micro-batch comes from);
- :mod:`.per_task_batches` (:class:`TaskBatcher`: one task per batch, padded, resumable) and
  :mod:`.mixed_batches` (:class:`MixedBatchSampler`, mixed-task micro-batches packed without padding);
- :mod:`.layout` (:class:`BatchLayout`: a batch's rows and tasks, built once and passed along).
"""

from fastpals.data.layout import BatchLayout
from fastpals.data.loading import load_task, resolve_data_dir, split_path
from fastpals.data.mixed_batches import MixedBatchSampler, collate_packed, model_inputs, pack_batches
from fastpals.data.per_task_batches import TaskBatcher, merge_batches
from fastpals.data.readers import DataError, DataWarning, Example, PairExample, SentenceExample
from fastpals.data.sampling import TaskSampler
from fastpals.data.tasks import TASKS, TaskSpec, get_task, resolve_tasks
from fastpals.data.tokenizer import Tokenizer

__all__ = [
    "BatchLayout",
    "DataError",
    "DataWarning",
    "Example",
    "MixedBatchSampler",
    "PairExample",
    "SentenceExample",
    "TASKS",
    "TaskBatcher",
    "TaskSampler",
    "TaskSpec",
    "Tokenizer",
    "collate_packed",
    "get_task",
    "load_task",
    "merge_batches",
    "model_inputs",
    "pack_batches",
    "resolve_data_dir",
    "resolve_tasks",
    "split_path",
]
