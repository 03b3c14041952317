"""Fault injection (issue 33): runs that never lose work. kill -9 inside an epoch then --resume is bit-identical;
one run per --out (a lock naming the pid; a dead run's lock taken over); two-stage Ctrl-C and Ctrl-C in the
set-up; non-finite weights never evaluated, checkpointed or saved; full disk / no permission while saving;
random corruptions of a checkpoint; ds_config typos at both levels; strict-JSON metrics with a resume record.

Runs a handful of tiny training processes (a 2-layer d=32 BERT, a few updates each)."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpals.train.errors import ConfigError, NonFiniteLossError, OutputError, TrainingInterrupted
from fastpals.train.outputs import RunLock
from fastpals.train.state import TrainState, check_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_fixtures import tiny_run_args  # noqa: E402


def common(tiny, out, *extra):
    return tiny_run_args(*tiny, out, "--no-progress", *extra)


def _env():
    return {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }


def run(args, timeout=300, script=None):
    cmd = [sys.executable, *(["-c", script] if script else ["train.py"]), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())
    return proc.returncode, proc.stdout, proc.stderr


def _default_sigint() -> None:
    """In the child: Ctrl-C's default disposition. A shell starts background jobs with SIGINT ignored, and an
    ignored SIGINT is inherited (Python then installs no KeyboardInterrupt handler): the run would never see it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen(args):
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)  # fmt: skip


