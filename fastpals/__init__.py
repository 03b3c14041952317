"""fastpals: fused kernels for multi-task BERT fine-tuning with PALs and gradient surgery.

Public names: ``BertModel``, ``BertConfig``, ``PALConfig``, ``MultiTaskBert``, ``TaskSpec``,
``count_parameters``, ``inject_pals``, ``save_pals``, ``load_pals``, ``set_task``; ``fastpals.surgery``
(PCGrad, GEM); ``fastpals.functional`` (reference ops), ``fastpals.kernels`` (fused ops).
"""

from fastpals.inject import inject_pals, load_pals, remove_pals, save_pals, set_task
from fastpals.model import BertConfig, BertModel, PALConfig
from fastpals.multitask import MultiTaskBert, MultiTaskConfig, TaskSpec, count_parameters
from fastpals.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "BertConfig",
    "BertModel",
    "MultiTaskBert",
    "MultiTaskConfig",
    "PALConfig",
    "TaskSpec",
    "Tokenizer",
    "count_parameters",
    "inject_pals",
    "load_pals",
    "remove_pals",
    "save_pals",
    "set_task",
]
