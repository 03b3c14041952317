"""Gradient surgery against float64 transcriptions of the papers, written here on explicit gradient vectors.

- PCGrad (Yu et al. 2020, Algorithm 1): for each task i, a copy of g_i is projected, in a random order of the
  other tasks, onto the normal plane of each original g_j it conflicts with; the projected copies are summed.
  The orders follow the documented rule of ``fastpals.surgery.pcgrad_orders`` (transcribed below).
- GEM (Lopez-Paz & Ranzato 2017): ``min_z 1/2 |z - g|^2`` s.t. ``<z, g_c> >= 0``, solved through its dual with
  scipy's NNLS (``min_{v >= 0} |M^T v + g|``, ``z = g + M^T v``) in float64 on the explicit vectors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import nnls

from fastpals.surgery import (
    GEM,
    PCGrad,
    TaskGradientBuffer,
    gem_weights,
    mean_weights,
    pcgrad_orders,
    pcgrad_weights,
    sum_weights,
)

# ---------------------------------------------------------------------------------------------------------------
# float64 transcriptions


def paper_orders(num_tasks: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_tasks):
        others = [j for j in range(num_tasks) if j != i]
        perm = torch.randperm(num_tasks - 1, generator=gen).tolist()
        out.append([others[k] for k in perm])
    return out


def pcgrad_paper(grads: np.ndarray, orders: list[list[int]]) -> np.ndarray:
    """Algorithm 1 of Yu et al. on explicit float64 vectors ``grads [T, D]``; returns the summed update [D]."""
    grads = np.asarray(grads, dtype=np.float64)
    total = np.zeros(grads.shape[1])
    for i in range(grads.shape[0]):
        g = grads[i].copy()
        for j in orders[i]:
            dot = g @ grads[j]
            if dot < 0:
                g = g - dot / (grads[j] @ grads[j]) * grads[j]
        total += g
    return total


def gem_paper(proposal: np.ndarray, constraints: np.ndarray) -> np.ndarray:
    """GEM's projection of ``proposal [D]`` against the rows of ``constraints [C, D]`` (dual QP via NNLS)."""
    g = np.asarray(proposal, dtype=np.float64)
    m = np.asarray(constraints, dtype=np.float64)
    if m.shape[0] == 0 or np.all(m @ g >= 0):
        return g
    v, _ = nnls(m.T, -g, maxiter=100 * m.shape[0] + 100)
    return g + m.T @ v


