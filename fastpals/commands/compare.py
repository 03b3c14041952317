"""``fastpals compare RECIPE... --budget STEPS``: recipes trained one after the other in this process with the
same ``train.py`` options; writes ``compare.md``, ``compare.json`` and ``compare.png`` to ``--out``."""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fastpals.data.metrics import overall
from fastpals.train.args import recipe_names
from fastpals.train.command import parse_args
from fastpals.train.errors import ConfigError, NonFiniteLossError, OutputError, TrainingInterrupted
from fastpals.train.loop import Trainer
from fastpals.train.outputs import finite_or_null

__all__ = ["SCORE_COLUMNS", "compare_rows", "main", "plot_compare", "write_markdown"]

SCORE_COLUMNS = (("sst", "SST acc"), ("para", "Quora acc*"), ("sts", "STS r"), ("cfimdb", "CFIMDB acc"))
PROG = "fastpals compare"
RESERVED = ("--epochs", "--steps-per-epoch", "--out", "--resume", "--recipe", "--overwrite")


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line pointing at ``--help`` (``fastpals compare`` and ``claims``)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``fastpals compare`` itself; every other option is a common ``train.py`` option."""
    p = OneLineErrorParser(
        prog=PROG,
        usage=f"{PROG} RECIPE [RECIPE ...] --budget STEPS [--out DIR] [--max-eval N] [train.py options]",
        description="Train each recipe for one epoch of STEPS updates on the same data and seed, then write "
        f"compare.md, compare.json and compare.png in --out. Recipes: all, {', '.join(recipe_names())}, or "
        "JSON files. Other options (e.g. --model, --batch-size, --max-length, --seed, --data-dir) go to every run.",
    )
    arg = p.add_argument
    arg("--budget", type=int, required=True, metavar="STEPS", help="updates per recipe (one epoch)")
    arg("--out", default="runs/compare", metavar="DIR", help="output folder (default: runs/compare)")
    arg("--max-eval", type=int, metavar="N", help="dev examples per task (default: all)")
    arg("--max-predict", type=int, default=8, metavar="N",
        help="test predictions per task written by each run (default: 8)")  # fmt: skip
    return p


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """Leading non-option words are the recipes; the rest are options."""
    i = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    return argv[:i], argv[i:]


def _examples(run_dir: Path) -> int:
    """Training examples of a run, from its ``metrics.jsonl`` step records."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return round(sum(r["examples_per_s"] * r["seconds"] for r in records if r.get("type") == "step"))


def _overall3(dev: dict[str, float]) -> float:
    if all(t in dev for t in ("sst", "para", "sts")):
        return overall({t: dev[t] for t in ("sst", "para", "sts")})
    return None


def compare_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table rows of ``runs`` (``{"recipe", "results", "error", "seconds", "examples"}``): the first step-0
    score (``kind`` ``untrained``), one ``recipe`` row per run, and a ``single`` row combining the
    ``single_<task>`` recipes. A row: ``name``, ``scores``, ``overall`` (None unless SST, Quora, STS),
    ``steps``, ``examples``, ``train_s``, ``total_s``, ``error``, ``kind``."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        untrained = (run.get("results") or {}).get("untrained_dev")
        if untrained:
            scores = {k: v for k, v in untrained.items() if k != "overall"}
            rows.append({"name": f"untrained ({run['recipe']}, step 0)", "kind": "untrained", "scores": scores,
                         "overall": _overall3(scores), "steps": 0, "examples": 0, "train_s": None,
                         "total_s": None, "error": None})  # fmt: skip
            break
    for run in runs:
        res = run.get("results") or {}
        scores = {k: v for k, v in (res.get("dev") or {}).items() if k != "overall"}
        timings = res.get("timings") or {}
        rows.append({"name": run["recipe"], "kind": "recipe", "scores": scores, "overall": _overall3(scores),
                     "steps": res.get("steps", 0), "examples": run.get("examples", 0),
                     "train_s": timings.get("train_s"), "total_s": run.get("seconds"),
                     "error": run.get("error")})  # fmt: skip
    one = [r for r in rows if r["kind"] == "recipe" and Path(r["name"]).stem.startswith("single_")]
    one = [r for r in one if len(r["scores"]) == 1 and not r["error"]]
    if one:
        singles = {k: v for r in one for k, v in r["scores"].items()}
        rows.append({"name": "single-task (" + " + ".join(f"single_{t}" for t in singles) + ")", "kind": "single",
                     "scores": singles, "overall": _overall3(singles),
                     "train_s": sum((r["train_s"] or 0.0 for r in one), 0.0),
                     "total_s": sum((r["total_s"] or 0.0 for r in one), 0.0),
                     "steps": sum(r["steps"] for r in one), "examples": sum(r["examples"] for r in one),
                     "error": None})  # fmt: skip
    return rows


