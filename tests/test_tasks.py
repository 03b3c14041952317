"""fastpals.data.tasks: the one task registry, users' task files (JSON schema, errors), and user tasks run through
the readers, the batcher and MultiTaskBert (forward, loss, a few optimizer steps)."""

import dataclasses
import json
import re
import warnings

import pytest
import torch

import fastpals
from fastpals.data.loading import TASK_FORMATS, load_task, split_path
from fastpals.data.metrics import read_predictions, task_metrics, write_predictions
from fastpals.data.per_task_batches import TaskBatcher, merge_batches
from fastpals.data.readers import DataError, DataWarning, PairExample, SentenceExample, read_task_file
from fastpals.data.tasks import TASKS, TaskFileError, TaskSpec, get_task, resolve_tasks
from fastpals.data.tokenizer import Tokenizer
from fastpals.encoder.bert import BertConfig, PALConfig
from fastpals.model import multitask
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig

WORDS = "good bad great awful film plot acting boring fun a the is was movie man plays guitar music".split()


def vocab_tokenizer(folder):
    """A BERT tokenizer of the special tokens and ``WORDS``, its vocab.txt written in ``folder``."""
    vocab = folder / "vocab.txt"
    vocab.write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n", encoding="utf-8"
    )
    return Tokenizer(vocab)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocab_tokenizer(tmp_path_factory.mktemp("vocab"))


def write_task(folder, name, content):
    path = folder / name
    path.write_text(json.dumps(content) if isinstance(content, dict) else content, encoding="utf-8")
    return path


@pytest.fixture
def imdb(tmp_path):
    """A JSONL classification task whose labels are names, in a sub-folder next to its task file."""
    data = tmp_path / "imdb"
    data.mkdir()
    rows = [
        ("r1", "a great film", "pos"),
        ("r2", "boring plot", "neg"),
        ("r3", "the acting was awful", "neg"),
        ("r4", "fun movie", "pos"),
    ]
    for split in ("train", "dev"):
        lines = [json.dumps({"rid": rid, "review": text, "label": label}) for rid, text, label in rows]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (data / "test.jsonl").write_text('{"rid": 7, "review": "a good movie"}\n', encoding="utf-8")
    return write_task(
        tmp_path,
        "imdb.json",
        {
            "name": "imdb",
            "kind": "classification",
            "num_labels": 2,
            "files": {"train": "imdb/train.jsonl", "dev": "imdb/dev.jsonl", "test": "imdb/test.jsonl"},
            "columns": {"text": "review", "label": "label", "id": "rid"},
            "label_names": ["neg", "pos"],
        },
    )


@pytest.fixture
def rating(tmp_path):
    """A TSV pair regression task with a label range, CRLF line ends and no id column."""
    rows = [
        ("a man plays guitar", "a man plays music", "8.5"),
        ("the film", "the movie", "9"),
        ("a boring plot", "great acting", "1"),
        ("fun", "awful", "2.5"),
    ]
    text = "first\tsecond\tscore\r\n" + "".join(f"{a}\t{b}\t{s}\r\n" for a, b, s in rows)
    (tmp_path / "rating.tab").write_text(text, encoding="utf-8", newline="")
    return write_task(
        tmp_path,
        "rating.json",
        {
            "kind": "regression",
            "files": {"train": "rating.tab", "dev": "rating.tab"},
            "columns": {"text": "first", "text_pair": "second", "label": "score"},
            "label_range": [1, 10],
        },
    )


# ---------------------------------------------------------------- one registry


