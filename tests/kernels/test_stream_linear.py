"""The streaming surgery's multi-Linear ops (fastpals_kernels.stream_linear): the Gram of every problem's per-task
weight (and bias) gradients and their weighted sum, against a float64 transcription of ``G_pt = sum over the calls
of dy[rows of t]^T [x, 1][rows of t]``.

Several problems of different shapes (none a multiple of the blocks; with and without a bias), two calls each
with different rows, random examples per task with tasks that have no rows. fp32 within 1e-5 of the fp32 PyTorch reference; fp32 and bf16:
the kernel's error against float64 at most 2x the same-dtype reference's (tests/tolerances.py). Inputs are drawn
on the CPU and moved to tests/device.py's DEVICE; off CUDA the kernels run in Triton's interpreter.
"""

import pytest
import torch
from device import DEVICE
from tolerances import assert_close_to_reference, assert_fp32_close
from torch.library import opcheck

from fastpals_kernels import stream_linear
from fastpals_kernels.common import build_task_row_plan

pytestmark = pytest.mark.kernels

SHAPES = [(40, 33), (16, 50), (70, 32)]  # [M, K] per problem
BIAS = [True, False, True]  # the last one's bias column starts a column block of its own


def _calls(num_tasks: int, dtype: torch.dtype, seed: int = 0) -> tuple[list, list, list[torch.Tensor]]:
    """Two calls per problem of :data:`SHAPES`: ``(op arguments, problem numbers, each call's row tasks)``.
    Examples of 1 to 6 rows with random tasks, task 1 never drawn (no rows), call 1 of each problem one task."""
    g = torch.Generator().manual_seed(seed)
    dy, x, row_index, offsets, problem, row_tasks = [], [], [], [], [], []
    drawn = [t for t in range(num_tasks) if t != 1]
    for p, (m, k) in enumerate(SHAPES):
        for call in range(2):
            examples = 5 + 3 * call
            # the examples' tasks and lengths: host draws (CPU generator), moved below
            pick = torch.randint(0, len(drawn), (examples,), generator=g)  # host: drawn on the CPU generator
            one = torch.full((examples,), drawn[p % len(drawn)])  # host: moved with the plan's inputs
            tasks = torch.tensor(drawn)[pick] if call == 0 else one  # host: moved with the plan's inputs
            lengths = torch.randint(1, 7, (examples,), generator=g)  # host: drawn on the CPU generator
            cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])  # host: moved below
            rows = int(cu[-1])
            plan = build_task_row_plan(tasks.to(DEVICE), num_tasks, rows, cu_seqlens=cu.to(DEVICE))
            dy.append(torch.randn(rows, m, generator=g).to(dtype).to(DEVICE))
            x.append(torch.randn(rows, k, generator=g).to(dtype).to(DEVICE))
            row_index.append(plan.row_index)
            offsets.append(plan.task_row_offsets)
            problem.append(p)
            row_tasks.append(torch.repeat_interleave(tasks, lengths))
    return [dy, x, row_index, offsets, problem, BIAS], row_tasks


def _float64_products(args: list, row_tasks: list, num_tasks: int) -> list[torch.Tensor]:
    """``G_p [T, M, K (+1)]`` float64 from each call's row tasks (not its plan), the bias as a last column."""
    widths = [(m, k + b) for (m, k), b in zip(SHAPES, BIAS)]
    out = [torch.zeros(num_tasks, m, k, dtype=torch.float64) for m, k in widths]  # host: float64 ref
    for dy, x, p, tasks in zip(args[0], args[1], args[4], row_tasks):
        x64 = x.cpu().double()
        if BIAS[p]:
            x64 = torch.cat([x64, x64.new_ones(x64.shape[0], 1)], 1)
        for t in range(num_tasks):
            rows = tasks == t
            out[p][t] += dy.cpu()[rows].double().T @ x64[rows]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tasks", [3, 17])
def test_gram_and_combine_against_float64(dtype, num_tasks):
    args, row_tasks = _calls(num_tasks, dtype)
    products = _float64_products(args, row_tasks, num_tasks)
    flat64 = [g.reshape(num_tasks, -1) for g in products]
    gram64 = sum(f @ f.T for f in flat64)
    weights = torch.linspace(-1.0, 1.5, num_tasks).to(DEVICE)
    combine64 = []  # per problem the weight's [M, K], then the bias's [M]
    for g, b in zip((torch.tensordot(weights.cpu().double(), g, 1) for g in products), BIAS):
        combine64 += [g[:, : g.shape[1] - b].reshape(-1), g[:, g.shape[1] - b :].T.reshape(-1)]
    combine64 = torch.cat(combine64)

    gram = stream_linear.stream_linear_gram_triton(*args, num_tasks)
    gram_ref = stream_linear.stream_linear_gram_reference(*args, num_tasks)
    combine = stream_linear.stream_linear_combine_triton(*args, weights)
    combine_ref = stream_linear.stream_linear_combine_reference(*args, weights)
    assert gram.dtype == torch.float64 and combine.dtype == torch.float32
    assert gram[1].abs().max() == 0 and gram[:, 1].abs().max() == 0  # task 1 has no rows
    if dtype == torch.float32:
        assert_fp32_close("gram", gram.float().cpu(), gram_ref.float().cpu())
        assert_fp32_close("combine", combine.cpu(), combine_ref.cpu())
    assert_close_to_reference("gram", gram.cpu(), gram_ref.cpu(), gram64)
    assert_close_to_reference("combine", combine.cpu(), combine_ref.cpu(), combine64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ops_pass_opcheck(dtype):
    args, _ = _calls(3, dtype)
    opcheck(torch.ops.fastpals.stream_linear_gram.default, (*args, 3))
    opcheck(
        torch.ops.fastpals.stream_linear_combine.default, (*args, torch.tensor([0.5, 1.0, -2.0]).to(DEVICE))
    )


def test_calls_of_one_problem_must_share_its_shape():
    args, _ = _calls(3, torch.float32)
    args[0][1] = args[0][1][:, :7]
    with pytest.raises(ValueError, match="the calls of problem 0 differ in shape"):
        torch.ops.fastpals.stream_linear_gram(*args, 3)
