"""The one-backward capture's few-launch forms (the launch budgets of tests/test_cuda_trace.py): the grouped
weight-gradient op written straight into strided buffer rows, the row plan built on the host, every task's
embedding rows in one ``index_put_`` (the CUDA form, run here on the CPU), and the buffer's rows made chunk by
chunk as the backward writes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from device import DEVICE
from test_per_task_grads import (
    _tiny_batch,
    _tiny_model,
    check_equal,
    mt_loss,
    one_backward,
    separate_backwards,
)
from torch.library import opcheck

from fastpals.surgery import TaskGradientBuffer, shared_parameters_by_name
from fastpals.surgery import per_task as per_task_module
from fastpals.surgery.buffer import NUM_CHUNKS, chunk_bounds
from fastpals_kernels import dispatch
from fastpals_kernels.common import build_task_row_plan, build_task_row_plan_host


@pytest.mark.parametrize("packed", [False, True])
def test_host_row_plan_equals_the_device_plan(packed: bool) -> None:
    """The numpy plan (one transfer) holds exactly the device plan's tensors, absent tasks included."""
    rng = np.random.default_rng(3)
    for num_tasks, batch_size, block_rows in ((3, 7, 4), (16, 40, 64), (5, 1, 2)):
        task_ids = rng.integers(0, num_tasks - 1, batch_size)  # the last task has no example
        lengths = rng.integers(1, 20, batch_size) if packed else np.full(batch_size, 6)
        cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]))
        want = build_task_row_plan(
            torch.as_tensor(task_ids), num_tasks, int(lengths.sum()), seq_len=None if packed else 6,
            cu_seqlens=cu if packed else None, block_rows=block_rows,
        )  # fmt: skip
        got = build_task_row_plan_host(task_ids, num_tasks, lengths, "cpu", block_rows=block_rows)
        for field in ("row_index", "task_row_offsets", "tile_task", "tile_start", "tile_end"):
            torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=0, atol=0)
        assert (got.num_rows, got.num_tasks, got.block_rows) == (
            want.num_rows,
            want.num_tasks,
            want.block_rows,
        )


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_wgrad_into_strided_rows(monkeypatch, backend: str, with_bias: bool) -> None:
    """``grouped_wgrad_out`` writes each task's ``dy_t^T x_t`` (and ``sum dy_t``) into column views of a
    ``[T, P]`` buffer (row stride P) and nothing else: float64 per-task products as the reference."""
    if backend == "triton":
        ok, reason = dispatch.available()
        if not ok:
            pytest.skip(f"Triton kernels cannot run here: {reason}")
    monkeypatch.setenv("FASTPALS_KERNELS", backend)
    g = torch.Generator().manual_seed(4)
    num_tasks, rows, m, k = 3, 23, 6, 5
    task_ids = torch.tensor([2, 0, 2, 1])
    lengths = np.array([5, 7, 3, 8])
    dy = torch.randn(rows, m, generator=g).to(DEVICE)
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    plan = build_task_row_plan_host(task_ids.numpy(), num_tasks, lengths, DEVICE)
    buf = torch.full((num_tasks, 3 + m * k + m + 4), 7.0, device=DEVICE)
    dw = buf[:, 3 : 3 + m * k].view(num_tasks, m, k)
    db = buf[:, 3 + m * k : 3 + m * k + m] if with_bias else None
    dispatch.grouped_wgrad_into(dy, x, plan, dw, db)
    row_task = torch.repeat_interleave(task_ids, torch.as_tensor(lengths))
    for t in range(num_tasks):
        sel = (row_task == t).to(DEVICE)
        torch.testing.assert_close(dw[t].double(), dy[sel].double().T @ x[sel].double(), rtol=0, atol=1e-5)
        if with_bias:
            torch.testing.assert_close(db[t].double(), dy[sel].double().sum(0), rtol=0, atol=1e-5)
    untouched = torch.cat([buf[:, :3], buf[:, 3 + m * k + (m if with_bias else 0) :]], 1)
    assert bool((untouched == 7.0).all())
    args = (dy, x, plan.row_index, plan.task_row_offsets, plan.tile_task, plan.tile_start, plan.tile_end,
            num_tasks, plan.block_rows, dw, db if with_bias else dw.new_empty(0))  # fmt: skip
    opcheck(torch.ops.fastpals.grouped_wgrad_out.default, args)


def test_embedding_rows_without_the_cpu_compaction_equal_separate_backwards(monkeypatch) -> None:
    """The CUDA form of the embedding rows (one accumulating ``index_put_`` at the ``(task, id)`` pairs, no
    compaction) gives every task's gradient of T separate backwards (a 2-layer BERT, its word embeddings
    shared and trained)."""
    monkeypatch.setattr(per_task_module, "compacts_embedding_rows", lambda device: False)
    model = _tiny_model()
    shared, specific = shared_parameters_by_name(model)
    assert any(p is model.bert.embeddings.word_embeddings.weight for p in shared)
    data = _tiny_batch()
    ref = separate_backwards(model, data, mt_loss, shared, specific)
    got = one_backward(model, data, mt_loss, shared, specific)
    check_equal(ref, got, shared, specific, "embedding rows without compaction")


def test_buffer_rows_are_made_chunk_by_chunk_in_write_order() -> None:
    """The rows are NUM_CHUNKS runs of consecutive parameters covering them all, the last parameters' chunk the
    smallest; writing the last parameter's rows makes only its chunk (not ``[T, P]``)."""
    numels = [5000] + [300] * 40 + [20] * 10
    bounds = chunk_bounds(numels)
    assert len(bounds) == NUM_CHUNKS
    assert bounds[0][0] == 0 and bounds[-1][1] == len(numels)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [sum(numels[a:b]) for a, b in bounds]
    assert sizes[-1] == min(sizes) and sizes[-1] <= sum(numels) // 16
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    buf = TaskGradientBuffer(params, 3)
    buf.param_rows(len(params) - 1).fill_(1.0)
    made = [c for c in buf._chunks if c is not None]
    assert len(made) == 1 and made[0].numel() == 3 * sizes[-1]
