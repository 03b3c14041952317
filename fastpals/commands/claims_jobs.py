"""The runs of ``fastpals claims`` as ``train.py`` subprocesses: how many run at once, their environment, running
a plan of them (finished runs skipped) and what each run scored."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fastpals import __version__
from fastpals.commands.memory import StepSpec, host_memory, plan_memory
from fastpals.train.command import parse_args

if TYPE_CHECKING:
    from fastpals.commands.claims import Arm

PROG = "fastpals claims"
#: what a run's process holds besides the tensors the planner counts: the CUDA context and allocator slack on a
#: GPU; the interpreter, torch, the data and the tokenizer on the CPU
GPU_PROCESS_BYTES = 1 << 30
CPU_PROCESS_BYTES = 3 << 29


def metric_value(dev: dict[str, float | None], metric: str) -> float:
    """A run's dev score on ``metric``: a task's metric, or ``overall`` = (SST + Quora + (STS r + 1) / 2) / 3 (an
    STS r of None/NaN, from constant predictions, counts as 0); NaN where a task is missing."""
    if metric != "overall":
        value = dev.get(metric)
        return math.nan if value is None else float(value)
    if not all(t in dev for t in ("sst", "para", "sts")):
        return math.nan
    r = dev["sts"]
    r = 0.0 if r is None or (isinstance(r, float) and math.isnan(r)) else float(r)
    if dev["sst"] is None or dev["para"] is None:
        return math.nan
    return (float(dev["sst"]) + float(dev["para"]) + (r + 1.0) / 2.0) / 3.0


def run_scores(arm: Arm, results: dict[str, Any]) -> dict[str, Any]:
    """What the table reads of a finished run's ``results.json``: ``dev`` (a learning-curve arm's best dev, any
    other arm's last evaluation, at its end), ``best_step`` and ``evals`` (``[[update, dev overall], ...]``)."""
    evals = [[e["step"], metric_value(e["dev"], "overall")] for e in results.get("evals") or []]
    curve = "--eval-every" in arm.options
    last = (results.get("evals") or [{"dev": results["dev"]}])[-1]["dev"]
    return {"dev": results["dev"] if curve else last, "best_step": results.get("best_step"), "evals": evals}


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def micro_batches_per_update(train_argv: Sequence[str]) -> int:
    """Micro-batches in one update of the run ``train_argv``: one per task with surgery, else ``--grad-accum``.
    Raises :class:`fastpals.train.errors.ConfigError` for bad options."""
    args = parse_args([*train_argv, "--out", "unused"])
    return len(args.task_list) if args.surgery != "none" else int(args.grad_accum)


