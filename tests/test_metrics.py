"""fastpals.data.metrics against scipy, hand-computed values and the CS224N prediction-file format."""

import math

import numpy as np
import pytest
import torch

from fastpals.data.metrics import (
    PREDICTION_HEADERS,
    accuracy,
    bin_sts,
    confusion_matrix,
    overall,
    overall_score,
    pearson,
    plot_confusion_matrix,
    prediction_header,
    read_predictions,
    spearman,
    task_confusion_matrix,
    task_metrics,
    unit_score,
    write_predictions,
)
from fastpals.data.tasks import TaskSpec

scipy_stats = pytest.importorskip("scipy.stats")


def test_accuracy_by_hand():
    assert accuracy([0, 1, 2, 3], [0, 1, 0, 3]) == 0.75
    assert accuracy(torch.tensor([1, 0]), np.array([1, 0])) == 1.0
    assert accuracy([0.0, 1.0, 1.0], [0, 1, 0]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="y_true has 2 entries but y_pred has 1"):
        accuracy([0, 1], [0])
    with pytest.raises(ValueError, match="empty"):
        accuracy([], [])
    with pytest.raises(ValueError, match="1-D"):
        accuracy([[0, 1]], [[0, 1]])


@pytest.mark.parametrize("n", [2, 3, 50, 10_000])
def test_pearson_matches_scipy(n):
    rng = np.random.default_rng(n)
    x = rng.normal(size=n)
    y = 0.3 * x + rng.normal(size=n)
    assert pearson(x, y) == pytest.approx(scipy_stats.pearsonr(x, y)[0], abs=1e-12)
    # float32 inputs (model outputs) are promoted to float64 before any arithmetic
    x32 = torch.tensor(x, dtype=torch.float32)
    y32 = torch.tensor(y, dtype=torch.float32)
    expected = scipy_stats.pearsonr(x32.double().numpy(), y32.double().numpy())[0]
    assert pearson(x32, y32) == pytest.approx(expected, abs=1e-12)


def test_pearson_large_offset_is_accurate():
    # values around 1e6 with small spread: naive single-pass formulas lose all digits in float32
    rng = np.random.default_rng(0)
    x = 1e6 + rng.normal(size=1000)
    y = x + 0.5 * rng.normal(size=1000)
    assert pearson(x, y) == pytest.approx(scipy_stats.pearsonr(x, y)[0], abs=1e-10)


def test_pearson_edge_cases():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    with pytest.warns(RuntimeWarning, match="constant"):
        assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="at least 2"):
        pearson([1.0], [2.0])
    with pytest.raises(ValueError, match="non-finite"):
        pearson([1.0, float("nan")], [2.0, 3.0])


def test_overall_score_formula():
    assert overall_score(0.5, 0.8, 0.6) == pytest.approx((0.5 + 0.8 + 0.8) / 3)
    assert overall_score(1.0, 1.0, 1.0) == pytest.approx(1.0)
    assert overall_score(0.0, 0.0, -1.0) == 0.0
    with pytest.raises(ValueError, match="sts_pearson"):
        overall_score(0.5, 0.5, 1.5)
    with pytest.raises(ValueError, match="sst_acc"):
        overall_score(float("nan"), 0.5, 0.5)


def test_confusion_matrix_by_hand():
    cm = confusion_matrix([0, 0, 1, 2, 2, 2], [0, 1, 1, 2, 0, 2], num_classes=3)
    assert cm.dtype == np.int64
    np.testing.assert_array_equal(cm, [[1, 1, 0], [0, 1, 0], [1, 0, 2]])
    cm4 = confusion_matrix(torch.tensor([3, 3]), [3, 0], num_classes=4)
    assert cm4.shape == (4, 4) and cm4[3, 3] == 1 and cm4[3, 0] == 1 and cm4.sum() == 2


def test_confusion_matrix_matches_loop():
    rng = np.random.default_rng(1)
    true = rng.integers(0, 5, size=2000)
    pred = rng.integers(0, 5, size=2000)
    expected = np.zeros((5, 5), dtype=np.int64)
    for t, p in zip(true, pred):
        expected[t, p] += 1
    np.testing.assert_array_equal(confusion_matrix(true, pred, 5), expected)
    assert np.trace(expected) / 2000 == accuracy(true, pred)