def _fmt(value: float | None, digits: int = 3) -> str:
    """``—`` for a missing value (None), ``nan`` for a measured NaN (e.g. Pearson r of constant predictions)."""
    return "—" if value is None else f"{value:.{digits}f}"


def write_markdown(rows: list[dict[str, Any]], path: Path, header: str) -> Path:
    """``compare.md``: ``header`` then the table (a CFIMDB column only when a row has that task)."""
    cols = [(k, n) for k, n in SCORE_COLUMNS if k != "cfimdb" or any(k in r["scores"] for r in rows)]
    names = " | ".join(n for _, n in cols)
    lines = [header, "", f"| recipe | {names} | overall† | updates | examples | train s | total s |"]
    lines.append("|---" * (len(cols) + 6) + "|")
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['name']} | failed: {r['error']} |" + " |" * (len(cols) + 4))
            continue
        cells = [_fmt(r["scores"].get(k)) for k, _ in cols]
        lines.append(
            f"| {r['name']} | " + " | ".join(cells)
            + f" | {_fmt(r['overall'])} | {r['steps']} | {r['examples']} | {_fmt(r['train_s'], 1)} "
            f"| {_fmt(r['total_s'], 1)} |"
        )  # fmt: skip
    lines += [
        "",
        "\\* Quora dev = the held-out 10% (sha256 of id) split of quora-dev.csv; the runs train on the rest.  ",
        "† overall = (SST + Quora + (STS r + 1) / 2) / 3 over these three tasks only (CFIMDB not included; an STS r "
        "of nan, from constant predictions, counts as 0); — where a task is missing.  ",
        "train s: the updates; total s: the whole run (set-up, evaluation, test predictions).",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_compare(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """``compare.png``: one group of bars per dev metric (tasks and overall), one bar per row (the single-task
    recipes' own rows are drawn as their combined ``single-task`` row)."""
    shown = [r for r in rows if not r["error"] and not (r["kind"] == "recipe" and Path(r["name"]).stem.startswith(
        "single_") and any(x["kind"] == "single" for x in rows))]  # fmt: skip
    cols = [c for c in SCORE_COLUMNS if any(c[0] in r["scores"] for r in shown)] + [("overall", "overall†")]
    figure = Figure(figsize=(max(7.0, 1.2 + 0.35 * len(shown) * len(cols)), 4.8))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(shown))
    for i, r in enumerate(shown):
        values = [r["overall"] if k == "overall" else r["scores"].get(k) for k, _ in cols]
        values = [math.nan if v is None else v for v in values]
        xs = [j - 0.4 + width * (i + 0.5) for j in range(len(cols))]
        color = "0.6" if r["kind"] == "untrained" else ("black" if r["kind"] == "single" else f"C{i % 10}")
        ax.bar(xs, values, width=width, label=r["name"], color=color)
    ax.set_xticks(range(len(cols)), [n for _, n in cols])
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_ylabel("dev score (accuracy / Pearson r)")
    ax.set_title(title, fontsize=9)
    if shown:  # all runs failed: an empty chart (the table says why)
        figure.legend(loc="lower center", ncol=min(4, len(shown)), fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, min(0.4, 0.05 * math.ceil(len(shown) / 4) + 0.02), 1, 1))  # legend rows
    figure.savefig(path, format="png", dpi=100)
    return path


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fastpals compare``; 0 when every run finished, 1 when one failed (its row says why), 2 for
    a bad option or recipe (before any run starts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        build_parser().print_help()
        return 0
    recipes, rest = _split(argv)
    opts, common = build_parser().parse_known_args(rest)
    recipes = [n for r in recipes for n in (recipe_names() if r == "all" else [r])]
    bad = [a.split("=")[0] for a in common if a.split("=")[0] in RESERVED]
    out = Path(opts.out)
    argvs = []
    for i, name in enumerate(recipes):
        run_argv = ["--recipe", name, *common, "--epochs", "1", "--steps-per-epoch", str(opts.budget),
                    "--out", str(out / Path(name).stem), "--overwrite", "--max-predict", str(opts.max_predict)]  # fmt: skip
        if opts.max_eval is not None:
            run_argv += ["--max-eval", str(opts.max_eval)]
        if i == 0 and "--eval-at-start" not in common:
            run_argv.append("--eval-at-start")
        argvs.append(run_argv)
    try:  # every recipe is checked before the first run starts
        if not recipes:
            raise ValueError(f"name at least one recipe (or all): {', '.join(recipe_names())}")
        if bad:
            raise ValueError(f"{', '.join(bad)} is set by compare itself (use --budget, --out)")
        if opts.budget < 1:
            raise ValueError(f"--budget must be >= 1, got {opts.budget}")
        if len(set(recipes)) != len(recipes):
            raise ValueError(f"a recipe is listed twice: {recipes}")
        parsed = [parse_args(a) for a in argvs]
    except ValueError as err:  # ConfigError too
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2

    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    status = 0
    for i, (name, args) in enumerate(zip(recipes, parsed)):
        print(f"[compare] {i + 1}/{len(recipes)} {name}: start ({opts.budget} updates, out {args.out})",
              file=sys.stderr, flush=True)  # fmt: skip
        t0 = time.perf_counter()
        run: dict[str, Any] = {"recipe": name, "results": None, "error": None}
        try:
            run["results"] = Trainer(args).run()
        except (ConfigError, NonFiniteLossError, OutputError) as err:
            run["error"] = str(err).replace("|", "/")
            status = 1
        except TrainingInterrupted as err:
            print(f"{PROG}: {err}; the table holds the runs finished so far", file=sys.stderr)
            status = 128 + err.signum
            break
        finally:
            gc.collect()
        run["seconds"] = time.perf_counter() - t0
        run["examples"] = _examples(Path(args.out))
        runs.append(run)
        overall = (run["results"] or {}).get("dev", {}).get("overall")
        end = f"failed: {run['error']}" if run["error"] else f"dev overall {overall:.4f}"
        print(f"[compare] {i + 1}/{len(recipes)} {name}: done in {run['seconds']:.1f} s, {end}", file=sys.stderr,
              flush=True)  # fmt: skip
    rows = compare_rows(runs)

    first = parsed[0]
    cpu = f"CPU, {torch.get_num_threads()} threads of {os.cpu_count()} cores"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu
    header = (
        f"# fastpals compare: {len(runs)} recipe(s), {opts.budget} updates each\n\n"
        f"Same data and seed for every run: model {first.model}, seed {first.seed}, batch size {first.batch_size}, "
        f"max length {first.max_length}, dev examples per task: {first.max_eval or 'all'}; common options: "
        f"`{' '.join(common) or '(none)'}`. Device: {device}, torch {torch.__version__}."
    )
    write_markdown(rows, out / "compare.md", header)
    (out / "compare.json").write_text(
        json.dumps({"budget": opts.budget, "common": common, "rows": finite_or_null(rows)}, indent=2)
    )
    plot_compare(rows, out / "compare.png", f"dev scores after {opts.budget} updates per recipe")
    written = ", ".join(str(out / f"compare.{ext}") for ext in ("md", "json", "png"))
    print(f"[compare] wrote {written}", file=sys.stderr)
    return status
