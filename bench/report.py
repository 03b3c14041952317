"""Rebuild the benchmark report from the results files: ``python -m bench.report [--results DIR] [--out DIR]``.

Reads ``bench/results/*.json`` and writes ``REPORT.md`` (Markdown tables) and PNG charts beside them:

- training steps (``suite: train_steps``, from ``pytest bench/ --benchmark-only`` with ``FASTPALS_BENCH_WRITE=1``):
  the newest file per device, one table per group (model, precision, T, shape) with each variant's step time,
  examples per second, peak memory and ratios to plain BERT, then the side-by-side pairs (fused / reference,
  fastpals / Pytorch-PCGrad-style reference); chart ``steps_<device>.png`` (time and peak memory per variant);
- memory report (``suite: memory_report``, from ``python -m bench.memory_report`` on a GPU): the newest file per
  device and precision, the largest batch that trains under each GPU's memory and the peak at batch 32; chart
  ``memory_<device>_<precision>.png``;
- every other results file (the PAL and surgery suites write their own): listed with its date, device and the
  ratios/speedups it holds.

Nothing is measured here: the report only reformats what the JSON files hold.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR

__all__ = ["build_report", "load_results", "main"]

VARIANT_LABELS = {
    "bert": "BERT (no PAL)",
    "pal_reference": "BERT + PAL, reference",
    "pal_fused": "BERT + PAL, fused",
    "pal_pcgrad_reference": "BERT + PAL + PCGrad, Pytorch-PCGrad-style reference",
    "pal_pcgrad_fastpals": "BERT + PAL + PCGrad, fastpals",
    "pal_gem_fastpals": "BERT + PAL + GEM, fastpals",
}


class ResultsError(ValueError):
    """A results file that cannot be used (bad JSON or missing fields); the message names the file."""


def load_results(results_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every ``*.json`` in ``results_dir`` (sorted by name), parsed. Raises :class:`ResultsError` naming the file
    that is not valid JSON or not a JSON object."""
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(doc, dict):
            raise ResultsError(f"{path}: expected a JSON object at the top level, got {type(doc).__name__}")
        out.append((path, doc))
    return out


def _require(doc: dict[str, Any], path: Path, *keys: str) -> None:
    missing = [k for k in keys if k not in doc]
    if missing:
        raise ResultsError(f"{path}: missing field(s) {', '.join(missing)}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:60] or "device"


def _newest(docs: list[tuple[Path, dict[str, Any]]], key: Any) -> list[tuple[Path, dict[str, Any]]]:
    """The newest document (by ``date``, then file name) for each value of ``key(doc)``."""
    best: dict[Any, tuple[Path, dict[str, Any]]] = {}
    for path, doc in docs:
        k = key(doc)
        if k not in best or (str(doc.get("date", "")), path.name) >= (
            str(best[k][1].get("date", "")),
            best[k][0].name,
        ):
            best[k] = (path, doc)
    return [best[k] for k in sorted(best, key=str)]


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f}"


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _source_line(path: Path, doc: dict[str, Any]) -> str:
    return (
        f"Source: `{path.name}` — {doc.get('device', 'unknown device')}, {doc.get('date', 'unknown date')}, "
        f"commit `{str(doc.get('commit', 'unknown'))[:12]}`"
    )


# ----------------------------------------------------------------------------------------------------------------
# training steps
# ----------------------------------------------------------------------------------------------------------------


