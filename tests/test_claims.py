"""``fastpals claims``: the statistics against hand-computed cases (Student-t quantiles from a printed table), the
findings table as data, and ``--quick`` end to end on a tiny random BERT: the three files, a resumed run that
skips the finished runs and reproduces a removed run's dev scores from its recorded command line."""

import dataclasses
import json
import math
import shlex
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_fixtures import make_tiny_data, make_tiny_model  # noqa: E402

from fastpals.commands import claims  # noqa: E402
from fastpals.commands.claims import (  # noqa: E402
    ARMS,
    CONVERGED,
    EARLY,
    FINDINGS,
    QUICK_FINDINGS,
    REFERENCE_ARMS,
    convergence_rows,
    job_environment,
    main,
    metric_value,
    micro_batches_per_update,
    paired_interval,
    pick_jobs,
    reference_scores,
    resolve_budget,
    run_argv,
    summarize,
    verdict,
    write_markdown,
)
from fastpals.commands.claims_findings import student_t_quantile  # noqa: E402

T_975 = {
    1: 12.706,
    2: 4.303,
    4: 2.776,
}  # Student-t 0.975 quantiles, df 1, 2, 4 (any printed table, 3 decimals)


def test_student_t_quantile_equals_scipys_without_needing_scipy():
    stats = pytest.importorskip("scipy.stats", reason="scipy (the dev extra) is the reference")
    for df in (1, 2, 4, 9, 30):
        for p in (0.5, 0.9, 0.975, 0.995):
            assert student_t_quantile(p, df) == pytest.approx(float(stats.t.ppf(p, df)), rel=1e-8, abs=1e-12)
    source = Path(claims.__file__).read_text()
    assert "scipy" not in source  # fastpals claims runs on a plain install


def test_paired_interval_matches_a_hand_computed_case():
    # differences 0.02, 0.03, 0.04: mean 0.03, sd 0.01, half width t(0.975, 2) * 0.01 / sqrt(3) = 0.02484
    iv = paired_interval([0.70, 0.72, 0.75], [0.68, 0.69, 0.71])
    assert iv["n"] == 3
    assert iv["mean"] == pytest.approx(0.03, abs=1e-12)
    assert iv["sd"] == pytest.approx(0.01, abs=1e-12)
    half = T_975[2] * 0.01 / math.sqrt(3)
    assert iv["lo"] == pytest.approx(
        0.03 - half, abs=3e-6
    )  # the table rounds t to 3 decimals: |error| <= 5e-4 * 0.01 / sqrt(3)
    assert iv["hi"] == pytest.approx(
        0.03 + half, abs=3e-6
    )  # the table rounds t to 3 decimals: |error| <= 5e-4 * 0.01 / sqrt(3)
    assert verdict(iv) == "holds"
    assert verdict(paired_interval([0.68, 0.69, 0.71], [0.70, 0.72, 0.75])) == "reversed"
    # two seeds, differences 0.1 and -0.05: mean 0.025, sd 0.075 * sqrt(2) = 0.10607, half 12.706 * 0.075 = 0.953
    iv = paired_interval([0.6, 0.5], [0.5, 0.55])
    assert iv["sd"] == pytest.approx(0.075 * math.sqrt(2), abs=1e-12)
    assert (iv["lo"], iv["hi"]) == pytest.approx(
        (0.025 - T_975[1] * 0.075, 0.025 + T_975[1] * 0.075), abs=1e-3
    )
    assert verdict(iv) == "not resolved"
    # five seeds, differences 1..5 (mean 3, sd sqrt(2.5)): half = 2.776 * sqrt(2.5 / 5)
    iv = paired_interval([1.0, 2.0, 3.0, 4.0, 5.0], [0.0] * 5)
    assert (iv["lo"], iv["hi"]) == pytest.approx(
        (3 - T_975[4] * math.sqrt(0.5), 3 + T_975[4] * math.sqrt(0.5)), abs=1e-3
    )
    one = paired_interval([0.7], [0.6])  # one seed: a difference, no interval
    assert one["mean"] == pytest.approx(0.1) and math.isnan(one["lo"]) and verdict(one) == "not resolved"
    with pytest.raises(ValueError, match="same seeds"):
        paired_interval([0.7, 0.8], [0.6])


