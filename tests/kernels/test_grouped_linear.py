"""grouped_linear / grouped_linear_varlen against the per-task reference (fastpals.functional) and float64.

Checked per case: the output and every gradient (x, weight, bias, residual). fp32 within 1e-5 of the fp32
reference; every dtype: the kernel's max error against float64 at most 2x the same-dtype PyTorch reference's
(flash-attn's rule, tests/tolerances.py). Inputs are drawn on the CPU and moved to tests/device.py's DEVICE; off
CUDA the kernels run in Triton's interpreter.
"""

import pytest
import torch
import torch.nn.functional as F
from device import DEVICE
from tolerances import assert_close_to_reference, assert_fp32_close

from fastpals.functional import grouped_linear_reference
from fastpals_kernels.grouped_linear import grouped_linear, grouped_linear_varlen

pytestmark = pytest.mark.kernels

# name -> (task ids, number of tasks)
TASK_MIXES = {
    "one_task": ([1, 1, 1, 1, 1, 1], 3),
    "uniform": ([0, 1, 2, 0, 1, 2], 3),
    "skewed": ([2, 2, 0, 2, 2, 2], 3),
    "empty_task": ([3, 0, 3, 0, 0, 3], 4),  # tasks 1 and 2 have no examples
}


def _reference(x, task_ids, weight, bias, activation, residual):
    y = grouped_linear_reference(x, task_ids, weight, bias)
    if activation == "gelu":
        y = F.gelu(y)
    return y if residual is None else residual + y


def _make(shape_x, num_tasks, m, dtype, bias=True, residual=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = shape_x[-1]
    x = torch.randn(*shape_x, generator=g).to(DEVICE)
    w = (torch.randn(num_tasks, m, k, generator=g) / k**0.5).to(DEVICE)
    b = torch.randn(num_tasks, m, generator=g).to(DEVICE) if bias else None
    r = torch.randn(*shape_x[:-1], m, generator=g).to(DEVICE) if residual else None
    dy = torch.randn(*shape_x[:-1], m, generator=g).to(DEVICE)
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (x, w, b, r)]
    return leaves, dy.to(dtype)


def _run(fn, leaves, dy):
    out = fn(*leaves)
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out, wrt, dy)
    return [out.detach(), *grads]


def _as64(leaves):
    return [t.detach().double().requires_grad_() if t is not None else None for t in leaves]


def _check_fp32(kernel, reference, leaves, dy, names=("y", "dx", "dW", "db", "dres")):
    """Run both on fp32 ``leaves`` and ``reference`` on their float64 copies: the kernel's output and gradients
    within 1e-5 of the fp32 reference's and at most 2x its error against float64. Returns the kernel's."""
    got, want = _run(kernel, leaves, dy), _run(reference, leaves, dy)
    exact = _run(reference, _as64(leaves), dy.double())
    assert len(got) == len(want) == len(exact)
    for name, a, e, e64 in zip(names, got, want, exact):
        assert_fp32_close(name, a, e)
        assert_close_to_reference(name, a, e, e64)
    return got


@pytest.mark.parametrize(
    "bias, activation, residual", [(True, "gelu", True), (False, None, False), (True, None, True)]
)
@pytest.mark.parametrize("mix", list(TASK_MIXES))
def test_padded_fp32_matches_reference(mix, bias, activation, residual):
    ids, num_tasks = TASK_MIXES[mix]
    task_ids = torch.tensor(ids, device=DEVICE)
    leaves, dy = _make((len(ids), 5, 80), num_tasks, 24, torch.float32, bias, residual)

    def kernel(x, w, b, r):
        return grouped_linear(x, task_ids, w, b, activation, r)

    def reference(x, w, b, r):
        return _reference(x, task_ids, w, b, activation, r)

    names = ["y", "dx", "dW"] + ["db"] * bias + ["dres"] * residual
    got = _check_fp32(kernel, reference, leaves, dy, names)
    dw = got[2]
    for t in range(num_tasks):
        if t not in ids:
            assert torch.count_nonzero(dw[t]) == 0, f"task {t} has no examples but a non-zero weight gradient"
            if bias:
                assert torch.count_nonzero(got[3][t]) == 0


@pytest.mark.parametrize(
    "k, m, num_tasks, bias, activation",
    [
        (16, 16, 8, True, "gelu"),
        (17, 3, 5, False, "gelu"),
        (130, 70, 6, True, None),
        (1, 33, 2, True, "gelu"),
    ],
)
def test_sizes_and_zipf_task_mix_fp32(k, m, num_tasks, bias, activation):
    """Odd and tiny feature sizes; tasks drawn from a Zipf-like law over many tasks (most examples on task 0)."""
    g = torch.Generator().manual_seed(k * 1000 + m)
    zipf = 1.0 / torch.arange(
        1, num_tasks + 1, dtype=torch.float64
    )  # multinomial normalizes; host: drawn by g
    task_ids = torch.multinomial(zipf, 12, replacement=True, generator=g).to(DEVICE)
    leaves, dy = _make((12, 3, k), num_tasks, m, torch.float32, bias, residual=True, seed=k + m)

    def kernel(x, w, b, r):
        return grouped_linear(x, task_ids, w, b, activation, r)

    def reference(x, w, b, r):
        return _reference(x, task_ids, w, b, activation, r)

    _check_fp32(kernel, reference, leaves, dy, names=["y", "dx", "dW"] + ["db"] * bias + ["dres"])


