"""``fastpals export --format sentence-transformers``: the exported folder opens with
``sentence_transformers.SentenceTransformer`` (offline), encodes through the task's own PALs, and the cosine of its
embeddings on STS dev gives fastpals' own dev Pearson (``fastpals.model.evaluate.evaluate``) within 1e-4; tasks
whose score is not a cosine are refused with one line."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("sentence_transformers")

from fastpals.commands.export import main as export_main  # noqa: E402
from fastpals.data.loading import load_task  # noqa: E402
from fastpals.data.metrics import pearson  # noqa: E402
from fastpals.data.per_task_batches import TaskBatcher  # noqa: E402
from fastpals.data.tokenizer import Tokenizer  # noqa: E402
from fastpals.encoder.bert import PALConfig  # noqa: E402
from fastpals.model.evaluate import evaluate, predict_batches  # noqa: E402
from fastpals.model.multitask import MultiTaskBert, get_task  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_fixtures import make_tiny_data, make_tiny_model  # noqa: E402

MAX_LENGTH = 24


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny sst + sts model (STS as a siamese cosine task, mean pooling) saved as the trainer saves best/,
    and the same with STS as a cross-encoder."""
    root = tmp_path_factory.mktemp("st_export")
    data = make_tiny_data(root / "data", n=64)
    model_dir = make_tiny_model(root / "model")
    tokenizer = Tokenizer.from_pretrained(str(model_dir))
    out = {"data": data}
    for name, mode in (("cosine", "sbert_cosine"), ("joint", "joint")):
        sts = dataclasses.replace(
            get_task("sts"), pair_mode=mode, pooling="mean" if mode != "joint" else "cls"
        )
        torch.manual_seed(0)
        model = MultiTaskBert.from_base(str(model_dir), ["sst", sts], PALConfig(hidden=16, num_heads=2))
        best = model.save_pretrained(root / name / "best", tokenizer=tokenizer)
        (best / "training_args.json").write_text(json.dumps({"max_length": MAX_LENGTH}))
        out[name] = best
    return out


def test_sts_round_trip_gives_fastpals_pearson(saved: dict[str, Path], tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from fastpals.integrations.sentence_transformers import PALTaskEncoder

    out = tmp_path / "st"
    assert (
        export_main(["--task", "sts", "--format", "sentence-transformers", str(saved["cosine"]), str(out)])
        == 0
    )
    st = SentenceTransformer(str(out), trust_remote_code=True, device="cpu", local_files_only=True)
    assert st.similarity_fn_name == "cosine"
    dev = load_task("sts", "dev", saved["data"])
    u = st.encode([e.sentence1 for e in dev], convert_to_tensor=True, batch_size=16)
    v = st.encode([e.sentence2 for e in dev], convert_to_tensor=True, batch_size=16)
    cos = st.similarity_pairwise(u, v).double().numpy()

    model = MultiTaskBert.from_pretrained(saved["cosine"])
    tokenizer = Tokenizer.from_pretrained(saved["cosine"])
    spec = model.tasks[1]
    batcher = TaskBatcher(dev, tokenizer, spec, 16, max_length=MAX_LENGTH, shuffle=False, bucket_by_length=False,
                          pair_encoding="separate")  # fmt: skip
    scores, _ = evaluate(model, {"sts": batcher}, model.task_names)
    _, preds, labels = predict_batches(model, batcher, 1)
    # fastpals' sbert_cosine prediction is label_scale * cos on every pair, negative cosines included
    np.testing.assert_allclose(cos * spec.label_scale, preds, rtol=0, atol=1e-5)
    assert abs(pearson(labels, cos) - scores["sts"]) < 1e-4

    # the STS path is the task's own: sst's PALs give other embeddings
    sst_path = PALTaskEncoder(model, tokenizer, "sts", MAX_LENGTH)
    sst_path.task_index = 0
    features = sst_path(sst_path.preprocess([e.sentence1 for e in dev[:8]]))
    assert (features["sentence_embedding"] - u[:8]).abs().max() > 1e-4


def test_cross_encoder_sts_and_bad_options_are_refused(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = ["--task", "sts", "--format", "sentence-transformers", str(saved["joint"]), str(tmp_path / "a")]
    assert export_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pair_mode joint" in err and "--pair-mode sbert_cosine" in err
    assert not (tmp_path / "a").exists()
    args = ["--task", "para", "--format", "sentence-transformers", str(saved["cosine"]), str(tmp_path / "b")]
    assert export_main(args) == 2
    assert "the model has the tasks sst, sts" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    args = ["--task", "sst", "--format", "sentence-transformers", str(saved["cosine"]), str(tmp_path / "c")]
    assert export_main(args) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "c" / "keep.txt").read_text() == "mine"


def test_sbert_cosine_prediction_is_the_scaled_cosine_unclipped() -> None:
    joint = get_task("sts")
    cosine = dataclasses.replace(joint, pair_mode="sbert_cosine")
    z = torch.tensor([[-0.5], [0.25], [1.5]])
    torch.testing.assert_close(cosine.task_kind.predict(cosine, z), z[:, 0] * cosine.label_scale)
    torch.testing.assert_close(joint.task_kind.predict(joint, z), z[:, 0].clamp(0, 1) * joint.label_scale)


def test_bf16_model_scores_cosine_pairs_in_fp32(saved: dict[str, Path]) -> None:
    model = MultiTaskBert.from_pretrained(saved["cosine"])
    tokenizer = Tokenizer.from_pretrained(saved["cosine"])
    dev = load_task("sts", "dev", saved["data"])
    batcher = TaskBatcher(dev, tokenizer, model.tasks[1], 16, max_length=MAX_LENGTH, shuffle=False,
                          bucket_by_length=False, pair_encoding="separate")  # fmt: skip
    _, fp32, _ = predict_batches(model, batcher, 1)
    _, bf16, _ = predict_batches(model.to(torch.bfloat16), batcher, 1)
    # bf16 features, fp32 cosine and logits: the scores keep more than bf16's 3 digits
    assert np.abs(np.asarray(bf16) - np.asarray(fp32)).max() < 0.05
    assert len(np.unique(np.asarray(bf16))) == len(np.unique(np.asarray(fp32)))
