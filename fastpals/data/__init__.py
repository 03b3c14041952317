"""The data stage: tasks and their files (readers, loading), the tokenizer, task sampling, per-task padded
batches (:class:`TaskBatcher`), mixed-task packed micro-batches and their :class:`BatchLayout`."""

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
