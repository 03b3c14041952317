"""Session-level plumbing of the benchmark suites (``pytest bench/ --benchmark-only``, or ``--benchmark``).

- ``--benchmark`` is ``--benchmark-only`` (pytest-benchmark's option) under a shorter name.
- Long variants carry the marker ``slow``: without a ``-m`` expression they are deselected (the default run
  finishes in minutes on a 2-core CPU); ``-m slow`` runs them, ``-m "slow or not slow"`` runs everything.
- At the end of the run, the terminal summary prints every suite's side-by-side ratio table: the tables the
  suites hand to the ``ratio_table`` fixture, the training-step groups below, and, for every other named
  pytest-benchmark group of two or more benchmarks, each one's median beside the group's first.

The whole-training-step suite (``test_bench_steps.py``) appends one record per configuration to
:data:`STEP_RECORDS` through the ``step_records`` fixture. At the end of the run the records of the same
group (model, device, precision, T, batch, length) are put side by side: every variant's time and peak memory
against plain BERT and the named pairs of :data:`bench.training.PAIRS` (fused / reference, fastpals surgery /
Pytorch-PCGrad-style reference, surgery / its PAL step). The ratios come from one pytest run on one machine:
times from the group's interleaved test (all its configurations round robin, :data:`INTERLEAVED_RECORDS`) when it
ran, else each configuration's own median; peak memory from each configuration's own test. They are
printed in the terminal summary and, with ``FASTPALS_BENCH_WRITE=1``, written with the records to
``bench/results/steps_<cpu|cuda>_<UTC time>.json`` (then ``python -m bench.report`` rebuilds the report).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

STEP_RECORDS: list[dict[str, Any]] = []
INTERLEAVED_RECORDS: list[dict[str, Any]] = []
RATIO_TABLES: list[tuple[str, list[str]]] = []
SLOW_HINT = "long variants (marker slow) deselected: run them with -m slow"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--benchmark", action="store_true", default=False, help="run only the benchmarks (= --benchmark-only)"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "train_step: whole training-step benchmark (bench/test_bench_steps.py)"
    )
    if config.getoption("benchmark", default=False):
        config.option.benchmark_only = True


@pytest.fixture(scope="session")
def ratio_table() -> Callable[[str, list[str]], None]:
    """``ratio_table(title, lines)``: a suite's side-by-side table, printed in the terminal summary."""

    def add(title: str, lines: list[str]) -> None:
        RATIO_TABLES.append((title, list(lines)))

    return add


@pytest.fixture(scope="session")
def step_records() -> list[dict[str, Any]]:
    """The session's list of training-step records (see ``bench/test_bench_steps.py`` for the fields)."""
    return STEP_RECORDS


@pytest.fixture(scope="session")
def interleaved_records() -> list[dict[str, Any]]:
    """The session's interleaved (round-robin) timings, one entry per group."""
    return INTERLEAVED_RECORDS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``-m``, deselect the ``slow`` items. Run each group's training-step tests, then its interleaved
    test, before the next group's (so that only one group's models are alive at a time). Other tests keep their
    order."""
    if not config.option.markexpr:
        slow = [it for it in items if it.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [it for it in items if it.get_closest_marker("slow") is None]
            config._bench_slow_deselected = len(slow)  # type: ignore[attr-defined]
    positions = [i for i, it in enumerate(items) if it.nodeid.split("::")[0].endswith("test_bench_steps.py")]
    if not positions:
        return
    steps = [items[i] for i in positions]
    groups: list[tuple] = []

    def key(item: pytest.Item) -> tuple:
        params = getattr(getattr(item, "callspec", None), "params", {})
        group = (params.get("precision"), params.get("num_tasks"))
        if group not in groups:
            groups.append(group)
        return (groups.index(group), 1 if "interleaved" in item.name else 0)

    for i, it in zip(positions, sorted(steps, key=key)):
        items[i] = it


def _fmt_ratio(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:6.2f}"


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    tr = terminalreporter
    for title, lines in RATIO_TABLES:
        tr.section(title)
        for line in lines:
            tr.write_line(line)
    _group_ratios(tr, config)
    _step_ratios(tr)
    if getattr(config, "_bench_slow_deselected", 0):
        tr.write_line(f"{config._bench_slow_deselected} {SLOW_HINT}")  # type: ignore[attr-defined]


def _group_ratios(tr: Any, config: pytest.Config) -> None:
    """Each named pytest-benchmark group of two or more (training steps aside, which have their own table):
    every benchmark's median beside the group's first one's."""
    session = getattr(config, "_benchmarksession", None)
    groups: dict[str, list[tuple[str, float]]] = {}
    for bench in getattr(session, "benchmarks", None) or []:
        group, stats = getattr(bench, "group", None), getattr(bench, "stats", None)
        if not group or group.startswith("train-step") or stats is None or not getattr(stats, "rounds", 0):
            continue
        groups.setdefault(group, []).append((bench.name, stats.median))
    for group, rows in groups.items():
        if len(rows) < 2:
            continue
        tr.section(f"{group}: medians side by side")
        base_name, base = rows[0]
        tr.write_line(f"  {'benchmark':44s} {'median ms':>10s} {'x ' + base_name:>12s}")
        for name, median in rows:
            tr.write_line(f"  {name:44s} {median * 1e3:10.1f} {median / base:12.2f}")


def _step_ratios(tr: Any) -> None:
    if not STEP_RECORDS:
        return
    from bench.training import side_by_side

    rows = side_by_side(STEP_RECORDS, INTERLEAVED_RECORDS)
    tr.section("training steps side by side (ratios from this run)")
    for group in rows["groups"]:
        tr.write_line(f"{group['title']} (times: {group['timing']})")
        tr.write_line(
            f"  {'variant':24s} {'step ms':>9s} {'peak MiB':>9s} {'time/bert':>9s} {'mem/bert':>9s}"
        )
        for v in group["variants"]:
            peak = "n/a" if v["peak_bytes"] is None else f"{v['peak_bytes'] / 2**20:.0f}"
            tr.write_line(
                f"  {v['variant']:24s} {v['median_s'] * 1e3:9.1f} {peak:>9s} "
                f"{_fmt_ratio(v['time_vs_bert']):>9s} {_fmt_ratio(v['memory_vs_bert']):>9s}"
            )
        for pair in group["pairs"]:
            tr.write_line(
                f"  {pair['numerator']} / {pair['denominator']}: time {_fmt_ratio(pair['time_ratio'])}, "
                f"memory {_fmt_ratio(pair['memory_ratio'])}"
            )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not STEP_RECORDS:
        return
    from bench.common import should_write, write_results
    from bench.training import RATIO_METHOD, side_by_side

    if not should_write():
        return
    device_type = STEP_RECORDS[0]["device_type"]
    path = write_results(
        f"steps_{device_type}",
        {
            "suite": "train_steps",
            "ratio_method": RATIO_METHOD,
            "records": STEP_RECORDS,
            "interleaved": INTERLEAVED_RECORDS,
            "side_by_side": side_by_side(STEP_RECORDS, INTERLEAVED_RECORDS),
        },
    )
    session.config.get_terminal_writer().line(f"training-step results written to {path}")
