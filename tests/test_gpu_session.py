"""The CPU plumbing of the one-command GPU session (bench/gpu_session.py): step selection, GPU steps skipped with
a reason, the result files (at most 8, merged across calls), and the commands each step would run."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import gpu_session  # noqa: E402

NO_GPU = pytest.mark.skipif(gpu_session.has_cuda()[0], reason="checks the no-GPU plumbing")


def test_steps_are_parsed_in_session_order():
    assert gpu_session.parse_steps("memory,env") == ["env", "memory"]
    with pytest.raises(Exception, match="unknown step"):
        gpu_session.parse_steps("env,lint")
    with pytest.raises(SystemExit):
        gpu_session.main(["--steps", "nope", "--out", "/nonexistent"])


def test_every_step_has_commands_writing_only_session_files(tmp_path):
    for name in gpu_session.STEPS:
        cmds = gpu_session.step_commands(name, str(tmp_path), "/tmp/site", python="python3")
        assert all(isinstance(c, list) and c for c in cmds)
    tests = gpu_session.step_commands("tests", str(tmp_path), "/s", python="python3")
    assert tests[0][-3:] == ["-m", "kernels or gpu", "tests"]
    memcheck, racecheck = gpu_session.step_commands("sanitizer", str(tmp_path), "/s", python="python3")
    assert memcheck[:3] == ["compute-sanitizer", "--tool", "memcheck"]
    assert racecheck[:3] == ["compute-sanitizer", "--tool", "racecheck"]
    peers, bench = gpu_session.step_commands("bench", str(tmp_path), "/s", python="python3")
    assert peers[:3] == ["python3", "-m", "bench.peers"] and "--shapes" not in peers
    assert f"--benchmark-json={tmp_path / 'bench.json'}" in bench
    validate, memory = gpu_session.step_commands("memory", str(tmp_path), "/s", python="python3")
    assert validate[:3] == ["python3", "-m", "bench.memory_validate"] and "--rehearse" not in validate
    assert "T4 16GB,A100 40GB,80GB A100/H100" in memory
    assert len(gpu_session.OUTPUT_FILES) <= 8
    with pytest.raises(ValueError, match="unknown step"):
        gpu_session.step_commands("lint", str(tmp_path), "/s")


@NO_GPU
def test_cpu_session_skips_gpu_steps_with_a_reason_and_writes_its_files(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [
            sys.executable,
            "bench/gpu_session.py",
            "--steps",
            "env,tests,sanitizer,bench,memory",
            "--state",
            str(tmp_path / "state"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(os.listdir(out))
    assert files == ["env.json", "session.json", "session.md"]
    session = json.loads((out / "session.json").read_text())
    assert session["device"] == "no GPU"
    steps = session["steps"]
    assert steps["env"]["status"] == "ok"
    for name in ("tests", "sanitizer", "bench", "memory"):
        assert steps[name]["status"] == "skipped"
        assert "no CUDA device" in steps[name]["reason"]
    env_info = json.loads((out / "env.json").read_text())
    assert env_info["dispatch"]["ops"]["pal"]["bf16"]["backend"] == "reference"
    md = (out / "session.md").read_text()
    assert "| tests | skipped |" in md and "| env | ok |" in md


@NO_GPU
def test_a_second_call_merges_into_the_session(tmp_path):
    out = str(tmp_path)
    assert gpu_session.main(["--steps", "tests", "--out", out]) == 0
    assert gpu_session.main(["--steps", "memory", "--out", out, "--budget-s", "0"]) == 0
    steps = json.loads((tmp_path / "session.json").read_text())["steps"]
    assert set(steps) == {"tests", "memory"}
    assert all(s["status"] == "skipped" for s in steps.values())


def test_spent_budget_skips_steps_that_could_run(tmp_path):
    result = gpu_session.run_step("env", str(tmp_path), "/s", dict(os.environ), deadline=0.0, dry_run=False)
    assert result.status == "skipped" and "--budget-s" in result.reason


def test_wheels_step_without_wheels_and_the_download_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_session, "ROOT", str(tmp_path))  # no .whl/ there
    assert gpu_session.step_commands("wheels", str(tmp_path), "/s") == []
    assert "no wheels" in gpu_session.skip_reason("wheels", (True, "GPU"))
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "deepspeed-0.18.0-py3-none-any.whl").write_bytes(b"")
    (cmd,) = gpu_session.step_commands("wheels", str(tmp_path), "/s", python="python3")
    assert cmd[:4] == ["python3", "-m", "pip", "install"] and "--no-index" in cmd and cmd[-1].endswith(".whl")
    assert gpu_session.main(["--download-wheels", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "DS_BUILD_OPS=0 pip wheel --no-deps" in printed and "deepspeed==0.19.8" in printed
    assert "pip download" in printed and "torchjd" in printed


def test_the_uninstalled_source_tree_finds_fastpals_kernels_through_the_site_link(tmp_path):
    site = str(tmp_path / "site")
    link = gpu_session.link_kernels(site)
    assert gpu_session.link_kernels(site) == link  # idempotent
    code = "import importlib.util as u; print(u.find_spec('fastpals_kernels').origin)"
    env = {**os.environ, "PYTHONPATH": site}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert os.path.samefile(out.stdout.strip(), os.path.join(gpu_session.ROOT, "kernels", "__init__.py"))


@NO_GPU
def test_rehearsal_runs_every_step_on_the_cpu_and_writes_the_sessions_files(tmp_path):
    """``--rehearse``: every step's real code path at tiny shapes (CI's proof that ``make gpu-session`` runs)."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "--rehearse", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    session = json.loads((out / "session.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr + json.dumps(session, indent=1)[-6000:]
    steps = session["steps"]
    assert session["device"] == "CPU rehearsal"
    for name in gpu_session.STEPS:
        expected = (
            "skipped" if name == "wheels" and not (gpu_session.glob.glob(ROOT + "/.whl/*.whl")) else "ok"
        )
        assert steps[name]["status"] == expected, (name, steps[name])
    files = sorted(os.listdir(out))
    assert set(files) - {"session.json", "session.md"} <= set(gpu_session.OUTPUT_FILES)
    assert {"env.json", "tests.log", "sanitizer.log", "bench.json", "peers.json", "memory.json"} <= set(files)
    assert len(files) <= 8
    assert "passed" in (out / "tests.log").read_text()
    peers = json.loads((out / "peers.json").read_text())
    rows = {r["row"]: r for r in peers["rows"]}
    assert set(rows) == {"pal_fp16", "pal_bf16", "pal_fp32", "packing", "pcgrad", "bandwidth_fp32",
                         "bandwidth_bf16", "sync", "memory", "many_tasks"}  # fmt: skip
    for r in rows.values():
        assert "error" not in r and r["cpu_figures"] and r["compares"] and r["goal"]
    assert rows["sync"]["met"] is True
    assert rows["pcgrad"]["ratio"] > 0 and rows["packing"]["ratio"] > 0
    many = rows["many_tasks"]  # plain / buffer / stream at T = 2 and 3 (CPU, tiny): times, no CUDA peaks
    assert set(many["tasks"]) == {"2", "3"} and many["ratio"] > 0 and many["ratio_vs_buffer_at_few"] > 0
    assert many["ratio_peak"] is None and many["met"] is None
    assert many["ratio_kept"] > 0 and many["ratio_peak_kept"] is None
    md = (out / "session.md").read_text()
    assert "Peers side by side" in md and "CPU figures" in md
    memory = {doc["suite"]: doc for doc in json.loads((out / "memory.json").read_text())}
    assert memory["memory_report"]["entries"][0]["max_batch"]
    # the planner against the real step (tiny MiniLM, fp32, live tensor bytes): every case, within 10%
    validation = memory["memory_validate"]
    assert validation["rehearsal"] is True and validation["measured_on"] == "cpu"
    assert validation["torch"] and "triton" in validation and validation["commit"] and validation["date"]
    cases = validation["entries"]
    assert [(e["precision"], e["surgery"]) for e in cases] == [("fp32", "none"), ("fp32", "pcgrad")]
    for e in cases:
        assert "error" not in e, e
        assert e["predicted_bytes"] > 0 and e["measured_bytes"] > 0 and e["measured_by"]
        assert e["ratio"] == e["predicted_bytes"] / e["measured_bytes"] and 0.9 <= e["ratio"] <= 1.1, e
    assert cases[1]["measured_bytes"] > cases[0]["measured_bytes"]  # the surgery buffer is measured


