"""The adapter stage: PALs put into an encoder someone already has, and the one format they are saved in.

- :mod:`.inject` (:func:`inject_pals`, :func:`save_pals`, :func:`load_pals`, :func:`set_task`,
  :func:`remove_pals`);
- :mod:`.targets` (the per-architecture targets ``TARGETS``: BERT, RoBERTa, XLM-R, ELECTRA, DistilBERT,
  DeBERTa-v2/v3, ModernBERT, minBERT) and :mod:`.hooks` (the injection state and its forward hooks);
- :mod:`.format` (``adapter_config.json`` + ``adapter_model.safetensors``, shared with ``MultiTaskBert``);
- :mod:`.peft_method` (the same adapters as the PEFT method ``FASTPALS``; imports PEFT) and
  :mod:`.peft_registration` (registers it when PEFT is imported).

The names below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "inject_pals": "inject", "save_pals": "inject", "load_pals": "inject", "set_task": "inject",
    "remove_pals": "inject",
    "TARGETS": "targets",
    "read_adapter": "format", "write_adapter": "format",
    "register_with_peft": "peft_registration",
}  # fmt: skip

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"fastpals.adapters.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'fastpals.adapters' has no attribute {name!r}")