def test_metric_value():
    dev = {"sst": 0.5, "para": 0.7, "sts": 0.6, "overall": 0.0}
    assert metric_value(dev, "overall") == pytest.approx((0.5 + 0.7 + 0.8) / 3)
    assert metric_value({**dev, "sts": None}, "overall") == pytest.approx((0.5 + 0.7 + 0.5) / 3)  # r nan -> 0
    assert metric_value(dev, "para") == 0.7
    assert math.isnan(metric_value({"sst": 0.5}, "overall")) and math.isnan(
        metric_value({"sst": 0.5}, "para")
    )
    runs = {("single_sst", 0): {"dev": {"sst": 0.5, "overall": 0.5}}, ("single_para", 0): {"dev": {"para": 0.7}},
            ("single_sts", 0): {"dev": {"sts": 0.6}}, ("single_sst", 1): {"dev": {"sst": 0.4}}}  # fmt: skip
    assert reference_scores(runs, [0, 1], "overall") == {0: pytest.approx((0.5 + 0.7 + 0.8) / 3)}
    assert reference_scores(runs, [0, 1], "sst") == {0: 0.5, 1: 0.4}


def test_the_findings_table():
    from fastpals.train.command import parse_args

    assert {f.report for f in FINDINGS} == {"000", "001", "002", "003", "004"}
    assert len({f.key for f in FINDINGS}) == len(FINDINGS) and set(QUICK_FINDINGS) <= {
        f.key for f in FINDINGS
    }
    for f in FINDINGS:
        assert f.comparisons and f.metric in ("overall", "sst", "para", "sts", "best_step"), f.key
        assert all(a in ARMS for a in f.arm_names()), f.key
    options = [a.options for a in ARMS.values()]
    assert len(set(options)) == len(options)  # an arm that two findings share is one arm, run once per seed
    assert all(a in ARMS for a in REFERENCE_ARMS)
    for arm in ARMS.values():  # every arm is a valid train.py option set
        parse_args([*arm.options, "--out", "unused"])


def test_peaks_earlier_is_a_lower_best_step(tmp_path):
    # the learning-curve arms evaluate every 20 updates; their best update comes from each run's results.json
    (f,) = [f for f in FINDINGS if f.key == "000-optimizer-earlier"]
    assert f.lower and f.metric == "best_step" and [(c.better, c.worse) for c in f.comparisons] == [
        ("rmsprop_curve", "adamw_curve"), ("rmsprop_curve", "sgd_curve")]  # fmt: skip
    for a in f.arm_names():
        assert ARMS[a].options[-2:] == ("--eval-every", "20")
    steps = {"rmsprop_curve": [20, 40, 40], "adamw_curve": [60, 100, 80], "sgd_curve": [40, 20, 60]}
    runs = {
        (a, s): {"dev": {"overall": 0.5}, "best_step": v} for a, vs in steps.items() for s, v in enumerate(vs)
    }
    item_lower, item_height = summarize([f, dataclasses.replace(f, lower=False)], runs, [0, 1, 2])
    assert item_lower["arms"]["rmsprop_curve"]["scores"] == {0: 20.0, 1: 40.0, 2: 40.0}
    # adamw - rmsprop: 40, 60, 40 (mean 46.667, sd 11.547); sgd - rmsprop: 20, -20, 20 (mean 6.667, sd 23.094)
    c1, c2 = item_lower["comparisons"]
    half = T_975[2] * 11.547005 / math.sqrt(3)
    assert (c1["mean"], c1["lo"], c1["hi"]) == pytest.approx(
        (46.6667, 46.6667 - half, 46.6667 + half),
        abs=4e-3,  # t to 3 decimals: 5e-4 * 11.55 / sqrt(3)
    )
    assert c1["verdict"] == "holds" and c2["verdict"] == "not resolved"
    assert item_height["comparisons"][0]["verdict"] == "reversed"  # the same numbers read as "higher"
    write_markdown([item_lower], tmp_path / "c.md", "# t", [0, 1, 2])
    md = (tmp_path / "c.md").read_text()
    assert "| 000-optimizer-earlier | 000 | rmsprop_curve < adamw_curve | best_step | +46.7 [" in md


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")
    return make_tiny_data(root / "data", n=16), make_tiny_model(root / "model")


