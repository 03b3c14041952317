"""Runs that never mix or lose results, and errors a user can fix (issue 16), and the single-process start-up
(issue 14): --resume from the saved options, broken checkpoints, output-folder reuse, one-line errors on stderr,
timestamped logs, training-curve colours, no shared-memory comm op build for one process."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastpals.train.command import build_parser, parse_args
from fastpals.train.errors import ConfigError
from fastpals.train.outputs import discard_replaced, prepare_out, restore_replaced
from fastpals.train.state import TrainState, check_checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_fixtures import tiny_run_args  # noqa: E402


def common(tiny, out, *extra):
    return tiny_run_args(*tiny, out, "--steps-per-epoch", "3", *extra)


def run(args, env_extra=None, drop=(), module=None, timeout=300):
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env.update(env_extra or {})
    for key in drop:
        env.pop(key, None)
    cmd = [sys.executable, *(["-m", module] if module else ["train.py"]), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def one_line_error(stderr, *needles):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def stopped_run(tiny, tmp_path_factory):
    """A run stopped (SIGTERM) after update 1 of 3, with its checkpoint."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    ext = out.parent / "extensions"
    rc, _, err = run(
        common(tiny, out, "--no-progress", "--stop-after-steps", "1"), {"TORCH_EXTENSIONS_DIR": str(ext)}
    )
    assert rc == 143, err[-3000:]
    # one process: DeepSpeed's shared-memory comm op is neither built nor loaded
    assert not ext.exists() or not any(ext.rglob("*shm*"))
    assert "built successfully" not in err
    return out


# --- --help ---------------------------------------------------------------------------------------------------
def test_help_lists_every_option_and_which_may_change_on_resume():
    text = build_parser().format_help()
    for flag in ("--ds_config", "--model", "--tasks", "--resume", "--overwrite", "--debug", "--batching",
                 "--max-tokens", "--task-weighting", "--surgery-opts", "--surgery-buffer-dtype", "--max-train"):  # fmt: skip
        assert flag in text, flag
    epilog = text.split("marks the options a resumed run may give anew:")[1]
    assert "--out" in epilog and "--eval-every" in epilog and "--lr" not in epilog.split(".")[0]
    assert "--inject-nan-at-step" not in text  # test-only, hidden


# --- resume ---------------------------------------------------------------------------------------------------
def test_resume_reads_the_saved_options(stopped_run, tmp_path):
    saved = json.loads((stopped_run / "train_args.json").read_text())
    assert saved["lr"] == 1e-3 and saved["pal_hidden"] == 16 and saved["batch_size"] == 8
    args = parse_args(["--out", str(stopped_run), "--resume", "--eval-every", "2"])
    assert (
        args.lr == 1e-3 and args.pal_hidden == 16 and args.max_length == 24 and args.model == saved["model"]
    )
    assert args.eval_every == 2 and args.resume and args.stop_after_steps is None  # may change / per command
    with pytest.raises(
        ConfigError, match=r"--resume with different options: --lr \(saved 0.001, now 0.002\)"
    ):
        parse_args(["--out", str(stopped_run), "--resume", "--lr", "2e-3"])
    with pytest.raises(ConfigError, match="train_args.json does not exist"):
        parse_args(["--out", str(tmp_path), "--resume"])


