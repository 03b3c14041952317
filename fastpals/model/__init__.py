"""The model stage: the multi-task model on any encoder, and running it over batches.

- :mod:`.multitask` (:class:`MultiTaskBert`: encoder + PALs + one head per task; ``from_base``,
  ``save_pretrained``/``from_pretrained``, losses, predictions, :func:`count_parameters`);
- :mod:`.heads` (the heads, the batch's output, the per-task losses and predictions);
- :mod:`.hf_encoder` (an HF encoder with injected PALs as the multi-task model's encoder);
- :mod:`.evaluate` (prediction over a task's batches and dev metrics, shared by the trainer and
  ``fastpals predict``).
"""

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
