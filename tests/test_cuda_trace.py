"""One whole training update as a GPU would run it, traced on the CPU (:mod:`bench.cuda_trace`): fake tensors on
device ``cuda`` at BERT-base shapes (12 layers, 768 hidden, default PALs), the op library's dispatch resolving its
CUDA backends for sm_90 and sm_75, for plain training and one-backward surgery (PCGrad, UPGrad, MGDA, IMTL-G;
buffer and stream memory). A CPU tensor meeting a ``cuda`` one or a host read of a device value raises inside the
trace, so every update completing is the device and sync check. The same trace counts the kernels each update
launches; the counts are in docs/gpu-session.md (``## Launch counts``).

The traces run in one subprocess (the fake-CUDA runtime of :mod:`bench.fake_cuda` must load before torch, and
makes torch believe it was built with CUDA for the rest of that process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastpals.surgery.buffer import NUM_CHUNKS

ROOT = Path(__file__).resolve().parents[1]
SM90, SM75 = [9, 0], [7, 5]
AGGREGATORS = ("pcgrad", "upgrad", "mgda", "imtlg")
ALL_VARIANTS = [[None, "buffer"]] + [[a, m] for a in AGGREGATORS for m in ("buffer", "stream")]
CASES = [
    {"check": "guards"},
    {"tasks": 3, "capability": SM90, "variants": ALL_VARIANTS},
    {
        "tasks": 3,
        "capability": SM75,
        "variants": [[None, "buffer"], ["upgrad", "buffer"], ["mgda", "stream"]],
    },
    {
        "tasks": 16,
        "capability": SM90,
        "variants": [[None, "buffer"], ["pcgrad", "buffer"], ["pcgrad", "stream"]],
    },
    {"tasks": 3, "capability": SM90, "layers": 2, "variants": [["pcgrad", "buffer"], ["pcgrad", "stream"]]},
]


@pytest.fixture(scope="module")
def traces() -> list[dict]:
    """Every case of :data:`CASES` traced in one fresh interpreter; one dict per update (or check)."""
    code = (
        "import sys; from bench.fake_cuda import load_runtime; load_runtime(); "
        "from bench.cuda_trace import main; main(sys.argv[1:])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(CASES)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"the CUDA trace failed:\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _find(
    traces: list[dict], tasks: int, surgery: str | None, memory: str = "buffer", cap=SM90, layers=12
) -> dict:
    for row in traces:
        if (
            row.get("tasks") == tasks and row["surgery"] == surgery and row["capability"] == cap
            and row["layers"] == layers and (surgery is None or row["memory"] == memory)
        ):  # fmt: skip
            return row
    raise KeyError((tasks, surgery, memory, cap, layers))


def test_the_trace_catches_device_mismatches_and_host_reads(traces) -> None:
    """The guard itself (so the updates below cannot pass vacuously): a CPU tensor meeting a ``cuda`` one and a
    host read of a ``cuda`` value both raise inside :func:`bench.cuda_trace.fake_cuda`."""
    assert {"guards": "ok"} in traces


@pytest.mark.parametrize("cap", [SM90, SM75], ids=["sm90", "sm75"])
def test_every_update_runs_on_cuda_without_a_host_read(traces, cap) -> None:
    """Each traced update completed (no device mismatch, no host read) and launched the op library's CUDA ops:
    the PAL and the attention as custom ops (Triton on sm_90, SDPA inside them on sm_75), the grouped
    weight-gradient kernels on sm_90 only (sm_75 fp32 takes per-task cuBLAS matmuls; the buffer's writes
    straight into its rows, the stream's are its multi-Linear Gram and combine), the Gram and the combine as
    custom ops on both."""
    rows = [r for r in traces if r.get("capability") == cap and r.get("layers") == 12]
    expected = 9 if cap == SM90 else 3
    assert len([r for r in rows if r["tasks"] == 3]) == expected
    for row in rows:
        counts = row["counts"]
        assert counts.get("fastpals.attention_varlen", 0) == 12  # 12 layers, one launch each
        assert counts.get("fastpals.pal_varlen", 0) == 12
        if row["surgery"] is not None:
            grouped = sum(counts.get(f"fastpals.{op}", 0) for op in ("grouped_wgrad", "grouped_wgrad_out",
                                                                       "stream_linear_gram"))  # fmt: skip
            assert (grouped > 0) == (cap == SM90)
            assert row["gram"] > 0
            assert (row["combine"] > 0) == (row["memory"] == "buffer")


def test_buffer_gram_and_combine_launches_do_not_grow_with_the_parameter_tensors(traces) -> None:
    """The buffer's Gram and combine run over all shared parameters in one launch per chunk of its rows:
    BERT-base with 2 layers (39 shared parameter tensors) and with 12 (199) launch the same number; the linear
    layers' weight gradients go straight into the rows (one grouped launch per Linear, no copy)."""
    small, large = _find(traces, 3, "pcgrad", layers=2), _find(traces, 3, "pcgrad")
    assert (small["gram"], small["combine"]) == (large["gram"], large["combine"]) == (NUM_CHUNKS, NUM_CHUNKS)
    for row in (small, large):
        assert row["counts"]["fastpals.grouped_wgrad_out"] == 6 * row["layers"] + 1
        assert "fastpals.grouped_wgrad" not in row["counts"]


def test_stream_gram_and_combine_launches_do_not_grow_with_the_parameter_tensors(traces) -> None:
    """The stream mode's Gram and update on sm_90: every streamed Linear weight in one multi-Linear Gram and one
    multi-Linear combine launch, plus one Gram launch over all its small kept rows and T over its token-id
    embeddings (word and position; blocks of d / T columns, flat in memory): the same at 2 layers (13 streamed
    Linear weights) as at 12 (73). The
    backward computes no per-task gradient of those weights and biases: its per-task reductions are the
    LayerNorms' (two each; 2 per layer and the embeddings')."""
    rows = [_find(traces, 3, "pcgrad", "stream", layers=layers) for layers in (2, 12)]
    for row in rows:
        counts = row["counts"]
        assert counts["fastpals.stream_linear_gram"] == counts["fastpals.stream_linear_combine"] == 1
        assert "fastpals.grouped_wgrad" not in counts and "fastpals.grouped_wgrad_out" not in counts
        assert counts["aten.scatter_reduce_"] == 2 * (2 * row["layers"] + 1)
    assert rows[0]["gram"] == rows[1]["gram"] == 1 + 3


def _surgery_overhead(traces: list[dict], tasks: int, memory: str) -> float:
    plain, surgery = _find(traces, tasks, None), _find(traces, tasks, "pcgrad", memory)
    return (surgery["total"] - surgery["solve"]) / plain["total"] - 1


BUDGETS = [(3, 0.15), (16, 0.25)]


@pytest.mark.parametrize(("tasks", "budget"), BUDGETS)
def test_buffer_surgery_launch_budget(traces, tasks, budget) -> None:
    """Buffer-mode surgery (without the weight solve) adds at most 15% to the plain update's launches at T = 3,
    25% at T = 16."""
    assert _surgery_overhead(traces, tasks, "buffer") <= budget


@pytest.mark.parametrize(("tasks", "budget"), BUDGETS)
def test_stream_surgery_launch_budget(traces, tasks, budget) -> None:
    """The same budgets in stream mode."""
    assert _surgery_overhead(traces, tasks, "stream") <= budget