def test_one_registry_behind_every_old_name():
    assert multitask.TASKS is TASKS and TASK_FORMATS is TASKS
    assert fastpals.TaskSpec is TaskSpec and multitask.TaskSpec is TaskSpec and multitask.get_task is get_task
    sst = TASKS["sst"]
    assert (sst.kind, sst.num_labels, sst.num_classes, sst.metric) == ("classification", 5, 5, "accuracy")
    assert (
        sst.files["dev"] == "ids-sst-dev.csv" and sst.columns["label"] == "sentiment" and sst.format == "tsv"
    )
    sts = TASKS["sts"]
    assert (sts.pair, sts.label_scale, sts.label_range, sts.metrics) == (
        True,
        5.0,
        (0.0, 5.0),
        ("pearson", "spearman"),
    )
    assert TASKS["para"].files == {"train": "quora-dev.csv", "dev": "quora-dev.csv"}
    # a spec built by name alone (as older code and saved configs do) gets the built-in files
    assert TaskSpec("sts", "regression", pair=True, label_scale=5.0) == sts
    assert TaskSpec("sst", "classification", num_labels=5) == sst and sst.label_name(4) == "very positive"
    assert TaskSpec("sts", "regression", pair=True) == sts  # range and scale come with the built-in files
    with pytest.raises(ValueError, match="label_scale=1 is below label_range's high 5"):
        TaskSpec("sts", "regression", pair=True, label_scale=1.0)
    assert get_task("sst") == sst and get_task("sst") is not sst


def test_spec_round_trips_through_json(imdb, rating):
    for spec in (*TASKS.values(), TaskSpec.from_file(imdb), TaskSpec.from_file(rating)):
        again = TaskSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
        assert again == spec
    config = MultiTaskConfig(BertConfig(hidden_size=8, num_attention_heads=2), [TaskSpec.from_file(imdb)])
    assert MultiTaskConfig.from_dict(json.loads(json.dumps(config.to_dict()))).tasks == config.tasks


# ---------------------------------------------------------------- task files


def test_task_file_resolves_paths_and_fields(imdb, rating, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / "imdb")  # relative paths follow the task file, not the working folder
    spec = TaskSpec.from_file(imdb)
    assert spec.files["train"] == str(tmp_path / "imdb" / "train.jsonl")
    assert (spec.name, spec.kind, spec.num_labels, spec.pair, spec.label_range) == (
        "imdb", "classification", 2, False, (0.0, 1.0),
    )  # fmt: skip
    assert spec.source == str(imdb) and spec.file_format("dev") == "jsonl" and spec.label_name(1) == "pos"
    reg = TaskSpec.from_file(rating)
    assert reg.name == "rating" and reg.pair and reg.label_range == (1.0, 10.0) and reg.label_scale == 10.0
    assert reg.file_format("train") == "tsv" and reg.metric == "pearson"


def test_resolve_tasks_mixes_builtin_and_task_files(imdb, rating):
    specs = resolve_tasks(f"sst, para,{imdb},{rating}")
    assert [s.name for s in specs] == ["sst", "para", "imdb", "rating"]
    assert specs[0] == TASKS["sst"] and specs[2] == TaskSpec.from_file(imdb)
    assert resolve_tasks(["sts", TASKS["sst"]]) == [TASKS["sts"], TASKS["sst"]]
    with pytest.raises(
        ValueError, match=r"unknown task 'mnli': give a built-in task \(sst, para, sts, cfimdb\)"
    ):
        resolve_tasks("sst,mnli")
    with pytest.raises(ValueError, match="task name.s. imdb given twice"):
        resolve_tasks([str(imdb), str(imdb)])
    with pytest.raises(TaskFileError, match="nothere.json: task file does not exist"):
        resolve_tasks("sst,nothere.json")
    with pytest.raises(ValueError, match="no tasks given"):
        resolve_tasks(" , ")


GOOD = {
    "name": "t",
    "kind": "binary",
    "files": {"train": "train.csv"},
    "columns": {"text": "text", "label": "label"},
}

