"""TorchJD 0.18's further weightings (fastpals.surgery.weights_basic and CR-MOGM) against TorchJD's own
``*Weighting`` classes on the same Gram matrices (stateful ones over several calls), TorchJD's value table
(its ``tests/unit/aggregation/test_values.py``), and their use by name (``--surgery NAME``,
``make_weighting``, ``SurgeryOptimizer`` with a checkpointed state)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_aggregators import rel_dir, task_gradients  # noqa: E402

from fastpals.surgery import (  # noqa: E402
    AGGREGATORS,
    STATEFUL,
    CRMOGMState,
    MoDoState,
    SDMGradState,
    SurgeryOptimizer,
    make_weighting,
)
from fastpals.surgery.weights_basic import (  # noqa: E402
    ExcessMTLState,
    PCDState,
    excessmtl_weights,
    project_onto_simplex,
)

tja = pytest.importorskip("torchjd.aggregation", reason="torchjd (dev extra) is needed for the comparisons")
F64 = torch.float64
NEW = ["constant", "random", "krum", "modo", "sdmgrad", "crmogm", "pcd", "excessmtl"]
GRAMS = [(t, kind) for t in (3, 5, 16, 64) for kind in ("full", "lowrank", "conflict")]


def gram(t, kind, seed=0):
    j = task_gradients(t, kind, seed, dim=max(40, 2 * t))
    return j @ j.T


def test_registered_by_name_with_their_states():
    assert list(AGGREGATORS)[-len(NEW) :] == NEW
    assert STATEFUL["modo"] is MoDoState and STATEFUL["sdmgrad"] is SDMGradState
    assert STATEFUL["crmogm"] is CRMOGMState and STATEFUL["pcd"] is PCDState
    assert STATEFUL["excessmtl"] is ExcessMTLState


def test_simplex_projection_is_torchjds():
    from torchjd.aggregation._utils.simplex import project_onto_simplex as ref

    gen = torch.Generator().manual_seed(0)
    for t in (1, 2, 3, 7, 64):
        for scale in (0.1, 1.0, 30.0):
            y = scale * torch.randn(t, dtype=F64, generator=gen)
            torch.testing.assert_close(project_onto_simplex(y), ref(y), rtol=0, atol=1e-14)


def test_constant_and_random_equal_torchjd():
    g = gram(5, "full")
    w = torch.tensor([1.0, 2.0, 0.5, 0.0, -1.0], dtype=F64)
    fn, _ = make_weighting("constant", weights="1,2,0.5,0,-1")
    torch.testing.assert_close(fn(g), tja.ConstantWeighting(w)(g), rtol=0, atol=0)
    for seed in range(3):
        torch.manual_seed(seed)
        ref = tja.RandomWeighting()(g)
        got = AGGREGATORS["random"](g, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-15)


@pytest.mark.parametrize("n_byzantine, n_selected", [(0, 1), (1, 2), (1, 4)])
def test_krum_equals_torchjd(n_byzantine, n_selected):
    for t, kind in GRAMS:
        if t < max(n_byzantine + 3, n_selected):
            continue
        g = gram(t, kind, 1)
        ref = tja.KrumWeighting(n_byzantine, n_selected)(g)
        got = AGGREGATORS["krum"](g, n_byzantine=n_byzantine, n_selected=n_selected)
        torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=f"T={t} {kind}")


def run_steps(name, ref, options, steps=4, grams=GRAMS):
    """The fastpals weighting and the TorchJD one over ``steps`` calls on changing Grams: the largest
    difference of the weights."""
    state = STATEFUL[name]()
    worst = 0.0
    for t, kind in grams:
        state.reset()
        ref.reset()
        for step in range(steps):
            g = gram(t, kind, step)
            got = AGGREGATORS[name](g, state, **options)
            want = ref(g)
            worst = max(worst, float((got - want).abs().max()))
    return worst


def test_modo_equals_torchjd_over_steps():
    assert run_steps("modo", tja.MoDoWeighting(gamma=0.1, rho=0.1), {}) < 1e-12
    assert run_steps("modo", tja.MoDoWeighting(gamma=1e-3, rho=0.0), {"gamma": 1e-3, "rho": 0.0}) < 1e-12


def test_sdmgrad_equals_torchjd_over_steps():
    assert run_steps("sdmgrad", tja.SDMGradWeighting(), {}, steps=3) < 1e-10
    pref = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    state, ref = SDMGradState(), tja.SDMGradWeighting(lambda_=1.0, momentum=0.0, pref_vector=pref)
    for step in range(3):
        g = gram(3, "conflict", step)
        got = AGGREGATORS["sdmgrad"](g, state, lambda_=1.0, momentum=0.0, pref_vector=pref)
        torch.testing.assert_close(got, ref(g), rtol=0, atol=1e-10)


def test_crmogm_equals_torchjd_over_steps():
    for base, ref_base in (("mgda", tja.MGDAWeighting()), ("upgrad", tja.UPGradWeighting())):
        small = [(t, kind) for t, kind in GRAMS if t <= 16]  # TorchJD's UPGrad: T quadprog solves per call
        worst = run_steps("crmogm", tja.CRMOGMWeighting(ref_base, alpha=0.9), {"base": base}, grams=small)
        assert worst < 1e-6, (base, worst)  # the base weightings agree with TorchJD's to ~1e-7 relative


G_BASE = (
    torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]]) @ torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]]).T
)
J_KRUM = torch.tensor(
    [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [75.0, -666.0, 23.0], [1.0, 2.0, 3.0], [2.0, 0.0, 1.0]]
)


def test_torchjd_value_table():
    fn, _ = make_weighting("constant", weights="1,2")
    torch.testing.assert_close(fn(G_BASE), torch.tensor([1.0, 2.0]), rtol=0, atol=1e-4)
    torch.testing.assert_close(
        AGGREGATORS["krum"](J_KRUM @ J_KRUM.T, n_byzantine=1, n_selected=4),
        torch.tensor([0.25, 0.25, 0.0, 0.25, 0.25]),
        rtol=0,
        atol=1e-4,
    )


@pytest.mark.parametrize("name", ["modo", "sdmgrad", "crmogm", "krum", "random"])
def test_surgery_optimizer_trains_and_checkpoints(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    opt = SurgeryOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), method=name)
    x = torch.randn(16, 6)
    first = None
    for _ in range(3):
        losses = [model(x)[:, k].pow(2).mean() for k in range(4)]
        first = first if first is not None else sum(float(v) for v in losses)
        opt.zero_grad()
        opt.backward(losses)
        opt.step()
    assert sum(float(model(x)[:, k].pow(2).mean()) for k in range(4)) < first
    if name in STATEFUL:
        saved = opt.state_dict()
        again = SurgeryOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), method=name)
        again.load_state_dict(saved)
        torch.testing.assert_close(again.weighting_state.weights, opt.weighting_state.weights.cpu())


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: make_weighting("constant", weights="1,2")[0](torch.eye(3)), "option weights"),
        (lambda: make_weighting("crmogm", base="nashmtl")[0](torch.eye(3)), "base="),
        (lambda: AGGREGATORS["krum"](torch.eye(3), n_byzantine=1), "krum: needs"),
        (lambda: make_weighting("pcd", tau="1.5")[0](torch.eye(3)), "option tau"),
        (lambda: make_weighting("pcd", tau="0.1,0.2,0.3")[0](torch.eye(3)), "option tau"),
        (lambda: excessmtl_weights(torch.eye(3), ExcessMTLState(), robust_step_size=0.0), "robust_step_size"),
    ],
)
def test_bad_options_name_the_option(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("options", [{}, {"tau": 0.3, "beta": 0.9}])
def test_pcd_equals_torchjd_over_steps(options):
    """PCD's update direction over 4 calls (its moving average of the squared norms carried) within 1e-4 of
    TorchJD's, T = 2..64 on random, rank-deficient and conflicting gradients in float64, and on the full-rank
    ones in float32 (a rounded rank-deficient Gram is a different, degenerate problem)."""
    bad = []
    for t, kind in [(2, "conflict")] + GRAMS:
        for dtype in (F64, torch.float32) if kind != "lowrank" else (F64,):
            state, ref = PCDState(), tja.PCDWeighting(**options)
            for step in range(4):
                j = task_gradients(t, kind, step, dim=max(40, 2 * t))
                g = (j @ j.T).to(dtype)
                err = rel_dir(AGGREGATORS["pcd"](g, state, **options), ref(g), j)
                if err > 1e-4:
                    bad.append((err, t, kind, dtype, step))
    assert not bad, f"pcd: direction differs from TorchJD's on {bad}"


def test_pcd_tau_per_task_from_a_string():
    g = gram(3, "conflict")
    fn, state = make_weighting("pcd", tau="0.1,0.6", beta="0.5")
    ref = tja.PCDWeighting(tau=torch.tensor([0.1, 0.6], dtype=F64), beta=0.5)
    for _ in range(2):
        torch.testing.assert_close(fn(g), ref(g), rtol=1e-6, atol=1e-10)
    assert isinstance(state, PCDState) and state.step == 2


@pytest.mark.parametrize("n_warmup_steps", [0, 2])
def test_excessmtl_equals_torchjd_over_steps(n_warmup_steps):
    for t in (2, 5, 64):
        for dtype in (F64, torch.float32):
            state = ExcessMTLState()
            ref = tja.ExcessMTLWeighting(robust_step_size=0.5, n_warmup_steps=n_warmup_steps)
            for step in range(5):
                j = task_gradients(t, "conflict", step, dim=max(40, 2 * t)).to(dtype)
                got = excessmtl_weights(j, state, robust_step_size=0.5, n_warmup_steps=n_warmup_steps)
                assert got.dtype == dtype
                torch.testing.assert_close(
                    got, ref(j), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12
                )


def test_pcd_and_excessmtl_torchjd_values():
    """The weights TorchJD 0.18's ``PCDWeighting()`` and ``ExcessMTLWeighting()`` give for
    ``J = [[-4, 1, 1], [6, 1, 1]]`` (first call)."""
    j = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(
        AGGREGATORS["pcd"](G_BASE, PCDState()), torch.tensor([1.8481, 1.0954]), rtol=0, atol=1e-4
    )
    torch.testing.assert_close(
        excessmtl_weights(j, ExcessMTLState()), torch.tensor([0.1192, 0.8808]), rtol=0, atol=1e-4
    )


def test_pcd_surgery_optimizer_trains_and_checkpoints():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    opt = SurgeryOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), method="pcd")
    x = torch.randn(16, 6)
    first = float(model(x)[:, 0].pow(2).mean().detach())
    for _ in range(3):
        opt.zero_grad()
        opt.backward([model(x)[:, k].pow(2).mean() for k in range(4)])
        opt.step()
    assert float(model(x)[:, 0].pow(2).mean().detach()) < first  # the primary task descends
    again = SurgeryOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), method="pcd")
    again.load_state_dict(opt.state_dict())
    assert again.weighting_state.step == 3
    torch.testing.assert_close(again.weighting_state.sq_norm_ema, opt.weighting_state.sq_norm_ema.cpu())
