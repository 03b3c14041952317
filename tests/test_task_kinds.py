"""fastpals.data.task_kinds: the built-in kinds and their registry, and a new kind defined in this file alone.

``Ordinal`` below is a kind fastpals does not have (K ordered classes from K - 1 cumulative logits, CORAL-style).
It is registered here and run through the public paths (task file, readers, batcher, ``MultiTaskBert`` loss and
predictions, evaluation, metrics, prediction files, save and load) without any change to another file: adding a
task kind touches the module that defines it (``fastpals/data/task_kinds.py`` for a built-in one) and its test.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_tasks import _tiny_model, vocab_tokenizer

from fastpals.data.loading import load_task
from fastpals.data.metrics import overall, read_predictions, task_confusion_matrix, task_metrics, unit_score
from fastpals.data.per_task_batches import TaskBatcher, merge_batches
from fastpals.data.readers import DataError, read_task_file
from fastpals.data.task_kinds import (
    TASK_KINDS,
    Binary,
    Classification,
    Regression,
    TaskKind,
    cosent_loss,
    kind_names,
    register_task_kind,
)
from fastpals.data.tasks import TaskFileError, TaskSpec, get_task
from fastpals.model.evaluate import confidence, evaluate
from fastpals.model.multitask import MultiTaskBert, MultiTaskOutput
from fastpals.train.outputs import write_dev_predictions

# ---------------------------------------------------------------- the built-in kinds


def test_registry_holds_the_three_builtin_kinds_in_order():
    assert list(TASK_KINDS) == ["classification", "binary", "regression"]
    assert [type(k) for k in TASK_KINDS.values()] == [Classification, Binary, Regression]
    for name in ("sst", "para", "sts"):
        spec = get_task(name)
        assert spec.task_kind is TASK_KINDS[spec.kind] and spec.to_dict()["kind"] == spec.kind
    assert kind_names(lambda k: not k.scored) == "classification and binary"
    assert kind_names(lambda k: k.cosine_pairs) == "regression"
    with pytest.raises(ValueError, match="'binary' is already registered"):
        register_task_kind(Binary())
    with pytest.raises(TypeError, match="TaskKind instance"):
        register_task_kind(Binary)
    assert list(TASK_KINDS) == ["classification", "binary", "regression"]


@pytest.mark.parametrize("name", ["sst", "para", "sts"])
def test_builtin_predict_and_confidence_read_nothing_back_to_the_host(name):
    """Meta tensors hold no data: ``.item()``, ``.tolist()``, ``nonzero`` or boolean masks on them raise."""
    spec = get_task(name)
    logits = torch.empty(7, spec.num_labels, device="meta", dtype=torch.bfloat16)
    pred = spec.task_kind.predict(spec, logits)
    assert (pred.shape, pred.dtype) == ((7,), torch.float32)
    conf = spec.task_kind.confidence(spec, logits)
    assert conf is None if name == "sts" else (conf.shape, conf.dtype) == ((7,), torch.float32)


def test_builtin_losses_are_0dim_fp32():
    torch.manual_seed(0)
    sts_cos = TaskSpec("sts", "regression", pair=True, loss="cosine")
    for spec, labels in (
        (get_task("sst"), torch.tensor([0.0, 4.0, 2.0])),
        (get_task("para"), torch.tensor([1.0, 0.0, 1.0])),
        (get_task("sts"), torch.tensor([0.5, 4.0, 2.5])),
        (sts_cos, torch.tensor([0.5, 4.0, 2.5])),
    ):
        loss = spec.task_kind.loss(spec, torch.randn(3, spec.num_labels, dtype=torch.bfloat16), labels)
        assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    scores, labels = torch.tensor([0.2, 0.9, 0.5]), torch.tensor([1.0, 3.0, 2.0])
    pairs = [(i, j) for i in range(3) for j in range(3) if labels[i] > labels[j]]
    want = torch.log1p(sum(torch.exp(20.0 * (scores[j] - scores[i])) for i, j in pairs))
    torch.testing.assert_close(cosent_loss(scores, labels), want)


# ---------------------------------------------------------------- a new kind, defined and registered here


class Ordinal(TaskKind):
    """K ordered classes from K - 1 cumulative logits: ``z_k`` scores ``P(y > k)`` (CORAL). The loss is the
    mean BCE of each logit against ``y > k``; the prediction counts the positive logits; accuracy (primary) and
    mean absolute error. A task file's ``num_labels`` is K; ``TaskSpec.num_labels`` the K - 1 head outputs."""

    name = "ordinal"
    losses = ("coral",)
    metric_names = ("accuracy", "mae")

    def head_outputs(self, num_labels):
        if num_labels < 1:
            raise ValueError("ordinal needs num_labels >= 1 (thresholds)")
        return num_labels

    def task_file_num_labels(self, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"{value!r} must be an int >= 2 (ordinal needs the number of classes)")
        return value - 1

    def num_classes(self, spec):
        return spec.num_labels + 1

    def loss(self, spec, logits, labels):
        thresholds = torch.arange(logits.shape[1], device=logits.device)
        targets = (labels.long()[:, None] > thresholds).float()
        return F.binary_cross_entropy_with_logits(logits.float(), targets)

    def predict(self, spec, logits):
        return (logits.float() > 0).sum(-1).float()

    def metrics(self, spec, y_true, y_pred):
        scores = super().metrics(spec, y_true, y_pred)
        true, pred = np.asarray(y_true, dtype=np.float64), np.asarray(y_pred, dtype=np.float64)
        return {**scores, "mae": float(np.mean(np.abs(true - pred)))}


