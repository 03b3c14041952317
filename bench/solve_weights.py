"""Every aggregator's weight solve (Gram -> weights) on the CPU, one thread: the PyTorch solvers
(``FASTPALS_SOLVE=torch``) against the compiled op (``torch.ops.fastpals.solve_weights``, csrc/), which every
aggregator goes through, at T = 3, 16 and 64 on a conflicting Gram (the median of repeated calls, each batch of
calls at least 0.2 s).

``python -m bench.solve_weights`` prints a table and writes ``bench/results/solve_weights_cpu_<UTC time>.json``
and ``.md``."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import env_var, write_results
from fastpals.surgery import AGGREGATORS, STATEFUL, compiled

SIZES = (3, 16, 64)


def conflicting_gram(t: int, seed: int = 0) -> torch.Tensor:
    """``J J^T`` of ``T`` 256-dim gradients, half along a common direction and half against it, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(256, generator=gen, dtype=torch.float64)
    j = 0.3 * torch.randn(t, 256, generator=gen, dtype=torch.float64)
    j[0::2] += base
    j[1::2] -= base
    return (j @ j.T).float()


def seconds_per_solve(name: str, gram: torch.Tensor, rounds: int = 5) -> float:
    fn = AGGREGATORS[name]
    gen = torch.Generator().manual_seed(0)

    def call() -> None:
        if name in STATEFUL:
            fn(gram, STATEFUL[name](), generator=gen)
        else:
            fn(gram, generator=gen)

    call()
    samples = []
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - start < 0.2:
            call()
            n += 1
        samples.append((time.perf_counter() - start) / n)
    return statistics.median(samples)


def main() -> None:
    torch.set_num_threads(1)
    if not compiled.load():
        sys.exit("bench.solve_weights: the compiled solve is not available (see the line above)")
    rows = []
    for name, fn in AGGREGATORS.items():
        if getattr(fn, "reads_rows", False):  # ExcessMTL reads the gradient rows: no Gram solve
            continue
        for t in SIZES:
            if name == "krum" and t < 3:
                continue
            gram = conflicting_gram(t)
            with env_var("FASTPALS_SOLVE", "torch"):
                before = seconds_per_solve(name, gram)
            after = seconds_per_solve(name, gram)
            rows.append({"method": name, "T": t, "pytorch_s": before, "compiled_s": after})
            print(
                f"{name:11s} T={t:3d}  pytorch {before * 1e3:9.3f} ms  compiled {after * 1e3:.3f} ms",
                flush=True,
            )
    path = write_results("solve_weights_cpu", {"threads": 1, "gram": "conflicting, float32", "rows": rows})
    lines = [
        f"# Weight solve per call, CPU, one thread ({path.name})",
        "",
        "| method | T | PyTorch solvers (ms) | compiled op (ms) | speed-up |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        before, after = r["pytorch_s"], r["compiled_s"]
        lines.append(
            f"| {r['method']} | {r['T']} | {before * 1e3:.3f} | {after * 1e3:.3f} | {before / after:.0f}x |"
        )
    Path(path.with_suffix(".md")).write_text("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    main()
