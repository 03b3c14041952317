"""The encoder stage: fastpals' own BERT (minBERT) and the PAL variants it runs.

- :mod:`.bert` (:class:`BertModel`, :class:`BertConfig`, :class:`PALConfig`; HF ``BertModel`` names and numerics);
- :mod:`.pal_variants` (one class per PAL variant, registered in ``PAL_VARIANTS``; the PAL modules and hooks);
- :mod:`.task_params` (the one rule for task-specific parameters, :func:`freeze_shared_parameters`);
- :mod:`.checkpoints` (HF / CS224N checkpoint key names, load reports) and :mod:`.fingerprint` (the encoder's
  fingerprint recorded in an adapter).

The names below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "BertConfig": "bert", "BertModel": "bert", "PALConfig": "bert",
    "PAL_VARIANTS": "pal_variants", "PALVariant": "pal_variants", "register_pal_variant": "pal_variants",
    "get_pal_variant": "pal_variants",
    "is_task_specific": "task_params", "freeze_shared_parameters": "task_params",
    "load_bert_state_dict": "checkpoints",
    "encoder_fingerprint": "fingerprint",
}  # fmt: skip

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"fastpals.encoder.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'fastpals.encoder' has no attribute {name!r}")
