"""The encoder stage: minBERT, PAL variants, the task-specific parameter rule, the encoder fingerprint."""

from fastpals.encoder.bert import BertConfig, BertModel, PALConfig, load_bert_state_dict
from fastpals.encoder.fingerprint import encoder_fingerprint
from fastpals.encoder.pal_variants import (
    PAL_VARIANTS,
    PALVariant,
    freeze_shared_parameters,
    get_pal_variant,
    is_task_specific,
    register_pal_variant,
)

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
