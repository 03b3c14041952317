"""End-to-end training runs on a tiny random BERT and small synthetic task files (a few seconds of compute
each): both launch styles, outputs, prediction, kill + resume = uninterrupted, PCGrad/GEM, NaN, bad inputs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def common(tiny, out, *extra):
    data, model = tiny
    return [
        "--model", str(model), "--data-dir", str(data), "--out", str(out), "--batch-size", "8",
        "--max-length", "24", "--pal-hidden", "16", "--pal-heads", "2", "--max-eval", "24", "--max-predict", "8",
        "--no-progress", *extra,
    ]  # fmt: skip


def run(cmd, timeout=300):
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def test_python_launch_writes_every_output(tiny, tmp_path):
    out = tmp_path / "run"
    rc, log = run(
        [sys.executable, "train.py", "--ds_config", "configs/cpu_bf16.json",
         *common(tiny, out, "--epochs", "2", "--steps-per-epoch", "3", "--eval-at-start", "--lr", "1e-3")]
    )  # fmt: skip
    assert rc == 0, log[-4000:]
    assert "skipped 1 bad row(s)" in log and "quora-dev.csv:" in log  # the broken Quora row is reported
    results = json.loads((out / "results.json").read_text())
    assert set(results["dev"]) == {"sst", "para", "sts", "overall"}
    assert set(results["untrained_dev"]) == {"sst", "para", "sts", "overall"}
    assert results["steps"] == 6 and results["zero_stage"] == 1
    assert (
        results["ds_config"]["bf16"]["enabled"]
        and results["ds_config"]["train_micro_batch_size_per_gpu"] == 8
    )
    assert {"setup_s", "train_s", "eval_s"} <= set(results["timings"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert all(r["examples_per_s"] > 0 and len(r["lr"]) >= 4 for r in steps)
    assert [r["epoch"] for r in records if r["type"] == "epoch"] == [1, 2]
    assert "dev" in records[-1] or any(r["type"] == "eval" for r in records)
    for name in ("training_curves.png", "confusion_sst.png", "confusion_sts.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert any((out / "tensorboard").iterdir())
    for name in ("sst-dev-output.csv", "para-dev-output.csv", "sts-dev-output.csv", "sst-test-output.csv",
                 "sts-test-output.csv"):  # fmt: skip
        lines = (out / "predictions" / name).read_text().splitlines()
        assert lines[0].startswith("id \t Predicted_") and len(lines) > 1, name
    assert len((out / "predictions" / "sst-test-output.csv").read_text().splitlines()) == 9  # --max-predict 8
    # fastpals predict: sentences and test files
    rc, log = run([sys.executable, "-m", "fastpals.cli", "predict", str(out / "best"), "--task", "sst",
                   "--text", "good movie", "--text", "bad plot"])  # fmt: skip
    assert rc == 0, log
    lines = [line for line in log.splitlines() if line.startswith("sst\t")]
    assert len(lines) == 2 and float(lines[0].split("\t")[1]) in {0.0, 1.0, 2.0, 3.0, 4.0}
    rc, log = run([sys.executable, "-m", "fastpals.commands.predict", str(out / "best"), "--task", "sts",
                   "--pair", "good movie", "good film"])  # fmt: skip
    assert rc == 0 and 0.0 <= float(log.split("sts\t")[1].split("\t")[0]) <= 5.0, log
    rc, log = run([sys.executable, "-m", "fastpals.commands.predict", str(out / "best"), "--data-dir", str(tiny[0]),
                   "--out", str(tmp_path / "pred")])  # fmt: skip
    assert rc == 0, log
    assert len((tmp_path / "pred" / "sts-test-output.csv").read_text().splitlines()) == 49
    # best/ opens in HF transformers: the shared encoder, the tokenizer, and the encoder with its PALs
    import transformers

    from fastpals import MultiTaskBert, Tokenizer, load_pals

    best = out / "best"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(best))
    ours = Tokenizer.from_pretrained(best)(["good movie", "a gripping, funny film"], max_length=32)
    assert (
        hf_tok(["good movie", "a gripping, funny film"], padding=True)["input_ids"]
        == ours["input_ids"].tolist()
    )
    hf = (
        transformers.AutoModel.from_pretrained(str(best), attn_implementation="eager").float().eval()
    )  # bf16 run
    model = MultiTaskBert.from_pretrained(best)
    with pytest.warns(UserWarning, match="heads"):
        load_pals(hf, best)
    tasks = torch.tensor([0, 2])
    with torch.no_grad():
        want = model.bert(ours["input_ids"], ours["attention_mask"], ours["token_type_ids"], tasks)
        got = hf(**ours, task_ids=tasks)
    keep = ours["attention_mask"].bool()
    assert (got.last_hidden_state - want.last_hidden_state)[keep].abs().max() <= 1e-5
    # a run folder with checkpoints is not overwritten by accident
    rc, log = run([sys.executable, "train.py", *common(tiny, out, "--epochs", "1", "--steps-per-epoch", "1")])
    assert rc == 2 and "--resume" in log


def test_deepspeed_launcher(tiny, tmp_path):
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
    assert launcher, "the deepspeed launcher is not installed"
    out = tmp_path / "ds"
    rc, log = run([launcher, "--num_gpus", "1", "train.py", "--ds_config", "configs/cpu_bf16.json",
                   *common(tiny, out, "--epochs", "1", "--steps-per-epoch", "2")])  # fmt: skip
    assert rc == 0, log[-4000:]
    assert "--local_rank=0" in log  # it went through the launcher
    assert json.loads((out / "results.json").read_text())["steps"] == 2


def test_kill_and_resume_equals_uninterrupted(tiny, tmp_path):
    opts = [
        "--epochs",
        "2",
        "--steps-per-epoch",
        "3",
        "--lr",
        "1e-3",
        "--sampling",
        "annealed",
        "--seed",
        "3",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    rc, log = run([sys.executable, "train.py", *common(tiny, full, *opts)])
    assert rc == 0, log[-4000:]
    # SIGTERM after update 2 (mid-epoch 1): checkpoint, exit 128 + 15
    rc, log = run([sys.executable, "train.py", *common(tiny, cut, *opts, "--stop-after-steps", "2")])
    assert rc == 143, log[-4000:]
    assert "stopped by signal SIGTERM after update step 2" in log
    assert not (cut / "results.json").exists()
    rc, log = run([sys.executable, "train.py", *common(tiny, cut, *opts, "--lr", "2e-3", "--resume")])
    assert rc == 2 and "--lr (saved 0.001, now 0.002)" in log  # options must match the saved run
    rc, log = run([sys.executable, "train.py", *common(tiny, cut, *opts, "--resume")])
    assert rc == 0, log[-4000:]
    a = json.loads((full / "results.json").read_text())
    b = json.loads((cut / "results.json").read_text())
    assert a["dev"] == b["dev"] and a["evals"] == b["evals"] and a["steps"] == b["steps"] == 6

    def losses(folder):
        records = (json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"]) for r in records if r["type"] == "step"]

    assert losses(full) == losses(cut)  # same batches, same dropout, same updates
    for name in ("model.safetensors", "pals/adapter_model.safetensors"):
        assert (full / "best" / name).read_bytes() == (cut / "best" / name).read_bytes(), name


def test_the_main_jobs_options_twice_give_the_same_numbers(tiny, tmp_path):
    """``make train``'s options (default config, mixed packed sqrt-share batches, frozen word embeddings and
    bottom layer, PALs above it, fused AdamW, warm-up), at a tiny scale (2 layers): two runs of the same command
    give identical losses, scores and weights."""
    opts = ["--epochs", "1", "--steps-per-epoch", "4", "--sampling", "sqrt", "--lr", "1e-3", "--pal-lr", "2e-3",
            "--head-lr", "2e-3", "--warmup", "0.25", "--freeze-word-embeddings", "--freeze-layers", "1",
            "--pal-layers", "1"]  # fmt: skip
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        rc, log = run([sys.executable, "train.py", *common(tiny, out, *opts)])
        assert rc == 0, log[-4000:]
        assert "[setup] precision: " in log
    a, b = (json.loads((out / "results.json").read_text()) for out in runs)
    assert a["dev"] == b["dev"] and a["evals"] == b["evals"] and a["steps"] == b["steps"] == 4

    def losses(folder):
        records = (json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"]) for r in records if r["type"] == "step"]

    assert losses(runs[0]) == losses(runs[1]) and len(losses(runs[0])) == 4
    for name in ("model.safetensors", "pals/adapter_model.safetensors"):
        assert (runs[0] / "best" / name).read_bytes() == (runs[1] / "best" / name).read_bytes(), name


@pytest.mark.parametrize(
    "surgery, sampling, config, extra",
    [
        ("pcgrad", "random_round_robin", "cpu_fp32", ["--optimizer", "sgd", "--head", "mlp", "--eval-every", "1"]),
        # ZeRO-1 (cpu_bf16) with a torch optimizer DeepSpeed has not tested: the config allows it
        ("gem", "every_task_plus_annealed", "cpu_bf16",
         ["--optimizer", "rmsprop", "--freeze-bert", "--pal", "gate", "--pair-mode", "sbert_cosine"]),
    ],
)  # fmt: skip
def test_surgery_runs(tiny, tmp_path, surgery, sampling, config, extra):
    out = tmp_path / surgery
    rc, log = run([sys.executable, "train.py", "--ds_config", f"configs/{config}.json",
                   *common(tiny, out, "--surgery", surgery, "--sampling", sampling, "--epochs", "1",
                           "--steps-per-epoch", "2", "--lr", "1e-3", *extra)])  # fmt: skip
    assert rc == 0, log[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 2 and all(set(r["loss"]) == {"sst", "para", "sts"} for r in steps)
    evals = [r["step"] for r in records if r["type"] == "eval"]
    assert evals == ([1, 2] if "--eval-every" in extra else [2])
    config = json.loads((out / "best" / "pals" / "adapter_config.json").read_text())
    if "--freeze-bert" in extra:
        assert [t["pair_mode"] for t in config["tasks"]] == ["joint", "sbert_concat", "sbert_cosine"]
        assert config["pal_config"]["gate"] is True


def test_nan_loss_is_reported_and_stops(tiny, tmp_path):
    out = tmp_path / "nan"
    rc, log = run([sys.executable, "train.py",
                   *common(tiny, out, "--epochs", "1", "--steps-per-epoch", "4", "--inject-nan-at-step", "2")])  # fmt: skip
    assert rc == 3, log[-4000:]
    assert "non-finite loss nan at update step 2, task" in log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["type"] == "nonfinite" and records[-1]["step"] == 2
    assert set(records[-1]["task"].split(",")) <= {"sst", "para", "sts"}  # the micro-batch's tasks


def test_bad_inputs_fail_before_training(tiny, tmp_path):
    data, _ = tiny
    cases = [
        (["--tasks", "sst,nope"], "unknown task"),
        (["--pal-heads", "5", "--pal-hidden", "16"], "does not divide the PAL width"),
        (["--data-dir", str(tmp_path)], "missing data file"),
        (["--ds_config", "configs/gpu_fp16_zero1.json"], "fp16 needs a CUDA GPU"),
    ]
    bad_cfg = tmp_path / "micro.json"
    bad_cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                                   "zero_optimization": {"stage": 1}}))  # fmt: skip
    cases.append((["--ds_config", str(bad_cfg)], "train_micro_batch_size_per_gpu = 4 but --batch-size 8"))
    for extra, message in cases:
        out = tmp_path / "bad"
        rc, log = run([sys.executable, "train.py", *common(tiny, out), *extra], timeout=120)
        assert rc == 2 and message in log, (extra, log[-2000:])
        assert "DeepSpeed" not in log and not (out / "metrics.jsonl").exists()  # nothing started


def _user_tasks(folder: Path) -> tuple[Path, Path]:
    """A JSONL classification task and a TSV pair-regression task (label range [1, 10]) with train/dev/test."""
    import random

    rng = random.Random(0)
    words = "good bad film plot actor great boring fun slow music".split()
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 40), ("dev", 12), ("test", 6)):
        with open(folder / f"imdb_{split}.jsonl", "w") as f:
            for i in range(n):
                row = {"id": f"{split}{i}", "review": " ".join(rng.choice(words) for _ in range(6))}
                if split != "test":
                    row["label"] = rng.randrange(2)
                f.write(json.dumps(row) + "\n")
        with open(folder / f"rate_{split}.tsv", "w") as f:
            f.write("id\ta\tb" + ("\tscore" if split != "test" else "") + "\n")
            for i in range(n):
                a = " ".join(rng.choice(words) for _ in range(5))
                b = " ".join(rng.choice(words) for _ in range(5))
                f.write(
                    f"r{split}{i}\t{a}\t{b}"
                    + (f"\t{rng.uniform(1, 10):.2f}" if split != "test" else "")
                    + "\n"
                )
    imdb = folder / "imdb.json"
    imdb.write_text(json.dumps({
        "name": "imdb", "kind": "classification", "num_labels": 2, "label_names": ["negative", "positive"],
        "files": {s: f"imdb_{s}.jsonl" for s in ("train", "dev", "test")},
        "columns": {"text": "review", "label": "label", "id": "id"},
    }))  # fmt: skip
    rate = folder / "rate.json"
    rate.write_text(json.dumps({
        "name": "rate", "kind": "regression", "label_range": [1, 10],
        "files": {s: f"rate_{s}.tsv" for s in ("train", "dev", "test")},
        "columns": {"text": "a", "text_pair": "b", "label": "score", "id": "id"},
    }))  # fmt: skip
    return imdb, rate


def test_user_task_files_train_end_to_end(tiny, tmp_path):
    """--tasks mixes a built-in task with a JSONL and a TSV task file: training, dev metrics, prediction files,
    confusion matrices and `fastpals predict` (label names) work for the user tasks."""
    imdb, rate = _user_tasks(tmp_path / "tasks")
    out = tmp_path / "user"
    rc, log = run([sys.executable, "train.py", *common(tiny, out, "--tasks", f"sst,{imdb},{rate}",
                   "--epochs", "1", "--steps-per-epoch", "3")])  # fmt: skip
    assert rc == 0, log[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["dev"]) == {"sst", "imdb", "rate", "overall"}
    for name in ("imdb-dev-output.csv", "imdb-test-output.csv", "rate-test-output.csv"):
        assert (out / "predictions" / name).is_file(), name
    assert len((out / "predictions" / "rate-test-output.csv").read_text().splitlines()) == 7  # header + 6
    assert (out / "confusion_imdb.png").is_file() and (out / "confusion_rate.png").is_file()
    rc, log = run([sys.executable, "-m", "fastpals.commands.predict", str(out / "best"), "--task", "imdb", "--text",
                   "good fun film"])  # fmt: skip
    assert rc == 0 and ("negative" in log or "positive" in log), log[-2000:]


EVERY_WEIGHTING = r"""
import json, sys
from fastpals.surgery import AGGREGATORS, STATEFUL
from fastpals.train.command import parse_args
from fastpals.train.loop import Trainer

