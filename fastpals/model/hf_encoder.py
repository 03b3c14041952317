"""Any non-BERT HF encoder (``AutoModel`` with injected PALs) as :class:`fastpals.MultiTaskBert`'s encoder,
called like minBERT: packed rows are padded for the HF model and its output packed again."""

from __future__ import annotations

import inspect
import json
import os
from typing import Any

import torch
from torch import nn

from fastpals.adapters.inject import inject_pals
from fastpals.data.hub import resolve_model_dir
from fastpals.data.layout import BatchLayout
from fastpals.encoder.bert import BertConfig, BertOutput, PALConfig


def runs_as_minbert(name_or_path: str | os.PathLike) -> bool:
    """Is the checkpoint (``"minilm-l6"``, a folder, a Hub id) a BERT, run as minBERT (not as an HF model)?"""
    folder = resolve_model_dir(name_or_path, ("config.json",))
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON ({err})") from None
    return config.get("model_type", "bert") == "bert"


class HFEncoder(nn.Module):
    """An HF encoder (``transformers.AutoModel``; ``pal``: PALs injected here) called like minBERT."""

    def __init__(self, model: nn.Module, pal: PALConfig | None = None) -> None:
        super().__init__()
        self.model, c = model, model.config
        self.model_type = c.model_type
        positions = getattr(c, "max_position_embeddings", 512)  # the BertConfig fields fastpals reads
        if c.model_type in ("roberta", "xlm-roberta", "camembert"):
            positions -= (getattr(c, "pad_token_id", 1) or 0) + 1  # positions start after the pad id
        sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        self.config = BertConfig(
            **{name: getattr(c, name) for name in sizes},
            intermediate_size=getattr(c, "intermediate_size", 4 * c.hidden_size),
            max_position_embeddings=positions,
            type_vocab_size=getattr(c, "type_vocab_size", 0) or 0,
            pad_token_id=getattr(c, "pad_token_id", 0) or 0,
        )
        self.num_tasks = 0 if pal is None else pal.num_tasks
        if pal is not None:
            inject_pals(model, pal)
        params = inspect.signature(model.forward).parameters
        self.token_types = "token_type_ids" in params and self.config.type_vocab_size >= 2
        self.has_pooler = getattr(model, "pooler", None) is not None

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, pal: PALConfig | None = None) -> HFEncoder:
        """The checkpoint ``name_or_path`` (``AutoModel``; a local folder or a Hub id) with ``pal`` injected."""
        import transformers  # optional: only HF encoders need it

        weights = ("model.safetensors", "pytorch_model.bin")
        folder = resolve_model_dir(name_or_path, ("config.json",), any_of=weights)
        return cls(transformers.AutoModel.from_pretrained(str(folder)), pal)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        task_ids: torch.Tensor | None = None,
        unpad: bool = False,
        layout: BatchLayout | None = None,
    ) -> BertOutput:
        """minBERT's call: padded int64 ``[B, L]`` inputs (``unpad`` ignored) or packed ``[N]`` and layout."""
        packed = layout is not None and layout.packed and input_ids.dim() == 1
        if packed:  # to the layout's padded [B, L] and back
            mask = layout.padding_mask()
            input_ids = layout.to_padded(input_ids).masked_fill(~mask, self.config.pad_token_id)
            attention_mask = mask.long()
            if token_type_ids is not None:
                token_type_ids = layout.to_padded(token_type_ids)
            task_ids = layout.task_ids  # this pass's rows (a siamese second pass holds the siamese rows only)
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.token_types and token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        if self.num_tasks:
            kwargs["task_ids"] = task_ids
        out = self.model(**kwargs)
        h = out.last_hidden_state
        pooled = getattr(out, "pooler_output", None) if self.has_pooler else None
        pooled = h[:, 0] if pooled is None else pooled
        return BertOutput(layout.to_rows(h), pooled, layout.cu_seqlens) if packed else BertOutput(h, pooled)