def rel(a: torch.Tensor | np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(torch.as_tensor(a).double().cpu())
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def random_grads(num_tasks: int, dim: int, seed: int, conflict: float = 1.0) -> torch.Tensor:
    """Task gradients with a shared component and conflicts (``conflict`` flips a share of tasks)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(dim, generator=gen, dtype=torch.float64)
    g = torch.randn(num_tasks, dim, generator=gen, dtype=torch.float64) + 0.5 * base
    scales = torch.rand(num_tasks, 1, generator=gen, dtype=torch.float64) * 4 + 0.25
    g = g * scales
    g[: max(1, num_tasks // 2)] -= conflict * base
    return g


def update_via_buffer(grads: torch.Tensor, aggregator, buffer_dtype=torch.float32, **kwargs) -> torch.Tensor:
    """Drive TaskGradientBuffer with one 'parameter' whose per-task gradients are the rows of ``grads``."""
    t, d = grads.shape
    p = torch.nn.Parameter(torch.zeros(d))
    buf = TaskGradientBuffer([p], t, buffer_dtype)
    for k in range(t):
        p.grad = grads[k].to(torch.float32).clone()
        buf.capture(k)
    result = buf.apply(aggregator, **kwargs)
    assert not result.skipped
    return p.grad.detach().clone()


# ---------------------------------------------------------------------------------------------------------------
# PCGrad


def test_pcgrad_orders_follow_the_documented_rule():
    for t in (1, 2, 5):
        got = pcgrad_orders(t, torch.Generator().manual_seed(3))
        assert got.shape == (t, t - 1) and got.dtype == torch.int64
        assert got.tolist() == paper_orders(t, 3)


def test_pcgrad_conflicting_pair_closed_form():
    g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    w = pcgrad_weights(g @ g.T, generator=torch.Generator().manual_seed(0))
    # g1' = g1 - (-1/2) g2 = [0.5, 0.5]; g2' = g2 - (-1/1) g1 = [0, 1]; sum = [0.5, 1.5]
    assert torch.allclose(w @ g, torch.tensor([0.5, 1.5], dtype=torch.float64), atol=1e-15)
    assert torch.allclose(w, torch.tensor([2.0, 1.5], dtype=torch.float64), atol=1e-15)


def test_pcgrad_no_conflict_is_the_sum():
    g = torch.rand(4, 10, dtype=torch.float64) + 0.1  # all inner products positive
    assert torch.equal(pcgrad_weights(g @ g.T), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("num_tasks", [2, 3, 4, 5, 6, 7, 8])
def test_pcgrad_matches_paper_fp64_and_fp32(num_tasks):
    for seed in range(3):
        grads = random_grads(num_tasks, 257, seed)
        ref = pcgrad_paper(grads.numpy(), paper_orders(num_tasks, seed))
        w64 = pcgrad_weights(grads @ grads.T, generator=torch.Generator().manual_seed(seed))
        assert w64.dtype == torch.float64
        assert rel(w64 @ grads, ref) < 1e-12
        g32 = update_via_buffer(grads, pcgrad_weights, generator=torch.Generator().manual_seed(seed))
        assert g32.dtype == torch.float32
        assert rel(g32, ref) < 1e-5


def test_pcgrad_bf16_buffer_within_1e3():
    """bf16 gradients (a bf16 model, or a bf16 buffer): within 1e-3 of the paper on those bf16 values."""
    for num_tasks in (2, 5, 8):
        grads = random_grads(num_tasks, 513, 10 + num_tasks)
        rounded = grads.to(torch.bfloat16).double()
        got = update_via_buffer(
            grads, pcgrad_weights, torch.bfloat16, generator=torch.Generator().manual_seed(1)
        )
        assert rel(got, pcgrad_paper(rounded.numpy(), paper_orders(num_tasks, 1))) < 1e-3
        # against the unrounded fp64 gradients the error is that of bf16 storage itself (2^-9 per element)
        storage = rel(rounded, grads.numpy())
        assert rel(got, pcgrad_paper(grads.numpy(), paper_orders(num_tasks, 1))) < 1.5 * storage


def test_pcgrad_zero_gradient_task_is_never_projected_against():
    g = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 2.0]], dtype=torch.float64)
    w = pcgrad_weights(g @ g.T, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(w).all()
    assert (
        rel(w @ g, pcgrad_paper(g.numpy(), paper_orders(3, 0))) < 1e-12
    )  # dot with a zero g_j is 0: no conflict


# ---------------------------------------------------------------------------------------------------------------
# GEM


def test_gem_no_conflict_returns_the_proposal():
    g = torch.rand(3, 7, dtype=torch.float64) + 0.1
    assert torch.allclose(gem_weights(g @ g.T), torch.ones(3, dtype=torch.float64))
    assert torch.allclose(gem_weights(g @ g.T, proposal="mean"), torch.full((3,), 1 / 3, dtype=torch.float64))


def test_gem_conflicting_pair():
    g = torch.tensor([[1.0, 0.0], [-2.0, 1.0]], dtype=torch.float64)
    w = gem_weights(g @ g.T, proposal=0)  # propose g_0, constrain g_1
    z = w @ g
    ref = gem_paper(g[0].numpy(), g[1:].numpy())
    assert rel(z, ref) < 1e-10  # the solver's ridge (1e-12 of max |g|^2) is the only difference
    assert rel(z, np.array([0.2, 0.4])) < 1e-10  # g_0 minus its component along g_1
    assert float(z @ g[1]) >= -1e-10


@pytest.mark.parametrize("num_tasks", [2, 3, 4, 5, 6, 7, 8])
def test_gem_matches_scipy_qp(num_tasks):
    for seed in range(3):
        grads = random_grads(num_tasks, 129, 100 + seed, conflict=2.5)
        gram64 = grads @ grads.T
        for proposal in ("sum", "mean", num_tasks - 1):
            if proposal == "sum":
                g = grads.sum(0)
                cons = grads
            elif proposal == "mean":
                g = grads.mean(0)
                cons = grads
            else:
                g = grads[proposal]
                cons = torch.cat([grads[:proposal], grads[proposal + 1 :]])
            ref = gem_paper(g.numpy(), cons.numpy())
            z64 = gem_weights(gram64, proposal=proposal) @ grads
            assert rel(z64, ref) < 1e-8
            assert (cons @ z64).min() >= -1e-8 * float(z64.norm() * cons.norm(dim=1).max())
            z32 = update_via_buffer(grads, gem_weights, proposal=proposal)
            assert rel(z32, ref) < 1e-5


def test_gem_bf16_buffer():
    grads = random_grads(4, 300, 7, conflict=2.5)
    ref = gem_paper(
        grads.to(torch.bfloat16).double().sum(0).numpy(), grads.to(torch.bfloat16).double().numpy()
    )
    got = update_via_buffer(grads, gem_weights, torch.bfloat16)
    assert rel(got, ref) < 1e-3


def test_gem_explicit_constraints_and_episodic_rows():
    # rows 0..2: current gradients (proposal = their sum); rows 3..5: memory gradients (constraints)
    cur = random_grads(3, 64, 1)
    mem = -cur + 0.3 * random_grads(3, 64, 2)
    rows = torch.cat([cur, mem])
    a = torch.tensor([1.0, 1, 1, 0, 0, 0], dtype=torch.float64)
    w = gem_weights(rows @ rows.T, proposal=a, constraints=[3, 4, 5])
    assert torch.equal(w[:3], a[:3])
    assert rel(w @ rows, gem_paper(cur.sum(0).numpy(), mem.numpy())) < 1e-8


def test_gem_duplicated_tasks_stay_finite():
    g = random_grads(3, 50, 3, conflict=3.0)
    g = torch.cat([g, g[:1]])  # task 3 == task 0: a singular Gram matrix
    z = gem_weights(g @ g.T) @ g
    assert torch.isfinite(z).all()
    assert rel(z, gem_paper(g.sum(0).numpy(), g.numpy())) < 1e-6


def test_sum_and_mean_weights():
    g = torch.eye(3, dtype=torch.float32)
    assert torch.equal(sum_weights(g), torch.ones(3))
    assert torch.allclose(mean_weights(g), torch.full((3,), 1 / 3))


def test_aggregator_input_errors():
    with pytest.raises(ValueError, match="gram"):
        pcgrad_weights(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="gram"):
        gem_weights(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="at most"):
        sum_weights(torch.zeros(129, 129))  # MAX_TASKS + 1
    with pytest.raises(ValueError, match="orders"):
        pcgrad_weights(torch.eye(3), orders=torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="proposal"):
        gem_weights(torch.eye(3), proposal=5)
    with pytest.raises(ValueError, match="proposal"):
        gem_weights(torch.eye(3), proposal="max")
    with pytest.raises(ValueError, match="constraints"):
        gem_weights(torch.eye(3), constraints=[3])


# ---------------------------------------------------------------------------------------------------------------
# the buffer on a model: shared / task-specific / unused parameters, non-finite steps


class TinyMultiTask(torch.nn.Module):
    def __init__(self, num_tasks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        self.heads = torch.nn.ModuleList([torch.nn.Linear(16, 1) for _ in range(num_tasks)])
        self.unused = torch.nn.Linear(3, 3)

    def loss(self, x: torch.Tensor, y: torch.Tensor, task: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.heads[task](self.encoder(x)).squeeze(-1), y)


def task_batches(num_tasks: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(num_tasks):
        x = torch.randn(8, 6, generator=gen)
        y = torch.randn(8, generator=gen) * (t + 1) * (-1) ** t
        out.append((x, y))
    return out


def per_task_grads(model: TinyMultiTask, batches) -> list[list[torch.Tensor | None]]:
    params = list(model.parameters())
    out = []
    for t, (x, y) in enumerate(batches):
        grads = torch.autograd.grad(model.loss(x, y, t), params, allow_unused=True)
        out.append([None if g is None else g.detach().double() for g in grads])
    return out


@pytest.mark.parametrize("method", ["pcgrad", "gem"])
def test_buffer_on_a_model_touches_only_shared_parameters(method):
    t = 3
    model = TinyMultiTask(t)
    batches = task_batches(t)
    ref_grads = per_task_grads(model, batches)
    shared = list(model.encoder.parameters())
    specific = list(model.heads.parameters())
    n_shared = len(shared)
    flat = torch.stack([torch.cat([g.reshape(-1) for g in ref_grads[k][:n_shared]]) for k in range(t)])
    if method == "pcgrad":
        ref = pcgrad_paper(flat.numpy(), paper_orders(t, 5))
        agg, kw = pcgrad_weights, {"generator": torch.Generator().manual_seed(5)}
    else:
        ref = gem_paper(flat.sum(0).numpy(), flat.numpy())
        agg, kw = gem_weights, {}

    buf = TaskGradientBuffer(shared, t, task_params=specific)
    for k, (x, y) in enumerate(batches):
        model.loss(x, y, k).backward()
        buf.capture(k)
        assert all(p.grad is None for p in shared)  # captured and cleared
    result = buf.apply(agg, **kw)
    assert not result.skipped
    got = torch.cat([p.grad.reshape(-1) for p in shared])
    assert rel(got, ref) < 1e-5
    for k in range(t):  # each head: its own task's gradient, unchanged
        for p, g in zip(model.heads[k].parameters(), ref_grads[k][n_shared + 2 * k : n_shared + 2 * k + 2]):
            assert torch.allclose(p.grad.double(), g, rtol=1e-6, atol=1e-7)
    assert buf.task_param_tasks == [{0}, {0}, {1}, {1}, {2}, {2}]
    assert model.unused.weight.grad is None and model.unused.bias.grad is None


def test_update_lives_in_the_buffer_and_next_step_without_zero_grad_accumulates():
    a = torch.nn.Parameter(torch.ones(4))
    buf = TaskGradientBuffer([a], 2)
    for t in range(2):
        (a * (t + 1)).sum().backward()
        buf.capture(t)
    buf.apply(sum_weights)
    base = a.grad._base  # the update is written over the last row of the parameter's [T, numel] block
    assert base is not None and base.shape == (2, 4) and a.grad.data_ptr() == base[1].data_ptr()
    assert torch.equal(a.grad, torch.full((4,), 3.0))
    assert buf.data.abs().sum() == 0  # the buffer itself keeps no row past apply()
    # no zero_grad: task 0's backward accumulates onto the previous update, as in plain PyTorch
    for t in range(2):
        (a * (t + 1)).sum().backward()
        buf.capture(t)
    buf.apply(sum_weights)
    assert torch.equal(a.grad, torch.full((4,), 6.0))
    # a bf16 buffer with fp32 gradients writes into a separate fp32 tensor
    buf16 = TaskGradientBuffer([a], 2, torch.bfloat16)
    a.grad = None
    for t in range(2):
        (a * (t + 1)).sum().backward()
        buf16.capture(t)
    buf16.apply(sum_weights)
    assert a.grad.dtype == torch.float32 and torch.equal(a.grad, torch.full((4,), 3.0))


def test_shared_parameter_no_task_used_keeps_none():
    a = torch.nn.Parameter(torch.randn(4))
    b = torch.nn.Parameter(torch.randn(4))
    buf = TaskGradientBuffer([a, b], 2)
    for t in range(2):
        (a * (t + 1)).sum().backward()
        buf.capture(t)
    buf.apply(pcgrad_weights)
    assert torch.allclose(a.grad, torch.full((4,), 3.0)) and b.grad is None


def test_pcgrad_wrapper_matches_buffer_path_and_splits_by_graph():
    t = 3
    batches = task_batches(t, seed=3)
    model = TinyMultiTask(t)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pc = PCGrad(opt, generator=torch.Generator().manual_seed(9))
    losses = [model.loss(x, y, k) for k, (x, y) in enumerate(batches)]
    result = pc.pc_backward(losses)
    assert not result.skipped
    assert [id(p) for p in pc.buffer.params] == [id(p) for p in model.encoder.parameters()]
    wrapped = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert model.unused.weight.grad is None
    pc.step()

    model2 = TinyMultiTask(t)
    buf = TaskGradientBuffer(
        list(model2.encoder.parameters()), t, task_params=list(model2.heads.parameters())
    )
    for k, (x, y) in enumerate(batches):
        model2.loss(x, y, k).backward()
        buf.capture(k)
    buf.apply(pcgrad_weights, generator=torch.Generator().manual_seed(9))
    for n, p in model2.named_parameters():
        if n in wrapped:
            assert torch.allclose(p.grad, wrapped[n], rtol=1e-5, atol=1e-7), n
    # step() moved the parameters of the wrapped model by -lr * grad
    assert torch.allclose(
        model.encoder[0].weight, model2.encoder[0].weight - 0.1 * wrapped["encoder.0.weight"]
    )


@pytest.mark.parametrize("capture_task_params", [False, True])
def test_gem_wrapper_with_episodic_memory(capture_task_params):
    t = 3
    model = TinyMultiTask(t)
    cur, mem = task_batches(t, seed=4), task_batches(t, seed=5)
    ref_cur, ref_mem = per_task_grads(model, cur), per_task_grads(model, mem)
    n = len(list(model.encoder.parameters()))
    flat_cur = torch.stack([torch.cat([g.reshape(-1) for g in ref_cur[k][:n]]) for k in range(t)])
    flat_mem = torch.stack([torch.cat([g.reshape(-1) for g in ref_mem[k][:n]]) for k in range(t)])
    ref = gem_paper(flat_cur.sum(0).numpy(), flat_mem.numpy())
    gem = GEM(torch.optim.SGD(model.parameters(), lr=0.1), capture_task_params=capture_task_params)
    result = gem.gem_backward(
        [model.loss(x, y, k) for k, (x, y) in enumerate(cur)],
        memory_losses=[model.loss(x, y, k) for k, (x, y) in enumerate(mem)],
    )
    assert not result.skipped and result.weights.shape == (2 * t,)
    got = torch.cat([p.grad.reshape(-1) for p in model.encoder.parameters()])
    assert rel(got, ref) < 1e-5
    for k in range(t):  # heads: the current batch's gradient only (memory gradients only constrain)
        assert torch.allclose(
            model.heads[k].weight.grad.double(), ref_cur[k][n + 2 * k], rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_skips_the_step_without_calling_the_solver(bad):
    p = torch.nn.Parameter(torch.zeros(10))
    head = torch.nn.Parameter(torch.zeros(2))
    buf = TaskGradientBuffer([p], 3, task_params=[head])
    for t in range(3):
        p.grad = torch.randn(10)
        if t == 1:
            p.grad[4] = bad
        buf.capture(t)

    def solver_must_not_run(gram, generator=None):
        raise AssertionError("a non-finite Gram reached the solver")

    result = buf.apply(solver_must_not_run)
    assert result.skipped and result.nonfinite_tasks == [1] and result.weights is None
    assert p.grad is None and buf.skipped_steps == 1
    # a non-finite task-specific gradient skips too
    for t in range(3):
        p.grad = torch.randn(10)
        buf.capture(t)
    head.grad = torch.tensor([1.0, bad])
    result = buf.apply(solver_must_not_run)
    assert result.skipped and result.nonfinite_tasks == [] and result.nonfinite_task_params
    assert buf.skipped_steps == 2


def test_wrapper_step_is_skipped_on_nonfinite_loss():
    model = TinyMultiTask(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pc = PCGrad(opt)
    before = [p.detach().clone() for p in model.parameters()]
    batches = task_batches(2)
    losses = [model.loss(x, y, k) for k, (x, y) in enumerate(batches)]
    losses[1] = losses[1] * float("inf")
    result = pc.pc_backward(losses)
    assert result.skipped and pc.skipped_steps == 1
    pc.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_loss_scale_does_not_change_the_update_and_fp16_gram_does_not_overflow():
    grads = random_grads(3, 200, 8)
    w1 = pcgrad_weights(grads @ grads.T, generator=torch.Generator().manual_seed(0))
    s = 2.0**16
    w2 = pcgrad_weights((s * grads) @ (s * grads).T, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(w1, w2, rtol=1e-12)
    # fp16 gradients of a scaled loss: |g|^2 far beyond fp16's 65504, fine in the fp32 Gram
    p = torch.nn.Parameter(torch.zeros(200, dtype=torch.float16))
    buf = TaskGradientBuffer([p], 3, torch.float16)
    g16 = (grads * 300).to(torch.float16)
    for t in range(3):
        p.grad = g16[t].clone()
        buf.capture(t)
    result = buf.apply(gem_weights)
    assert not result.skipped and torch.isfinite(result.gram).all()
    assert float(result.gram[0, 0]) > 65504
    ref = gem_paper(g16.double().sum(0).numpy(), g16.double().numpy())
    assert rel(p.grad, ref) < 2e-3  # the update is stored in fp16


def test_buffer_input_errors():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="num_tasks"):
        TaskGradientBuffer([p], 0)
    with pytest.raises(ValueError, match="num_tasks"):
        TaskGradientBuffer([p], 129)  # MAX_TASKS + 1
    with pytest.raises(TypeError, match="dtype"):
        TaskGradientBuffer([p], 2, torch.int32)
    with pytest.raises(ValueError, match="params is empty"):
        TaskGradientBuffer([], 2)
    with pytest.raises(ValueError, match="both shared"):
        TaskGradientBuffer([p], 2, task_params=[p])
    buf = TaskGradientBuffer([p], 2)
    with pytest.raises(ValueError, match="task must be"):
        buf.capture(2)
    p.grad = torch.ones(3)
    buf.capture(0)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="already captured"):
        buf.capture(0)
    buf.capture(0, accumulate=True)
    result = buf.apply(sum_weights)
    assert torch.equal(p.grad, torch.full((3,), 2.0))  # task 0 twice (accumulated), task 1 absent (zero)
    assert torch.equal(result.weights, torch.ones(2))
    with pytest.raises(TypeError, match="losses"):
        PCGrad(torch.optim.SGD([p], lr=1.0)).pc_backward(torch.zeros(()))


def test_excessmtl_surgery_optimizer_equals_torchjd_and_checkpoints():
    """``SurgeryOptimizer(method="excessmtl")`` on the buffer: the update is TorchJD 0.18's ``ExcessMTLWeighting``
    of the shared parameters' per-task Jacobian over 4 steps (its state carried on), also after a state_dict
    round trip at step 2; the streaming mode refuses it, naming the option and the fix."""
    tja = pytest.importorskip("torchjd.aggregation", reason="torchjd (dev extra) is the reference")
    from fastpals.surgery import StreamingTaskGradients, SurgeryOptimizer, make_weighting

    t = 3
    model = TinyMultiTask(t)
    shared = list(model.encoder.parameters())
    wrapped = SurgeryOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), "excessmtl", robust_step_size="0.5"
    )
    ref = tja.ExcessMTLWeighting(robust_step_size=0.5)
    for step in range(4):
        batches = task_batches(t, seed=step)
        jac = torch.stack(
            [torch.cat([g.reshape(-1) for g in gs[: len(shared)]]) for gs in per_task_grads(model, batches)]
        )
        want = ref(jac.float()).double() @ jac
        wrapped.backward([model.loss(x, y, k) for k, (x, y) in enumerate(batches)])
        got = torch.cat([p.grad.reshape(-1) for p in shared])
        assert rel(got, want.numpy()) < 1e-4, step
        if step == 2:  # the state goes through the checkpoint
            saved = wrapped.state_dict()
            assert saved["surgery"]["step"] == 3
            wrapped = SurgeryOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), "excessmtl", robust_step_size=0.5
            )
            wrapped.load_state_dict(saved)
        wrapped.step()
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="use --surgery-memory buffer"):
        StreamingTaskGradients([p], 2).apply(make_weighting("excessmtl")[0])