def test_many_tiles_per_task_fp32():
    """160 rows, 140 of one task: several row tiles per task, several row blocks in the weight gradient."""
    task_ids = torch.tensor([2, 2, 0, 2, 2, 2, 2, 2], device=DEVICE)
    leaves, dy = _make((8, 20, 48), 3, 40, torch.float32)

    def kernel(x, w, b, r):
        return grouped_linear(x, task_ids, w, b, "gelu", r)

    def reference(x, w, b, r):
        return _reference(x, task_ids, w, b, "gelu", r)

    _check_fp32(kernel, reference, leaves, dy)


def test_two_dim_input_fp32():
    task_ids = torch.tensor([1, 0, 1, 1, 0], device=DEVICE)
    leaves, dy = _make((5, 33), 2, 17, torch.float32)

    def kernel(x, w, b, r):
        return grouped_linear(x, task_ids, w, b, "gelu", r)

    def reference(x, w, b, r):
        return _reference(x, task_ids, w, b, "gelu", r)

    _check_fp32(kernel, reference, leaves, dy)


@pytest.mark.parametrize("activation, residual", [("gelu", True), (None, False)])
def test_varlen_fp32_matches_reference(activation, residual):
    lengths = torch.tensor([4, 0, 7, 1, 9, 3], device=DEVICE)  # an empty sequence included
    task_ids = torch.tensor([0, 1, 3, 0, 3, 0], device=DEVICE)  # task 2 unused
    cu = torch.tensor([0, 4, 4, 11, 12, 21, 24], dtype=torch.int32, device=DEVICE)
    row_tasks = torch.repeat_interleave(task_ids, lengths)
    leaves, dy = _make((24, 36), 4, 20, torch.float32, residual=residual)

    def kernel(x, w, b, r):
        return grouped_linear_varlen(x, cu, task_ids, w, b, activation, r)

    def reference(x, w, b, r):  # every packed row is its own example
        return _reference(x, row_tasks, w, b, activation, r)

    _check_fp32(kernel, reference, leaves, dy, names=["y", "dx", "dW", "db"] + ["dres"] * residual)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mix", ["skewed", "empty_task"])
def test_half_precision_error_at_most_twice_reference(dtype, mix):
    ids, num_tasks = TASK_MIXES[mix]
    task_ids = torch.tensor(ids, device=DEVICE)
    leaves, dy = _make((len(ids), 6, 72), num_tasks, 40, dtype, seed=1)

    def kernel(x, w, b, r):
        return grouped_linear(x, task_ids, w, b, "gelu", r)

    def reference(x, w, b, r):
        return _reference(x, task_ids, w, b, "gelu", r)

    got = _run(kernel, leaves, dy)
    ref = _run(reference, leaves, dy)
    exact = _run(reference, _as64(leaves), dy.double())
    for name, a, r, e in zip(["y", "dx", "dW", "db", "dres"], got, ref, exact):
        assert a.dtype == dtype
        assert_close_to_reference(name, a, r, e, rtol=1e-6)  # rtol: where the reference is exact (dres = dy)


def test_no_grad_inputs_and_partial_grads():
    """Only the weight needs a gradient (a frozen input, e.g. the first PAL layer): dx is not computed."""
    g = torch.Generator().manual_seed(0)
    task_ids = torch.tensor([0, 1, 1], device=DEVICE)
    x = torch.randn(3, 4, 20, generator=g).to(DEVICE)
    w = torch.randn(2, 16, 20, generator=g).to(DEVICE).requires_grad_()
    out = grouped_linear(x, task_ids, w)
    (dw,) = torch.autograd.grad(out.sum(), [w])
    (dw_ref,) = torch.autograd.grad(grouped_linear_reference(x, task_ids, w, None).sum(), [w])
    w64 = w.detach().double().requires_grad_()
    (dw64,) = torch.autograd.grad(grouped_linear_reference(x.double(), task_ids, w64, None).sum(), [w64])
    assert_fp32_close("dW", dw, dw_ref)
    assert_close_to_reference("dW", dw, dw_ref, dw64)