def one_line(stderr, *needles):
    """The one error line of ``stderr``, with each needle: the run's own log lines (timestamped ``HH:MM:SS``) and
    DeepSpeed's (``[20..``) aside, nothing else is there, and no traceback."""
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not re.match(r"\[20|\d\d:\d\d:\d\d ", ln)]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def strict_records(path: Path) -> list[dict]:
    """metrics.jsonl read as strict JSON: NaN / Infinity refused."""

    def refuse(name):
        raise AssertionError(f"{path}: {name} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def wait_for(predicate, proc, seconds=240):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _has_step(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return metrics.exists() and '"type": "step"' in metrics.read_text()


# --- kill -9 inside an epoch, then --resume ----------------------------------------------------------------------
KILL_OPTS = ("--steps-per-epoch", "6", "--checkpoint-every", "2", "--eval-every", "3", "--seed", "5")


@pytest.fixture(scope="module")
def killed_and_resumed(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("kill9")
    full, cut = root / "full", root / "cut"
    rc, _, err = run(common(tiny, full, *KILL_OPTS))
    assert rc == 0, err[-3000:]
    rc, _, err = run(common(tiny, cut, *KILL_OPTS, "--kill-after-steps", "5"))
    assert rc == -signal.SIGKILL, err[-3000:]
    assert (cut / "checkpoints" / "latest").read_text() == "step4"  # the mid-epoch checkpoint of update 4
    assert not (cut / "results.json").exists()
    rc, _, resume_err = run(["--out", str(cut), "--resume"])
    assert rc == 0, resume_err[-3000:]
    return full, cut, resume_err


def test_kill_9_inside_the_only_epoch_then_resume_is_bit_identical(killed_and_resumed):
    full, cut, _ = killed_and_resumed
    a, b = (json.loads((f / "results.json").read_text()) for f in (full, cut))
    assert a["dev"] == b["dev"] and a["evals"] == b["evals"] and a["steps"] == b["steps"] == 6

    def losses(folder):
        return [
            (r["step"], r["loss"]) for r in strict_records(folder / "metrics.jsonl") if r["type"] == "step"
        ]

    assert losses(full) == losses(cut) and [s for s, _ in losses(cut)] == [1, 2, 3, 4, 5, 6]  # no step twice
    for name in ("model.safetensors", "pals/adapter_model.safetensors"):
        assert (full / "best" / name).read_bytes() == (cut / "best" / name).read_bytes(), name
    for name in sorted(p.name for p in (full / "predictions").iterdir()):
        assert (full / "predictions" / name).read_bytes() == (cut / "predictions" / name).read_bytes(), name


def test_resume_after_kill_9_records_it_and_takes_over_the_lock(killed_and_resumed):
    _, cut, err = killed_and_resumed
    records = strict_records(cut / "metrics.jsonl")
    resumes = [r for r in records if r["type"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 4 and resumes[0]["dropped_records"] >= 1  # step 5
    assert [r["type"] for r in records].index("resume") == [r.get("step") for r in records].index(5) - 1
    assert "ended without releasing its lock" in err  # the killed run's lock: taken over with a warning
    assert (cut / ".lock").read_text() == ""  # a clean end empties it


# --- random corruptions of a checkpoint ---------------------------------------------------------------------
def test_200_random_corruptions_are_one_line_or_load_exactly(killed_and_resumed, tmp_path):
    """Head, body and tail (the zip directory) of the model file: each corruption is a one-line ConfigError
    naming the file, or the file passes and loads to exactly the original tensors."""
    _, cut, _ = killed_and_resumed
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(cut / "checkpoints", ckpt)
    tag = (ckpt / "latest").read_text()
    target = ckpt / tag / "mp_rank_00_model_states.pt"
    original = target.read_bytes()
    reference = torch.load(target, map_location="cpu", weights_only=False)["module"]
    rng = random.Random(33)
    refused = 0
    for i in range(200):
        data = bytearray(original)
        region = ("head", "body", "tail")[i % 3]
        lo, hi = {"head": (0, 512), "body": (512, len(data) - 4096), "tail": (len(data) - 4096, len(data))}[
            region
        ]
        kind = rng.choice(("flip", "zero", "truncate"))
        at = rng.randrange(lo, hi)
        if kind == "truncate":
            data = data[:at]
        else:
            for k in range(at, min(at + rng.randint(1, 16), len(data))):
                data[k] = 0 if kind == "zero" else data[k] ^ (1 << rng.randrange(8))
        target.write_bytes(bytes(data))
        try:
            check_checkpoint(ckpt)
        except ConfigError as err:
            assert str(target) in str(err) and "\n" not in str(err), (region, kind, at)
            refused += 1
            continue
        loaded = torch.load(target, map_location="cpu", weights_only=False)["module"]  # must load, exactly
        assert loaded.keys() == reference.keys(), (region, kind, at)
        assert all(torch.equal(loaded[k], reference[k]) for k in reference), (region, kind, at)
    target.write_bytes(original)
    check_checkpoint(ckpt)
    assert refused > 150  # most corruptions are caught (padding bytes inside the zip may change nothing)


# --- one run per folder, Ctrl-C ---------------------------------------------------------------------------------
def test_second_run_into_a_busy_folder_and_a_dead_runs_lock(tmp_path):
    out = tmp_path / "run"
    first = RunLock(out).acquire()
    with pytest.raises(ConfigError, match=rf"in use by the run with pid {os.getpid()} on host"):
        RunLock(out).acquire()
    first.release()
    second = RunLock(out).acquire()
    assert second.taken_over is None  # released cleanly: nothing to take over
    second.release()
    # a run killed while holding the lock: the kernel frees the flock; the next run takes over and says whose
    child = subprocess.run([sys.executable, "-c", "import os, signal, sys; from fastpals.train.outputs import "
                            "RunLock; RunLock(sys.argv[1]).acquire(); print(os.getpid(), flush=True); "
                            "os.kill(os.getpid(), signal.SIGKILL)", str(out)],
                           capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=60)  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    third = RunLock(out).acquire()
    assert third.taken_over is not None and third.taken_over[0] == child.stdout.strip()
    third.release()
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        if os.access(readonly, os.W_OK):
            pytest.skip("running as a user that writes anywhere (root)")
        with pytest.raises(ConfigError, match=r"cannot write .*Permission denied.*choose an --out"):
            RunLock(readonly / "run").acquire()
    finally:
        readonly.chmod(0o700)


def test_busy_folder_refused_on_the_command_line_and_ctrl_c_stops_with_a_checkpoint(tiny, tmp_path):
    """A running run holds --out: a second run into it gets one line naming the first's pid. The first Ctrl-C
    says at once what it will do, and the run stops after the update with a checkpoint, code 130."""
    out = tmp_path / "run"
    proc = popen(common(tiny, out, "--steps-per-epoch", "400", "--checkpoint-every", "0"))
    try:
        assert wait_for(lambda: _has_step(out), proc), proc.communicate()[1][-3000:]
        rc, _, err = run(common(tiny, out, "--steps-per-epoch", "2"))
        assert rc == 2
        one_line(err, f"--out {out} is in use by the run with pid {proc.pid} on host")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Ctrl-C again to stop now" in err and "stopped by signal SIGINT after update step" in err
    assert err.index("Ctrl-C again") < err.index("stopped by signal SIGINT")
    assert (out / "checkpoints" / "latest").is_file()
    check_checkpoint(out / "checkpoints")


def test_ctrl_c_during_the_set_up_is_one_line_and_130(tiny, tmp_path):
    proc = popen(common(tiny, tmp_path / "run", "--steps-per-epoch", "2"))
    time.sleep(0.5)  # importing torch and DeepSpeed alone takes longer
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    one_line(err, "interrupted by Ctrl-C during the set-up", "nothing was trained")


class _SwallowedCtrlC:
    """Deleted at once: its finalizer runs the SIGINT handler, whose KeyboardInterrupt Python swallows (as a Ctrl-C
    landing in an import lock's callback)."""

    def __del__(self):
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)


def test_a_ctrl_c_python_swallows_during_the_set_up_still_stops_the_run(tiny, tmp_path, monkeypatch, capsys):
    from fastpals.train import command

    set_up = command.Trainer.__init__

    def set_up_then_ctrl_c(self, args):
        set_up(self, args)
        _SwallowedCtrlC()

    monkeypatch.setattr(command.Trainer, "__init__", set_up_then_ctrl_c)
    before = signal.getsignal(signal.SIGINT), sys.unraisablehook
    assert command.main(common(tiny, tmp_path / "run", "--steps-per-epoch", "2")) == 130
    one_line(capsys.readouterr().err, "interrupted by Ctrl-C during the set-up", "nothing was trained")
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert (signal.getsignal(signal.SIGINT), sys.unraisablehook) == before


def test_a_ctrl_c_python_swallows_while_the_libraries_load_is_one_line_and_130(tiny, tmp_path):
    script = (
        "import builtins, runpy, signal, sys\n"
        "load = builtins.__import__\n"
        "class Swallowed:\n"
        "    def __del__(self): signal.getsignal(signal.SIGINT)(signal.SIGINT, None)\n"
        "def ctrl_c_in_an_import(name, *a, **k):\n"
        "    if name == 'fastpals.train': Swallowed()\n"
        "    return load(name, *a, **k)\n"
        "builtins.__import__ = ctrl_c_in_an_import\n"
        "sys.argv[0] = 'train.py'\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    rc, _, err = run(common(tiny, tmp_path / "run", "--steps-per-epoch", "2"), script=script)
    assert rc == 130, err[-3000:]
    one_line(err, "interrupted by Ctrl-C during the set-up", "nothing was trained")
    assert not (tmp_path / "run").exists()


def test_second_ctrl_c_stops_at_once_and_names_the_last_checkpoint(capsys):
    from fastpals.train.loop import Trainer

    trainer = Trainer.__new__(Trainer)  # only the signal handler's state
    trainer.is_main, trainer._stop_signal, trainer.state = True, None, TrainState(global_step=7)
    trainer._checkpoint = (Path("runs/x/checkpoints/step5"), 5)
    trainer._on_signal(signal.SIGINT, None)
    assert "stopping after this update/evaluation" in capsys.readouterr().err  # said at once
    assert trainer._stop_signal == signal.SIGINT
    with pytest.raises(TrainingInterrupted) as info:
        trainer._on_signal(signal.SIGINT, None)
    assert info.value.at_once and info.value.signum == signal.SIGINT
    assert "stopped at once by a second Ctrl-C after update step 7" in str(info.value)
    assert "runs/x/checkpoints/step5" in str(info.value) and "--out runs/x --resume" in str(info.value)


# --- non-finite ------------------------------------------------------------------------------------------------
def test_nonfinite_weights_right_before_an_evaluation_are_never_evaluated_or_saved(tiny, tmp_path):
    out = tmp_path / "run"
    rc, _, err = run(common(tiny, out, "--steps-per-epoch", "4", "--checkpoint-every", "1", "--eval-every", "2",
                            "--inject-nan-weights-at-step", "2"))  # fmt: skip
    assert rc == 3, err[-3000:]
    line = one_line(err, "non-finite weights after update step 2", "not evaluated, saved as best/ or checkpointed",
                    f"the last checkpoint, {out / 'checkpoints' / 'step1'} (update 1), is good",
                    "lower --lr", "another --out")  # fmt: skip
    assert "then --resume" not in line
    assert (out / "checkpoints" / "latest").read_text() == "step1"
    assert not (out / "best").exists()  # the evaluation of step 2 never ran
    records = strict_records(out / "metrics.jsonl")
    assert records[-1] == {"type": "nonfinite", "step": 2, "task": "all", "what": "weights"}
    assert not any(r["type"] == "eval" for r in records)


def test_nonfinite_advice_says_which_checkpoint_and_never_resume_with_another_rate():
    err = NonFiniteLossError(3, "sst", float("nan"))
    err.add_context(None, None, None, None)
    assert "this run wrote no checkpoint yet" in str(err) and "then --resume" not in str(err)
    assert "--resume keeps the saved options" in str(err)
    err.add_context(Path("r/checkpoints/step2"), 2, Path("r/best"), 2)
    assert "the last checkpoint, r/checkpoints/step2 (update 2), is good; r/best holds the best model" in str(
        err
    )


def test_metrics_are_strict_json(tmp_path):
    from fastpals.train.callbacks import JsonlLog

    log = JsonlLog(tmp_path / "metrics.jsonl")
    log.on_record(None, {"type": "step", "step": 1, "loss": {"sst": float("nan"), "sts": float("inf")}})
    assert strict_records(tmp_path / "metrics.jsonl") == [{"type": "step", "step": 1,
                                                          "loss": {"sst": None, "sts": None}}]  # fmt: skip


# --- disk and files -------------------------------------------------------------------------------------------
class _FailingEngine:
    """An engine whose checkpoint save writes part of the folder, then fails with ``err``."""

    def __init__(self, err: BaseException | None) -> None:
        self.err = err

    def save_checkpoint(self, save_dir, tag, client_state, save_latest=True):
        assert not save_latest  # fastpals writes ``latest`` itself, atomically, after the folder is whole
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"partial")
        if self.err is not None:
            raise self.err


@pytest.mark.parametrize(
    "err, cause",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "No space left on device (ENOSPC)"),
        (PermissionError(errno.EACCES, "Permission denied"), "Permission denied (EACCES)"),
        (OSError(errno.EROFS, "Read-only file system"), "Read-only file system (EROFS)"),
        (RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 67456 vs 67350"), "disk full"),
    ],
)  # fmt: skip
def test_a_failed_checkpoint_save_removes_its_partial_folder_and_keeps_the_previous(tmp_path, err, cause):
    ckpt = tmp_path / "checkpoints"
    save_checkpoint(_FailingEngine(None), ckpt, TrainState(global_step=2), {}, is_main=True)
    (ckpt / "step1").mkdir()  # half-deleted by a kill: cleaned up at the next save
    with pytest.raises(OutputError) as info:
        save_checkpoint(_FailingEngine(err), ckpt, TrainState(global_step=4), {}, is_main=True)
    message = str(info.value)
    assert "\n" not in message and cause in message and str(ckpt / "step4") in message
    assert f"the previous checkpoint {ckpt / 'step2'} is whole" in message
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step2"]
    assert (ckpt / "latest").read_text() == "step2"


def test_a_failed_save_is_one_line_and_code_4_end_to_end(tiny, tmp_path):
    """torch.save fails as on a full disk (torch says only ``unexpected pos``) at the second checkpoint."""
    script = (
        "import sys, torch\n"
        "real = torch.save\n"
        "def save(obj, f, *a, **k):\n"
        "    if 'step4' in str(f):\n"
        "        raise RuntimeError('[enforce fail at inline_container.cc:778] . unexpected pos 67456 vs 67350')\n"
        "    return real(obj, f, *a, **k)\n"
        "torch.save = save\n"
        "from fastpals.train.command import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "run"
    rc, _, err = run(common(tiny, out, "--steps-per-epoch", "6", "--checkpoint-every", "2"), script=script)
    assert rc == 4, err[-3000:]
    one_line(err, "cannot write checkpoint file", "is the disk full?", "step2 is whole", "--resume")
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step")) == ["step2"]
    check_checkpoint(out / "checkpoints")


def test_a_failed_best_save_keeps_the_previous_best(tmp_path):
    from fastpals.train.outputs import save_best

    class Module:
        def __init__(self, fail):
            self.fail = fail

        def save_pretrained(self, folder, tokenizer=None):
            folder.mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(b"new" if not self.fail else b"part")
            if self.fail:
                raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))

    best = tmp_path / "best"
    save_best(Module(False), None, best, 24, 1, ["sst"])
    with pytest.raises(
        OutputError, match=r"No space left on device \(ENOSPC\).*previous best model .* is whole"
    ):
        save_best(Module(True), None, best, 24, 2, ["sst"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    assert (best / "model.safetensors").read_bytes() == b"new"
    assert json.loads((best / "training_args.json").read_text())["step"] == 1


def test_free_space_is_checked_before_training(tmp_path, monkeypatch):
    from fastpals.train import outputs

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: usage._replace(free=100 * 2**20))
    err = outputs.free_space_error(tmp_path, 80 * 2**20, 10 * 2**20, resume=False)
    assert err is not None and "100 MiB free, but the run writes about 180 MiB" in str(err)
    assert "checkpoint 80 MiB" in str(err) and "best/ 10 MiB" in str(err)
    assert outputs.free_space_error(tmp_path, 40 * 2**20, 10 * 2**20, resume=False) is None


def test_empty_latest_names_the_newest_whole_checkpoint(killed_and_resumed, tmp_path):
    _, cut, _ = killed_and_resumed
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(cut / "checkpoints", ckpt)
    tag = (ckpt / "latest").read_text()
    (ckpt / "latest").write_text("")
    with pytest.raises(ConfigError) as info:
        check_checkpoint(ckpt)
    assert f"{ckpt / 'latest'} is empty, but {ckpt / tag} is a whole checkpoint" in str(info.value)
    assert f"echo {tag} > {ckpt / 'latest'}" in str(info.value)


# --- ds_config -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"gradient_clippin": 5.0}, "unknown key 'gradient_clippin': did you mean gradient_clipping?"),
        ({"zero_optimisation": {"stage": 2}}, "did you mean zero_optimization?"),
        ({"bf16": {"enabeld": True}, "zero_optimization": {"stage": 1}}, "'bf16.enabeld': did you mean bf16.enabled?"),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"devise": "cpu"}}},
         "did you mean zero_optimization.offload_optimizer.device?"),
        ({"data_types": {"grad_acum_dtype": "fp32"}}, "did you mean data_types.grad_accum_dtype?"),
        ({"zero_optimization": {"stage": 1, "reduce_bucket_size": "big"}},
         "zero_optimization.reduce_bucket_size = 'big': Input should be a valid integer"),
    ],
)  # fmt: skip
def test_ds_config_typos_are_refused_with_the_closest_key(cfg, message):
    from fastpals.train.dsconfig import check_ds_config

    with pytest.raises(ConfigError) as info:
        check_ds_config(cfg, 8, 1, cuda=False, native_bf16=True)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_ds_config_typo_fails_before_the_set_up(tiny, tmp_path):
    cfg = tmp_path / "typo.json"
    cfg.write_text(json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": "auto"},
                               "gradient_clippin": 1.0}))  # fmt: skip
    out = tmp_path / "run"
    rc, _, err = run(common(tiny, out, "--ds_config", str(cfg), "--steps-per-epoch", "2"))
    assert rc == 2
    one_line(err, f"--ds_config {cfg}: unknown key 'gradient_clippin': did you mean gradient_clipping?")
    assert not any(p.name != ".lock" for p in out.iterdir()) if out.exists() else True


