"""``fastpals claims`` (``docs/claims.md``): the findings' arms run as ``train.py`` subprocesses over several
seeds, then ``claims.md`` (paired 95% t-intervals and verdicts), ``claims.json`` and ``claims.png``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fastpals import __version__
from fastpals.commands.claims_findings import (
    ARMS,
    CONVERGED,
    EARLY,
    FINDINGS,
    QUICK,
    QUICK_FINDINGS,
    REFERENCE_ARMS,
    Arm,
    Budget,
    Finding,
    mean_sd,
    paired_interval,
    plan_runs,
    quick_finding,
    resolve_budget,
    run_argv,
    verdict,
)
from fastpals.commands.compare import OneLineErrorParser
from fastpals.commands.memory import StepSpec, plan_memory
from fastpals.train.command import parse_args
from fastpals.train.memory_mode import device_memory_bytes

__all__ = ["main", "plot_claims", "write_markdown"]

PROG = "fastpals claims"
#: options set by claims itself (per run)
RESERVED = ("--epochs", "--steps-per-epoch", "--out", "--resume", "--recipe", "--overwrite", "--seed")
#: a run whose last evaluation gained more than this over the previous one is "still improving"
IMPROVING = 0.005
#: per run (arm, seed), its record (options, command, status, scores; written to claims.json)
Runs = dict[tuple[str, int], dict[str, Any]]
#: what a run's process holds besides the tensors the planner counts: the CUDA context and allocator slack
#: on a GPU; the interpreter, torch, the data and the tokenizer on the CPU
GPU_PROCESS_BYTES = 1 << 30
CPU_PROCESS_BYTES = 3 << 29


def metric_value(dev: dict[str, float | None], metric: str) -> float:
    """A run's dev score on ``metric``: a task's metric, or ``overall`` = (SST + Quora + (STS r + 1) / 2) / 3 (an
    STS r of None/NaN, from constant predictions, counts as 0); NaN where a task is missing."""
    if metric != "overall":
        return math.nan if dev.get(metric) is None else float(dev[metric])
    if dev.get("sst") is None or dev.get("para") is None or "sts" not in dev:
        return math.nan
    r = 0.0 if dev["sts"] is None or math.isnan(dev["sts"]) else float(dev["sts"])
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


def _proc_field(path: str, key: str) -> str:
    """The value of ``key`` in a ``/proc`` file such as ``/proc/meminfo`` ("" where there is none)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), "")


def auto_jobs(train_argv: Sequence[str], runs: int) -> tuple[int, str]:
    """``--jobs auto``: the runs whose planner peak (PALs + PCGrad, the heaviest arms) plus a process fit the
    GPU's free memory (CPU: available RAM), at most one per core. Returns (jobs, how it was chosen)."""
    cuda = torch.cuda.is_available()
    ds = _option(train_argv, "--ds_config", _option(train_argv, "--ds-config", ""))
    precision = next((p for p in ("fp16", "bf16", "fp32") if p in ds), "bf16" if cuda else "fp32")
    spec = StepSpec(model=_option(train_argv, "--model", "minilm-l6"), precision=precision, pal="12heads",
                    max_length=int(_option(train_argv, "--max-length", "128")), surgery="pcgrad")  # fmt: skip
    peak = plan_memory(spec, int(_option(train_argv, "--batch-size", "16"))).peak_bytes
    if cuda:
        free, per_run, where = torch.cuda.mem_get_info()[0], peak + GPU_PROCESS_BYTES, "GPU memory free"
    else:
        free = int(_proc_field("/proc/meminfo", "MemAvailable:").split(" ")[0] or 0) * 1024
        free, per_run, where = free or device_memory_bytes("cpu"), peak + CPU_PROCESS_BYTES, "RAM available"
    cores = cpu_cores()
    jobs = pick_jobs(per_run, free, cores, runs)
    return jobs, (f"--jobs auto: {jobs} (per run {per_run / 2**30:.2f} GiB = planner peak {peak / 2**30:.2f} GiB "
                  f"+ the process; {free / 2**30:.1f} GiB {where}; {cores} CPU cores; {runs} runs)")  # fmt: skip


