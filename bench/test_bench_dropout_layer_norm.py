"""The residual + dropout + LayerNorm op, fused Triton kernels against the unfused reference (``dropout(x) +
residual``, then ``F.layer_norm``), on CUDA (pytest-benchmark): ``pytest bench/test_bench_dropout_layer_norm.py
--benchmark-only``. Skipped on the CPU, where the op IS the reference.

Shapes: a sublayer output of BERT-base (``[8 * 128, 768]``) and of MiniLM (``[1300, 384]``, the main job's packed
batch), forward + backward, bf16 dense output and fp32 residual as under autocast, and all-bf16. Both paths run
round robin in one process (``FASTPALS_BENCH_DROPOUT_LN_ROUNDS``, default 50); the table gives the medians and the
ratio.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch

from bench.common import interleaved_times, should_write, write_results
from fastpals_kernels.dropout_layer_norm import dropout_add_layer_norm, dropout_add_layer_norm_reference

ROUNDS = int(os.environ.get("FASTPALS_BENCH_DROPOUT_LN_ROUNDS", "50"))
CASES = {
    "BERT-base [1024, 768] autocast": ((1024, 768), torch.float32),
    "MiniLM [1300, 384] autocast": ((1300, 384), torch.float32),
    "BERT-base [1024, 768] bf16": ((1024, 768), torch.bfloat16),
}


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="on the CPU the op runs the reference: nothing to compare"
)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_vs_reference(benchmark, case, ratio_table, monkeypatch):
    monkeypatch.setenv("FASTPALS_KERNELS", "auto")
    (rows, d), residual_dtype = CASES[case]
    g = torch.Generator().manual_seed(0)

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=g).to("cuda", dtype).requires_grad_()

    x, residual = make((rows, d), torch.bfloat16), make((rows, d), residual_dtype)
    weight, bias = make((d,), torch.float32), make((d,), torch.float32)
    grad = torch.randn(rows, d, generator=g).to("cuda", torch.promote_types(torch.bfloat16, residual_dtype))

    def run(fn) -> None:
        fn(x, residual, weight, bias, 1e-12, 0.1, True).backward(grad)

    steps = {
        "fused": lambda: run(dropout_add_layer_norm),
        "reference": lambda: run(dropout_add_layer_norm_reference),
    }
    wall, _ = interleaved_times(steps, ROUNDS, torch.cuda.synchronize)
    fused, reference = statistics.median(wall["fused"]), statistics.median(wall["reference"])
    benchmark.extra_info.update(fused_s=fused, reference_s=reference, ratio=fused / reference)
    benchmark.pedantic(steps["fused"], rounds=1, iterations=1)
    line = (
        f"{case}, forward + backward: fused {fused * 1e6:.0f} us, reference {reference * 1e6:.0f} us, "
        f"fused/reference {fused / reference:.2f}x (wall-clock medians of {ROUNDS}, {torch.cuda.get_device_name()})"
    )
    ratio_table("dropout + residual + LayerNorm", [line])
    if should_write():
        name = "dropout_layer_norm_" + case.split()[0].lower().replace("-", "")
        write_results(name, {"rounds": ROUNDS, "fused_s": fused, "reference_s": reference})