# --- --help ----------------------------------------------------------------------------------------------------
def test_help_documents_the_exit_codes():
    from fastpals.train.command import build_parser

    text = build_parser().format_help()
    for code in ("  0  the run finished", "  2  an option", "  3  a non-finite", "  4  an output", "129  ",
                 "130  stopped by Ctrl-C", "143  stopped by SIGTERM"):  # fmt: skip
        assert code in text, code
    assert "--checkpoint-every" in text


# --- one line, never a traceback ----------------------------------------------------------------------------
def test_hand_edited_train_args_json_is_one_line(tmp_path):
    from fastpals.train.command import parse_args

    (tmp_path / "train_args.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match=r"must hold a JSON object of options, not list"):
        parse_args(["--out", str(tmp_path), "--resume"])
    for entry, message in (({"lr": "fast"}, 'lr = "fast" must be a number'),
                           ({"epochs": 1.5}, "epochs = 1.5 must be an integer"),
                           ({"freeze_bert": "yes"}, 'freeze_bert = "yes" must be true or false'),
                           ({"model": 3}, "model = 3 must be a string")):  # fmt: skip
        (tmp_path / "train_args.json").write_text(json.dumps(entry))
        with pytest.raises(ConfigError) as info:
            parse_args(["--out", str(tmp_path), "--resume"])
        assert message in str(info.value) and "train_args.json" in str(info.value), str(info.value)


def test_garbage_weights_file_in_model_is_named(tiny, tmp_path):
    from fastpals.train.command import parse_args
    from fastpals.train.optimizer_setup import build_model

    model = tmp_path / "model"
    shutil.copytree(tiny[1], model)
    (model / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    args = parse_args(common(tiny, tmp_path / "run"))
    args.model = str(model)
    with pytest.raises(ConfigError) as info:
        build_model(args)
    message = str(info.value)
    assert f"{model / 'model.safetensors'} is not a readable weights file" in message and "\n" not in message


def test_data_file_that_is_a_folder_or_a_symlink_loop_is_named(tiny, tmp_path):
    from fastpals.train.command import parse_args

    data = tmp_path / "data"
    shutil.copytree(tiny[0], data)
    train = data / "ids-sst-train.csv"
    train.unlink()
    train.mkdir()
    argv = common(tiny, tmp_path / "run")
    argv[argv.index("--data-dir") + 1] = str(data)
    with pytest.raises(ConfigError, match=rf"data file {train} is a folder, not a file"):
        parse_args(argv)
    train.rmdir()
    loop = data / "loop.csv"
    loop.symlink_to(train)
    train.symlink_to(loop)
    with pytest.raises(ConfigError, match=rf"data file {train} cannot be read \(Too many levels of symbolic"):
        parse_args(argv)


def test_unwritable_out_is_one_line(tmp_path, monkeypatch):
    from fastpals.train import outputs

    def refuse(path, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(outputs.os, "open", refuse)
    with pytest.raises(ConfigError) as info:
        RunLock(tmp_path / "run").acquire()
    assert "Read-only file system" in str(info.value) and "choose an --out" in str(info.value)


def test_predict_refuses_a_model_with_non_finite_weights(killed_and_resumed, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from fastpals.commands.predict import PredictError, _refuse_nonfinite, main

    best = tmp_path / "best"
    shutil.copytree(killed_and_resumed[1] / "best", best)
    assert main([str(best), "--task", "sst", "--text", "a good movie"]) == 0
    weights = load_file(str(best / "model.safetensors"))
    name = next(iter(weights))
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(best / "model.safetensors"))
    capsys.readouterr()
    assert main([str(best), "--task", "sst", "--text", "a good movie"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds non-finite weights" in err and "p=nan" not in err
    with pytest.raises(PredictError, match="2 non-finite output"):
        _refuse_nonfinite("sst", np.array([0.0, np.nan]), np.array([0.5, np.inf]))


def test_overwrite_also_clears_a_user_tasks_confusion_plot(tmp_path):
    from fastpals.train.outputs import discard_replaced, prepare_out

    out = tmp_path / "run"
    out.mkdir()
    for name in ("metrics.jsonl", "confusion_para.png", "confusion_mytask.png", "notes.txt"):
        (out / name).write_text(name)
    aside = prepare_out(out, resume=False, overwrite=True, is_main=True)
    assert sorted(p.name for p in aside.iterdir()) == [
        "confusion_mytask.png",
        "confusion_para.png",
        "metrics.jsonl",
    ]
    discard_replaced(aside)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# --- the run's manifest: --overwrite clears what the run wrote, nothing else --------------------------------------
def test_overwrite_clears_exactly_the_runs_manifest(tmp_path):
    """A run records every top-level name it creates in --out (``run_manifest.json``); ``--overwrite`` moves
    exactly those aside (any file name: a user task's plot, an extra file), never the user's own files, even one
    that looks like a run output."""
    from fastpals.train.outputs import MANIFEST_NAME, discard_replaced, entries, prepare_out, record_manifest

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "confusion_mine.png").write_text("the user's own plot, from before the run")
    before = entries(out)
    for name in ("metrics.jsonl", "confusion_mytask.png", "mytask_extra.tsv"):
        (out / name).write_text(name)
    (out / "best").mkdir()
    (out / ".lock").write_text("1 host")
    record_manifest(out, before)
    listed = json.loads((out / MANIFEST_NAME).read_text())["outputs"]
    assert listed == ["best", "confusion_mytask.png", "metrics.jsonl", "mytask_extra.tsv"]
    (out / ".lock").unlink()
    aside = prepare_out(out, resume=False, overwrite=True, is_main=True)
    assert sorted(p.name for p in aside.iterdir()) == sorted(listed + [MANIFEST_NAME])
    discard_replaced(aside)
    assert sorted(p.name for p in out.iterdir()) == ["confusion_mine.png", "notes.txt"]


def test_a_run_lists_its_outputs_in_the_manifest(killed_and_resumed):
    """The runs of the kill -9 fixture (one whole, one killed and resumed) list every name they wrote."""
    from fastpals.train.outputs import MANIFEST_NAME

    for out in killed_and_resumed[:2]:
        listed = json.loads((out / MANIFEST_NAME).read_text())["outputs"]
        assert {"metrics.jsonl", "results.json", "best", "checkpoints"} <= set(listed)
        assert set(listed) == {p.name for p in out.iterdir()} - {".lock", MANIFEST_NAME}


# --- the model and the tokenizer are opened before --out is touched -----------------------------------------------
@pytest.mark.parametrize("broken", ["missing", "no_tokenizer", "garbage_weights"])
def test_a_bad_model_or_tokenizer_is_refused_before_out_is_touched(tiny, tmp_path, broken):
    from fastpals.train.command import parse_args
    from fastpals.train.loop import Trainer

    model = tmp_path / "model"
    if broken != "missing":
        shutil.copytree(tiny[1], model)
        if broken == "no_tokenizer":
            (model / "vocab.txt").unlink()
        else:
            (model / "model.safetensors").write_bytes(b"not a safetensors file")
    out = tmp_path / "new" / "run"
    args = parse_args(tiny_run_args(tiny[0], model, out, "--no-progress"))
    with pytest.raises(ConfigError, match="--model"):
        Trainer(args)
    assert not out.exists() and not out.parent.exists()


# --- NaN outputs from finite weights --------------------------------------------------------------------------------
NAN_OUTPUTS = """
import sys
from fastpals.model.multitask import MultiTaskBert
forward = MultiTaskBert.forward
def overflowing(self, *args, **kwargs):  # finite weights, non-finite logits in evaluation (an overflow)
    out = forward(self, *args, **kwargs)
    if not self.training:
        out.logits = out.logits * float("inf")
    return out
MultiTaskBert.forward = overflowing
from fastpals.train.command import main
sys.exit(main(sys.argv[1:]))
"""


def test_nan_outputs_from_finite_weights_stop_the_run_in_one_line_and_are_not_saved(tiny, tmp_path):
    """Finite weights whose dev logits are NaN/inf never reach ``pearson`` (``ValueError: pearson got
    non-finite values``) nor score as class 0: one line, code 3, no best/."""
    out = tmp_path / "run"
    rc, _, err = run(common(tiny, out, "--steps-per-epoch", "2", "--eval-every", "1"), script=NAN_OUTPUTS)
    assert rc == 3, err[-3000:]
    one_line(err, "non-finite dev outputs (NaN/inf) of task", "after update step 1", "not saved as best/")
    assert "pearson" not in err
    assert not (out / "best").exists()
    records = strict_records(out / "metrics.jsonl")
    assert records[-1]["type"] == "nonfinite" and records[-1]["what"] == "outputs"
    assert not any(r["type"] == "eval" for r in records)
