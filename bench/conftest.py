"""Session-level plumbing of the benchmark suites (``pytest bench/ --benchmark-only``).

The whole-training-step suite (``test_bench_steps.py``) appends one record per configuration to
:data:`STEP_RECORDS` through the ``step_records`` fixture. At the end of the session the records of the same
group (model, device, precision, T, batch, length) are put side by side: every variant's time and peak memory
against plain BERT and the named pairs of :data:`bench.training.PAIRS` (fused / reference, fastpals surgery /
Pytorch-PCGrad-style reference, surgery / its PAL step). The ratios come from one pytest session on one machine:
times from the group's interleaved test (all its configurations round robin, :data:`INTERLEAVED_RECORDS`) when it
ran, else each configuration's own median; peak memory from each configuration's own test. They are
printed in the terminal summary and, with ``FASTPALS_BENCH_WRITE=1``, written with the records to
``bench/results/steps_<cpu|cuda>_<UTC time>.json`` (then ``python -m bench.report`` rebuilds the report).
"""

from __future__ import annotations

from typing import Any

import pytest

STEP_RECORDS: list[dict[str, Any]] = []
INTERLEAVED_RECORDS: list[dict[str, Any]] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "train_step: whole training-step benchmark (bench/test_bench_steps.py)"
    )


@pytest.fixture(scope="session")
def step_records() -> list[dict[str, Any]]:
    """The session's list of training-step records (see ``bench/test_bench_steps.py`` for the fields)."""
    return STEP_RECORDS


@pytest.fixture(scope="session")
def interleaved_records() -> list[dict[str, Any]]:
    """The session's interleaved (round-robin) timings, one entry per group."""
    return INTERLEAVED_RECORDS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run each group's training-step tests, then its interleaved test, before the next group's (so that only
    one group's models are alive at a time). Other tests keep their order."""
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


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not STEP_RECORDS:
        return
    from bench.training import side_by_side

    rows = side_by_side(STEP_RECORDS, INTERLEAVED_RECORDS)
    tr = terminalreporter
    tr.section("training steps side by side (ratios from this session)")
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