def test_sync_stand_in_catches_a_host_read():
    """The CPU stand-in of the sync row fails a step that reads a tensor value (so its pass means something)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench import peers

    def reads() -> None:
        with FakeTensorMode():
            torch.ones(3).sum().item()

    assert peers._sync_check(reads, torch.device("cpu"))["passed"] is False
    assert peers._sync_check(lambda: None, torch.device("cpu"))["passed"] is True


def test_calls_on_different_machines_merge(tmp_path):
    first, second, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    for d in (first, second):
        d.mkdir()
    ok = {"status": "ok", "reason": "", "seconds": 1.0, "returncode": 0, "commands": [], "log_tail": ""}
    skipped = {**ok, "status": "skipped", "reason": "budget", "returncode": None}
    (first / "session.json").write_text(
        json.dumps({"device": "H100", "steps": {"tests": ok, "bench": skipped}})
    )
    (first / "tests.log").write_text("first")
    (second / "session.json").write_text(
        json.dumps({"device": "H100", "steps": {"tests": skipped, "bench": ok}})
    )
    (second / "bench.json").write_text("{}")
    (second / "tests.log").write_text("not this one")
    assert gpu_session.main(["--merge", str(first), str(second), "--out", str(out)]) == 0
    steps = json.loads((out / "session.json").read_text())["steps"]
    assert steps["tests"]["status"] == "ok" and steps["bench"]["status"] == "ok"
    assert (out / "tests.log").read_text() == "first" and (out / "bench.json").exists()


@NO_GPU
def test_a_cut_call_keeps_its_finished_steps(tmp_path):
    """session.json is written after every step; with --state a later call returns the earlier call's files."""
    out1, out2, state = tmp_path / "o1", tmp_path / "o2", str(tmp_path / "state")
    assert gpu_session.main(["--steps", "env", "--out", str(out1), "--state", state]) == 0
    assert json.loads((out1 / "session.json").read_text())["steps"]["env"]["status"] == "ok"
    assert gpu_session.main(["--steps", "tests", "--out", str(out2), "--state", state]) == 0
    steps = json.loads((out2 / "session.json").read_text())["steps"]
    assert set(steps) == {"env", "tests"} and (out2 / "env.json").exists()
