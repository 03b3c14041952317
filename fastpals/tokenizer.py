"""BERT WordPiece tokenizer on the Rust ``tokenizers`` library.

The pipeline is BERT's uncased one, built from a ``vocab.txt`` (one token per line, id = line number from 0):
BERT normalizer (clean control characters, space around CJK characters, lower-case, strip accents as lower-casing
does), BERT pre-tokenizer (split on whitespace and punctuation), WordPiece (``##`` continuation prefix, ``[UNK]``
for words over 100 characters or not coverable), and the post-processor

    single:  [CLS] a [SEP]                 token types 0 ... 0
    pair:    [CLS] a [SEP] b [SEP]         token types 0 ... 0 1 ... 1

The special tokens are registered as such, so a literal ``[SEP]`` inside a text is that token (as in HF's
``BertTokenizerFast``). Ids, attention masks and token types equal HF's ``BertTokenizerFast`` built on the same
vocabulary with ``do_lower_case=True`` (tests/test_tokenizer.py checks every sentence of the SST dev file and every
pair of the STS dev file).

Truncation is always on, at ``max_length`` tokens including the special tokens (at most 512, BERT's position
table); pairs are truncated longest-first, one token at a time from the longer side, as HF does. Every truncated
sequence (or pair) is counted in ``Tokenizer.num_truncated``; nothing is cut without being counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from fastpals.hub import resolve_model_dir

__all__ = ["MAX_POSITIONS", "Encoded", "Tokenizer"]

MAX_POSITIONS = 512
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class Encoded(NamedTuple):
    """One tokenized (unpadded) sequence: ``input_ids`` and ``token_type_ids``, both ``list[int]`` of one length."""

    input_ids: list[int]
    token_type_ids: list[int]


def _read_vocab(path: Path) -> dict[str, int]:
    vocab: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle):
            token = line.rstrip("\n").rstrip("\r")
            if token in vocab:  # BERT vocabularies have unique lines; a duplicate would silently shift ids
                raise ValueError(f"{path}:{line_no + 1}: token {token!r} already at line {vocab[token] + 1}")
            vocab[token] = line_no
    if not vocab:
        raise ValueError(f"{path} is empty: a vocab.txt holds one token per line")
    missing = [token for token in SPECIAL_TOKENS if token not in vocab]
    if missing:
        raise ValueError(f"{path} lacks the special tokens {', '.join(missing)}")
    return vocab


def _check_texts(texts: Sequence[str], name: str) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{name} must be a list of str, got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(text).__name__}")
    return list(texts)


def _check_max_length(max_length: int, pair: bool) -> int:
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise TypeError(f"max_length must be an int, got {type(max_length).__name__}")
    smallest = 4 if pair else 3  # room for the special tokens and one token of text per sequence
    if not smallest <= max_length <= MAX_POSITIONS:
        raise ValueError(f"max_length must be in [{smallest}, {MAX_POSITIONS}], got {max_length}")
    return max_length


class Tokenizer:
    """Uncased BERT WordPiece tokenizer with dynamic padding.

    Build it with ``Tokenizer.from_pretrained("minilm-l6" | folder | hub name)`` or ``Tokenizer(vocab_file)``.

    Attributes:
        vocab_file: the ``vocab.txt`` it was built from.
        vocab_size: number of tokens.
        pad_token_id, cls_token_id, sep_token_id, unk_token_id, mask_token_id: special token ids.
        num_truncated: how many sequences (a pair counts once) were truncated so far; reset it by assigning 0.

    One instance sets its Rust tokenizer's truncation length per call: share it between threads only with a lock
    (processes are fine: it pickles).
    """

    def __init__(self, vocab_file: str | os.PathLike) -> None:
        self.vocab_file = Path(vocab_file)
        if not self.vocab_file.is_file():
            raise FileNotFoundError(f"vocab_file {self.vocab_file} does not exist")
        self.vocab = _read_vocab(self.vocab_file)
        self.vocab_size = len(self.vocab)
        self.pad_token_id = self.vocab["[PAD]"]
        self.unk_token_id = self.vocab["[UNK]"]
        self.cls_token_id = self.vocab["[CLS]"]
        self.sep_token_id = self.vocab["[SEP]"]
        self.mask_token_id = self.vocab["[MASK]"]
        self.num_truncated = 0

        rust = RustTokenizer(WordPiece(self.vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        rust.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
        )
        rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        rust.post_processor = processors.TemplateProcessing(
            single="[CLS]:0 $A:0 [SEP]:0",
            pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
            special_tokens=[("[CLS]", self.cls_token_id), ("[SEP]", self.sep_token_id)],
        )
        rust.decoder = decoders.WordPiece(prefix="##")
        rust.add_special_tokens(list(SPECIAL_TOKENS))
        rust.no_padding()
        self._rust = rust
        self._truncation_length: int | None = None

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike) -> Tokenizer:
        """Build from the ``vocab.txt`` of ``"minilm-l6"``, a local folder, or a Hugging Face Hub repository id.

        See ``fastpals.hub.resolve_model_dir`` for how the name is resolved and the errors it raises.
        """
        return cls(resolve_model_dir(name_or_path, ("vocab.txt",)) / "vocab.txt")

    def save_pretrained(self, folder: str | os.PathLike) -> list[Path]:
        """Write the tokenizer files HF transformers reads, so ``AutoTokenizer.from_pretrained(folder)`` gives a
        ``BertTokenizerFast`` with the same ids, masks and token types (and ``Tokenizer.from_pretrained(folder)``
        this tokenizer): ``vocab.txt``, ``tokenizer.json`` (this Rust pipeline, without truncation or padding),
        ``tokenizer_config.json`` and ``special_tokens_map.json``. Returns the paths written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        by_id = sorted(self.vocab, key=self.vocab.__getitem__)
        special = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                   "mask_token": "[MASK]"}  # fmt: skip
        pipeline = json.loads(self._rust.to_str())
        pipeline["truncation"] = None
        pipeline["padding"] = None
        config = {
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": True,
            "tokenize_chinese_chars": True,
            "strip_accents": None,
            "model_max_length": MAX_POSITIONS,
            "clean_up_tokenization_spaces": True,
            **special,
        }
        files = {
            "vocab.txt": "".join(t + "\n" for t in by_id),
            "tokenizer.json": json.dumps(pipeline, ensure_ascii=False),
            "tokenizer_config.json": json.dumps(config, indent=2),
            "special_tokens_map.json": json.dumps(special, indent=2),
        }
        paths = []
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")
            paths.append(folder / name)
        return paths

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_file={str(self.vocab_file)!r}, vocab_size={self.vocab_size})"

    def __len__(self) -> int:
        return self.vocab_size

    def _set_truncation(self, max_length: int) -> None:
        if self._truncation_length != max_length:
            self._rust.enable_truncation(max_length, stride=0, strategy="longest_first", direction="right")
            self._truncation_length = max_length

    def encode(
        self, texts: Sequence[str], pair_texts: Sequence[str] | None = None, max_length: int = 128
    ) -> list[Encoded]:
        """Tokenize without padding.

        Args:
            texts: ``B`` strings.
            pair_texts: ``None``, or ``B`` second sentences encoded jointly as ``[CLS] a [SEP] b [SEP]``.
            max_length: most tokens per sequence, special tokens included (``<= 512``).

        Returns:
            ``B`` ``Encoded(input_ids, token_type_ids)``; truncated ones are counted in ``num_truncated``.
        """
        texts = _check_texts(texts, "texts")
        max_length = _check_max_length(max_length, pair_texts is not None)
        if pair_texts is None:
            inputs: list = texts
        else:
            pair_texts = _check_texts(pair_texts, "pair_texts")
            if len(pair_texts) != len(texts):
                raise ValueError(f"texts has {len(texts)} entries but pair_texts has {len(pair_texts)}")
            inputs = list(zip(texts, pair_texts))
        if not inputs:
            return []
        self._set_truncation(max_length)
        encodings = self._rust.encode_batch(inputs, add_special_tokens=True)
        self.num_truncated += sum(1 for enc in encodings if enc.overflowing)
        return [Encoded(enc.ids, enc.type_ids) for enc in encodings]

    def pad(
        self, encoded: Sequence[Encoded], return_tensors: str | None = "pt"
    ) -> dict[str, torch.Tensor] | dict[str, list[list[int]]]:
        """Pad to the longest sequence of the batch (right padding with ``[PAD]``, token type 0, mask 0).

        Args:
            encoded: ``B`` ``Encoded`` sequences (``B >= 1``).
            return_tensors: ``"pt"`` for int64 tensors of shape ``(B, L)``, ``None`` for nested lists.

        Returns:
            ``{"input_ids", "attention_mask", "token_type_ids"}``, each ``(B, L)`` with ``L`` the longest length.
        """
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        if len(encoded) == 0:
            raise ValueError("encoded is empty: cannot pad a batch of 0 sequences")
        longest = max(len(enc.input_ids) for enc in encoded)
        input_ids = [enc.input_ids + [self.pad_token_id] * (longest - len(enc.input_ids)) for enc in encoded]
        type_ids = [enc.token_type_ids + [0] * (longest - len(enc.token_type_ids)) for enc in encoded]
        mask = [[1] * len(enc.input_ids) + [0] * (longest - len(enc.input_ids)) for enc in encoded]
        if return_tensors is None:
            return {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": type_ids}
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.int64),
            "attention_mask": torch.tensor(mask, dtype=torch.int64),
            "token_type_ids": torch.tensor(type_ids, dtype=torch.int64),
        }

    def __call__(
        self,
        texts: Sequence[str],
        pair_texts: Sequence[str] | None = None,
        max_length: int = 128,
        padding: bool = True,
        return_tensors: str | None = "pt",
    ) -> dict[str, torch.Tensor] | dict[str, list[list[int]]]:
        """Tokenize a batch: single sentences, or pairs encoded jointly (``[CLS] a [SEP] b [SEP]``, types 0/1).

        Args:
            texts: ``B`` strings (``B >= 1``).
            pair_texts: ``None`` or ``B`` second sentences.
            max_length: most tokens per sequence, special tokens included (``<= 512``); longer inputs are
                truncated (longest-first for pairs) and counted in ``num_truncated``.
            padding: ``True`` pads to the longest sequence of the batch. ``False`` is only allowed with
                ``return_tensors=None`` (ragged lists; ``attention_mask`` all ones).
            return_tensors: ``"pt"`` (int64 tensors ``(B, L)``) or ``None`` (lists).

        Returns:
            ``{"input_ids", "attention_mask", "token_type_ids"}``.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be a list of str (wrap a single sentence in a list)")
        encoded = self.encode(texts, pair_texts, max_length)
        if not encoded:
            raise ValueError("texts is empty: nothing to tokenize")
        if padding:
            return self.pad(encoded, return_tensors)
        if return_tensors is not None:
            raise ValueError("padding=False gives ragged sequences: it needs return_tensors=None")
        return {
            "input_ids": [enc.input_ids for enc in encoded],
            "attention_mask": [[1] * len(enc.input_ids) for enc in encoded],
            "token_type_ids": [enc.token_type_ids for enc in encoded],
        }

    def encode_separately(
        self,
        texts_a: Sequence[str],
        texts_b: Sequence[str],
        max_length: int = 128,
        return_tensors: str | None = "pt",
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Tokenize the two sentences of each pair as two single sequences (for siamese / bi-encoder heads).

        Each side is ``[CLS] x [SEP]`` with token type 0, truncated to ``max_length`` on its own and padded to
        the longest of its own side. Returns ``(batch_a, batch_b)`` as from ``__call__``.
        """
        texts_a = _check_texts(texts_a, "texts_a")
        texts_b = _check_texts(texts_b, "texts_b")
        if len(texts_a) != len(texts_b):
            raise ValueError(f"texts_a has {len(texts_a)} entries but texts_b has {len(texts_b)}")
        return (
            self(texts_a, max_length=max_length, return_tensors=return_tensors),
            self(texts_b, max_length=max_length, return_tensors=return_tensors),
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Turn ids back into text (WordPiece pieces merged; lower-cased as encoded)."""
        return self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id."""
        out = []
        for i in ids:
            token = self._rust.id_to_token(int(i))
            if token is None:
                raise ValueError(f"id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(token)
        return out
