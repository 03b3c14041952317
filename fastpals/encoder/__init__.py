"""The encoder stage: fastpals' own BERT (minBERT, HF ``BertModel`` names and numerics), the PAL variants, the
rule for task-specific parameters, checkpoint reading and the encoder fingerprint an adapter records."""

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
