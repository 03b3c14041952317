"""One task of a trained :class:`fastpals.MultiTaskBert` as a ``sentence_transformers.SentenceTransformer``
(``fastpals export --format sentence-transformers``): one module, :class:`PALTaskEncoder`, runs the task's
PALs (attention: they fold into no linear merge), encoder and pooling. Only a task scored by the cosine of two
embeddings exports (a pair task trained ``--pair-mode sbert_cosine``, or a single-sentence task). Loading
needs fastpals and ``SentenceTransformer(out, trust_remote_code=True)``; nothing is read from the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import InputModule

from fastpals.data.tokenizer import Tokenizer
from fastpals.model.multitask import MultiTaskBert

__all__ = ["ExportError", "PALTaskEncoder", "check_exportable", "export_task"]

MODEL_SUBFOLDER = "fastpals_model"
CONFIG_NAME = "fastpals_encoder.json"


class ExportError(ValueError):
    """A task that cannot be exported, or a bad option; printed as one line."""


def check_exportable(model: MultiTaskBert, task: str) -> None:
    """Raise :class:`ExportError` when ``task`` is not a task of ``model`` or its score is not the cosine of
    its sentence embeddings (a pair task not trained as ``sbert_cosine``)."""
    if task not in model.task_names:
        raise ExportError(f"--task {task}: the model has the tasks {', '.join(model.task_names)}")
    spec = model.tasks[model.task_index(task)]
    if spec.pair and spec.pair_mode != "sbert_cosine":
        joint = spec.pair_mode == "joint"
        how = "a cross-encoder over the joined pair" if joint else "a head on (u, v, |u-v|)"
        raise ExportError(
            f"--task {task} was trained with pair_mode {spec.pair_mode} ({how}): its score is not the cosine of "
            "two sentence embeddings, so a sentence-transformers model cannot reproduce it; train it with "
            "--pair-mode sbert_cosine to export it"
        )


class PALTaskEncoder(InputModule):
    """A sentence-transformers input module running ``task``'s path of a :class:`fastpals.MultiTaskBert`:
    ``preprocess(texts)`` gives int64 ``[B, L]`` ``input_ids``, ``attention_mask``, ``token_type_ids`` (right
    padded, at most ``max_seq_length``); ``forward`` adds ``sentence_embedding`` ``[B, d]`` in the model's
    dtype."""

    config_keys = ["task", "max_seq_length"]
    config_file_name = CONFIG_NAME

    def __init__(self, model: MultiTaskBert, tokenizer: Any, task: str, max_seq_length: int = 128) -> None:
        super().__init__()
        check_exportable(model, task)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.task = task
        self.max_seq_length = int(max_seq_length)
        self.task_index = model.task_index(task)

    def preprocess(
        self, inputs: Sequence[str], prompt: str | None = None, **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        """Token ids of ``B`` texts, as fastpals tokenizes one sentence (``prompt`` is prepended if given)."""
        texts = [str(text) for text in inputs]
        if prompt:
            texts = self._prepend_prompt(texts, prompt)
        return self.tokenizer(texts, max_length=self.max_seq_length)

    def forward(self, features: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, torch.Tensor]:
        """``features["sentence_embedding"]`` ``[B, d]``: the task's pooled features of each text."""
        ids, mask = features["input_ids"], features["attention_mask"]
        task_ids = torch.full((ids.shape[0],), self.task_index, dtype=torch.long, device=ids.device)
        spec = self.model.tasks[self.task_index]
        out = self.model.bert(ids, mask, features.get("token_type_ids"), task_ids, unpad=True)
        features["sentence_embedding"] = self.model._features(spec, out, mask)
        return features

    def get_sentence_embedding_dimension(self) -> int:
        """``d``, the encoder's hidden size."""
        return self.model.config.bert.hidden_size

    def save(self, output_path: str, *args: Any, safe_serialization: bool = True, **kwargs: Any) -> None:
        """``fastpals_model/`` (the model and its ``vocab.txt``) and ``fastpals_encoder.json``."""
        self.model.save_pretrained(Path(output_path) / MODEL_SUBFOLDER, tokenizer=self.tokenizer)
        self.save_config(output_path)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs: Any) -> PALTaskEncoder:
        """Open a folder written by :meth:`save` (a local folder; fastpals opens the model)."""
        folder = Path(model_name_or_path) / subfolder
        if not (folder / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}: not a folder written by fastpals export")
        config = json.loads((folder / CONFIG_NAME).read_text())
        model = MultiTaskBert.from_pretrained(folder / MODEL_SUBFOLDER)
        tokenizer = Tokenizer.from_pretrained(folder / MODEL_SUBFOLDER)
        return cls(model, tokenizer, config["task"], config["max_seq_length"])


def export_task(
    model: MultiTaskBert, tokenizer: Any, task: str, out: str | os.PathLike, max_seq_length: int = 128
) -> Path:
    """Write ``task`` of ``model`` as a sentence-transformers folder ``out`` (cosine similarity); returns it.
    Raises :class:`ExportError` for a task that cannot be exported (:func:`check_exportable`)."""
    encoder = PALTaskEncoder(model, tokenizer, task, max_seq_length)
    st = SentenceTransformer(modules=[encoder], similarity_fn_name="cosine", device="cpu")
    st.save(str(out))
    return Path(out)
