"""The compiled weight solve ``torch.ops.fastpals.solve_weights`` (``csrc/``) against the PyTorch solvers it
replaces (float64: weights within 1e-10 where the arithmetic is the same algorithm's; GEM, whose PyTorch solve
uses LU where the compiled one uses Gauss-Jordan, within 1e-8 in its QP objective; FairGrad's and Nash-MTL's
Newton root within 1e-8) and against TorchJD 0.18's weighting of the same name (update direction within 1e-4),
for T = 2..64 on random, conflicting and rank-deficient Grams, float32 and float64; TorchJD's own value table
(its ``test_values.py``, ``J = [[-4, 1, 1], [6, 1, 1]]``) reproduced. The op is built once per machine (just in
time, cached) and shared by every test."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_aggregators import project_dual_cone, rel_dir, task_gradients, torchjd_weighting  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fastpals.surgery import AGGREGATORS, STATEFUL, SurgeryOptimizer, compiled, upgrad_weights  # noqa: E402
from fastpals.surgery.weights_basic import gem_weights  # noqa: E402

tja = pytest.importorskip("torchjd.aggregation", reason="torchjd (dev extra) is needed for the comparisons")
F64 = torch.float64
# every Gram aggregator solves through the op (asserted below); CR-MOGM smooths its base's solve; ExcessMTL
# reads the gradient rows, not the Gram
METHODS = tuple(n for n, fn in AGGREGATORS.items() if n != "crmogm" and not getattr(fn, "reads_rows", False))
SIZES = (2, 3, 5, 8, 16, 17, 33, 64)
KINDS = ("full", "lowrank", "conflict")
# the PyTorch Jacobi solver takes ~0.4 s at T = 64: every kind up to 16, one each beyond
REF_CASES = [(t, kind) for t in (2, 3, 5, 8, 16) for kind in KINDS] + [
    (17, "full"),
    (33, "lowrank"),
    (64, "conflict"),
]


@pytest.fixture(scope="module", autouse=True)
def op():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the PyTorch solvers run (tests/test_aggregators.py covers them)")
    assert compiled.load(), "the compiled weight solve did not build (see the 'fastpals:' line above)"


def weights(name, g):
    """``AGGREGATORS[name]`` on ``g`` (a fresh state for a stateful one; GradVac's orders from seed 0)."""
    gen = torch.Generator().manual_seed(0)
    if name in STATEFUL:
        return AGGREGATORS[name](g, STATEFUL[name](), generator=gen)
    return AGGREGATORS[name](g, generator=gen)


class SolveCalls(TorchDispatchMode):
    """Counts the ``fastpals::solve_weights`` calls dispatched inside the block."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.fastpals.solve_weights.default
        return func(*args, **(kwargs or {}))


def pytorch_solver(name, g, monkeypatch):
    monkeypatch.setenv("FASTPALS_SOLVE", "torch")
    try:
        return weights(name, g)
    finally:
        monkeypatch.delenv("FASTPALS_SOLVE")


def kind_for(name, kind):
    """FairGrad's and Nash-MTL's root exists only when no non-negative combination of the gradients vanishes:
    their rank-deficient Grams mix the gradients with positive coefficients."""
    return "lowrank_pos" if kind == "lowrank" and name in ("fairgrad", "nashmtl") else kind


def gem_objective(w, g):
    """GEM's dual objective at ``v = w - 1`` (the default proposal ``sum``): ``1/2 v^T G v + v^T G 1``."""
    v = w.to(F64) - 1.0
    return float(0.5 * v @ g @ v + v @ g @ torch.ones_like(v))


@pytest.mark.parametrize("name", METHODS)
def test_compiled_equals_the_pytorch_solver(name, monkeypatch):
    with SolveCalls() as calls:
        weights(name, torch.eye(4, dtype=F64) + 0.5)
    assert calls.count == 1, f"{name}: {calls.count} compiled solves in one call"
    worst = []
    for t, kind in REF_CASES:
        if name == "krum" and t < 3:  # Krum needs T >= n_byzantine + 3
            continue
        j = task_gradients(t, kind_for(name, kind), 1, dim=max(40, 2 * t))
        g = j @ j.T
        # PCD on a rounded rank-deficient Gram is a degenerate QP (multipliers not unique, infeasibility decided
        # at a threshold): float64 only there
        for dtype in (F64,) if name == "pcd" and kind == "lowrank" else (F64, torch.float32):
            w_ref = pytorch_solver(name, g.to(dtype), monkeypatch)
            w = weights(name, g.to(dtype))
            assert w.dtype == w_ref.dtype == dtype and w.shape == (t,)
            if name == "gem":  # a QP: the optimum's objective
                gd = g.to(dtype).to(F64)
                f, f_ref = gem_objective(w, gd), gem_objective(w_ref, gd)
                err = abs(f - f_ref) / max(abs(f_ref), float(gd.diagonal().max()))
                tol = 1e-8
            else:
                err = float((w - w_ref).abs().max() / w_ref.abs().max().clamp_min(1e-300))
                tol = 1e-10 if dtype == F64 else 2 * torch.finfo(torch.float32).eps
                if name in ("fairgrad", "nashmtl") and dtype == F64:
                    # Newton's solves: LAPACK's blocked LU there, an unblocked one in the op; on the
                    # rank-deficient Grams the root's conditioning amplifies that round-off to ~1e-9
                    tol = 1e-8
            worst.append((err, tol, t, kind, dtype))
    bad = [x for x in worst if x[0] > x[1]]
    assert not bad, f"{name}: compiled solve differs from the PyTorch solver on {bad}"


def test_gradvac_state_over_steps_equals_the_pytorch_solver(monkeypatch):
    """GradVac's targets live in the op's ``state`` tensor, updated in place: weights and targets over 4 calls
    equal the PyTorch solver's."""
    for t in (2, 5, 16, 64):
        compiled_state, torch_state = STATEFUL["gradvac"](), STATEFUL["gradvac"]()
        for step in range(4):
            g = task_gradients(t, "conflict", step, dim=max(40, 2 * t))
            g = g @ g.T
            w = AGGREGATORS["gradvac"](g, compiled_state, torch.Generator().manual_seed(step), beta=0.3)
            monkeypatch.setenv("FASTPALS_SOLVE", "torch")
            w_ref = AGGREGATORS["gradvac"](g, torch_state, torch.Generator().manual_seed(step), beta=0.3)
            monkeypatch.delenv("FASTPALS_SOLVE")
            scale = float(w_ref.abs().max())
            assert float((w - w_ref).abs().max()) <= 1e-10 * scale, (t, step)
            assert float((compiled_state.phi - torch_state.phi).abs().max()) <= 1e-10, (t, step)


@pytest.mark.parametrize("name", ("imtlg", "alignedmtl", "upgrad", "dualproj", "mgda", "fairgrad"))
def test_compiled_direction_matches_torchjd(name):
    ref = torchjd_weighting(name)
    bad = []
    for t in SIZES:
        for kind in KINDS:
            j = task_gradients(t, kind_for(name, kind), 2, dim=max(40, 2 * t))
            g = j @ j.T
            # a float32 Gram is its own problem: rounding makes a rank-deficient or conflicting one a different,
            # ill-conditioned problem; full-rank ones are compared (TorchJD solving the rounded Gram in float64)
            for dtype in (F64, torch.float32) if kind == "full" else (F64,):
                g_in = g.to(dtype)
                err = rel_dir(AGGREGATORS[name](g_in), ref(g_in.to(F64)), j)
                if err > 1e-4:
                    bad.append((err, t, kind, dtype))
    assert not bad, f"{name}: direction differs from TorchJD's on {bad}"


def test_gem_update_is_the_projection_of_the_sum_onto_the_dual_cone():
    """GEM with the default proposal (the sum) and every task constrained: the update is the Euclidean
    projection of the summed gradient onto ``{z : J z >= 0}`` (scipy's NNLS on the explicit vectors)."""
    for t in (2, 5, 16, 64):
        j = task_gradients(t, "conflict", 3, dim=max(40, 2 * t))
        z = gem_weights(j @ j.T) @ j
        z_ref = torch.from_numpy(project_dual_cone(j.sum(0).numpy(), j.numpy()))
        assert float((z - z_ref).norm() / z_ref.norm()) < 1e-6, t


# TorchJD's value table (tests/unit/aggregation/test_values.py of its repository): weightings of G = J J^T
J_BASE = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
VALUES = {
    "alignedmtl": [0.5591, 0.4083],
    "dualproj": [0.6109, 0.5000],
    "imtlg": [0.5923, 0.4077],
    "mgda": [0.6000, 0.4000],
    "upgrad": [1.1109, 0.7894],
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_torchjd_value_table(name):
    w = AGGREGATORS[name](J_BASE @ J_BASE.T)
    torch.testing.assert_close(w, torch.tensor(VALUES[name]), rtol=0, atol=1e-4)


def test_one_op_under_fake_tensors_and_torch_compile():
    """The solve is one ``fastpals::solve_weights`` node: its fake gives the shape and dtype, and a compiled
    graph of the weighting calls it once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = AGGREGATORS["upgrad"](torch.empty(7, 7, dtype=torch.float32))
    assert w.shape == (7,) and w.dtype == torch.float32
    j = task_gradients(6, "conflict", 4)
    gram = j @ j.T
    graph = torch.fx.experimental.proxy_tensor.make_fx(lambda g: AGGREGATORS["imtlg"](g))(gram)
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "solve_weights" in str(n.target)]
    assert len(calls) == 1
    torch.testing.assert_close(graph(gram), AGGREGATORS["imtlg"](gram), rtol=0, atol=0)


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_with_the_extension_runs_a_surgery_update(tmp_path):
    """``FASTPALS_BUILD_EXT=1 pip wheel .`` (a copy of the checkout, so that no ``build/`` is left in it) ships
    ``fastpals/_C``; installed into a fresh venv, its UPGrad update runs the compiled solve from it."""
    import os
    import subprocess
    import sysconfig
    import venv

    src = tmp_path / "src"
    skip = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", "*.so"
    )
    shutil.copytree(ROOT, src, ignore=skip, symlinks=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FASTPALS_SOLVE")}
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp_path)],
        capture_output=True, text=True, env={**env, "FASTPALS_BUILD_EXT": "1"}, timeout=900,
    )  # fmt: skip
    assert build.returncode == 0, (build.stdout + build.stderr)[-3000:]
    (wheel,) = tmp_path.glob("fastpals-*.whl")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    assert subprocess.run([*pip, str(wheel)], env=env, timeout=600).returncode == 0
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "_deps_from_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import torch\n"
        "from fastpals.surgery import SurgeryOptimizer\n"
        "model = torch.nn.Linear(4, 3)\n"
        "opt = SurgeryOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), method='upgrad')\n"
        "x = torch.randn(8, 4)\n"
        "losses = [model(x)[:, k].pow(2).mean() for k in range(3)]\n"
        "opt.zero_grad(); opt.backward(losses); opt.step()\n"
        "print('ok')\n"
    )
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
    assert f"installed extension {site}/fastpals/_C" in run.stderr, run.stderr[-2000:]


def test_surgery_upgrad_run_gives_the_pytorch_solver_weights(monkeypatch):
    """The Grams of real ``SurgeryOptimizer(method="upgrad")`` updates (a small MLP, 4 regression tasks with
    conflicting targets) get the same weights from the compiled op as from the PyTorch solver, within 1e-6."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = SurgeryOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), method="upgrad")
    seen, solve = [], opt.weighting

    def recording(gram, generator=None):
        seen.append((gram.clone(), solve(gram, generator)))
        return seen[-1][1]

    opt.weighting = recording
    x = torch.randn(64, 8)
    y = torch.cat([x[:, :2], -x[:, :2]], dim=1) + 0.1 * torch.randn(64, 4)  # tasks 0, 2 and 1, 3 conflict
    for _ in range(6):
        opt.zero_grad()
        opt.backward([(model(x)[:, k] - y[:, k]).pow(2).mean() for k in range(4)])
        opt.step()
    assert len(seen) == 6 and all(compiled.enabled(g) for g, _ in seen)
    assert all(float(g.min()) < 0 for g, _ in seen)  # conflicting gradients: the dual-cone QP is active
    monkeypatch.setenv("FASTPALS_SOLVE", "torch")
    errors = [float((w - upgrad_weights(g)).abs().max() / w.abs().max()) for g, w in seen]
    assert max(errors) <= 1e-6, errors


def test_a_killed_build_does_not_block_the_next_one():
    """A build killed mid-way leaves torch's ``lock`` file in the cache; the next process must build (or load)
    instead of waiting on it forever."""
    import os
    import subprocess

    lock = compiled.build_directory() / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    code = "from fastpals.surgery import compiled; assert compiled.load()"
    env = {k: v for k, v in os.environ.items() if k != "FASTPALS_SOLVE"}
    try:
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the next load waited on the killed build's lock file")
    finally:
        lock.unlink(missing_ok=True)
    assert run.returncode == 0, run.stderr[-2000:]
