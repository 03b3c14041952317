"""The CPU dropout op, compiled one-pass kernel against its PyTorch reference (pytest-benchmark):
``pytest bench/test_bench_dropout.py --benchmark-only``.

Shapes of the main job (``make train``: MiniLM-L6 in bf16, 48 packed examples, about 1,300 tokens): a sublayer's
``dropout(x) + residual`` on ``[1300, 384]`` and the attention probabilities of one length bucket,
``[20, 12, 58, 58]``, each forward + backward. Both paths run round robin in one process
(``FASTPALS_BENCH_DROPOUT_ROUNDS``, default 30) with one torch thread; the table gives the medians and the ratio.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch

from bench.common import interleaved_times, results_header, should_write, write_results
from fastpals_kernels import dropout as ops

ROUNDS = int(os.environ.get("FASTPALS_BENCH_DROPOUT_ROUNDS", "30"))
CASES = {
    "sublayer [1300, 384] + residual": ((1300, 384), True),
    "attention [20, 12, 58, 58]": ((20, 12, 58, 58), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_dropout_vs_reference(benchmark, case, monkeypatch):
    if not ops.compiled_dropout():
        pytest.skip("the compiled dropout did not build here (no C++ compiler or ninja)")
    shape, with_residual = CASES[case]
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) if with_residual else None
    grad = torch.randn(shape, dtype=torch.bfloat16)

    def run(fused: bool) -> None:
        monkeypatch.setitem(ops._state, "ok", fused)
        ops.dropout_add(x, residual, 0.1).backward(grad)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, cpu = interleaved_times({"compiled": lambda: run(True), "reference": lambda: run(False)}, ROUNDS)
    finally:
        torch.set_num_threads(threads)
    compiled, reference = statistics.median(cpu["compiled"]), statistics.median(cpu["reference"])
    benchmark.extra_info.update(compiled_s=compiled, reference_s=reference, ratio=compiled / reference)
    benchmark.pedantic(run, args=(True,), rounds=1, iterations=1)
    print(
        f"\ndropout {case}, bf16, forward + backward, one thread: compiled {compiled * 1e3:.2f} ms, reference "
        f"{reference * 1e3:.2f} ms, compiled/reference {compiled / reference:.2f}x (CPU-time medians of {ROUNDS})"
    )
    if should_write():
        name = "dropout_" + case.split()[0]
        write_results(
            name, {**results_header(name), "rounds": ROUNDS, "compiled_s": compiled, "reference_s": reference}
        )
