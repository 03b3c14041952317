"""The checkpoint's own tokenizer (its ``tokenizer.json``, else the uncased BERT pipeline of a ``vocab.txt``) on
the Rust ``tokenizers`` library, with padding and truncation (at ``max_length`` tokens with the special tokens,
longest-first for pairs, counted in ``Tokenizer.num_truncated``). Token types only where the model has them."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from fastpals.data.hub import resolve_model_dir

MAX_POSITIONS = 512
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class Encoded(NamedTuple):
    """One tokenized sequence: ``input_ids`` and ``token_type_ids``, ``list[int]`` of one length."""

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


def _bert_pipeline(vocab: dict[str, int]) -> RustTokenizer:
    """The uncased BERT pipeline of a ``vocab.txt``."""
    rust = RustTokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    rust.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    rust.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    rust.decoder = decoders.WordPiece(prefix="##")
    rust.add_special_tokens(list(SPECIAL_TOKENS))
    return rust


def _check_texts(texts: Sequence[str], name: str) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{name} must be a list of str, got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(text).__name__}")
    return list(texts)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """A checkpoint's tokenizer with dynamic padding: ``Tokenizer.from_pretrained("minilm-l6" | folder | hub
    name)`` or ``Tokenizer(vocab_file)``. ``token_types``: ``token_type_ids`` carry segment ids;
    ``num_truncated``: sequences truncated so far. It sets the truncation length per call: share it between
    threads only with a lock."""

    def __init__(
        self,
        vocab_file: str | os.PathLike | None = None,
        *,
        tokenizer_file: str | os.PathLike | None = None,
        special_tokens: dict[str, str] | None = None,
        token_types: bool = True,
        max_positions: int = MAX_POSITIONS,
    ) -> None:
        if (vocab_file is None) == (tokenizer_file is None):
            raise TypeError(
                "Tokenizer takes one of vocab_file (a BERT vocab.txt) or tokenizer_file (tokenizer.json)"
            )
        special = dict(special_tokens or {})
        self.source = Path(vocab_file if vocab_file is not None else tokenizer_file)
        if not self.source.is_file():
            name = "vocab_file" if vocab_file is not None else "tokenizer_file"
            raise FileNotFoundError(f"{name} {self.source} does not exist")
        if vocab_file is not None:
            rust = _bert_pipeline(_read_vocab(self.source))
            special = {"pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]", "cls_token": "[CLS]",
                       "sep_token": "[SEP]", **special}  # fmt: skip
        else:
            try:
                rust = RustTokenizer.from_file(str(self.source))
            except Exception as err:  # the Rust library's parse errors carry no file name
                raise ValueError(f"{self.source} is not a tokenizers tokenizer.json ({err})") from None
            if "pad_token" not in special and rust.padding is not None:
                special["pad_token"] = rust.padding["pad_token"]
        rust.no_padding()
        rust.no_truncation()
        self._rust, self.special_tokens = rust, special
        self.vocab_size = rust.get_vocab_size(with_added_tokens=True)
        pad = special.get("pad_token")
        self.pad_token_id = None if pad is None else rust.token_to_id(pad)
        if self.pad_token_id is None:
            raise ValueError(
                f"{self.source}: the tokenizer has no pad token{f' ({pad!r} is not in its vocabulary)' if pad else ''}"
                ": set pad_token in tokenizer_config.json next to it"
            )
        self.unk_token_id = rust.token_to_id(special["unk_token"]) if "unk_token" in special else None
        self.mask_token_id = rust.token_to_id(special["mask_token"]) if "mask_token" in special else None
        empty = rust.encode("", add_special_tokens=True)
        if not empty.ids:
            raise ValueError(
                f"{self.source}: the tokenizer adds no special tokens to a sequence (no post_processor "
                "template): an encoder needs its [CLS]-like first token"
            )
        self.cls_token_id, self.sep_token_id = empty.ids[0], empty.ids[-1]
        self.token_types, self.max_positions, self.num_truncated = token_types, max_positions, 0
        self._truncation_length: int | None = None

    @property
    def vocab_file(self) -> Path:
        """:attr:`source` (former name)."""
        return self.source

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike) -> Tokenizer:
        """The tokenizer of ``"minilm-l6"``, a folder or a Hub id (:func:`resolve_model_dir`), with the special
        tokens of its ``tokenizer_config.json`` / ``special_tokens_map.json`` and token types per its config."""
        optional = ("tokenizer_config.json", "special_tokens_map.json", "config.json")
        folder = resolve_model_dir(
            name_or_path, (), optional=optional, any_of=("tokenizer.json", "vocab.txt")
        )
        special: dict[str, str] = {}
        config = _read_json(folder / "tokenizer_config.json")
        for data in (_read_json(folder / "special_tokens_map.json"), config):
            for key in ("pad_token", "unk_token", "mask_token", "cls_token", "sep_token"):
                name = data.get(key)  # a str or {"content": str}
                name = name.get("content") if isinstance(name, dict) else name
                if isinstance(name, str):
                    special[key] = name
        model_config = _read_json(folder / "config.json")
        types = model_config.get("type_vocab_size", 2 if not model_config else 0)
        limit = config.get("model_max_length")  # may raise BERT's 512
        limit = max(MAX_POSITIONS, limit) if isinstance(limit, int) and limit <= 1_000_000 else MAX_POSITIONS
        main = {"tokenizer_file": folder / "tokenizer.json"}
        if not main["tokenizer_file"].is_file():
            main = {"vocab_file": folder / "vocab.txt"}
        types = isinstance(types, int) and types >= 2
        return cls(**main, special_tokens=special, token_types=types, max_positions=limit)

    def save_pretrained(self, folder: str | os.PathLike) -> list[Path]:
        """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` (and ``vocab.txt``)
        so that ``AutoTokenizer.from_pretrained(folder)`` gives the same ids; returns the paths written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        pipeline = {**json.loads(self._rust.to_str()), "truncation": None, "padding": None}
        files = {"tokenizer.json": json.dumps(pipeline, ensure_ascii=False)}
        src = self.source.parent
        if self.source.name == "vocab.txt":
            config = {
                "tokenizer_class": "BertTokenizer",
                "do_lower_case": True,
                "tokenize_chinese_chars": True,
                "strip_accents": None,
                "model_max_length": self.max_positions,
                "clean_up_tokenization_spaces": True,
                **self.special_tokens,
            }
            by_id = sorted(self._rust.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
            files["vocab.txt"] = "".join(t + "\n" for t, _ in by_id)
            files["tokenizer_config.json"] = json.dumps(config, indent=2)
            files["special_tokens_map.json"] = json.dumps(self.special_tokens, indent=2)
        else:
            for name in ("tokenizer_config.json", "special_tokens_map.json"):
                if (src / name).is_file():
                    files[name] = (src / name).read_text(encoding="utf-8")
            if "tokenizer_config.json" not in files:
                config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
                files["tokenizer_config.json"] = json.dumps(config, indent=2)
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")
        return [folder / name for name in files]

    def __repr__(self) -> str:
        return f"Tokenizer(source={str(self.source)!r}, vocab_size={self.vocab_size})"

    def __len__(self) -> int:
        return self.vocab_size

    def encode(
        self, texts: Sequence[str], pair_texts: Sequence[str] | None = None, max_length: int = 128
    ) -> list[Encoded]:
        """``B`` :class:`Encoded` (no padding) of ``B`` texts (``pair_texts``: encoded jointly with the pair
        template), at most ``max_length`` tokens each."""
        texts = _check_texts(texts, "texts")
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise TypeError(f"max_length must be an int, got {type(max_length).__name__}")
        smallest = 3 if pair_texts is None else 4  # room for the special tokens and one token of text each
        if not smallest <= max_length <= self.max_positions:
            raise ValueError(f"max_length must be in [{smallest}, {self.max_positions}], got {max_length}")
        if pair_texts is None:
            inputs: list = texts
        else:
            pair_texts = _check_texts(pair_texts, "pair_texts")
            if len(pair_texts) != len(texts):
                raise ValueError(f"texts has {len(texts)} entries but pair_texts has {len(pair_texts)}")
            inputs = list(zip(texts, pair_texts))
        if not inputs:
            return []
        if self._truncation_length != max_length:
            self._rust.enable_truncation(max_length, stride=0, strategy="longest_first", direction="right")
            self._truncation_length = max_length
        encodings = self._rust.encode_batch(inputs, add_special_tokens=True)
        self.num_truncated += sum(1 for enc in encodings if enc.overflowing)
        return [
            Encoded(enc.ids, enc.type_ids if self.token_types else [0] * len(enc.ids)) for enc in encodings
        ]

    def pad(
        self, encoded: Sequence[Encoded], return_tensors: str | None = "pt"
    ) -> dict[str, torch.Tensor] | dict[str, list[list[int]]]:
        """``{"input_ids", "attention_mask", "token_type_ids"}`` ``[B, L]`` right-padded to the longest, as int64
        tensors (``"pt"``) or lists (None)."""
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        if len(encoded) == 0:
            raise ValueError("encoded is empty: cannot pad a batch of 0 sequences")
        longest = max(len(enc.input_ids) for enc in encoded)
        input_ids = [enc.input_ids + [self.pad_token_id] * (longest - len(enc.input_ids)) for enc in encoded]
        type_ids = [enc.token_type_ids + [0] * (longest - len(enc.token_type_ids)) for enc in encoded]
        mask = [[1] * len(enc.input_ids) + [0] * (longest - len(enc.input_ids)) for enc in encoded]
        padded = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": type_ids}
        if return_tensors is None:
            return padded
        return {key: torch.tensor(value, dtype=torch.int64) for key, value in padded.items()}

    def __call__(
        self,
        texts: Sequence[str],
        pair_texts: Sequence[str] | None = None,
        max_length: int = 128,
        padding: bool = True,
        return_tensors: str | None = "pt",
    ) -> dict[str, torch.Tensor] | dict[str, list[list[int]]]:
        """``{"input_ids", "attention_mask", "token_type_ids"}`` of ``B`` sentences or joint pairs, at most
        ``max_length`` tokens each; ``padding=False`` (ragged lists) needs ``return_tensors=None``."""
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
        """``(batch_a, batch_b)``: each side of the pairs as single sequences, each padded on its own (siamese)."""
        texts_a, texts_b = _check_texts(texts_a, "texts_a"), _check_texts(texts_b, "texts_b")
        if len(texts_a) != len(texts_b):
            raise ValueError(f"texts_a has {len(texts_a)} entries but texts_b has {len(texts_b)}")
        return (
            self(texts_a, max_length=max_length, return_tensors=return_tensors),
            self(texts_b, max_length=max_length, return_tensors=return_tensors),
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        return self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id."""
        tokens = [self._rust.id_to_token(int(i)) for i in ids]
        if None in tokens:
            raise ValueError(
                f"id {ids[tokens.index(None)]} is outside the vocabulary (size {self.vocab_size})"
            )
        return tokens