SCHEMA_ERRORS = [
    ({"kind": "multiclass"}, "kind", "'multiclass' is not one of classification, binary, regression"),
    ({"kind": None}, "kind", "missing"),
    ({"columns": {"text": "text"}}, r"columns\.label", "missing"),
    ({"columns": {"text": "text", "label": "y", "txt_pair": "b"}}, r"columns\.txt_pair", "unknown key"),
    ({"columns": {"label": "y"}}, r"columns\.text", "missing"),
    ({"files": {"train": "nope.csv"}}, r"files\.train", r"data file .*nope\.csv does not exist"),
    ({"files": {"dev": "train.csv"}}, r"files\.train", "missing"),
    ({"files": {"validation": "train.csv"}}, r"files\.validation", "unknown split"),
    ({"files": {"train": "train.txt"}}, r"files\.train", 'cannot tell the format .* add "format"'),
    ({"format": "xlsx"}, "format", "'xlsx' is not one of csv, tsv, jsonl"),
    ({"colums": {}}, "colums", "unknown key"),
    ({"kind": "classification"}, "num_labels", "missing"),
    ({"kind": "classification", "num_labels": 1}, "num_labels", "1 must be an int >= 2"),
    ({"num_labels": 3}, "num_labels", "a binary task has 2 labels"),
    ({"label_range": [0, 5]}, "label_range", "only for regression"),
    ({"kind": "regression", "label_range": [5]}, "label_range", r"must be \[low, high\]"),
    ({"kind": "regression", "label_range": [-1, 1]}, None, "low must be >= 0"),
    ({"kind": "regression", "label_range": [3, 3]}, None, "needs low < high"),
    ({"name": "has space"}, "name", "letters, digits"),
    ({"label_names": ["only one"]}, None, "label_names must be 2 non-empty strings"),
    ({"head": "transformer"}, None, "head='transformer'"),
]


@pytest.mark.parametrize(("change", "key", "message"), SCHEMA_ERRORS)
def test_task_file_errors_are_one_line_naming_file_and_key(tmp_path, change, key, message):
    (tmp_path / "train.csv").write_text("text,label\nfun,1\n", encoding="utf-8")
    (tmp_path / "train.txt").write_text("x", encoding="utf-8")
    content = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    path = write_task(tmp_path, "task.json", content)
    with pytest.raises(TaskFileError) as info:
        TaskSpec.from_file(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path}: ")
    where = f"{key}: " if key else ""
    assert info.value.key == (key.replace("\\", "") if key else None)
    assert re.search(f"{re.escape(str(path))}: {where}.*{message}", text), text


def test_task_dict_without_a_file(tmp_path):
    (tmp_path / "t.tsv").write_text("text\tlabel\nfun\t1\n")
    spec = TaskSpec.from_task_dict({**GOOD, "files": {"train": "t.tsv"}}, base_dir=tmp_path)
    assert spec.files == {"train": str(tmp_path / "t.tsv")} and spec.source is None
    assert load_task(spec, "train") == [SentenceExample("line2", "fun", 1)]
    with pytest.raises(TaskFileError, match=r"^name: missing$"):
        TaskSpec.from_task_dict({k: v for k, v in GOOD.items() if k != "name"}, base_dir=tmp_path)


def test_task_file_not_json_or_not_an_object(tmp_path):
    with pytest.raises(TaskFileError, match=r"bad\.json: not valid JSON: Expecting ',' delimiter at line 2"):
        TaskSpec.from_file(write_task(tmp_path, "bad.json", '{"kind": "binary"\n "files": {}}'))
    with pytest.raises(TaskFileError, match=r"list\.json: must hold a JSON object, got list"):
        TaskSpec.from_file(write_task(tmp_path, "list.json", "[1, 2]"))


def test_csv_file_that_is_really_tab_separated_gets_a_hint(tmp_path):
    (tmp_path / "train.csv").write_text("text\tlabel\nfun\t1\n", encoding="utf-8")
    spec = TaskSpec.from_file(write_task(tmp_path, "t.json", GOOD))
    with pytest.raises(
        DataError, match=r'train\.csv:1: header lacks column.*is the file tsv\? \(set "format": "tsv"\)'
    ):
        load_task(spec, "train")


# ---------------------------------------------------------------- reading user tasks