class TestValidation:
    def setup_method(self):
        self.x = torch.randn(3, 4, 8, device=DEVICE)
        self.w = torch.randn(2, 5, 8, device=DEVICE)
        self.b = torch.randn(2, 5, device=DEVICE)

    @pytest.mark.parametrize(
        "task_ids, error, match",
        [
            (torch.tensor([0, 2, 1], device=DEVICE), ValueError, "outside \\[0, 2\\)"),
            (torch.tensor([0, -1, 1], device=DEVICE), ValueError, "-1"),
            (torch.tensor([0.0, 1.0, 1.0], device=DEVICE), TypeError, "integer dtype"),
            (torch.tensor([0, 1], device=DEVICE), ValueError, "shape \\[3\\]"),
            (torch.tensor([[0, 1, 1]], device=DEVICE), ValueError, "shape \\[3\\]"),
            ([0, 1, 1], TypeError, "torch.Tensor"),
            (torch.tensor([0, 1, 1], device="meta"), ValueError, "task_ids is on meta"),
        ],
    )
    def test_bad_task_ids(self, task_ids, error, match):
        with pytest.raises(error, match=match):
            grouped_linear(self.x, task_ids, self.w, self.b)

    def test_dtype_mismatch(self):
        with pytest.raises(TypeError, match="weight has dtype torch.float16"):
            grouped_linear(self.x, torch.tensor([0, 1, 1], device=DEVICE), self.w.half(), None)
        with pytest.raises(TypeError, match="bias has dtype torch.float64"):
            grouped_linear(self.x, torch.tensor([0, 1, 1], device=DEVICE), self.w, self.b.double())

    def test_shape_mismatch(self):
        ids = torch.tensor([0, 1, 1], device=DEVICE)
        with pytest.raises(ValueError, match="K must match"):
            grouped_linear(self.x, ids, torch.randn(2, 5, 9, device=DEVICE))
        with pytest.raises(ValueError, match="bias must have shape"):
            grouped_linear(self.x, ids, self.w, torch.randn(3, 5, device=DEVICE))
        with pytest.raises(ValueError, match="residual must have"):
            grouped_linear(self.x, ids, self.w, self.b, residual=torch.randn(3, 4, 6, device=DEVICE))
        with pytest.raises(ValueError, match="activation"):
            grouped_linear(self.x, ids, self.w, self.b, activation="relu")

    def test_bad_cu_seqlens(self):
        x = torch.randn(6, 8, device=DEVICE)
        ids = torch.tensor([0, 1], device=DEVICE)
        with pytest.raises(ValueError, match="end at the number of packed rows 6"):
            grouped_linear_varlen(x, torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE), ids, self.w)
        with pytest.raises(ValueError, match="non-decreasing"):
            grouped_linear_varlen(
                x,
                torch.tensor([0, 4, 2, 6], dtype=torch.int32, device=DEVICE),
                torch.tensor([0, 1, 1], device=DEVICE),
                self.w,
            )
        with pytest.raises(TypeError, match="int32 or int64"):
            grouped_linear_varlen(x, torch.tensor([0.0, 2.0, 6.0], device=DEVICE), ids, self.w)
        with pytest.raises(ValueError, match="task_ids must have shape \\[1\\]"):
            grouped_linear_varlen(x, torch.tensor([0, 6], dtype=torch.int32, device=DEVICE), ids, self.w)


def test_plan_cache_reuses_validated_plans_and_sees_in_place_changes():
    from fastpals_kernels.common import task_row_plan

    task_ids = torch.tensor([0, 1, 1], device=DEVICE)
    plan = task_row_plan(task_ids, 2, 12, task_ids.device, batch=3, seq_len=4)
    assert task_row_plan(task_ids, 2, 12, task_ids.device, batch=3, seq_len=4) is plan  # e.g. the next layer
    assert task_row_plan(task_ids, 3, 12, task_ids.device, batch=3, seq_len=4) is not plan  # other sizes
    assert task_row_plan(task_ids.clone(), 2, 12, task_ids.device, batch=3, seq_len=4) is not plan
    task_ids[0] = 1  # in place: the version changes, the plan is rebuilt (and re-validated)
    replanned = task_row_plan(task_ids, 2, 12, task_ids.device, batch=3, seq_len=4)
    assert replanned is not plan and replanned.task_row_offsets.tolist() == [0, 0, 12]
    task_ids[0] = 5
    with pytest.raises(ValueError, match="outside \\[0, 2\\)"):
        task_row_plan(task_ids, 2, 12, task_ids.device, batch=3, seq_len=4)
    cu = torch.tensor([0, 5, 7], dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([1, 0], device=DEVICE)
    varlen = task_row_plan(ids, 2, 7, ids.device, cu_seqlens=cu)
    assert task_row_plan(ids, 2, 7, ids.device, cu_seqlens=cu) is varlen
    cu[1] = 8
    with pytest.raises(ValueError, match="non-decreasing"):
        task_row_plan(ids, 2, 7, ids.device, cu_seqlens=cu)
