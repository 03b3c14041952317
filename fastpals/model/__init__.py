"""The model stage: :class:`MultiTaskBert`, its heads and losses, prediction and dev metrics."""

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
