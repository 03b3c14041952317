"""Small random HF encoders of seven families, each saved with a tokenizer of its family (trained here with
``tokenizers`` on a few sentences, saved by transformers' ``save_pretrained``), for the any-encoder trainer tests.

``make_encoder(arch, folder)`` writes ``config.json`` + ``model.safetensors`` (``AutoModel.from_config``) and the
tokenizer files as transformers 5 saves them (``tokenizer.json`` + ``tokenizer_config.json``, no ``vocab.txt``).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

#: the architectures of the any-encoder tests (``config.model_type``)
ENCODERS = ("bert", "roberta", "xlm-roberta", "deberta-v2", "modernbert", "electra", "distilbert")

_WORDPIECE = ("bert", "electra", "distilbert")
_BPE = ("roberta", "modernbert")
_SPECIAL = {
    "bert": dict(pad="[PAD]", unk="[UNK]", cls="[CLS]", sep="[SEP]", mask="[MASK]"),
    "roberta": dict(pad="<pad>", unk="<unk>", cls="<s>", sep="</s>", mask="<mask>"),
    "deberta-v2": dict(pad="[PAD]", unk="[UNK]", cls="[CLS]", sep="[SEP]", mask="[MASK]"),
}
_SPECIAL.update({"electra": _SPECIAL["bert"], "distilbert": _SPECIAL["bert"], "xlm-roberta": _SPECIAL["roberta"],
                 "modernbert": _SPECIAL["bert"]})  # fmt: skip
_ORDER = {  # special tokens first, in each family's id order
    "roberta": ("cls", "pad", "sep", "unk", "mask"),
    "xlm-roberta": ("cls", "pad", "sep", "unk", "mask"),
    "deberta-v2": ("pad", "cls", "sep", "unk", "mask"),
}


def train_tokenizer(arch: str, texts: list[str], vocab_size: int = 400) -> tuple[Tokenizer, dict[str, str]]:
    """A tokenizer of ``arch``'s family trained on ``texts``, and its special tokens by role."""
    sp = _SPECIAL[arch]
    specials = [sp[k] for k in _ORDER.get(arch, ("pad", "unk", "cls", "sep", "mask"))]
    if arch in _WORDPIECE:
        tok = Tokenizer(models.WordPiece(unk_token=sp["unk"]))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    elif arch in _BPE:
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    else:  # SentencePiece-style unigram (XLM-R, DeBERTa-v2/v3)
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials, unk_token=sp["unk"])
    tok.train_from_iterator(texts, trainer)
    cls, sep = sp["cls"], sp["sep"]
    ids = [(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))]
    if arch in ("roberta", "xlm-roberta"):
        tok.post_processor = processors.RobertaProcessing((sep, ids[1][1]), (cls, ids[0][1]))
        if arch == "xlm-roberta":
            tok.post_processor = processors.TemplateProcessing(
                single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} {sep} $B {sep}", special_tokens=ids
            )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1", special_tokens=ids
        )
    return tok, sp


def tiny_config(arch: str, vocab_size: int, special_ids: dict[str, int], max_positions: int = 64):
    """A 2-layer, hidden-32 config of ``arch`` (transformers), with the tokenizer's special ids."""
    import transformers

    common = dict(vocab_size=vocab_size, pad_token_id=special_ids["pad"])
    bert = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                max_position_embeddings=max_positions, **common)  # fmt: skip
    if arch == "bert":
        return transformers.BertConfig(**bert)
    if arch == "electra":
        return transformers.ElectraConfig(**bert, embedding_size=16)
    if arch in ("roberta", "xlm-roberta"):
        cls = transformers.RobertaConfig if arch == "roberta" else transformers.XLMRobertaConfig
        return cls(**dict(bert, max_position_embeddings=max_positions + special_ids["pad"] + 1), type_vocab_size=1,
                   bos_token_id=special_ids["cls"], eos_token_id=special_ids["sep"])  # fmt: skip
    if arch == "deberta-v2":
        return transformers.DebertaV2Config(
            **bert, type_vocab_size=0, relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"],
            position_biased_input=False, norm_rel_ebd="layer_norm",
        )  # fmt: skip
    if arch == "modernbert":
        return transformers.ModernBertConfig(
            **bert, cls_token_id=special_ids["cls"], sep_token_id=special_ids["sep"],
            bos_token_id=special_ids["cls"], eos_token_id=special_ids["sep"],
        )  # fmt: skip
    if arch == "distilbert":
        return transformers.DistilBertConfig(
            dim=32, n_layers=2, n_heads=2, hidden_dim=48, max_position_embeddings=max_positions, **common
        )
    raise ValueError(f"no tiny config for {arch!r}")


def make_encoder(arch: str, folder: Path, texts: list[str], seed: int = 0, max_positions: int = 64) -> Path:
    """Save a random ``arch`` encoder and its family tokenizer (trained on ``texts``) to ``folder``, as
    transformers 5 saves them."""
    import torch
    import transformers

    tok, sp = train_tokenizer(arch, texts)
    special_ids = {role: tok.token_to_id(name) for role, name in sp.items()}
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=sp["pad"], unk_token=sp["unk"], cls_token=sp["cls"], sep_token=sp["sep"],
        mask_token=sp["mask"], model_max_length=max_positions,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(
        tiny_config(arch, tok.get_vocab_size(), special_ids, max_positions)
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return folder
