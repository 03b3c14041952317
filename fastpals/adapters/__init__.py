"""The adapter stage: PALs put into an encoder someone already has, and the one format they are saved in.

- :mod:`.inject` (:func:`inject_pals`, :func:`save_pals`, :func:`load_pals`, :func:`set_task`,
  :func:`remove_pals`);
- :mod:`.targets` (the per-architecture targets ``TARGETS``: BERT, RoBERTa, XLM-R, ELECTRA, DistilBERT,
  DeBERTa-v2/v3, ModernBERT, minBERT) and :mod:`.hooks` (the injection state and its forward hooks);
- :mod:`.format` (``adapter_config.json`` + ``adapter_model.safetensors``, shared with ``MultiTaskBert``);
- :mod:`.peft_method` (the same adapters as the PEFT method ``FASTPALS``; imports PEFT) and
  :mod:`.peft_registration` (registers it with PEFT without importing PEFT first).
"""

from fastpals.adapters.format import read_adapter, write_adapter
from fastpals.adapters.inject import inject_pals, load_pals, remove_pals, save_pals, set_task
from fastpals.adapters.peft_registration import register_with_peft
from fastpals.adapters.targets import TARGETS

__all__ = [
    "TARGETS",
    "inject_pals",
    "load_pals",
    "read_adapter",
    "register_with_peft",
    "remove_pals",
    "save_pals",
    "set_task",
    "write_adapter",
]