def _steps_section(path: Path, doc: dict[str, Any], out_dir: Path) -> list[str]:
    _require(doc, path, "records", "side_by_side")
    lines = [f"### Training steps on {doc.get('device', 'unknown device')}", "", _source_line(path, doc), ""]
    if doc.get("ratio_method"):
        lines += [f"Ratios: {doc['ratio_method']}.", ""]
    records = {
        (r["model"], r["precision"], r["num_tasks"], r["batch"], r["length"], r["variant"]): r
        for r in doc["records"]
    }
    for group in doc["side_by_side"]["groups"]:
        key = group["key"]
        lines += [f"**{group['title']}** (times: {group.get('timing', 'each configuration alone')})", ""]
        lines += [
            "| configuration | PAL path | step (ms) | examples/s | peak memory (MiB) | time vs BERT | memory vs BERT |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for v in group["variants"]:
            r = records.get(
                (key["model"], key["precision"], key["num_tasks"], key["batch"], key["length"], v["variant"]),
                {},
            )
            lines.append(
                f"| {VARIANT_LABELS.get(v['variant'], v['variant'])} | {r.get('pal_path') or '—'} | "
                f"{v['median_s'] * 1e3:,.1f} | {key['batch'] / v['median_s']:,.1f} | {_mib(v['peak_bytes'])} | "
                f"{_x(v['time_vs_bert'])} | {_x(v['memory_vs_bert'])} |"
            )
        if group["pairs"]:
            lines += ["", "| side by side | time ratio | memory ratio |", "|---|---:|---:|"]
            for p in group["pairs"]:
                lines.append(
                    f"| {p['numerator']} / {p['denominator']} | {_x(p['time_ratio'])} | {_x(p['memory_ratio'])} |"
                )
        lines.append("")
    kinds = sorted({str(r.get("peak_kind")) for r in doc["records"]})
    lines += [f"Peak memory: {', '.join(kinds)}.", ""]
    loads = [r["load_average"] for r in doc["records"] if r.get("load_average") is not None]
    if loads:
        threads = sorted({r.get("torch_threads") for r in doc["records"] if r.get("torch_threads")})
        lines += [
            f"Machine load (1-minute load average at the end of each configuration): {min(loads):.1f} to "
            f"{max(loads):.1f}; torch threads: {', '.join(map(str, threads)) or 'unknown'}. A load above the "
            "core count means other processes shared the cores: compare ratios, not absolute times.",
            "",
        ]
    chart = out_dir / f"steps_{doc.get('device_type', 'device')}_{_slug(doc.get('device', ''))}.png"
    _steps_chart(doc, chart)
    lines += [f"![training steps]({chart.name})", ""]
    return lines


def _steps_chart(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = doc["side_by_side"]["groups"]
    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 1.6 * len(groups) + 5), 7.5), squeeze=False)
    variants = [v for v in VARIANT_LABELS if any(x["variant"] == v for g in groups for x in g["variants"])]
    width = 0.8 / max(1, len(variants))
    labels = [f"{g['key']['precision']} T={g['key']['num_tasks']}" for g in groups]
    panels = (
        ("median_s", 1e3, "step time (ms, log scale)", "{:,.0f}", True),
        ("peak_bytes", 1 / 2**20, "peak memory (MiB)", "{:,.0f}", False),
    )
    for row, (field, scale, ylabel, fmt, log) in enumerate(panels):
        ax = axes[row][0]
        for i, name in enumerate(variants):
            xs, ys = [], []
            for gi, g in enumerate(groups):
                for v in g["variants"]:
                    if v["variant"] == name and v[field] is not None:
                        xs.append(gi + (i - (len(variants) - 1) / 2) * width)
                        ys.append(v[field] * scale)
            color = f"C{list(VARIANT_LABELS).index(name)}"
            bars = ax.bar(xs, ys, width=width, label=VARIANT_LABELS[name], color=color)
            ax.bar_label(bars, labels=[fmt.format(y) for y in ys], fontsize=6, padding=1)
        if log:
            ax.set_yscale("log")
        ax.set_xticks(range(len(groups)), labels)
        ax.set_xlim(-0.5, len(groups) - 0.5)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_title(
        f"Training step, {groups[0]['key']['model'] if groups else ''} — {doc.get('device', '')}"
    )
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# memory report
# ----------------------------------------------------------------------------------------------------------------


def _memory_section(path: Path, doc: dict[str, Any], out_dir: Path) -> list[str]:
    _require(doc, path, "caps", "entries", "precision", "length")
    caps = doc["caps"]
    title = (
        f"### Largest batch ({doc['length']} tokens, {doc['precision']}) on {doc.get('device', 'unknown')}"
    )
    lines = [title, "", _source_line(path, doc), ""]
    if len(doc.get("merged_files", [])) > 1:
        lines += ["Merged from: " + ", ".join(f"`{n}`" for n in doc["merged_files"]), ""]
    if doc.get("method"):
        lines += [doc["method"], ""]
    head = "| configuration | T | peak at batch 32 (GiB) | " + " | ".join(
        f"{name} ({caps[name]['cap_bytes'] / 2**30:.1f} GiB)" for name in caps
    )
    lines += [head + " |", "|---|---:|---:|" + "---:|" * len(caps)]
    for e in doc["entries"]:
        cells = []
        for name in caps:
            res = e["max_batch"].get(name)
            if res is None or res.get("batch") is None:
                cells.append(res.get("note", "n/a") if res else "n/a")
            else:
                cells.append(f"{res['batch']:,}")
        lines.append(
            f"| {VARIANT_LABELS.get(e['variant'], e['variant'])} | {e['num_tasks']} | "
            f"{_gib(e.get('peak_at_32_bytes'))} | " + " | ".join(cells) + " |"
        )
    lines.append("")
    chart = out_dir / f"memory_{_slug(doc.get('device', ''))}_{doc['precision']}.png"
    _memory_chart(doc, chart)
    lines += [f"![largest batch]({chart.name})", ""]
    return lines


