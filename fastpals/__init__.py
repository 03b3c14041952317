"""fastpals: fused kernels for multi-task BERT fine-tuning with PALs and gradient surgery.

One package per stage, each importing only the ones before it (docs/architecture.md). ``import fastpals``
registers the PEFT method ``FASTPALS`` when PEFT is already imported (:func:`register_with_peft` at any time).
"""

from fastpals._version import __version__ as __version__
from fastpals.adapters.inject import inject_pals, load_pals, remove_pals, save_pals, set_task
from fastpals.adapters.peft_registration import register_if_peft_is_imported, register_with_peft
from fastpals.data.tasks import resolve_tasks
from fastpals.data.tokenizer import Tokenizer
from fastpals.encoder.bert import BertConfig, BertModel, PALConfig, freeze_shared_parameters, is_task_specific
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig, TaskSpec, count_parameters

__all__ = [
    "BertConfig",
    "BertModel",
    "MultiTaskBert",
    "MultiTaskConfig",
    "PALConfig",
    "TaskSpec",
    "Tokenizer",
    "count_parameters",
    "freeze_shared_parameters",
    "is_task_specific",
    "inject_pals",
    "load_pals",
    "register_with_peft",
    "remove_pals",
    "resolve_tasks",
    "save_pals",
    "set_task",
]

register_if_peft_is_imported()