def test_confusion_matrix_bad_input():
    with pytest.raises(ValueError, match=r"y_pred holds 0..5, outside \[0, 5\)"):
        confusion_matrix([0, 1], [0, 5], 5)
    with pytest.raises(ValueError, match="y_true holds -1"):
        confusion_matrix([-1, 1], [0, 1], 5)
    with pytest.raises(ValueError, match="whole class indices"):
        confusion_matrix([0.5, 1.0], [0, 1], 5)
    with pytest.raises(ValueError, match="num_classes"):
        confusion_matrix([0], [0], 0)


def test_bin_sts():
    scores = [0.0, 0.24, 0.25, 0.74, 2.5, 4.76, 5.0, -0.3, 5.7]
    np.testing.assert_array_equal(bin_sts(scores), [0, 0, 1, 1, 5, 10, 10, 0, 10])
    assert bin_sts(np.array([3.3])).dtype == np.int64
    with pytest.raises(ValueError, match="non-finite"):
        bin_sts([float("inf")])


def test_write_predictions_cs224n_format(tmp_path):
    path = write_predictions(
        tmp_path / "out" / "sst-dev-output.csv", ["a1", "b2"], torch.tensor([3, 0]), "sst"
    )
    assert path.read_text(encoding="utf-8") == "id \t Predicted_Sentiment \na1 , 3 \nb2 , 0 \n"
    path = write_predictions(tmp_path / "sts.csv", ["x"], np.array([2.25], dtype=np.float32), "sts")
    assert path.read_text(encoding="utf-8") == "id \t Predicted_Similiary \nx , 2.25 \n"
    header, rows = read_predictions(path)
    assert header == PREDICTION_HEADERS["sts"] and rows == {"x": "2.25"}
    assert read_predictions(write_predictions(tmp_path / "p.csv", ["i"], [True], "para")) == (
        "Predicted_Is_Paraphrase",
        {"i": "1"},
    )


def test_write_predictions_bad_input(tmp_path):
    with pytest.raises(ValueError, match="task"):
        write_predictions(tmp_path / "x.csv", ["a"], [1], "quora")
    with pytest.raises(ValueError, match="ids has 2 entries but predictions has 1"):
        write_predictions(tmp_path / "x.csv", ["a", "b"], [1], "sst")
    with pytest.raises(ValueError, match="without comma"):
        write_predictions(tmp_path / "x.csv", ["a,b"], [1], "sst")
    with pytest.raises(ValueError, match="not finite"):
        write_predictions(tmp_path / "x.csv", ["a"], [float("nan")], "sts")
    with pytest.raises(TypeError, match="ints or floats"):
        write_predictions(tmp_path / "x.csv", ["a"], ["3"], "sst")


def test_plot_confusion_matrix_png(tmp_path):
    cm = confusion_matrix([0, 1, 2, 2], [0, 2, 2, 1], 3)
    path = plot_confusion_matrix(cm, tmp_path / "plots" / "cm.png", ["neg", "neu", "pos"], title="SST")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    big = confusion_matrix(bin_sts(np.linspace(0, 5, 200)), bin_sts(np.linspace(5, 0, 200)), 11)
    assert plot_confusion_matrix(big, tmp_path / "sts.png", normalize=True).stat().st_size > 2000
    with pytest.raises(ValueError, match="class_names has 2"):
        plot_confusion_matrix(cm, tmp_path / "bad.png", ["a", "b"])
    with pytest.raises(ValueError, match="square"):
        plot_confusion_matrix(np.zeros((2, 3), dtype=np.int64), tmp_path / "bad.png")


# ---------------------------------------------------------------- Spearman, per-kind metrics, overall


@pytest.mark.parametrize("n", [2, 3, 50, 5_000])
def test_spearman_matches_scipy(n):
    rng = np.random.default_rng(100 + n)
    x = rng.normal(size=n)
    y = np.exp(x) + rng.normal(size=n)
    assert spearman(x, y) == pytest.approx(scipy_stats.spearmanr(x, y)[0], abs=1e-12)


