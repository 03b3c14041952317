"""The model stage: :class:`MultiTaskBert` (an encoder, minBERT or an HF one, with PALs and one head per task),
its heads and losses, and prediction and dev metrics over a task's batches."""

from fastpals.model.evaluate import predict_batches
from fastpals.model.heads import MultiTaskOutput, TaskLosses
from fastpals.model.hf_encoder import HFEncoder
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig, count_parameters

__all__ = [
    "HFEncoder",
    "MultiTaskBert",
    "MultiTaskConfig",
    "MultiTaskOutput",
    "TaskLosses",
    "count_parameters",
    "predict_batches",
]