def job_environment(jobs: int) -> dict[str, str]:
    """The variables every run gets when ``jobs`` run at once: the CPU cores split between them
    (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``), and one GPU for all (the first visible one)."""
    threads = str(max(1, cpu_cores() // jobs))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = "0" if visible is None else visible.split(",")[0]  # "": no GPU, kept
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "CUDA_VISIBLE_DEVICES": gpu}


def train_command() -> list[str]:
    """The command that starts ``train.py``: the repository's ``train.py`` next to the package when present, else
    ``python -m fastpals.cli train`` (the same entry point)."""
    script = Path(__file__).resolve().parents[2] / "train.py"
    if script.is_file():
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "fastpals.cli", "train"]


def environment() -> dict[str, str]:
    """Where and with what the runs run: device, versions, commit and date."""
    try:
        commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    cpu = _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else f"CPU ({cpu}), {os.cpu_count()} cores"
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
    i = argv.index("--out") if "--out" in argv else len(argv)
    return [*argv[:i], *argv[i + 2 :]]


def _overall(results: dict[str, Any]) -> str:
    """A finished run's best dev overall, 4 digits."""
    value = metric_value(results["dev"], "overall")
    return "—" if math.isnan(value) else f"{value:.4f}"


def execute(runs: Runs, runs_dir: Path, jobs: int, keep_checkpoints: bool = False) -> int:
    """Run ``runs`` in order, ``jobs`` at a time (0: none, ``--report``), skipping finished ones, each record
    filled by :func:`run_scores`. Returns 0, 1 (a run failed), 2 (another run's folder) or 128 + signal."""
    plan, command = list(runs), train_command()
    done_cost = done_s = 0.0
    remaining = sum(ARMS[a].cost for a, _ in plan)
    pending = []
    for i, (a, s) in enumerate(plan):
        record, run_dir = runs[(a, s)], runs_dir / run_name(a, s)
        results, path = _read_results(run_dir), run_dir / "claims_run.json"
        if results is None:
            pending.append((i, a, s))
            continue
        saved = json.loads(path.read_text()) if path.is_file() else {}
        if _without_out(saved.get("argv") or []) != _without_out(
            record["argv"]
        ):  # a moved folder still matches
            print(f"{PROG}: error: {run_dir} holds a run with other options than {shlex.join(record['argv'])}"
                  "; use another --out or move that folder", file=sys.stderr)  # fmt: skip
            return 2
        record.update(**run_scores(ARMS[a], results), status="done", seconds=saved.get("seconds"),
                      argv=saved["argv"], environment=saved.get("environment"),
                      command=saved.get("command") or shlex.join([*command, *saved["argv"]]))  # fmt: skip
        remaining -= ARMS[a].cost
        print(f"[claims] {i + 1}/{len(plan)} {run_name(a, s)}: finished earlier, skipped (dev overall "
              f"{_overall(results)})", file=sys.stderr, flush=True)  # fmt: skip
    if jobs == 0:
        return 0
    runs_dir.mkdir(parents=True, exist_ok=True)
    # a run is its own one-process job: no rank or port of a launcher (or of an in-process run) leaks in
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env.update(PYTHONUNBUFFERED="1", **job_environment(jobs))
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
                remaining -= ARMS[a].cost
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
                record.update(**run_scores(ARMS[a], results), status="done", **saved)
                done_cost += ARMS[a].cost
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


def convergence_rows(runs: Runs, plan: Sequence[tuple[str, int]]) -> list[dict[str, Any]]:
    """Per finished run: its updates, the dev overall at its last two evaluations (``previous`` None when it was
    evaluated once), their difference and ``improving`` (the last gained more than :data:`IMPROVING`)."""
    rows = []
    for a, s in [key for key in plan if runs[key].get("evals")]:
        (prev_step, prev), (last_step, last) = ([[None, None]] + runs[(a, s)]["evals"])[-2:]
        gain = None if prev is None else last - prev
        rows.append({"arm": a, "seed": s, "updates": runs[(a, s)]["updates"], "previous_step": prev_step,
                     "previous": prev, "last_step": last_step, "last": last, "gain": gain,
                     "improving": gain is not None and gain > IMPROVING})  # fmt: skip
    return rows


def _collect(runs: Runs, arm: str, seeds: Sequence[int], metric: str) -> dict[int, float]:
    done = {s: run for s in seeds if (run := runs.get((arm, s))) and run.get("dev") is not None}
    if metric != "best_step":
        return {s: metric_value(run["dev"], metric) for s, run in done.items()}
    return {s: float(run["best_step"]) for s, run in done.items() if run.get("best_step") is not None}


