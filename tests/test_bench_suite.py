"""The benchmark suites' run-level plumbing (``bench/conftest.py``): ``--benchmark`` runs only the benchmarks, the
``slow`` ones are left out unless ``-m`` asks for them, and every side-by-side table is printed at the end."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITE = """
import time

import pytest


def test_not_a_benchmark():
    pass


@pytest.mark.parametrize("seconds", [0.01, 0.04])
def test_pair(benchmark, seconds):
    benchmark.group = "pair"
    benchmark.pedantic(time.sleep, args=(seconds,), rounds=3, iterations=1)


def test_with_table(benchmark, ratio_table):
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    ratio_table("made-up comparison", ["variant a x1.00", "variant b x2.50"])


@pytest.mark.slow
def test_long(benchmark):
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
"""


def run_suite(tmp_path, *args):
    (tmp_path / "conftest.py").write_text("from bench.conftest import *  # noqa: F403\\n")
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(SUITE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), "-p", "no:cacheprovider", "-rs", *args],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("option", ["--benchmark", "--benchmark-only"])
def test_default_run_leaves_out_slow_and_prints_every_table(tmp_path, option):
    rc, out = run_suite(tmp_path, option)
    assert rc == 0, out[-3000:]
    assert "3 passed, 1 skipped, 1 deselected" in out, out[
        -3000:
    ]  # not_a_benchmark skipped, test_long left out
    assert "made-up comparison" in out and "variant b x2.50" in out
    summary = out[out.index("pair: medians side by side") :]
    ratio = float(summary.splitlines()[3].split()[-1])  # the 40 ms benchmark beside the 10 ms one
    assert 1.5 < ratio < 20, summary
    assert "1 long variants (marker slow) deselected: run them with -m slow" in out


def test_minus_m_slow_runs_the_long_ones(tmp_path):
    rc, out = run_suite(tmp_path, "--benchmark", "-m", "slow")
    assert rc == 0, out[-3000:]
    assert "1 passed, 4 deselected" in out, out[-3000:]