@pytest.mark.slow
def test_resume_without_repeating_options_finishes_the_run(stopped_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    rc, stdout, err = run(["--out", str(out), "--resume", "--no-progress"])
    assert rc == 0, err[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 3 and results["config"]["lr"] == 1e-3
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["type"] == "step"] == [1, 2, 3]
    rc, _, err = run(["--out", str(out), "--resume", "--pal-hidden", "32"])
    one_line_error(err, "--pal-hidden (saved 16, now 32)")


# --- broken checkpoints ---------------------------------------------------------------------------------------
def _broken(stopped_run, tmp_path, how):
    out = tmp_path / how
    shutil.copytree(stopped_run, out)
    ckpt = out / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    model_file = ckpt / tag / "mp_rank_00_model_states.pt"
    if how == "no_latest":
        (ckpt / "latest").unlink()
        return out, ckpt / "latest"
    if how == "latest_nowhere":
        (ckpt / "latest").write_text("step99")
        return out, ckpt / "latest"
    if how == "missing_file":
        model_file.unlink()
        return out, model_file
    data = bytearray(model_file.read_bytes())
    if how == "truncated":
        model_file.write_bytes(data[: len(data) // 2])
    else:  # corrupt: flip bytes in the middle
        mid = len(data) // 2
        data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
        model_file.write_bytes(bytes(data))
    return out, model_file


@pytest.mark.parametrize("how", ["no_latest", "latest_nowhere", "missing_file", "truncated", "corrupt"])
def test_broken_checkpoint_is_named(stopped_run, tmp_path, how):
    out, path = _broken(stopped_run, tmp_path, how)
    with pytest.raises(ConfigError) as info:
        check_checkpoint(out / "checkpoints")
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    if how in (
        "no_latest",
        "latest_nowhere",
    ):  # the whole step folder beside it is named, with how to resume from it (#33)
        assert "is a whole checkpoint (the newest)" in message and "--resume again" in message
    else:
        assert "--overwrite" in message or "drop --resume" in message
    check_checkpoint(stopped_run / "checkpoints")  # the intact one passes


def test_broken_checkpoint_is_one_line_on_stderr(stopped_run, tmp_path):
    out, path = _broken(stopped_run, tmp_path, "truncated")
    rc, _, err = run(["--out", str(out), "--resume"])
    assert rc == 2
    one_line_error(err, str(path), "truncated or corrupt", "--overwrite")


def test_train_state_round_trips():
    state = TrainState(global_step=7, evaluated_epoch=1, step_losses={"sst": ([1, 3], [0.5, 0.25])},
                       evals=[{"step": 3, "dev": {"sst": 0.5}}], untrained={"sst": 0.2}, timings={"setup_s": 1.5},
                       options={"lr": 1e-3})  # fmt: skip
    assert TrainState.from_state_dict(state.state_dict()) == state
    with pytest.raises(ValueError, match="lacks"):
        TrainState.from_state_dict({"global_step": 1})


# --- reusing --out --------------------------------------------------------------------------------------------
def test_out_folder_with_an_earlier_run_is_refused(tmp_path):
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl, tensorboard\).*--overwrite"):
        prepare_out(out, resume=False, overwrite=False, is_main=True)
    aside = prepare_out(out, resume=False, overwrite=True, is_main=True)
    # only the run's outputs move, and only aside: nothing is deleted before the new run has a checkpoint
    assert sorted(p.name for p in out.iterdir() if p != aside) == ["notes.txt"]
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "tensorboard"]
    (out / "metrics.jsonl").write_text("new\n")  # the new run starts writing, then fails
    restore_replaced(out, aside)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "notes.txt", "tensorboard"]
    assert (out / "metrics.jsonl").read_text() == "{}\n"
    aside = prepare_out(out, resume=False, overwrite=True, is_main=True)
    discard_replaced(aside)  # the new run wrote its first checkpoint
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    prepare_out(tmp_path / "new", resume=False, overwrite=False, is_main=True)
    assert (tmp_path / "new").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        prepare_out(tmp_path / "file", resume=False, overwrite=False, is_main=True)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_with_a_bad_option_leaves_the_earlier_run_as_it_was(stopped_run, tmp_path, tiny):
    """``--overwrite --model ./typo``: the new run fails at set-up, and the earlier run is byte-identical."""
    earlier = tmp_path / "run"
    shutil.copytree(stopped_run, earlier)
    before = _tree(earlier)
    args = common(tiny, earlier, "--overwrite")
    args[args.index("--model") + 1] = str(tmp_path / "typo")
    rc, _, err = run(args)
    assert rc == 2
    one_line_error(err, "--model", "typo")
    assert _tree(earlier) == before
    assert not any(p.name.startswith(".replaced-") for p in earlier.iterdir())