def _merge_memory(docs: list[tuple[Path, dict[str, Any]]]) -> list[tuple[Path, dict[str, Any]]]:
    """One document per (device, precision, length): the newest file's fields, with the entries of all its files
    merged (the newest entry per configuration wins: a GPU run may measure the configurations in parts)."""
    groups: dict[tuple, list[tuple[Path, dict[str, Any]]]] = {}
    for path, doc in docs:
        _require(doc, path, "caps", "entries", "precision", "length")
        groups.setdefault((str(doc.get("device")), doc["precision"], doc["length"]), []).append((path, doc))
    out = []
    for key in sorted(groups):
        files = sorted(groups[key], key=lambda pd: (str(pd[1].get("date", "")), pd[0].name))
        entries: dict[tuple, dict[str, Any]] = {}
        caps: dict[str, Any] = {}
        for _, doc in files:
            caps.update(doc["caps"])
            for e in doc["entries"]:
                entries[(e["variant"], e["num_tasks"])] = e
        order = {v: i for i, v in enumerate(VARIANT_LABELS)}
        merged = dict(files[-1][1])
        merged["caps"] = dict(sorted(caps.items(), key=lambda kv: kv[1]["cap_bytes"]))
        merged["entries"] = sorted(
            entries.values(), key=lambda e: (e["num_tasks"], order.get(e["variant"], 99))
        )
        merged["merged_files"] = [p.name for p, _ in files]
        out.append((files[-1][0], merged))
    return out


def _memory_chart(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = list(doc["caps"])
    entries = doc["entries"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(entries) + 3), 4.8))
    width = 0.8 / max(1, len(caps))
    for i, cap in enumerate(caps):
        xs, ys = [], []
        for k, e in enumerate(entries):
            res = e["max_batch"].get(cap) or {}
            if res.get("batch") is not None:
                xs.append(k + (i - (len(caps) - 1) / 2) * width)
                ys.append(res["batch"])
        bars = ax.bar(xs, ys, width=width, label=cap)
        ax.bar_label(bars, fontsize=6, padding=1)
    ax.set_xticks(
        range(len(entries)),
        [f"{e['variant']}\nT={e['num_tasks']}" for e in entries],
        fontsize=7,
        rotation=30,
        ha="right",
    )
    ax.set_ylabel(f"largest batch ({doc['length']} tokens)")
    ax.set_title(f"What fits: {doc['precision']} — measured on {doc.get('device', '')}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# other suites' files
# ----------------------------------------------------------------------------------------------------------------


def _ratio_items(value: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, number) for every number under a key naming a ratio or speedup."""
    items: list[tuple[str, float]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and re.search("ratio|speedup", key):
                items.append((key, float(v)))
            elif isinstance(v, dict):
                items.extend(_ratio_items(v, key))
    return items


def _other_section(files: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    lines = ["## Other results files", "", "| file | date | device | ratios |", "|---|---|---|---|"]
    for path, doc in files:
        device = doc.get("device_name") or doc.get("device") or "unknown"
        ratios = "; ".join(f"{k} = {v:.2f}" for k, v in _ratio_items(doc)[:12]) or "—"
        lines.append(f"| `{path.name}` | {doc.get('date', 'unknown')} | {device} | {ratios} |")
    lines.append("")
    return lines


def build_report(results_dir: Path | str = RESULTS_DIR, out_dir: Path | str | None = None) -> Path:
    """Write ``REPORT.md`` and the charts into ``out_dir`` (default: ``results_dir``); return the report's path."""
    results_dir = Path(results_dir)
    out_dir = Path(out_dir) if out_dir is not None else results_dir
    if not results_dir.is_dir():
        raise FileNotFoundError(f"results folder {results_dir} does not exist")
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = load_results(results_dir)
    steps = [(p, d) for p, d in docs if d.get("suite") == "train_steps"]
    memory = [(p, d) for p, d in docs if d.get("suite") == "memory_report"]
    others = [(p, d) for p, d in docs if d.get("suite") not in ("train_steps", "memory_report")]
    lines = [
        "# fastpals benchmark report",
        "",
        "Generated by `python -m bench.report` from `bench/results/*.json` (newest file per device for each "
        "suite). Regenerate after `FASTPALS_BENCH_WRITE=1 pytest bench/ --benchmark-only` or "
        "`python -m bench.memory_report`.",
        "",
        "## Memory: what fits where",
        "",
    ]
    if memory:
        for path, doc in _merge_memory(memory):
            lines += _memory_section(path, doc, out_dir)
    else:
        lines += ["No memory report yet: `python -m bench.memory_report` needs a CUDA GPU.", ""]
    lines += ["## Training steps", ""]
    if steps:
        for path, doc in _newest(steps, lambda d: d.get("device")):
            lines += _steps_section(path, doc, out_dir)
    else:
        lines += ["No training-step results yet.", ""]
    if others:
        lines += _other_section(others)
    report = out_dir / "REPORT.md"
    report.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS_DIR), help="folder of the *.json results files")
    parser.add_argument(
        "--out", default=None, help="where to write REPORT.md and the PNGs (default: --results)"
    )
    args = parser.parse_args(argv)
    try:
        path = build_report(args.results, args.out)
    except (ResultsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
