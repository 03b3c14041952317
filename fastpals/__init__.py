"""fastpals: fused kernels for multi-task BERT fine-tuning with PALs and gradient surgery.
``import fastpals`` registers the PEFT method ``FASTPALS`` when PEFT is already imported."""

import sys
import warnings

from fastpals._version import __version__ as __version__
from fastpals.adapters import register_with_peft
from fastpals.adapters.inject import inject_pals, load_pals, remove_pals, save_pals, set_task
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

# registered here only when PEFT is already imported (importing it takes seconds)
if sys.modules.get("peft") is not None:
    try:
        register_with_peft()
    except Exception as err:  # never break the user's `import fastpals`
        warnings.warn(
            f"fastpals could not register its PAL adapters with PEFT ({type(err).__name__}: {err}); "
            "peft.PeftModel.from_pretrained will not open fastpals adapters (fastpals.load_pals does)",
            RuntimeWarning,
            stacklevel=1,
        )
