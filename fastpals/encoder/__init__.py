"""The encoder stage: fastpals' own BERT (minBERT) and the PAL variants it runs.

- :mod:`.bert` (:class:`BertModel`, :class:`BertConfig`, :class:`PALConfig`; HF ``BertModel`` names and numerics);
- :mod:`.pal_variants` (one class per PAL variant, registered in ``PAL_VARIANTS``; the PAL modules and hooks);
- :mod:`.task_params` (the one rule for task-specific parameters, :func:`freeze_shared_parameters`);
- :mod:`.checkpoints` (HF / CS224N checkpoint key names, load reports) and :mod:`.fingerprint` (the encoder's
  fingerprint recorded in an adapter).
"""

from fastpals.encoder.bert import BertConfig, BertModel, PALConfig
from fastpals.encoder.checkpoints import load_bert_state_dict
from fastpals.encoder.fingerprint import encoder_fingerprint
from fastpals.encoder.pal_variants import PAL_VARIANTS, PALVariant, get_pal_variant, register_pal_variant
from fastpals.encoder.task_params import freeze_shared_parameters, is_task_specific

__all__ = [
    "BertConfig",
    "BertModel",
    "PALConfig",
    "PALVariant",
    "PAL_VARIANTS",
    "encoder_fingerprint",
    "freeze_shared_parameters",
    "get_pal_variant",
    "is_task_specific",
    "load_bert_state_dict",
    "register_pal_variant",
]