def pick_jobs(per_run_bytes: int, free_bytes: int, cores: int, runs: int) -> int:
    """How many runs go at once: as many as 90% of ``free_bytes`` holds at ``per_run_bytes`` each, at most one per
    CPU core and one per run; at least 1."""
    by_memory = int(0.9 * free_bytes // per_run_bytes) if per_run_bytes > 0 else runs
    return max(1, min(by_memory, cores, runs))


def _option(argv: Sequence[str], name: str, default: str) -> str:
    """The last value of option ``name`` in ``argv`` (``--x v`` or ``--x=v``), else ``default``."""
    value = default
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _available_ram() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def auto_jobs(train_argv: Sequence[str], runs: int) -> tuple[int, str]:
    """``--jobs auto``: the runs that fit at once, from the memory planner's peak of one run (its model, batch and
    length with PALs and PCGrad, the heaviest arms) plus a process's own memory, against the GPU's free memory (on
    the CPU: the available RAM) and the CPU cores. Returns (jobs, how it was chosen)."""
    cuda = torch.cuda.is_available()
    ds = _option(train_argv, "--ds_config", _option(train_argv, "--ds-config", ""))
    precision = next((p for p in ("fp16", "bf16", "fp32") if p in ds), "bf16" if cuda else "fp32")
    spec = StepSpec(model=_option(train_argv, "--model", "minilm-l6"), precision=precision, pal="12heads",
                    max_length=int(_option(train_argv, "--max-length", "128")), surgery="pcgrad")  # fmt: skip
    peak = plan_memory(spec, int(_option(train_argv, "--batch-size", "16"))).peak_bytes
    if cuda:
        free, per_run, where = torch.cuda.mem_get_info()[0], peak + GPU_PROCESS_BYTES, "GPU memory free"
    else:
        free, per_run, where = _available_ram() or host_memory(), peak + CPU_PROCESS_BYTES, "RAM available"
    cores = cpu_cores()
    jobs = pick_jobs(per_run, free, cores, runs)
    return jobs, (f"--jobs auto: {jobs} (per run {per_run / 2**30:.2f} GiB = planner peak {peak / 2**30:.2f} GiB "
                  f"+ the process; {free / 2**30:.1f} GiB {where}; {cores} CPU cores; {runs} runs)")  # fmt: skip


def job_environment(jobs: int) -> dict[str, str]:
    """The variables every run gets when ``jobs`` run at once: the CPU cores split between them
    (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``), and one GPU for all (the first visible one)."""
    threads = str(max(1, cpu_cores() // jobs))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    env["CUDA_VISIBLE_DEVICES"] = "0" if visible is None else visible.split(",")[0]  # "": no GPU, kept
    return env


def train_command() -> list[str]:
    """The command that starts ``train.py``: the repository's ``train.py`` next to the package when present, else
    ``python -m fastpals.cli train`` (the same entry point)."""
    script = Path(__file__).resolve().parents[2] / "train.py"
    if script.is_file():
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "fastpals.cli", "train"]


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else the machine type)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, str]:
    """Where and with what the runs run: device, versions, commit and date."""
    try:
        commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU ({_cpu_name()}), {os.cpu_count()} cores")  # fmt: skip
    return {"device": device, "python": platform.python_version(), "torch": torch.__version__,
            "fastpals": __version__, "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    return f"{seconds // 60} min {seconds % 60:02d} s"


def _read_results(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "results.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _without_out(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--out DIR``."""
    argv = list(argv)
    i = argv.index("--out") if "--out" in argv else -1
    return argv[:i] + argv[i + 2 :] if i >= 0 else argv


def _check_earlier(run_dir: Path, argv: Sequence[str]) -> dict[str, Any] | None:
    """The ``claims_run.json`` of a finished run in ``run_dir`` (None when it has no ``results.json``); raises
    :class:`ValueError` when that run had other options."""
    if not (run_dir / "results.json").is_file():
        return None
    path = run_dir / "claims_run.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if _without_out(saved.get("argv") or []) != _without_out(argv):  # a moved claims folder still matches
        raise ValueError(f"{run_dir} holds a run with other options than {shlex.join(argv)}; use another --out or "
                         "move that folder")  # fmt: skip
    return saved


def _overall(results: dict[str, Any]) -> str:
    """A finished run's best dev overall, 4 digits."""
    value = metric_value(results["dev"], "overall")
    return "—" if math.isnan(value) else f"{value:.4f}"


def execute(
    plan: Sequence[tuple[str, int]],
    runs: dict[tuple[str, int], dict[str, Any]],
    command: list[str],
    runs_dir: Path,
    jobs: int,
    arms: Mapping[str, Arm],
    report: bool = False,
    keep_checkpoints: bool = False,
) -> int:
    """Run the ``(arm, seed)`` plan, ``jobs`` subprocesses at a time, filling each record of ``runs`` with the
    :func:`run_scores` of its ``results.json``. A finished run is skipped; ``report``: none starts. Returns 0, 1
    (a run failed), 2 (a folder holds another run) or 128 + signal (stopped)."""
    done_cost = done_s = 0.0
    remaining = sum(arms[a].cost for a, _ in plan)
    pending = []
    for i, (a, s) in enumerate(plan):
        record = runs[(a, s)]
        run_dir = runs_dir / run_name(a, s)
        try:
            saved = _check_earlier(run_dir, record["argv"])
        except ValueError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        if saved is None:
            pending.append((i, a, s))
            continue
        results = _read_results(run_dir)
        record.update(**run_scores(arms[a], results), status="done", seconds=saved.get("seconds"),
                      argv=saved["argv"], environment=saved.get("environment"),
                      command=saved.get("command") or shlex.join([*command, *saved["argv"]]))  # fmt: skip
        remaining -= arms[a].cost
        print(f"[claims] {i + 1}/{len(plan)} {run_name(a, s)}: finished earlier, skipped (dev overall "
              f"{_overall(results)})", file=sys.stderr, flush=True)  # fmt: skip
    if report:
        return 0
    runs_dir.mkdir(parents=True, exist_ok=True)
    # a run is its own one-process job: no rank or port of a launcher (or of an in-process run) leaks in
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(job_environment(jobs))
    session_env = environment()
    running: list[tuple[int, str, int, subprocess.Popen, float, Any]] = []
    status = 0
    try:
        while pending or running:
            while pending and len(running) < jobs:
                i, a, s = pending.pop(0)
                name = run_name(a, s)
                print(f"[claims] {i + 1}/{len(plan)} {name}: start ({runs[(a, s)]['updates']} updates): "
                      f"{runs[(a, s)]['command']}", file=sys.stderr, flush=True)  # fmt: skip
                log = open(runs_dir / f"{name}.log", "w")
                proc = subprocess.Popen([*command, *runs[(a, s)]["argv"]], stdout=log, stderr=subprocess.STDOUT,
                                        env=env)  # fmt: skip
                running.append((i, a, s, proc, time.perf_counter(), log))
            time.sleep(0.2)
            for item in [r for r in running if r[3].poll() is not None]:
                running.remove(item)
                i, a, s, proc, t0, log = item
                log.close()
                name, record, run_dir = run_name(a, s), runs[(a, s)], runs_dir / run_name(a, s)
                seconds = time.perf_counter() - t0
                code = proc.returncode
                remaining -= arms[a].cost
                if code < 0 or code in (130, 143):
                    print(f"{PROG}: the run {name} was stopped (exit {code}); a rerun starts it again",
                          file=sys.stderr)  # fmt: skip
                    status = 128 + (-code if code < 0 else code - 128)
                    pending.clear()
                    continue
                results = _read_results(run_dir) if code == 0 else None
                if results is None:
                    record["status"] = f"failed (exit {code}, see {log.name})"
                    status = max(status, 1)
                    print(f"[claims] {i + 1}/{len(plan)} {name}: FAILED (exit {code}); its output: {log.name}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    continue
                run_env = {**session_env, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
                saved = {"command": record["command"], "argv": record["argv"], "seconds": seconds,
                         "environment": run_env}  # fmt: skip
                (run_dir / "claims_run.json").write_text(json.dumps(saved))
                if not keep_checkpoints and (run_dir / "checkpoints").is_dir():
                    shutil.rmtree(run_dir / "checkpoints")
                record.update(
                    **run_scores(arms[a], results), status="done", seconds=seconds, environment=run_env
                )
                done_cost += arms[a].cost
                done_s += seconds
                eta = remaining * done_s / done_cost / max(1, jobs)
                print(f"[claims] {i + 1}/{len(plan)} {name}: done in {seconds:.0f} s, dev overall "
                      f"{_overall(results)}{'' if keep_checkpoints else ' (checkpoints/ removed, best/ kept)'}; "
                      f"ETA {fmt_time(eta)}", file=sys.stderr, flush=True)  # fmt: skip
    except KeyboardInterrupt:
        for item in running:
            item[3].wait()  # Ctrl-C reached them too: each checkpoints and stops
            item[5].close()
        print(f"{PROG}: stopped; the finished runs are kept and a rerun skips them", file=sys.stderr)
        return 130
    return status