def test_user_jsonl_task_loads_with_label_names_and_ids(imdb):
    spec = TaskSpec.from_file(imdb)
    train = load_task(spec, "train")
    assert train[0] == SentenceExample("r1", "a great film", 1) and [ex.label for ex in train] == [1, 0, 0, 1]
    assert load_task(spec, "test") == [SentenceExample("7", "a good movie", None)]  # integer ids become text
    assert split_path(spec, "dev").name == "dev.jsonl"


def test_user_tsv_task_with_crlf_and_dev_as_hash_split(rating):
    spec = TaskSpec.from_file(rating)
    train, dev = load_task(spec, "train"), load_task(spec, "dev")
    both = sorted(train + dev, key=lambda ex: int(ex.id[4:]))
    assert len(train) + len(dev) == 4 and not {e.id for e in train} & {e.id for e in dev}
    assert both[0] == PairExample("line2", "a man plays guitar", "a man plays music", 8.5)  # no "\r" kept
    assert [ex.label for ex in both] == [8.5, 9.0, 1.0, 2.5]


def test_user_task_bad_rows_name_file_and_line(tmp_path, imdb):
    spec = TaskSpec.from_file(imdb)
    path = tmp_path / "imdb" / "train.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = '{"rid": "r3", "review": "awful", "label": "meh"}'
    lines.insert(3, '{"rid": "r1", "review": "dup", "label": "pos"}')
    lines.insert(4, '{"rid": "r9", "review": "cut off", "lab')
    lines.insert(5, "")  # blank lines are not rows
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        DataError, match=r"train\.jsonl:3: label 'meh' is not a number or one of \['neg', 'pos'\]"
    ):
        load_task(spec, "train")
    with pytest.warns(DataWarning) as record:
        kept = load_task(spec, "train", strict=False)
    assert [ex.id for ex in kept] == ["r1", "r2", "r4"]
    message = str(record[0].message)
    assert "skipped 3 bad row(s), kept 3" in message
    assert "train.jsonl:4: id r1 already on line 1" in message
    assert "train.jsonl:5: not valid JSON: Unterminated string" in message


def test_jsonl_schema_checked_on_first_object(tmp_path):
    spec = TaskSpec(
        "t", "binary", files={"train": str(tmp_path / "t.jsonl")}, columns={"text": "x", "label": "y"}
    )
    (tmp_path / "t.jsonl").write_text('{"x": "fun", "label": 1}\n{"x": "ok", "y": 0}\n')
    with pytest.raises(
        DataError, match=r"t\.jsonl:1: the first object lacks key\(s\) y \(its keys: x, label"
    ):
        load_task(spec, "train", strict=False)
    (tmp_path / "t.jsonl").write_text('{"x": "fun", "y": true}\n{"x": "ok", "y": 0}\n{"x": 3, "y": 1}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        examples, bad = read_task_file(tmp_path / "t.jsonl", spec, labelled=True, strict=False)
    assert [ex.label for ex in examples] == [1, 0] and [(b.line, b.kind) for b in bad] == [(3, "bad text")]


def test_regression_labels_outside_the_range_are_bad_rows(rating, tmp_path):
    spec = TaskSpec.from_file(rating)
    (tmp_path / "rating.tab").write_text("first\tsecond\tscore\nfun\tgood\t10.5\n")
    with pytest.raises(DataError, match=r"rating\.tab:2: score '10.5' is outside \[1, 10\]"):
        load_task(spec, "train")


# ---------------------------------------------------------------- user tasks through the model


def _tiny_model(specs):
    bert = BertConfig(
        vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return MultiTaskBert(
        MultiTaskConfig(bert, specs, PALConfig(num_tasks=len(specs), hidden=16, num_heads=2))
    )


def test_user_tasks_train_with_a_builtin_spec_through_multitaskbert(imdb, rating, tok, tmp_path):
    specs = resolve_tasks([str(imdb), str(rating), "sst"])
    imdb_spec, rating_spec, _ = specs
    model = _tiny_model(specs)
    sst_examples = [SentenceExample("s1", "a boring film", 1), SentenceExample("s2", "great fun", 4)]
    batchers = [
        TaskBatcher(load_task(imdb_spec, "train"), tok, imdb_spec, 4, shuffle=False),
        TaskBatcher(load_task(rating_spec, "train") + load_task(rating_spec, "dev"), tok, rating_spec, 4, shuffle=False),
        TaskBatcher(sst_examples, tok, "sst", 2, shuffle=False),
    ]  # fmt: skip
    batches = [b.next_batch() for b in batchers]
    assert batches[0]["labels"].dtype == torch.int64 and batches[1]["labels"].dtype == torch.float32
    assert batches[0]["task"] == "imdb" and "input_ids_b" not in batches[1]  # joint pair encoding
    batch = merge_batches(batches, [0, 1, 2], tok)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "task_ids")}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        total, per_task = model.loss(model(**inputs), batch["labels"])
        assert set(per_task) == {"imdb", "rating", "sst"} and torch.isfinite(total)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        losses.append(total.item())
    assert losses[-1] < losses[0]
    # every task's PALs and head got a gradient
    assert model.heads["rating"].out.weight.grad.abs().sum() > 0

    model.eval()
    with torch.no_grad():
        out = model(**inputs)
    preds = model.predict(out)
    rows = batch["task_ids"] == 1
    assert ((preds[rows] >= 0) & (preds[rows] <= rating_spec.label_scale)).all()
    scores = task_metrics(rating_spec, batch["labels"][rows], preds[rows])
    assert set(scores) == {"pearson", "spearman"}
    path = write_predictions(tmp_path / "imdb-dev-output.csv", batch["ids"][:4], preds[:4].long(), imdb_spec)
    header, written = read_predictions(path)
    assert header == "Predicted_Label" and sorted(written) == ["r1", "r2", "r3", "r4"]