def test_overwrite_replaces_the_earlier_run_once_the_new_one_has_a_checkpoint(stopped_run, tmp_path, tiny):
    earlier = tmp_path / "run"
    shutil.copytree(stopped_run, earlier)
    rc, _, err = run(common(tiny, earlier, "--overwrite", "--no-progress"))
    assert rc == 0, err[-3000:]
    assert not any(p.name.startswith(".replaced-") for p in earlier.iterdir())
    records = [json.loads(line) for line in (earlier / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["type"] == "config" for r in records) == 1  # the new run's records only
    assert (earlier / "results.json").is_file()


def test_sighup_stops_with_a_checkpoint_like_sigterm(tiny, tmp_path):
    """A closed terminal (SIGHUP) mid-training: a checkpoint is written and the code is 128 + 1."""
    import signal
    import time

    out = tmp_path / "run"
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    args = common(tiny, out, "--no-progress")
    args[args.index("--steps-per-epoch") + 1] = "400"
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and '"type": "step"' in metrics.read_text():
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGHUP, err[-3000:]
    assert "SIGHUP" in err and (out / "checkpoints" / "latest").is_file()


def test_out_reuse_on_the_command_line(stopped_run, tmp_path, tiny):
    rc, _, err = run(common(tiny, stopped_run))
    one_line_error(err, f"--out {stopped_run} already holds a run", "--resume", "--overwrite")
    (tmp_path / "afile").write_text("x")
    rc, _, err = run(common(tiny, tmp_path / "afile"))
    assert rc == 2
    one_line_error(err, "is a file")


# --- one-line errors ------------------------------------------------------------------------------------------
def test_user_errors_are_one_line_and_debug_shows_the_traceback(tiny, tmp_path):
    rc, _, err = run(common(tiny, tmp_path / "a", "--tasks", "sst,nope"))
    assert rc == 2
    one_line_error(err, "train.py: error: --tasks: unknown task", "--debug")
    rc, _, err = run(common(tiny, tmp_path / "a", "--tasks", "sst,nope", "--debug"))
    assert (
        rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("train.py: error: --tasks")
    )
    rc, _, err = run(common(tiny, tmp_path / "a", "--surgery", "pcgard"))
    assert rc == 2
    one_line_error(err, "--surgery: invalid choice: 'pcgard'", "--help")
    data, _ = tiny
    rc, _, err = run(["--model", "no-such-user/no-such-model", "--data-dir", str(data), "--out", str(tmp_path / "b"),
                      "--tasks", "sst"], env_extra={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert rc == 2
    one_line_error(err, "--model no-such-user/no-such-model")


def test_data_dir_unset_names_the_flag_and_variable(tiny, tmp_path):
    _, model = tiny
    rc, _, err = run(["--model", str(model), "--out", str(tmp_path / "r")], drop=("FASTPALS_DATA_DIR",))
    assert rc == 2
    one_line_error(err, "--data-dir", "FASTPALS_DATA_DIR")


@pytest.mark.slow
def test_predict_errors_are_one_line(stopped_run, tiny, tmp_path):
    best = tmp_path / "best"
    # a finished run's best/ folder: resume the stopped one to the end
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    rc, _, err = run(["--out", str(out), "--resume", "--no-progress"])
    assert rc == 0, err[-2000:]
    shutil.copytree(out / "best", best)
    rc, _, err = run([str(best), "--data-dir", str(tmp_path / "nowhere")], module="fastpals.commands.predict")
    assert rc == 2
    one_line_error(err, "--data-dir", "nowhere")
    rc, _, err = run([str(best)], module="fastpals.commands.predict", drop=("FASTPALS_DATA_DIR",))
    one_line_error(err, "--data-dir", "FASTPALS_DATA_DIR")
    rc, _, err = run([str(tmp_path / "nomodel")], module="fastpals.commands.predict")
    assert rc == 2
    one_line_error(err, "nomodel")
    (tmp_path / "f").write_text("x")
    rc, _, err = run(
        [str(best), "--data-dir", str(tiny[0]), "--out", str(tmp_path / "f")],
        module="fastpals.commands.predict",
    )
    one_line_error(err, "is a file")
    rc, stdout, err = run(
        [str(best), "--task", "sst", "--text", "good movie"], module="fastpals.commands.predict"
    )
    assert rc == 0, err
    fields = stdout.strip().split("\t")
    names = ("very negative", "negative", "neutral", "positive", "very positive")
    assert fields[0] == "sst" and fields[2] == names[int(float(fields[1]))] and fields[3].startswith("p=")
    assert 0.2 <= float(fields[3][2:]) <= 1.0  # the probability of the predicted class of 5
    rc, stdout, err = run([str(best), "--data-dir", str(tiny[0]), "--out", str(tmp_path / "p")],
                          module="fastpals.commands.predict")  # fmt: skip
    assert rc == 0 and "predict sst" in err  # the progress bar


# --- seeing what happens --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_single_process_run_logs_times_and_builds_no_comm_op(tiny, tmp_path):
    ext = tmp_path / "extensions"
    rc, _, err = run(
        common(tiny, tmp_path / "run", "--eval-every", "2"), env_extra={"TORCH_EXTENSIONS_DIR": str(ext)}
    )
    assert rc == 0, err[-3000:]
    assert not ext.exists() or not any(ext.rglob("*shm*"))  # no shared-memory op built
    assert "built successfully" not in err
    data_lines = [line for line in err.splitlines() if "[data]" in line or "[eval]" in line]
    assert data_lines and all(re.match(r"^\d\d:\d\d:\d\d \[", line) for line in data_lines), data_lines
    assert re.search(r"train, epoch 1/1: .*\| 3/3 ", err)  # one bar over the whole run (3 updates)
    assert "dev sst" in err  # the dev evaluation's progress bar


def test_training_curve_colours_are_per_task():
    from fastpals.train.callbacks import training_curve_series

    losses = {"sst": ([1, 4], [1.0, 0.8]), "para": ([2, 3, 5], [0.7, 0.6, 0.5]), "sts": ([3], [2.0])}
    evals = [{"step": 0, "dev": {"sst": 0.2, "para": 0.5, "sts": 0.1, "overall": 0.4}},
             {"step": 5, "dev": {"sst": 0.3, "para": 0.6, "sts": 0.2, "overall": 0.5}}]  # fmt: skip
    series = training_curve_series(losses, evals, tasks=["sst", "para", "sts"])
    colours: dict[str, set] = {}
    for s in series:
        colours.setdefault(s["task"], set()).add(s["color"])
    assert all(len(c) == 1 for c in colours.values()), colours  # one colour per task, in every panel
    assert len({next(iter(c)) for c in colours.values()}) == 4  # and different tasks differ
    for s in series:
        if s["panel"] == "loss":
            assert list(s["x"]) == losses[s["task"]][0]  # only at the updates where the task trained
    assert {s["kind"] for s in series if s["task"] == "para"} == {"points", "smoothed", "dev"}


def test_training_curves_title_names_the_settings(tiny):
    from fastpals.train.callbacks import run_title

    data, model = tiny
    args = parse_args(["--model", str(model), "--data-dir", str(data), "--surgery", "pcgrad", "--sampling",
                       "random_round_robin", "--pal", "12heads", "--lr", "3e-5", "--batch-size", "16"])  # fmt: skip
    title = run_title(args)
    for part in ("sst,para,sts", "PAL 12heads", "sampling random_round_robin", "surgery pcgrad", "batch 16",
                 "lr 3e-05"):  # fmt: skip
        assert part in title, (part, title)
