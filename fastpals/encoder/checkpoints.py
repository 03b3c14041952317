"""Reading encoder checkpoints: HF / CS224N minBERT key names, state-dict comparison, load reports."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

__all__ = ["LoadReport", "is_ignorable_key", "load_bert_state_dict", "normalize_key", "state_dict_mismatches"]


def is_ignorable_key(name: str) -> bool:
    """Checkpoint entries that are not encoder weights by design: the position-id buffer and pre-training heads."""
    return name.endswith("position_ids") or name.startswith(("cls.", "lm_head.", "classifier."))


_MINBERT_NAMES = {  # CS224N minBERT → HF
    "word_embedding": "embeddings.word_embeddings",
    "pos_embedding": "embeddings.position_embeddings",
    "tk_type_embedding": "embeddings.token_type_embeddings",
    "embed_layer_norm": "embeddings.LayerNorm",
    "pooler_dense": "pooler.dense",
}
_MINBERT_LAYER_NAMES = {
    "self_attention.query": "attention.self.query",
    "self_attention.key": "attention.self.key",
    "self_attention.value": "attention.self.value",
    "attention_dense": "attention.output.dense",
    "attention_layer_norm": "attention.output.LayerNorm",
    "interm_dense": "intermediate.dense",
    "out_dense": "output.dense",
    "out_layer_norm": "output.LayerNorm",
}


def normalize_key(key: str) -> str:
    """Map a checkpoint key to minBERT's (= HF ``BertModel``'s) name: strips ``bert.``, renames TF-era
    ``gamma``/``beta`` and CS224N minBERT names."""
    if key.startswith("bert."):
        key = key[5:]
    if key.endswith(".gamma"):
        key = key[:-6] + ".weight"
    elif key.endswith(".beta"):
        key = key[:-5] + ".bias"
    head, _, tail = key.partition(".")
    if head in _MINBERT_NAMES:
        return f"{_MINBERT_NAMES[head]}.{tail}"
    if head == "bert_layers":
        idx, _, rest = tail.partition(".")
        for old, new in _MINBERT_LAYER_NAMES.items():
            if rest.startswith(old + "."):
                return f"encoder.layer.{idx}.{new}{rest[len(old) :]}"
    return key


def state_dict_mismatches(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> list[str]:
    """Human-readable differences between a model's tensors (``expected``) and a checkpoint's (``found``):
    names missing from the checkpoint, names the model lacks, and shape mismatches. Empty when they agree."""
    problems = [f"missing in checkpoint: {k}" for k in sorted(set(expected) - set(found))]
    problems += [f"not in the model: {k}" for k in sorted(set(found) - set(expected))]
    problems += [
        f"{k}: saved {list(v.shape)}, model {list(expected[k].shape)}"
        for k, v in found.items()
        if k in expected and v.shape != expected[k].shape
    ]
    return problems


@dataclass
class LoadReport:
    """What a checkpoint load did: ``loaded`` tensors, ``missing`` model keys, ``unexpected`` checkpoint keys."""

    missing: list[str]
    unexpected: list[str]
    loaded: int

    def __str__(self) -> str:
        return f"loaded {self.loaded} tensors; missing {self.missing or 'none'}; unexpected {self.unexpected or 'none'}"


def load_bert_state_dict(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read ``model.safetensors`` (preferred) or ``pytorch_model.bin`` from a checkpoint folder."""
    folder = Path(folder)
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    path = st if st.is_file() else pt if pt.is_file() else None
    if path is None:
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor pytorch_model.bin")
    try:
        return load_file(str(st)) if path is st else torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged or foreign file: name it (the loaders' errors do not)
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise OSError(
            f"{path} is not a readable weights file ({type(err).__name__}: {detail}): replace it (download "
            f"or copy the model again)"
        ) from err