def test_siamese_user_pair_task(rating, tok):
    spec = dataclasses.replace(TaskSpec.from_file(rating), pair_mode="sbert_cosine")
    model = _tiny_model([spec])
    batcher = TaskBatcher(load_task(spec, "train"), tok, spec, 8, shuffle=False, pair_encoding="separate")
    batch = batcher.next_batch()
    inputs = {
        k: v for k, v in batch.items() if k.startswith(("input_ids", "attention_mask", "token_type_ids"))
    }
    assert len(inputs) == 6  # both sentences, encoded separately
    total, per_task = model.loss(model(**inputs), batch["labels"])
    total.backward()
    assert torch.isfinite(total) and set(per_task) == {"rating"}


# ---------------------------------------------------------------- fastpals predict on user tasks


def test_fastpals_predict_on_user_tasks(imdb, rating, tok, tmp_path, capsys):
    from fastpals.commands.predict import main

    specs = resolve_tasks([str(imdb), str(rating)])
    folder = _tiny_model(specs).save_pretrained(tmp_path / "best")
    (folder / "vocab.txt").write_text(tok.vocab_file.read_text())
    assert main([str(folder), "--task", "imdb", "--text", "a great film", "--text", "boring"]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    # task, prediction, label name (from the task file's label_names), p=probability, text
    assert [len(line) for line in lines] == [5, 5] and [line[4] for line in lines] == [
        "a great film",
        "boring",
    ]
    for task, pred, name, prob, _ in lines:
        assert task == "imdb" and float(pred) in (0.0, 1.0)
        assert name == ("pos" if float(pred) == 1 else "neg") and 0.5 <= float(prob[2:]) <= 1
    assert main([str(folder), "--task", "rating", "--pair", "a man plays guitar", "the movie"]) == 0
    task, pred, kind, score, shown = capsys.readouterr().out.strip().split("\t")
    assert 0 <= float(pred) <= 10 and kind == "score" and shown.endswith("||| the movie")
    assert main([str(folder), "--out", str(tmp_path / "pred")]) == 0
    assert "rating: no test file" in capsys.readouterr().err
    assert read_predictions(tmp_path / "pred" / "imdb-test-output.csv")[0] == "Predicted_Label"
    assert list(read_predictions(tmp_path / "pred" / "imdb-test-output.csv")[1]) == ["7"]