def reference_scores(runs: Runs, seeds: Sequence[int], metric: str) -> dict[int, float]:
    """Per seed, the single-task runs' score on ``metric`` (``overall``: the three single-task models together)."""
    out = {}
    for s in seeds:
        devs = [run["dev"] for a in REFERENCE_ARMS if (run := runs.get((a, s))) and run.get("dev")]
        value = metric_value({k: v for dev in devs for k, v in dev.items() if k != "overall"}, metric)
        if not math.isnan(value):
            out[s] = value
    return out


def summarize(findings: Sequence[Finding], runs: Runs, seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Per finding: each arm's scores per seed, mean and sd; each comparison's paired interval and verdict
    over the seeds both finished (``better - worse``, negated for ``Finding.lower``: above 0 supports it)."""
    out = []
    for f in findings:
        arms = {}
        for a in f.arm_names():
            scores = _collect(runs, a, seeds, f.metric)
            mean, sd = mean_sd(list(scores.values()))
            arms[a] = {"label": ARMS[a].label, "scores": scores, "mean": mean, "sd": sd}
        comps = []
        for c in f.comparisons:
            both = [s for s in seeds if s in arms[c.better]["scores"] and s in arms[c.worse]["scores"]]
            pair = ([arms[c.better]["scores"][s] for s in both], [arms[c.worse]["scores"][s] for s in both])
            iv = paired_interval(*(pair[::-1] if f.lower else pair))
            v = "unfinished" if not both else verdict(iv)
            comps.append({"better": c.better, "worse": c.worse, "seeds": both, **iv, "verdict": v})
        ref = reference_scores(runs, seeds, f.metric) if f.metric != "best_step" else {}
        rmean, rsd = mean_sd(list(ref.values()))
        out.append({"finding": f, "arms": arms, "comparisons": comps,
                    "reference": {"scores": ref, "mean": rmean, "sd": rsd}})  # fmt: skip
    return out


def _num(x: float, digits: int = 3, sign: bool = False) -> str:
    if x is None or math.isnan(x):
        return "—"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def write_markdown(
    summary: list[dict[str, Any]],
    path: Path,
    header: str,
    seeds: Sequence[int],
    convergence: Sequence[dict[str, Any]] = (),
) -> Path:
    """``claims.md``: ``header``, the verdicts (marked where an arm was still improving), per finding its arms
    and comparisons, then the ``convergence`` rows (:func:`convergence_rows`)."""
    improving: dict[str, list[int]] = {}  # per arm, the seeds whose run was still improving at its end
    for r in convergence:
        if r["improving"]:
            improving.setdefault(r["arm"], []).append(r["seed"])

    def marks(*arms: str) -> str:
        return "; ".join(f"{a} still improving (seed {', '.join(map(str, improving[a]))})" for a in arms
                         if a in improving) or "—"  # fmt: skip

    lines = [header, "", "## Verdicts", "", "| finding | report | comparison (the claim) | metric "
             "| difference, 95% interval | seeds | verdict | still improving at the end |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for item in summary:
        f = item["finding"]
        op, d = ("<" if f.lower else ">"), (1 if f.metric == "best_step" else 3)
        for c in item["comparisons"]:
            lines.append(f"| {f.key} | {f.report} | {c['better']} {op} {c['worse']} | {f.metric} | {_num(c['mean'], d, sign=True)} "
                         f"[{_num(c['lo'], d, sign=True)}, {_num(c['hi'], d, sign=True)}] | {len(c['seeds'])} | **{c['verdict']}** "
                         f"| {marks(c['better'], c['worse'])} |")  # fmt: skip
    for item in summary:
        f = item["finding"]
        op, d = ("<" if f.lower else ">"), (1 if f.metric == "best_step" else 3)
        lines += ["", f"## {f.key} (report {f.report}): {f.claim}", "", ("Metric: the update of the best dev overall (best_step)." if f.metric == "best_step" else f"Metric: dev {f.metric}.") + (f" {f.note}." if f.note else ""), "",
                  "| arm | options | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± sd |",
                  "|---|---|" + "---|" * len(seeds) + "---|"]  # fmt: skip
        for a, info in item["arms"].items():
            cells = [_num(info["scores"][s], d) if s in info["scores"] else "not run" for s in seeds]
            lines.append(f"| {a}: {info['label']} | `{' '.join(ARMS[a].options)}` | " + " | ".join(cells)
                         + f" | {_num(info['mean'], d)} ± {_num(info['sd'], d)} |")  # fmt: skip
        ref = item["reference"]
        if ref["scores"]:
            cells = [_num(ref["scores"][s]) if s in ref["scores"] else "not run" for s in seeds]
            lines.append("| reference: single-task models | `" + " / ".join(" ".join(ARMS[a].options) for a in REFERENCE_ARMS)
                         + "` | " + " | ".join(cells) + f" | {_num(ref['mean'])} ± {_num(ref['sd'])} |")  # fmt: skip
        lines += ["", "| comparison | paired difference (mean ± sd) | 95% t-interval | seeds | verdict |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for c in item["comparisons"]:
            lines.append(f"| {c['better']} {op} {c['worse']} | {_num(c['mean'], d, sign=True)} ± {_num(c['sd'], d)} | "
                         f"[{_num(c['lo'], d, sign=True)}, {_num(c['hi'], d, sign=True)}] | {len(c['seeds'])} | {c['verdict']} |")  # fmt: skip
    if convergence:
        lines += ["", "## Convergence: dev overall at each run's last two evaluations", "",
                  f"A run is **still improving** where its last evaluation gained more than {IMPROVING} over the "
                  "previous one; a verdict on such an arm may change with a longer budget.", "",
                  "| run | updates | previous evaluation | last evaluation (end) | gain | |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in convergence:
            prev = "—" if r["previous"] is None else f"{_num(r['previous'], 4)} (update {r['previous_step']})"
            lines.append(f"| {run_name(r['arm'], r['seed'])} | {r['updates']} | {prev} | {_num(r['last'], 4)} (update "
                         f"{r['last_step']}) | {_num(r['gain'] if r['gain'] is not None else math.nan, 4, sign=True)} "
                         f"| {'**still improving**' if r['improving'] else ''} |")  # fmt: skip
    lines += ["", "overall = (SST acc + Quora acc + (STS r + 1) / 2) / 3 (an STS r of nan counts as 0). Quora dev = the "
              "held-out 10% (sha256 of id) split of quora-dev.csv. best_step = the update of a run's best dev overall. The "
              "paired difference (same seed) is first - second for a claim first > second, second - first for a claim "
              "first < second. A verdict holds when the 95% t-interval of the "
              "paired difference lies above 0, is reversed when it lies below 0, and is not resolved "
              "otherwise; unfinished: no seed has both arms."]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_claims(summary: list[dict[str, Any]], path: Path, title: str) -> Path:
    """``claims.png``: one panel per finding, one column per arm with a point per seed and a bar at the mean; the
    single-task reference as a dashed line."""
    n = max(1, len(summary))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    figure = Figure(figsize=(4.6 * cols, 3.6 * rows))
    FigureCanvasAgg(figure)
    for k, item in enumerate(summary):
        ax = figure.add_subplot(rows, cols, k + 1)
        arms = list(item["arms"])
        for i, a in enumerate(arms):
            scores = item["arms"][a]["scores"]
            xs = [i + 0.08 * (j - (len(scores) - 1) / 2) for j in range(len(scores))]
            ax.scatter(xs, list(scores.values()), s=14, color=f"C{i % 10}", zorder=3)
            if scores:
                ax.hlines(item["arms"][a]["mean"], i - 0.25, i + 0.25, color=f"C{i % 10}", linewidth=2)
        ref = item["reference"]
        if ref["scores"]:
            ax.axhline(ref["mean"], color="black", linestyle="--", linewidth=0.8, label="single-task models")
            ax.legend(fontsize=6, loc="best", frameon=False)
        ax.set_xlim(-0.5, len(arms) - 0.5)  # an arm without a finished run keeps its column
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=7)
        f = item["finding"]
        counts = [c["verdict"] for c in item["comparisons"]]
        verdicts = ", ".join(f"{counts.count(v)} {v}" for v in dict.fromkeys(counts))
        ax.set_title(f"{f.key}: {verdicts}", fontsize=8)
        ax.set_ylabel("update of the best dev" if f.metric == "best_step" else f"dev {f.metric}", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=90)
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, Finding):
        return {"key": x.key, "report": x.report, "claim": x.claim, "metric": x.metric, "note": x.note,
                "arms": list(x.arm_names())}  # fmt: skip
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def build_parser() -> argparse.ArgumentParser:
    """The options of ``fastpals claims``; every other option goes to every run (a ``train.py`` option)."""
    p = OneLineErrorParser(prog=PROG, allow_abbrev=False, usage=f"{PROG} [--budget early|converged|STEPS] [--seeds N] [--jobs N|auto] [--out DIR] [--quick] [train.py options]",
                description="Re-run the findings of the five CS224N reports: every arm for --budget with "
                "seeds 0..N-1, then claims.md, claims.json and claims.png in --out. Finished runs are kept and "
                "skipped on a rerun. Other options (e.g. --model, --data-dir, --max-length) go to every run, after "
                "the budget's defaults.")  # fmt: skip
    arg = p.add_argument
    arg("--budget", metavar="early|converged|STEPS",
        help=f"early: {EARLY.what} (the default on the CPU); converged: {CONVERGED.what} (the default "
        f"on a GPU); a number: that many updates, scored at the end (--quick: {QUICK.what})")  # fmt: skip
    arg("--seeds", type=int, metavar="N", help="seeds per arm (default: 3; --quick: 2)")
    arg("--out", default="runs/claims", metavar="DIR", help="output folder (default: runs/claims)")
    arg("--only", metavar="KEY,...", help="only these findings (keys in claims.md)")
    arg("--jobs", default="1", metavar="N|auto",
        help="runs at a time, all on one device, the CPU cores split between them; auto: as many as the "
        "memory planner's peak of one run fits in the GPU's free memory (CPU: RAM) and the cores "
        "(default: 1)")  # fmt: skip
    arg(
        "--report",
        action="store_true",
        help="train nothing: write the three files from the runs finished so far in --out",
    )
    arg("--no-reference", action="store_true", help="skip the single-task reference runs")
    arg("--keep-checkpoints", action="store_true",
        help="keep each finished run's checkpoints/ (default: removed once its results.json is written; "
        "best/ is kept)")  # fmt: skip
    arg("--quick", action="store_true",
        help=f"the pipeline check: findings {', '.join(QUICK_FINDINGS)}, 2 seeds, 4 updates, no "
        "reference runs (give --model/--data-dir for tiny ones)")  # fmt: skip
    return p


def _header(
    n_findings: int, budget: Budget, common: list[str], env: dict, runs: Runs, jobs: int, wall_s: float
) -> str:
    """The head of ``claims.md``: budget, seeds, common options, where and with what the runs ran, the wall time."""
    seeds = sorted({s for _, s in runs})
    unfinished = [run_name(a, s) for (a, s), r in runs.items() if r["dev"] is None]
    envs: dict[tuple, list[str]] = {}
    for e in [r["environment"] for r in runs.values() if r["environment"]]:
        key = (e.get("device"), e.get("python"), e.get("torch"), e.get("fastpals"), e.get("commit"))
        envs.setdefault(key, []).append(e.get("date", "?"))
    where = "; ".join(f"{n} run(s) on {k[0]}, python {k[1]}, torch {k[2]}, fastpals {k[3]}, commit {k[4]}, "
                      f"{min(d)} to {max(d)}" for k, d in envs.items() for n in [len(d)]) or "no run finished"  # fmt: skip
    updates = sorted({r["updates"] for r in runs.values()})
    return (
        f"# fastpals claims: {n_findings} finding(s), budget {budget.name} ({'/'.join(map(str, updates))} "
        f"updates per run), seeds {', '.join(map(str, seeds))}\n\n"
        f"**Budget: {budget.name}**: {budget.what}. The verdicts are about the model of these runs at this budget. "
        f"Every run: its arm's options, then `{' '.join(budget.defaults)} {' '.join(common)}`, one epoch of "
        f"{'/'.join(map(str, updates))} updates, its seed (the exact command lines: claims.json). Runs: {where}. "
        f"Table written {env['date']} (commit {env['commit']}). Runs finished: {len(runs) - len(unfinished)} of "
        f"{len(runs)}, {fmt_time(sum(r['seconds'] or 0.0 for r in runs.values()))} of run time; wall time of "
        f"this call {fmt_time(wall_s)} with {jobs} run(s) at a time"
        + (f"; **not finished**: {', '.join(unfinished)}." if unfinished else ".")
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fastpals claims``: 0 when every run finished, 1 when one failed (the table marks it), 2 for
    a bad option, 128 + signal when stopped (the finished runs are kept)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        build_parser().print_help()
        return 0
    opts, common = build_parser().parse_known_args(argv)
    try:  # every run's options are checked before the first starts
        bad = [a.split("=")[0] for a in common if a.split("=")[0] in RESERVED]
        if bad:
            raise ValueError(f"{', '.join(bad)} is set by claims itself (use --budget, --seeds, --out)")
        budget = resolve_budget(opts.budget, opts.quick)
        n_seeds = opts.seeds if opts.seeds is not None else (2 if opts.quick else 3)
        jobs = int(opts.jobs) if opts.jobs.isdigit() else -1 if opts.jobs != "auto" else 0
        if n_seeds < 1 or jobs < 0 or opts.jobs == "0":
            raise ValueError(
                f"--seeds and --jobs must be >= 1 (--jobs also auto), got {n_seeds}, {opts.jobs}"
            )
        keys = [f.key for f in FINDINGS]
        wanted = opts.only.split(",") if opts.only else keys
        if opts.quick and opts.only is None:
            wanted = QUICK_FINDINGS
        unknown = [k for k in wanted if k not in keys]
        if unknown:
            raise ValueError(f"--only {','.join(unknown)}: no such finding; the findings: {', '.join(keys)}")
        findings = [f for f in FINDINGS if f.key in wanted]
        if opts.quick:  # only the comparisons between the quick arms (any model depth, 2 arms per seed)
            findings = [quick_finding(f) for f in findings]
        seeds = list(range(n_seeds))
        if opts.quick and "--max-eval" not in common:
            common += ["--max-eval", "16"]
        # the exact data in every command line
        if "--data-dir" not in common and os.environ.get("FASTPALS_DATA_DIR"):
            common += ["--data-dir", os.environ["FASTPALS_DATA_DIR"]]
        out = Path(opts.out).resolve()
        runs_dir = out / "runs"
        plan = [(a, s) for a in plan_runs(findings, not (opts.no_reference or opts.quick)) for s in seeds]
        updates = {a: budget.arm_updates(micro_batches_per_update([*ARMS[a].options, *budget.defaults, *common]))
                   for a in dict.fromkeys(a for a, _ in plan)}  # fmt: skip
        argvs = {(a, s): run_argv(ARMS[a], s, updates[a], common, runs_dir / run_name(a, s), budget.defaults,
                                  budget.eval_every(updates[a])) for a, s in plan}  # fmt: skip
        for a, s in plan:
            parse_args(argvs[(a, s)])
    except ValueError as err:  # ConfigError too
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if jobs == 0:
        report = (1, "--jobs auto: 1 (--report)") if opts.report else None
        jobs, how = report or auto_jobs([*budget.defaults, *common], len(plan))
        print(f"[claims] {how}", file=sys.stderr, flush=True)
    command = train_command()
    runs = {(a, s): {"arm": a, "seed": s, "command": shlex.join([*command, *argvs[(a, s)]]),
                     "argv": argvs[(a, s)], "updates": updates[a], "dev": None, "best_step": None, "evals": [],
                     "status": "not run", "seconds": None, "environment": None} for a, s in plan}  # fmt: skip
    t_start = time.perf_counter()
    status = execute(runs, runs_dir, 0 if opts.report else jobs, opts.keep_checkpoints)
    if status == 2:
        return 2
    summary = summarize(findings, runs, seeds)
    env = environment()
    wall_s = time.perf_counter() - t_start
    earlier = out / "claims.json"
    # the table's wall time and runs at once stay those of the training call
    if opts.report and earlier.is_file():
        saved = json.loads(earlier.read_text())
        wall_s, jobs = saved.get("wall_s_this_session", wall_s), saved.get("jobs", jobs)
    header = _header(len(findings), budget, common, env, runs, jobs, wall_s)
    out.mkdir(parents=True, exist_ok=True)
    convergence = convergence_rows(runs, plan)
    write_markdown(summary, out / "claims.md", header, seeds, convergence)
    data = {"budget": dataclasses.asdict(budget), "seeds": seeds, "common": [*budget.defaults, *common],
            "environment": env, "jobs": jobs, "wall_s_this_session": wall_s, "convergence": convergence,
            "run_s_total": sum(r["seconds"] or 0.0 for r in runs.values()),
            "runs": list(runs.values()), "findings": summary}  # fmt: skip
    (out / "claims.json").write_text(json.dumps(_jsonable(data), indent=1))
    plot_claims(summary, out / "claims.png", f"fastpals claims: budget {budget.name}, {n_seeds} seed(s)")
    print(f"[claims] wrote {out / 'claims.md'}, {out / 'claims.json'}, {out / 'claims.png'}", file=sys.stderr)
    return status
