"""The CPU attention over packed rows, compiled kernel (``packed_attention``) against the length-bucketed matmul
attention it replaces (pytest-benchmark): ``pytest bench/test_bench_packed_attention.py --benchmark-only``.

Shapes of the main job (``make train``: MiniLM-L6 in bf16, 48 packed sequences of 5 to 69 tokens, about 1,300
tokens): BERT's 12 heads of 32 and a PAL's 6 heads of 34, forward + backward with dropout 0.1. Both paths run round
robin in one process (``FASTPALS_BENCH_ATTENTION_ROUNDS``, default 20) with the process's torch threads, each round
on new sequence lengths as training's updates are (``FASTPALS_BENCH_ATTENTION_FRESH=0``: one micro-batch's lengths
every round); the table gives the wall-time medians and the ratio.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch

from bench.common import interleaved_times, results_header, should_write, write_results
from fastpals_kernels import attention_varlen as ops
from fastpals_kernels.padding import attention_plan

ROUNDS = int(os.environ.get("FASTPALS_BENCH_ATTENTION_ROUNDS", "20"))
FRESH = os.environ.get("FASTPALS_BENCH_ATTENTION_FRESH", "1") != "0"
#: the sequence lengths of one of make train's micro-batches (sorted)
LENGTHS = [69, 64, 57, 51, 49, 47, 45, 43, 40, 38, 37, 35, 34, 33, 32, 31, 30, 29, 28, 27, 27, 26, 25, 24, 23, 22,
           21, 21, 20, 19, 18, 18, 17, 16, 15, 14, 13, 13, 12, 11, 10, 10, 9, 8, 8, 7, 6, 5]  # fmt: skip
CASES = {"BERT 12 x 32": (12, 32), "PAL 6 x 34": (6, 34)}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_attention_vs_buckets(benchmark, case):
    if not ops.compiled_attention():
        pytest.skip("the compiled attention did not build here (no C++ compiler or ninja)")
    heads, head_dim = CASES[case]
    g = torch.Generator().manual_seed(0)
    batches = []
    for r in range(ROUNDS + 1 if FRESH else 1):
        lengths = (
            LENGTHS if r == 0 else [max(1, n + int(torch.randint(-4, 5, (), generator=g))) for n in LENGTHS]
        )
        order = torch.randperm(len(lengths), generator=g).tolist()  # packed in sampling order, not by length
        cu = torch.tensor([0, *torch.tensor([lengths[i] for i in order]).cumsum(0).tolist()])
        n = int(cu[-1])
        qkv = torch.randn(n, 3, heads, head_dim, generator=g).to(torch.bfloat16).requires_grad_(True)
        grad = torch.randn(n, heads, head_dim, generator=g).to(torch.bfloat16)
        batches.append((cu, qkv, grad, attention_plan(cu)))
    turns = {"compiled": 0, "buckets": 0}

    def next_batch(path: str) -> tuple:
        turns[path] += 1
        return batches[turns[path] % len(batches)]

    def compiled() -> None:
        cu, qkv, grad, plan = next_batch("compiled")
        ops.packed_attention(*qkv.unbind(1), cu, 0.1, plan=plan).backward(grad)

    def buckets() -> None:
        cu, qkv, grad, plan = next_batch("buckets")
        attend = lambda qb, kb, vb, b: ops.padded_attention(qb, kb, vb, b.mask, 0.1, key_bias=b.key_bias)  # noqa: E731
        ops.bucketed_attention(*qkv.unbind(1), plan, attend).backward(grad)

    wall, _ = interleaved_times({"compiled": compiled, "buckets": buckets}, ROUNDS)
    n = int(batches[0][0][-1])
    new, old = statistics.median(wall["compiled"]), statistics.median(wall["buckets"])
    benchmark.extra_info.update(compiled_s=new, buckets_s=old, ratio=new / old)
    benchmark.pedantic(compiled, rounds=1, iterations=1)
    print(
        f"\nattention {case}, about {n} packed bf16 rows, dropout 0.1, forward + backward, "
        f"{torch.get_num_threads()} threads, {'new lengths each round' if FRESH else 'one micro-batch'}: compiled "
        f"{new * 1e3:.2f} ms, length buckets {old * 1e3:.2f} ms, compiled/buckets {new / old:.2f}x (wall-time "
        f"medians of {ROUNDS})"
    )
    if should_write():
        name = "packed_attention_" + case.split()[0].lower()
        write_results(
            name,
            {**results_header(name), "rounds": ROUNDS, "fresh": FRESH, "compiled_s": new, "buckets_s": old},
        )
