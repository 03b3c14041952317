"""grouped_linear / grouped_linear_varlen against the per-task reference (fastpals.functional) and float64.

Checked per case: the output and every gradient (x, weight, bias, residual). fp32 within 1e-5 of the fp32
reference; fp16/bf16: the kernel's max error against float64 at most 2x the same-dtype PyTorch reference's
(flash-attn's rule). Runs on CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it).
"""

import pytest
import torch
import torch.nn.functional as F

from fastpals.functional import grouped_linear_reference
from fastpals_kernels.grouped_linear_triton import grouped_linear, grouped_linear_varlen

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
    x = torch.randn(*shape_x, generator=g)
    w = torch.randn(num_tasks, m, k, generator=g) / k**0.5
    b = torch.randn(num_tasks, m, generator=g) if bias else None
    r = torch.randn(*shape_x[:-1], m, generator=g) if residual else None
    dy = torch.randn(*shape_x[:-1], m, generator=g)
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (x, w, b, r)]
    return leaves, dy.to(dtype)


def _run(fn, leaves, dy):
    out = fn(*leaves)
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out, wrt, dy)
    return [out.detach(), *grads]


def _as64(leaves):
    return [t.detach().double().requires_grad_() if t is not None else None for t in leaves]


@pytest.mark.parametrize(
    "bias, activation, residual", [(True, "gelu", True), (False, None, False), (True, None, True)]
)
@pytest.mark.parametrize("mix", list(TASK_MIXES))
def test_padded_fp32_matches_reference(mix, bias, activation, residual):
    ids, num_tasks = TASK_MIXES[mix]
    task_ids = torch.tensor(ids)
    leaves, dy = _make((len(ids), 5, 80), num_tasks, 24, torch.float32, bias, residual)

    def kernel(x, w, b, r):
        return grouped_linear(x, task_ids, w, b, activation, r)

    def reference(x, w, b, r):
        return _reference(x, task_ids, w, b, activation, r)

    got, want = _run(kernel, leaves, dy), _run(reference, leaves, dy)
    for name, a, e in zip(["y", "dx", "dW", "db", "dres"], got, want):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
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
    probs = 1.0 / torch.arange(1, num_tasks + 1, dtype=torch.float64)
    task_ids = torch.multinomial(probs / probs.sum(), 12, replacement=True, generator=g)
    leaves, dy = _make((12, 3, k), num_tasks, m, torch.float32, bias, residual=True, seed=k + m)

    def kernel(x, w, b, r):
        return grouped_linear(x, task_ids, w, b, activation, r)

    def reference(x, w, b, r):
        return _reference(x, task_ids, w, b, activation, r)

    for a, e in zip(_run(kernel, leaves, dy), _run(reference, leaves, dy)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_many_tiles_per_task_fp32():
    """160 rows, 140 of one task: several row tiles per task, several row blocks in the weight gradient."""
    task_ids = torch.tensor([2, 2, 0, 2, 2, 2, 2, 2])
    leaves, dy = _make((8, 20, 48), 3, 40, torch.float32)

    def kernel(x, w, b, r):
        return grouped_linear(x, task_ids, w, b, "gelu", r)

    def reference(x, w, b, r):
        return _reference(x, task_ids, w, b, "gelu", r)

    for a, e in zip(_run(kernel, leaves, dy), _run(reference, leaves, dy)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_two_dim_input_fp32():
    task_ids = torch.tensor([1, 0, 1, 1, 0])
    leaves, dy = _make((5, 33), 2, 17, torch.float32)

    def kernel(x, w, b, r):
        return grouped_linear(x, task_ids, w, b, "gelu", r)

    def reference(x, w, b, r):
        return _reference(x, task_ids, w, b, "gelu", r)

    for a, e in zip(_run(kernel, leaves, dy), _run(reference, leaves, dy)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation, residual", [("gelu", True), (None, False)])
def test_varlen_fp32_matches_reference(activation, residual):
    lengths = torch.tensor([4, 0, 7, 1, 9, 3])  # an empty sequence included
    task_ids = torch.tensor([0, 1, 3, 0, 3, 0])  # task 2 unused
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    row_tasks = torch.repeat_interleave(task_ids, lengths)
    leaves, dy = _make((int(cu[-1]), 36), 4, 20, torch.float32, residual=residual)

    def kernel(x, w, b, r):
        return grouped_linear_varlen(x, cu, task_ids, w, b, activation, r)

    def reference(x, w, b, r):  # every packed row is its own example
        return _reference(x, row_tasks, w, b, activation, r)

    for a, e in zip(_run(kernel, leaves, dy), _run(reference, leaves, dy)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mix", ["skewed", "empty_task"])
def test_half_precision_error_at_most_twice_reference(dtype, mix):
    ids, num_tasks = TASK_MIXES[mix]
    task_ids = torch.tensor(ids)
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
        kernel_err = (a.double() - e).abs().max().item()
        ref_err = (r.double() - e).abs().max().item()
        floor = 1e-6 * e.abs().max().item()  # where the reference is exact (dres = dy) allow rounding noise
        assert kernel_err <= 2 * ref_err + floor, (
            f"{name}: kernel error {kernel_err:.3g} vs reference {ref_err:.3g}"
        )


def test_no_grad_inputs_and_partial_grads():
    """Only the weight needs a gradient (a frozen input, e.g. the first PAL layer): dx is not computed."""
    task_ids = torch.tensor([0, 1, 1])
    x = torch.randn(3, 4, 20)
    w = torch.randn(2, 16, 20, requires_grad=True)
    out = grouped_linear(x, task_ids, w)
    (dw,) = torch.autograd.grad(out.sum(), [w])
    (dw_ref,) = torch.autograd.grad(grouped_linear_reference(x, task_ids, w, None).sum(), [w])
    torch.testing.assert_close(dw, dw_ref, atol=1e-5, rtol=1e-5)


class TestValidation:
    def setup_method(self):
        self.x = torch.randn(3, 4, 8)
        self.w = torch.randn(2, 5, 8)
        self.b = torch.randn(2, 5)

    @pytest.mark.parametrize(
        "task_ids, error, match",
        [
            (torch.tensor([0, 2, 1]), ValueError, "outside \\[0, 2\\)"),
            (torch.tensor([0, -1, 1]), ValueError, "-1"),
            (torch.tensor([0.0, 1.0, 1.0]), TypeError, "integer dtype"),
            (torch.tensor([0, 1]), ValueError, "shape \\[3\\]"),
            (torch.tensor([[0, 1, 1]]), ValueError, "shape \\[3\\]"),
            ([0, 1, 1], TypeError, "torch.Tensor"),
            (torch.tensor([0, 1, 1], device="meta"), ValueError, "task_ids is on meta"),
        ],
    )
    def test_bad_task_ids(self, task_ids, error, match):
        with pytest.raises(error, match=match):
            grouped_linear(self.x, task_ids, self.w, self.b)

    def test_dtype_mismatch(self):
        with pytest.raises(TypeError, match="weight has dtype torch.float16"):
            grouped_linear(self.x, torch.tensor([0, 1, 1]), self.w.half(), None)
        with pytest.raises(TypeError, match="bias has dtype torch.float64"):
            grouped_linear(self.x, torch.tensor([0, 1, 1]), self.w, self.b.double())

    def test_shape_mismatch(self):
        ids = torch.tensor([0, 1, 1])
        with pytest.raises(ValueError, match="K must match"):
            grouped_linear(self.x, ids, torch.randn(2, 5, 9))
        with pytest.raises(ValueError, match="bias must have shape"):
            grouped_linear(self.x, ids, self.w, torch.randn(3, 5))
        with pytest.raises(ValueError, match="residual must have"):
            grouped_linear(self.x, ids, self.w, self.b, residual=torch.randn(3, 4, 6))
        with pytest.raises(ValueError, match="activation"):
            grouped_linear(self.x, ids, self.w, self.b, activation="relu")

    def test_bad_cu_seqlens(self):
        x = torch.randn(6, 8)
        ids = torch.tensor([0, 1])
        with pytest.raises(ValueError, match="end at the number of packed rows 6"):
            grouped_linear_varlen(x, torch.tensor([0, 2, 5], dtype=torch.int32), ids, self.w)
        with pytest.raises(ValueError, match="non-decreasing"):
            grouped_linear_varlen(
                x, torch.tensor([0, 4, 2, 6], dtype=torch.int32), torch.tensor([0, 1, 1]), self.w
            )
        with pytest.raises(TypeError, match="int32 or int64"):
            grouped_linear_varlen(x, torch.tensor([0.0, 2.0, 6.0]), ids, self.w)
        with pytest.raises(ValueError, match="task_ids must have shape \\[1\\]"):
            grouped_linear_varlen(x, torch.tensor([0, 6], dtype=torch.int32), ids, self.w)


def test_plan_cache_reuses_validated_plans_and_sees_in_place_changes():
    from fastpals_kernels.common import task_row_plan

    task_ids = torch.tensor([0, 1, 1])
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
    cu = torch.tensor([0, 5, 7], dtype=torch.int32)
    ids = torch.tensor([1, 0])
    varlen = task_row_plan(ids, 2, 7, ids.device, cu_seqlens=cu)
    assert task_row_plan(ids, 2, 7, ids.device, cu_seqlens=cu) is varlen
    cu[1] = 8
    with pytest.raises(ValueError, match="non-decreasing"):
        task_row_plan(ids, 2, 7, ids.device, cu_seqlens=cu)
