"""Small synthetic task files and a tiny random BERT for end-to-end trainer tests (seconds per run on CPU)."""

from __future__ import annotations

import csv
import random
import shutil
from pathlib import Path

WORDS = ["good", "bad", "great", "awful", "fine", "movie", "plot", "actor", "scene", "story", "dull", "fun"]


def _sentence(rng: random.Random, n: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _write(path: Path, header: list[str], rows: list[list[str]], shifted: bool = False) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(([""] if not shifted else ["0", ""]) + header)
        for i, row in enumerate(rows):
            w.writerow([str(i)] + ([f"{i}.0"] if shifted else []) + row)


def make_tiny_data(folder: Path, n: int = 48, seed: int = 0) -> Path:
    """SST/Quora/STS/CFIMDB-format files with ``n`` labelled rows each (Quora: 4n, plus one broken row)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    uid = iter(f"{k:025x}" for k in range(10**6))

    def single(split: str, name: str, classes: int) -> None:
        rows = []
        for _ in range(n):
            s = _sentence(rng)
            label = min(classes - 1, s.count("good") + s.count("great"))
            rows.append([next(uid), s] + ([str(label)] if split != "test" else []))
        header = ["id", "sentence"] + (["sentiment"] if split != "test" else [])
        _write(folder / name, header, rows, shifted=split == "test")

    for split in ("train", "dev", "test"):
        single(split, f"ids-sst-{split if split != 'test' else 'test-student'}.csv", 5)
        single(split, f"ids-cfimdb-{split if split != 'test' else 'test-student'}.csv", 2)
    rows = []
    for _ in range(4 * n):
        a = _sentence(rng)
        b = a if rng.random() < 0.5 else _sentence(rng)
        rows.append([next(uid), a, b, "1.0" if a == b else "0.0"])
    rows.append([next(uid), "", "", ""])  # a broken row: empty sentences and label (like the real file)
    _write(folder / "quora-dev.csv", ["id", "sentence1", "sentence2", "is_duplicate"], rows)
    for split in ("train", "dev", "test"):
        rows = []
        for _ in range(n):
            a, b = _sentence(rng), _sentence(rng)
            score = 5.0 * len(set(a.split()) & set(b.split())) / len(set(a.split()) | set(b.split()))
            rows.append([next(uid), a, b] + ([f"{score:.2f}"] if split != "test" else []))
        header = ["id", "sentence1", "sentence2"] + (["similarity"] if split != "test" else [])
        _write(folder / f"sts-{split if split != 'test' else 'test-student'}.csv", header, rows)
    return folder


def make_tiny_model(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer BERT (d = 32, 4 heads) in HF layout with MiniLM's vocab.txt."""
    import torch

    from fastpals.data.hub import resolve_model_dir
    from fastpals.encoder.bert import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    vocab = resolve_model_dir("minilm-l6", ("vocab.txt",)) / "vocab.txt"
    shutil.copy(vocab, folder / "vocab.txt")
    config = {
        "vocab_size": sum(1 for _ in open(vocab, encoding="utf-8")),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
        "type_vocab_size": 2,
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "layer_norm_eps": 1e-12,
        "model_type": "bert",
    }
    import json

    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    model = BertModel(BertConfig.from_dict(config))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def tiny_run_args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    """train.py options of a one-epoch run on the tiny data and model (``extra`` appended: later ones win)."""
    return [
        "--model", str(model), "--data-dir", str(data), "--out", str(out), "--batch-size", "8",
        "--max-length", "24", "--pal-hidden", "16", "--pal-heads", "2", "--max-eval", "16", "--max-predict", "8",
        "--epochs", "1", "--lr", "1e-3", *extra,
    ]  # fmt: skip