common = json.loads(sys.argv[1])
for name in AGGREGATORS:
    args = parse_args([*common, "--out", sys.argv[2] + "/" + name, "--surgery", name, "--epochs", "1",
                       "--steps-per-epoch", "2", "--max-eval", "4", "--max-predict", "2"])
    trainer = Trainer(args, callbacks=[])
    assert trainer.run()["steps"] == 2, name
    assert ("aggregator_state" in trainer.components) == (name in STATEFUL), name
    print("ok", name, flush=True)
"""


def test_every_weighting_trains_through_the_trainer(tiny, tmp_path):
    """Each fastpals.surgery.AGGREGATORS name runs updates through the trainer (mixed batches, one backward),
    in one process; the stateful ones' state is a checkpointed component."""
    from fastpals.surgery import AGGREGATORS

    rc, log = run([sys.executable, "-c", EVERY_WEIGHTING, json.dumps(common(tiny, tmp_path / "unused")),
                   str(tmp_path)], timeout=900)  # fmt: skip
    assert rc == 0, log[-4000:]
    assert [line.split()[1] for line in log.splitlines() if line.startswith("ok ")] == list(AGGREGATORS)


def test_mixed_batches_train_under_zero_1_2_bf16_and_freeze_word_embeddings(tiny, tmp_path):
    """Mixed packed batches (the default) under DeepSpeed ZeRO-1 and ZeRO-2 with bf16 on the CPU accelerator:
    both train; the first update's losses are identical (same weights, same packed batch) and the later ones
    agree to bf16 rounding (both keep fp32 master weights). bf16 ZeRO-0 on CPU is refused before training with
    the reason (DeepSpeed would run it without fp32 master weights). ``--freeze-word-embeddings`` leaves the
    word-embedding matrix exactly as loaded."""
    from safetensors.torch import load_file

    losses = {}
    for stage in (0, 1, 2, 2):
        cfg = tmp_path / f"zero{stage}.json"
        cfg.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
                                   "gradient_clipping": 1.0}))  # fmt: skip
        out = tmp_path / f"z{stage}"
        extra = ["--freeze-word-embeddings"] if f"z{stage}" in losses else []  # the second ZeRO-2 run
        if extra:
            out = tmp_path / "frozen"
        rc, log = run([sys.executable, "train.py", "--ds_config", str(cfg),
                       *common(tiny, out, "--epochs", "1", "--steps-per-epoch", "4", "--lr", "1e-3", *extra)])  # fmt: skip
        if stage == 0:
            assert rc == 2 and "bf16 with ZeRO stage 0 on CPU" in log, log[-2000:]
            continue
        assert rc == 0, log[-4000:]
        results = json.loads((out / "results.json").read_text())
        assert results["zero_stage"] == stage and results["config"]["batching"] == "mixed"
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[out.name] = [r["loss"] for r in records if r["type"] == "step"]
        assert len(losses[out.name]) == 4 and all(r["tokens"] > 0 for r in records if r["type"] == "step")
    assert losses["z2"][0] == losses["z1"][0] == losses["frozen"][0]
    for got, ref in zip(losses["z2"], losses["z1"]):
        for task, value in ref.items():
            assert abs(got[task] - value) <= 2e-2 * max(1.0, abs(value)), (task, got, ref)
    _, model = tiny
    base = load_file(str(model / "model.safetensors"))
    key = next(k for k in base if k.endswith("word_embeddings.weight"))
    saved = load_file(str(tmp_path / "frozen" / "best" / "model.safetensors"))
    got = next(v for k, v in saved.items() if k.endswith("word_embeddings.weight"))
    start = base[key].to(got.dtype)  # a bf16 run saves its bf16 weights
    assert torch.equal(got, start)
    trained = load_file(str(tmp_path / "z1" / "best" / "model.safetensors"))
    moved = next(v for k, v in trained.items() if k.endswith("word_embeddings.weight"))
    assert not torch.equal(moved, start)  # without the flag they train