def test_spearman_ties_match_scipy():
    rng = np.random.default_rng(7)
    x = rng.integers(0, 6, size=300).astype(float) / 2  # STS-like labels: many ties
    y = x + rng.integers(0, 3, size=300)
    assert spearman(x, y) == pytest.approx(scipy_stats.spearmanr(x, y)[0], abs=1e-12)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 1000]) == pytest.approx(1.0)  # monotone, not linear
    with pytest.warns(RuntimeWarning, match="constant"):
        assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="at least 2"):
        spearman([1.0], [2.0])


def test_task_metrics_follow_the_kind():
    reg = TaskSpec("rating", "regression", label_range=(1, 10))
    true, pred = [1.0, 4.0, 2.5, 9.0], [2.0, 3.0, 3.5, 7.0]
    got = task_metrics(reg, true, pred)
    assert set(got) == {"pearson", "spearman"} and reg.metric == "pearson"
    assert got["pearson"] == pytest.approx(scipy_stats.pearsonr(true, pred)[0], abs=1e-12)
    assert got["spearman"] == pytest.approx(scipy_stats.spearmanr(true, pred)[0], abs=1e-12)
    assert math.isnan(task_metrics(reg, true, [1.0] * 4)["pearson"])  # constant: NaN, no warning raised
    assert task_metrics("sst", [0, 4, 2], np.array([0.0, 4.0, 1.0])) == {"accuracy": pytest.approx(2 / 3)}
    assert task_metrics(TaskSpec("spam", "binary"), [1, 0], [1, 1]) == {"accuracy": 0.5}


def test_overall_general_rule_and_cs224n_special_case():
    assert overall({"sst": 0.5, "para": 0.8, "sts": 0.6, "overall": 9.0}) == pytest.approx(
        overall_score(0.5, 0.8, 0.6)
    )
    imdb = TaskSpec("imdb", "classification", num_labels=2)
    rating = TaskSpec("rating", "regression")
    scores = {"sst": 0.5, "imdb": 0.9, "rating": -0.2}
    assert overall(scores, [imdb, rating]) == pytest.approx((0.5 + 0.9 + 0.4) / 3)
    assert overall({"rating": math.nan}, [rating]) == 0.5  # NaN r (constant predictions) counts as r = 0
    assert unit_score("sts", 1.0) == 1.0 and unit_score("para", 0.25) == 0.25
    with pytest.raises(ValueError, match="unknown task 'imdb'"):
        overall(scores)  # a user task needs its spec
    with pytest.raises(ValueError, match="accuracy must be in"):
        overall({"imdb": 1.5}, [imdb])
    with pytest.raises(ValueError, match="no task"):
        overall({"overall": 0.3})


def test_prediction_files_for_user_tasks(tmp_path):
    spec = TaskSpec("imdb", "binary", columns={"text": "review", "label": "is positive"}, source="imdb.json")
    assert prediction_header(spec) == "Predicted_Is_positive"
    assert prediction_header("sst") == "Predicted_Sentiment"
    path = write_predictions(tmp_path / "imdb-test-output.csv", ["r1", "line7"], np.array([1, 0]), spec)
    assert read_predictions(path) == ("Predicted_Is_positive", {"r1": "1", "line7": "0"})
    reg = TaskSpec("rating", "regression", columns={"text": "t", "label": "score"})
    path = write_predictions(tmp_path / "r.csv", ["a"], np.array([7.5]), reg)
    assert path.read_text(encoding="utf-8") == "id \t Predicted_Score \na , 7.5 \n"


def test_task_confusion_matrix_any_kind():
    rng = np.random.default_rng(3)
    labels, preds = rng.uniform(-1, 6, size=200), rng.uniform(-1, 6, size=200)
    matrix, names = task_confusion_matrix("sts", labels, preds)
    np.testing.assert_array_equal(matrix, confusion_matrix(bin_sts(labels), bin_sts(preds), 11))
    assert names == ["0", "0.5", "1", "1.5", "2", "2.5", "3", "3.5", "4", "4.5", "5"]
    matrix, names = task_confusion_matrix("sst", [0, 4, 4], [0, 4, 3])
    assert names[0] == "very negative" and matrix[4, 3] == 1 and matrix.sum() == 3
    rating = TaskSpec("rating", "regression", label_range=(1, 3))
    matrix, names = task_confusion_matrix(rating, [1.0, 3.0], [1.05, 2.0], steps=2)
    assert names == ["1", "2", "3"] and matrix.tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 0]]
