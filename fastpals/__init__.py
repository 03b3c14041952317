"""fastpals: fused kernels for multi-task BERT fine-tuning with PALs and gradient surgery.

Public names: ``BertModel``, ``BertConfig``, ``PALConfig``, ``MultiTaskBert``, ``TaskSpec``, ``resolve_tasks``,
``count_parameters``, ``is_task_specific``, ``freeze_shared_parameters``, ``inject_pals``, ``save_pals``,
``load_pals``, ``set_task``, ``register_with_peft``. One package per stage, each importing only the ones before it
(docs/architecture.md): ``fastpals.data`` (tasks, tokenizer, per-task and mixed packed batches, ``BatchLayout``),
``fastpals.encoder`` (minBERT, PAL variants), ``fastpals.adapters`` (``inject_pals``, the adapter format, PEFT),
``fastpals.model`` (``MultiTaskBert``, heads, evaluation), ``fastpals.surgery`` (per-task gradients, the buffer,
the weightings), ``fastpals.train`` (the trainer), ``fastpals.commands`` (``fastpals predict``, ``memory``, ...),
``fastpals.integrations``; ``fastpals.functional`` (reference ops) and ``fastpals_kernels`` (fused ops and their
dispatch) below them.

With PEFT installed, fastpals' PAL adapters are a PEFT method (``peft_type`` ``"FASTPALS"``,
:mod:`fastpals.adapters.peft_method`): ``import fastpals`` registers it if PEFT is already imported (it does not
import PEFT itself), :func:`register_with_peft` at any time.
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