@pytest.fixture
def ordinal():
    kind = register_task_kind(Ordinal())
    yield kind
    del TASK_KINDS["ordinal"]


ROWS = [
    ("g1", "a great film", "great"),
    ("g2", "boring plot", 0),
    ("g3", "the acting was awful", "poor"),
    ("g4", "fun movie", 2),
    ("g5", "a good film", "good"),
    ("g6", "the plot is bad", 1),
]


@pytest.fixture
def grade_file(tmp_path):
    for split in ("train", "dev"):
        lines = [json.dumps({"id": i, "text": t, "grade": g}) for i, t, g in ROWS]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    task = {
        "name": "grade",
        "kind": "ordinal",
        "num_labels": 4,
        "files": {"train": "train.jsonl", "dev": "dev.jsonl"},
        "columns": {"text": "text", "label": "grade", "id": "id"},
        "label_names": ["poor", "fair", "good", "great"],
    }
    path = tmp_path / "grade.json"
    path.write_text(json.dumps(task), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocab_tokenizer(tmp_path_factory.mktemp("vocab"))


def test_new_kind_spec_and_task_file(ordinal, grade_file, tmp_path):
    spec = TaskSpec.from_file(grade_file)
    assert spec.task_kind is ordinal and spec.kind == "ordinal"
    assert (spec.num_labels, spec.num_classes, spec.loss, spec.label_range, spec.label_scale) == (
        3, 4, "coral", (0.0, 3.0), 1.0,
    )  # fmt: skip
    assert (spec.metric, spec.metrics, spec.label_dtype, spec.integer_labels) == (
        "accuracy", ("accuracy", "mae"), torch.int64, True,
    )  # fmt: skip
    assert TaskSpec(**spec.to_dict()) == spec  # saved configs rebuild it (head_outputs is idempotent)
    assert spec.label_name(3) == "great"
    # the checks every kind gets, with the usual one-line messages
    with pytest.raises(ValueError, match=r"loss='ce' not valid for ordinal \(\('coral',\)\)"):
        TaskSpec("x", "ordinal", num_labels=2, loss="ce")
    with pytest.raises(ValueError, match="ordinal needs num_labels >= 1"):
        TaskSpec("x", "ordinal", num_labels=0)
    with pytest.raises(ValueError, match="sbert_cosine is for regression tasks"):
        TaskSpec("x", "ordinal", num_labels=2, pair=True, pair_mode="sbert_cosine")
    with pytest.raises(ValueError, match="label_names must be 3 non-empty strings"):
        TaskSpec("x", "ordinal", num_labels=2, label_names=["a", "b"])
    raw = json.loads(grade_file.read_text())
    for change, key, message in (
        ({"num_labels": 1}, "num_labels", "1 must be an int >= 2 (ordinal needs the number of classes)"),
        ({"label_range": [0, 3]}, "label_range", "only for regression tasks, this one is ordinal"),
        (
            {"kind": "ordinall"},
            "kind",
            "'ordinall' is not one of classification, binary, regression, ordinal",
        ),
    ):
        with pytest.raises(TaskFileError) as err:
            TaskSpec.from_task_dict({**raw, **change}, base_dir=tmp_path, source=grade_file)
        assert (err.value.key, err.value.reason) == (key, message)


def test_new_kind_labels_through_the_readers(ordinal, grade_file, tmp_path):
    spec = TaskSpec.from_file(grade_file)
    examples = load_task(spec, "train")
    assert [ex.label for ex in examples] == [3, 0, 0, 2, 2, 1]
    bad = tmp_path / "bad.jsonl"
    cells = [4, 1.5, True, "okay", None]
    bad.write_text(
        "\n".join(json.dumps({"id": f"b{i}", "text": "fun", "grade": c}) for i, c in enumerate(cells))
    )
    _, rows = read_task_file(bad, spec, labelled=True, strict=False)
    assert [(r.line, r.kind, r.reason) for r in rows] == [
        (1, "label out of range", "grade 4 is outside [0, 3]"),
        (2, "bad label", "grade 1.5 is not a whole number"),
        (3, "bad label", "grade True is a boolean, the task is ordinal"),
        (4, "bad label", "grade 'okay' is not a number or one of ['poor', 'fair', 'good', 'great']"),
        (5, "empty label", "empty grade"),
    ]
    with pytest.raises(DataError, match=r"bad\.jsonl:1: grade 4 is outside \[0, 3\]"):
        read_task_file(bad, spec, labelled=True)


def test_new_kind_through_the_model_metrics_and_outputs(ordinal, grade_file, tok, tmp_path):
    spec = TaskSpec.from_file(grade_file)
    model = _tiny_model([get_task("sst"), spec])
    sst = TaskBatcher(load_task("sst", "train", data_dir=_sst_dir(tmp_path)), tok, "sst", 3, shuffle=False)
    grade = TaskBatcher(load_task(spec, "train"), tok, spec, 6, shuffle=False)
    batch = merge_batches([sst.next_batch(), grade.next_batch()], [0, 1], tok)
    assert batch["labels"].dtype == torch.float32 and batch["task_ids"].tolist() == [0] * 3 + [1] * 6
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "task_ids")}

    # loss: the kind's loss, and task_losses runs it on the task's rows
    out = model(**inputs)
    rows = batch["task_ids"] == 1
    z, y = out.logits[rows][:, :3], batch["labels"][rows]
    want = F.binary_cross_entropy_with_logits(z.float(), (y.long()[:, None] > torch.arange(3)).float())
    assert torch.equal(spec.task_kind.loss(spec, z, y), want)
    losses = model.task_losses(out, batch["labels"])
    assert torch.equal(losses.per_task["grade"], want) and losses.examples == {"sst": 3, "grade": 6}
    losses.total.backward()
    assert model.heads["grade"].out.weight.grad.abs().sum() > 0

    # predict: every row through its own task's kind, branch-free (it runs on meta tensors, which hold no data)
    logits = torch.randn(9, 5)
    logits[rows, 3:] = 0.0  # a grade row's logits past its 3 outputs are zero padding
    fake = MultiTaskOutput(logits=logits, task_ids=batch["task_ids"], pooled=out.pooled)
    preds = model.predict(fake)
    assert torch.equal(preds[rows], (logits[rows, :3] > 0).sum(-1).float())
    assert torch.equal(preds[~rows], logits[~rows].argmax(-1).float())
    meta = MultiTaskOutput(logits.to("meta"), batch["task_ids"].to("meta"), out.pooled.to("meta"))
    assert model.predict(meta).shape == (9,)
    assert confidence(model, fake, 1) is None  # the TaskKind default

    # metrics, overall score and confusion matrix
    y_true, y_pred = np.array([3, 0, 0, 2, 2, 1]), np.array([3.0, 1.0, 0.0, 2.0, 0.0, 1.0])
    assert task_metrics(spec, y_true, y_pred) == {"accuracy": pytest.approx(4 / 6), "mae": pytest.approx(0.5)}
    assert unit_score(spec, 0.75) == 0.75 and overall({"grade": 0.75, "sst": 0.25}, [spec]) == 0.5
    with pytest.raises(ValueError, match="accuracy must be in"):
        unit_score(spec, math.nan)
    matrix, names = task_confusion_matrix(spec, y_true, y_pred)
    assert names == ["poor", "fair", "good", "great"] and matrix.shape == (4, 4) and matrix[2, 0] == 1

    # the trainer's evaluation and prediction files; save and load the model
    model.eval()
    dev, dev_preds = evaluate(
        model, {"grade": TaskBatcher(load_task(spec, "dev"), tok, spec, 4)}, ["sst", "grade"]
    )
    ids, p, labels = dev_preds["grade"]
    assert dev["grade"] == task_metrics(spec, labels, p)["accuracy"] and set(p) <= {0.0, 1.0, 2.0, 3.0}
    write_dev_predictions(tmp_path / "out", dev_preds, {"grade": spec})
    header, written = read_predictions(tmp_path / "out" / "grade-dev-output.csv")
    assert header == "Predicted_Grade" and sorted(written) == sorted(ids)
    assert all(v in {"0", "1", "2", "3"} for v in written.values())  # integer labels are written as ints
    folder = model.save_pretrained(tmp_path / "saved")
    again = MultiTaskBert.from_pretrained(folder)
    assert again.tasks[1] == spec and again.tasks[1].task_kind is ordinal
    assert torch.equal(again.predict(fake), preds)


def _sst_dir(tmp_path):
    """A three-row SST training file (the built-in task's format) in its own folder."""
    folder = tmp_path / "sst"
    folder.mkdir()
    lines = ["id\tsentence\tsentiment", "s1\ta boring film\t1", "s2\tgreat fun\t4", "s3\tthe plot\t2"]
    (folder / "ids-sst-train.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder
