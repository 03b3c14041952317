"""Every encoder family in the trainer: small random encoders of seven architectures, saved as transformers 5
saves them (config.json + model.safetensors + tokenizer.json, no vocab.txt) with a tokenizer of their family
trained here on the task data, each train 3 updates with ``--surgery pcgrad`` and write results.json.

Adding an architecture: its row in fastpals.adapters.targets.TARGETS and its case in ENCODERS
(tests/encoder_fixtures.py: a tiny config and its tokenizer family)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encoder_fixtures import ENCODERS, make_encoder  # noqa: E402
from train_fixtures import _sentence, make_tiny_data, tiny_run_args  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_data(tmp_path_factory.mktemp("encoders") / "data", n=24)


def _texts() -> list[str]:
    rng = random.Random(0)
    return [_sentence(rng) for _ in range(200)]


@pytest.mark.parametrize("arch", ENCODERS)
def test_encoder_trains_three_pcgrad_updates(data, tmp_path, arch, capsys):
    from fastpals.train.command import main

    model = make_encoder(arch, tmp_path / arch, _texts(), max_positions=64)
    assert not (model / "vocab.txt").exists()
    out = tmp_path / "run"
    # sentence pairs: joint (the tokenizer's pair template) for half the families, siamese for the others
    siamese = ["--pair-mode", "sbert_concat"] if ENCODERS.index(arch) % 2 else []
    argv = tiny_run_args(data, model, out, "--surgery", "pcgrad", "--steps-per-epoch", "3", "--max-eval", "8",
                         "--max-predict", "4", "--no-progress", "--ds_config", "configs/cpu_fp32.json", *siamese)  # fmt: skip
    rc = main(argv)
    log = capsys.readouterr()
    assert rc == 0, (log.out + log.err)[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 3
    text = log.out + log.err
    expected = "fastpals minBERT" if arch == "bert" else f"HF {arch}"
    assert f"[model] encoder: {expected}" in text and "padded per micro-batch" in text or arch == "bert", (
        text[:2000]
    )
    if (
        arch != "bert"
    ):  # the run says which shared parameters take the exact per-task path (DeBERTa's rel. pos.)
        assert "[surgery] one backward gives every task's gradient" in text
        assert ("rel_embeddings.weight" in text) == (arch == "deberta-v2")


@pytest.mark.parametrize("arch", ENCODERS)
def test_one_backward_per_task_gradients_equal_separate_backwards(arch):
    """Per-task gradients of every shared parameter (Linear, LayerNorm, embeddings; the exact path for what one
    backward cannot split) and of the PALs from ONE backward equal T separate plain-autograd backwards, within
    1e-5, with PALs injected into the HF model (eval mode, fp32)."""
    import torch
    from test_inject import _tiny
    from test_per_task_grads import check_equal, separate_backwards
    from torch import nn

    from fastpals import PALConfig, inject_pals
    from fastpals.surgery import TaskGradientBuffer, per_task_gradients, task_mean_loss

    t_count = 3
    torch.manual_seed(0)
    model = inject_pals(
        _tiny(arch, dropout=False), PALConfig(num_tasks=t_count, hidden=12, num_heads=2, gate=True)
    )
    model.eval()
    gen = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if "dec_weight" in name:  # non-zero PAL decoders: the PALs change the encoder's gradients
            p.data = torch.randn(p.shape, generator=gen) * 0.05

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.heads = model, nn.ModuleList(nn.Linear(32, 1) for _ in range(t_count))

    wrapped = Wrapped()
    g = torch.Generator().manual_seed(0)
    task_ids, length = torch.tensor([2, 0, 1, 0, 2, 1]), 8
    lengths = torch.randint(3, length + 1, (6,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    ids = torch.randint(4, 97, (6, length), generator=g) * mask + (1 - mask)
    data = {
        "input_ids": ids,
        "attention_mask": mask,
        "task_ids": task_ids,
        "labels": torch.rand(6, generator=g),
    }

    def per_example(m, d):
        h = m.enc(input_ids=d["input_ids"], attention_mask=d["attention_mask"], task_ids=d["task_ids"])
        cls = h.last_hidden_state[:, 0]
        out = torch.stack([m.heads[t](cls[b]).squeeze(-1) for b, t in enumerate(d["task_ids"].tolist())])
        return (out - d["labels"]) ** 2

    def loss_fn(m, d):
        return task_mean_loss(per_example(m, d), d["task_ids"], t_count)

    specific = [
        p for n, p in wrapped.named_parameters() if ".pal" in n or "pal_projections" in n or "heads." in n
    ]
    own = {id(p) for p in specific}
    shared = [p for p in wrapped.parameters() if id(p) not in own]
    ref = separate_backwards(wrapped, data, loss_fn, shared, specific)

    buf = TaskGradientBuffer(shared, t_count, torch.float32, task_params=specific)
    wrapped.zero_grad(set_to_none=True)
    with per_task_gradients(wrapped, buf, data["task_ids"]) as block:
        losses = per_example(wrapped, data)
        terms = [(t, losses[data["task_ids"] == t].mean()) for t in range(t_count)]
        exact = block.exact_task_gradients(terms)
        sum(v for _, v in terms).backward()
    assert all(p.grad is None for p in shared), "shared parameters must get no ordinary .grad"
    got = buf, {id(p): None if p.grad is None else p.grad.clone() for p in specific}
    check_equal(ref, got, shared, specific, arch)
    if arch == "deberta-v2":  # relative-position table and its LayerNorm: not split by example (and the
        # attention projections, which also project that table)
        rel = {
            "enc.encoder.rel_embeddings.weight",
            "enc.encoder.LayerNorm.weight",
            "enc.encoder.LayerNorm.bias",
        }
        assert rel <= set(exact) and all(n in rel or "_proj." in n for n in exact), exact
    else:
        assert exact == [], exact