def test_quick_end_to_end_resumes_and_reproduces(tiny, tmp_path, capsys):
    data, model = tiny
    opts = ["--quick", "--jobs", "2", "--out", str(tmp_path), "--model", str(model), "--data-dir", str(data),
            "--max-length", "16", "--batch-size", "4", "--max-eval", "8"]  # fmt: skip
    assert main(opts) == 0
    for name in ("claims.md", "claims.json", "claims.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    record = json.loads((tmp_path / "claims.json").read_text())
    assert [(r["arm"], r["seed"]) for r in record["runs"]] == [("base", 0), ("base", 1), ("pal_full", 0),
                                                                ("pal_full", 1)]  # fmt: skip
    assert all(
        r["status"] == "done" and r["dev"] and "--seed" in shlex.split(r["command"]) for r in record["runs"]
    )
    assert [f["finding"]["key"] for f in record["findings"]] == list(QUICK_FINDINGS)
    for f in record["findings"]:
        (c,) = f["comparisons"]
        assert c["seeds"] == [0, 1] and c["verdict"] in ("holds", "reversed", "not resolved")
    md = (tmp_path / "claims.md").read_text()
    assert "| 004-para | 004 | pal_full > base | para |" in md and "Runs finished: 4 of 4, " in md
    # the budget, the wall time with the runs at once, and each run's last two evaluations, marked from its
    # results.json: still improving where the last gained more than 0.005
    assert "**Budget: quick**" in md and "with 2 run(s) at a time" in md and record["jobs"] == 2
    assert record["wall_s_this_session"] > 0 and "| still improving at the end |" in md
    for r in record["convergence"]:
        evals = json.loads((tmp_path / "runs" / f"{r['arm']}-s{r['seed']}" / "results.json").read_text())[
            "evals"
        ]
        (s2, d2), (s4, d4) = [(e["step"], metric_value(e["dev"], "overall")) for e in evals]
        assert (r["previous_step"], r["last_step"]) == (s2, s4) == (2, 4)
        assert (
            r["improving"] == (d4 - d2 > 0.005)
            and f"| {r['arm']}-s{r['seed']} | 4 | {d2:.4f} (update 2) |" in md
        )
    # the CPU cores split between the 2 runs at once
    import os

    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"device cpu ({threads} threads)" in (tmp_path / "runs" / "base-s0.log").read_text()
    assert not (tmp_path / "runs" / "base-s0" / "checkpoints").exists()  # removed, as the progress line says
    # a stopped table continues: the finished runs are skipped, the missing one runs again from its command line
    removed = record["runs"][3]
    shutil.rmtree(tmp_path / "runs" / "pal_full-s1")
    capsys.readouterr()
    assert main(opts) == 0
    err = capsys.readouterr().err
    assert err.count("finished earlier, skipped") == 3 and "pal_full-s1: done" in err
    again = json.loads((tmp_path / "claims.json").read_text())["runs"][3]
    assert again["command"] == removed["command"]
    for task, value in removed["dev"].items():  # the same seed and options: the same dev scores
        assert (value is None and again["dev"][task] is None) or abs(again["dev"][task] - value) <= 0.005, (
            task
        )
    assert main([*opts, "--report"]) == 0  # trains nothing
    assert "start (" not in capsys.readouterr().err


def test_bad_options(tmp_path, capsys):
    safe = ["--report", "--out", str(tmp_path)]  # should a check fail to refuse, nothing trains
    assert main(["--only", "nope", *safe]) == 2
    assert "no such finding" in capsys.readouterr().err
    assert main(["--seed", "3", *safe]) == 2  # not an abbreviation of --seeds: a per-run option claims sets
    assert "set by claims itself" in capsys.readouterr().err
    assert main(["--seeds", "0", *safe]) == 2
    assert main(["--jobs", "0", *safe]) == 2
    assert main(["--jobs", "many", *safe]) == 2
    assert main(["--budget", "fast", *safe]) == 2
    assert "--budget fast: give early, converged or a number" in capsys.readouterr().err


def test_converged_budget_and_still_improving_marks(tmp_path, monkeypatch):
    # the main job's 867 updates of 48; a surgery arm's update holds a micro-batch per task: 867 / 3 = 289 updates
    assert [micro_batches_per_update(ARMS[a].options) for a in ("base", "pcgrad", "shared4", "gem_pal_gem")] == [
        1, 3, 1, 3]  # fmt: skip
    assert (CONVERGED.arm_updates(1), CONVERGED.arm_updates(3)) == (867, 289) and EARLY.arm_updates(3) == 100
    assert (CONVERGED.eval_every(867), CONVERGED.eval_every(289), EARLY.eval_every(100)) == (174, 58, None)
    argv = run_argv(ARMS["pcgrad"], 0, 289, [], tmp_path, CONVERGED.defaults, 58)
    assert " --batch-size 48 --lr 1.2e-4 " in " ".join(
        argv
    ) and "--steps-per-epoch 289 --eval-every 58" in " ".join(argv)
    assert run_argv(ARMS["base"], 0, 100, [], tmp_path) == run_argv(
        ARMS["base"], 0, 100, [], tmp_path, EARLY.defaults
    )
    assert resolve_budget("converged") is CONVERGED and resolve_budget("early") is EARLY
    assert resolve_budget("50").updates == 50 and resolve_budget(None, quick=True).name == "quick"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert resolve_budget(None) is CONVERGED  # the default on a GPU
    with pytest.raises(ValueError, match="--budget fast"):
        resolve_budget("fast")
    # 0.9 * 20 GiB / 2 GiB = 9 runs, at most one per core and one per run
    gib = 1 << 30
    assert [pick_jobs(2 * gib, 20 * gib, 16, 81), pick_jobs(2 * gib, 20 * gib, 4, 81),
            pick_jobs(2 * gib, 20 * gib, 16, 5), pick_jobs(30 * gib, 20 * gib, 16, 81)] == [9, 4, 5, 1]  # fmt: skip
    # 4 runs at once on 16 cores: 4 threads each, all on the first visible GPU
    monkeypatch.setattr("fastpals.commands.claims.cpu_cores", lambda: 16)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert job_environment(4) == {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "3"}
    # gains of 0.006 and 0.004 at the last evaluation: the first is still improving, the second not
    runs = {("pal12", 0): {"updates": 867, "evals": [[696, 0.700], [867, 0.706]]},
            ("base", 0): {"updates": 867, "evals": [[696, 0.700], [867, 0.704]]}}  # fmt: skip
    rows = convergence_rows(runs, [("pal12", 0), ("base", 0)])
    assert [r["improving"] for r in rows] == [True, False] and rows[0]["gain"] == pytest.approx(0.006)
    (f,) = [f for f in FINDINGS if f.key == "000-pal"]
    summary = summarize([f], {k: {"dev": {"sst": 0.5, "para": 0.5, "sts": 0.5}} for k in runs}, [0])
    write_markdown(summary, tmp_path / "c.md", "# t", [0], rows)
    md = (tmp_path / "c.md").read_text()
    assert "| **not resolved** | pal12 still improving (seed 0) |" in md
    assert (
        "| pal12-s0 | 867 | 0.7000 (update 696) | 0.7060 (update 867) | +0.0060 | **still improving** |" in md
    )
    assert "| base-s0 | 867 | 0.7000 (update 696) | 0.7040 (update 867) | +0.0040 |  |" in md
