"""The aggregators never read a device value on the host, run fixed iteration budgets, and kept their weights.

- Fake: every aggregator of :data:`fastpals.surgery.AGGREGATORS` runs on a Gram matrix that is a
  ``FakeTensorMode`` tensor (T = 2, 3, 5; float32 and float64; default and non-default options; the stateful ones
  over several steps, and through :func:`make_weighting`). A fake tensor carries no data: any data-dependent read
  (``.item()``, ``.tolist()``, ``float(t)``, ``bool(t)``, ``if t:``, ``torch.equal``, ``nonzero``, boolean-mask
  indexing, indexing with a 0-dim tensor) raises inside fake mode.
- Meta: the same calls on a ``meta``-device Gram (the stand-in for CUDA on a CPU-only machine) under a dispatch
  mode that records every aten op: no op that reads device data back, no ``torch.linalg`` op that checks its
  errors on the host (``eigh``, ``svd``, ``pinv``, ``*_ex`` with ``check_errors=True``), no boolean-mask index,
  and every host-to-device copy is ``non_blocking`` (a blocking one synchronises the stream on CUDA).
- Values: the weights equal, within 1e-5, those the code produced before the sync-free rewrite (commit
  512dd0d, recorded below) on float32 Gram matrices with conflicting, non-conflicting, rank-deficient and
  zero-row tasks, T = 2, 3, 5, default and non-default options, two steps of the stateful methods.
- Fixed budgets: :func:`jacobi_eigh` matches ``torch.linalg.eigh``, and running a solver past its default budget
  leaves the weights unchanged (the iterate is frozen or a fixed point once converged).

Every test has ``fake`` in its name (``pytest -k fake``).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fastpals.surgery import AGGREGATORS, STATEFUL, GradVacState, NashMTLState, make_weighting
from fastpals.surgery.solvers import _round_robin, jacobi_eigh, jacobi_sweeps

F64 = torch.float64
NAMES = list(AGGREGATORS)


def real_gram(t: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A positive semidefinite ``[T, T]`` Gram of ``T`` random 50-dimensional gradients (some conflicting)."""
    g = torch.randn(t, 50, dtype=F64, generator=torch.Generator().manual_seed(100 * t + seed))
    return (g @ g.T).to(dtype)


def call(name: str, gram: torch.Tensor, state: object = None, seed: int = 0, **options) -> torch.Tensor:
    """``AGGREGATORS[name]`` as the real API takes it: ``fn(gram, [state,] generator=...)``."""
    fn = AGGREGATORS[name]
    gen = torch.Generator().manual_seed(seed)
    if name in STATEFUL:
        return fn(gram, STATEFUL[name]() if state is None else state, generator=gen, **options)
    return fn(gram, generator=gen, **options)


def option_variants(t: int) -> list[tuple[str, dict]]:
    """Non-default options of every method (tensors are created by the caller's mode: call inside it)."""
    pref = torch.linspace(1.0, 2.0, t, dtype=F64)
    pref = pref / pref.sum()
    orders = torch.stack([torch.tensor([j for j in range(t) if j != i]) for i in range(t)])
    return [
        ("pcgrad", {"orders": orders}),
        ("gem", {"proposal": 0}),
        ("gem", {"proposal": "mean"}),
        ("gem", {"proposal": pref, "constraints": list(range(1, t)), "max_iter": 5}),
        ("upgrad", {"pref_vector": pref, "reg_eps": 0.0, "max_iter": 7}),
        ("dualproj", {"pref_vector": pref, "norm_eps": 0.0}),
        ("mgda", {"epsilon": 1e-6, "max_iters": 17}),
        ("imtlg", {"sweeps": 3}),
        ("cagrad", {"c": 0.0}),
        ("cagrad", {"c": 0.9}),
        ("alignedmtl", {"scale_mode": "median", "pref_vector": pref}),
        ("alignedmtl", {"scale_mode": "rmse", "sweeps": 2}),
        ("fairgrad", {"alpha": 0.0}),
        ("fairgrad", {"alpha": 2.0, "max_iter": 5}),
        ("nashmtl", {"max_norm": 0.0, "max_iter": 3}),
        ("gradvac", {"beta": 0.1, "orders": orders}),
    ]


# ---------------------------------------------------------------------------------------------------------------
# fake tensors: any data-dependent host read raises


@pytest.mark.parametrize("t", [2, 3, 5])
@pytest.mark.parametrize("name", NAMES)
def test_fake_gram_every_aggregator(name, t):
    if name == "krum" and t < 3:
        pytest.skip("Krum needs T >= n_byzantine + 3")
    gram = real_gram(t)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(gram)
        w = call(name, fake)
    assert isinstance(w, FakeTensor)
    assert w.shape == (t,) and w.dtype == torch.float32 and w.device == gram.device


@pytest.mark.parametrize("name", NAMES)
def test_fake_float64_gram(name):
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real_gram(4, dtype=F64))
        w = call(name, fake)
    assert isinstance(w, FakeTensor) and w.shape == (4,) and w.dtype == F64


@pytest.mark.parametrize("t", [2, 3, 5])
def test_fake_gram_non_default_options(t):
    gram = real_gram(t, seed=1)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(gram)
        for name, options in option_variants(t):
            w = call(name, fake, **options)
            assert isinstance(w, FakeTensor) and w.shape == (t,), (name, options)


@pytest.mark.parametrize("name", NAMES)
def test_fake_gram_through_make_weighting(name):
    fn, state = make_weighting(name)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real_gram(3))
        for step in range(3):
            w = fn(fake, generator=torch.Generator().manual_seed(step))
            assert isinstance(w, FakeTensor) and w.shape == (3,)


def test_fake_stateful_methods_keep_their_state_on_the_device_over_steps():
    nash, vac = NashMTLState(), GradVacState()
    with FakeTensorMode() as mode:
        for step in range(4):
            fake = mode.from_tensor(real_gram(3, seed=step))
            gen = torch.Generator().manual_seed(step)
            w1 = AGGREGATORS["nashmtl"](fake, nash, generator=gen, update_weights_every=2)
            w2 = AGGREGATORS["gradvac"](fake, vac, generator=gen)
            assert w1.shape == w2.shape == (3,)
            # the state tensors never left the (fake) device: nothing was read back to build them
            assert isinstance(nash.weights, FakeTensor) and isinstance(vac.phi, FakeTensor)
    assert nash.step == 4 and vac.phi.shape == (3, 3)


# ---------------------------------------------------------------------------------------------------------------
# meta device: every aten op recorded


# ops that read device data back to the host, have a data-dependent output size, or check errors on the host
HOST_READS = {
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "nonzero_numpy", "argwhere",
    "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "_assert_async", "_assert_scalar", "repeat_interleave", "bincount",
    "_linalg_check_errors", "_linalg_eigh", "linalg_eigh", "linalg_eigvalsh", "_linalg_svd", "linalg_svd",
    "linalg_svdvals", "linalg_pinv", "linalg_eig", "linalg_eigvals", "linalg_lstsq", "linalg_matrix_rank",
    "linalg_inv", "inverse", "linalg_solve", "linalg_cholesky", "cholesky", "_linalg_det", "_linalg_slogdet",
}  # fmt: skip


class OpAudit(TorchDispatchMode):
    """Records every aten op and collects the ones a CUDA run would have to synchronise for."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.problems: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count += 1
        schema = func._schema
        op = schema.name.split("::")[-1]
        if op in HOST_READS:
            self.problems.append(f"{op}: reads the device / checks errors on the host")
        for i, arg in enumerate(schema.arguments):
            if arg.name == "check_errors":
                value = kwargs.get("check_errors", args[i] if i < len(args) else arg.default_value)
                if value:
                    self.problems.append(f"{op}: check_errors=True")
        if op in ("index", "index_put", "index_put_", "_index_put_impl_"):
            for idx in args[1]:
                if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
                    self.problems.append(f"{op}: boolean-mask index (data-dependent size)")
        if op == "_to_copy" and isinstance(args[0], torch.Tensor):
            dst = kwargs.get("device")
            if dst is not None and torch.device(dst) != args[0].device:
                self.check_copy(op, args[0].device, torch.device(dst), kwargs.get("non_blocking", False))
        if op == "copy_":
            nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            self.check_copy(op, args[1].device, args[0].device, nb)
        return func(*args, **kwargs)

    def check_copy(self, op: str, src: torch.device, dst: torch.device, non_blocking: bool) -> None:
        if src == dst:
            return
        if dst.type == "cpu":
            self.problems.append(f"{op}: device-to-host copy {src} -> {dst}")
        elif not non_blocking:
            self.problems.append(
                f"{op}: blocking host-to-device copy {src} -> {dst} (syncs the stream on CUDA)"
            )


def audit(fn, *args, **kwargs) -> tuple[torch.Tensor, OpAudit]:
    rec = OpAudit()
    with rec:
        out = fn(*args, **kwargs)
    return out, rec


@pytest.mark.parametrize("t", [2, 3, 5])
@pytest.mark.parametrize("name", NAMES)
def test_fake_meta_gram_no_host_read_no_blocking_copy(name, t):
    if name == "krum" and t < 3:
        pytest.skip("Krum needs T >= n_byzantine + 3")
    gram = torch.empty(t, t, device="meta")
    w, rec = audit(call, name, gram)
    assert w.device.type == "meta" and w.shape == (t,) and w.dtype == torch.float32
    assert rec.count > 0 and not rec.problems, (name, sorted(set(rec.problems)))


@pytest.mark.parametrize("t", [2, 5])
def test_fake_meta_gram_non_default_options_and_states(t):
    gram = torch.empty(t, t, device="meta", dtype=F64)
    problems = []
    for name, options in option_variants(t):
        w, rec = audit(call, name, gram, **options)
        assert w.device.type == "meta" and w.shape == (t,), (name, options)
        problems += [(name, p) for p in rec.problems]
    # constraints as a device tensor are scattered unchecked (no read back); state tensors restored on the host
    # from a checkpoint move to the device without blocking
    idx = torch.arange(1, t, device="meta")
    _, rec = audit(AGGREGATORS["gem"], gram, constraints=idx)
    problems += [("gem", p) for p in rec.problems]
    nash, vac = NashMTLState(), GradVacState()
    nash.load_state_dict({"step": 1, "weights": torch.ones(t, dtype=F64)})
    vac.load_state_dict({"phi": torch.zeros(t, t, dtype=F64)})
    _, rec = audit(AGGREGATORS["nashmtl"], gram, nash, update_weights_every=2)
    problems += [("nashmtl", p) for p in rec.problems]
    _, rec = audit(AGGREGATORS["gradvac"], gram, vac, generator=torch.Generator().manual_seed(0))
    problems += [("gradvac", p) for p in rec.problems]
    assert vac.phi.device.type == "meta"
    assert not problems, sorted(set(problems))


def test_fake_meta_audit_catches_what_it_should():
    """The audit itself: the pre-rewrite ways of doing these things are flagged."""
    g = torch.empty(3, 3, device="meta", dtype=F64)
    flagged = []
    for bad in (
        lambda: torch.linalg.eigh(g),
        lambda: torch.linalg.pinv(g),
        lambda: torch.linalg.solve_ex(g, g[0], check_errors=True),
        lambda: torch.ones(3).to("meta"),
    ):
        _, rec = audit(bad)
        flagged.append(bool(rec.problems))
    _, rec = audit(lambda: (torch.linalg.solve_ex(g, g[0]), torch.ones(3).to("meta", non_blocking=True)))
    assert all(flagged) and not rec.problems
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real_gram(3))
        with pytest.raises(DataDependentOutputException):
            fake[:, torch.argmin(fake[0])].sum()  # indexing with a 0-dim tensor reads it on the host
        with pytest.raises(DataDependentOutputException):
            bool((fake > 0).all())


def test_fake_suite_no_torch_tensor_from_python_data_on_the_gram_device():
    """``torch.tensor(x, device=d)`` copies host data with a blocking copy (a stream sync on CUDA) and bypasses
    dispatch modes, so the audit above cannot see it: the aggregator sources must not contain it."""
    import ast
    import inspect

    import fastpals.surgery.weights_basic as aggregators
    import fastpals.surgery.weights_solved as weightings

    found = []
    for module in (aggregators, weightings):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("tensor", "as_tensor")
                and any(k.arg == "device" for k in node.keywords)
            ):
                found.append(f"{module.__name__}:{node.lineno}")
    assert not found, found


# ---------------------------------------------------------------------------------------------------------------
# fixed budgets: the Jacobi eigensolver, and iterations past convergence


def test_fake_suite_round_robin_pairs_every_index_once_per_sweep():
    for n in (2, 4, 6, 8, 32):
        p, q = _round_robin(n, torch.device("cpu"))
        assert p.shape == q.shape == (n - 1, n // 2)
        for r in range(n - 1):  # each round: disjoint pairs covering 0 .. n-1
            assert sorted(p[r].tolist() + q[r].tolist()) == list(range(n))
        pairs = {tuple(sorted(x)) for x in zip(p.flatten().tolist(), q.flatten().tolist())}
        assert len(pairs) == n * (n - 1) // 2


def test_fake_suite_jacobi_default_budget():
    assert [jacobi_sweeps(t) for t in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [
        6,
        6,
        8,
        8,
        10,
        10,
        12,
        12,
        14,
        14,
    ]


@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 7, 8, 16, 32])
def test_fake_suite_jacobi_eigh_matches_torch_eigh(t):
    gen = torch.Generator().manual_seed(t)
    r = max(1, t // 2)
    mats = {
        "full": torch.randn(t, 60, generator=gen, dtype=F64),
        "lowrank": torch.randn(t, r, generator=gen, dtype=F64) @ torch.randn(r, 60, generator=gen, dtype=F64),
        "graded": torch.randn(t, 60, generator=gen, dtype=F64)
        * 10 ** torch.linspace(-2, 2, t, dtype=F64)[:, None],
        "zero_row": torch.cat(
            [torch.randn(t - 1, 60, generator=gen, dtype=F64), torch.zeros(1, 60, dtype=F64)]
        ),
    }
    for kind, j in mats.items():
        a = j @ j.T
        lam, vec = jacobi_eigh(a)
        assert lam.shape == (t,) and vec.shape == (t, t) and lam.dtype == vec.dtype == F64
        scale = float(a.norm())
        ref = torch.linalg.eigvalsh(a)
        assert float((lam.sort().values - ref).abs().max()) <= 1e-13 * t * scale, kind
        assert float(((vec * lam) @ vec.T - a).norm()) <= 1e-14 * t * scale, kind
        assert float((vec.T @ vec - torch.eye(t, dtype=F64)).norm()) <= 1e-14 * t, kind
        # past convergence a sweep changes nothing above round-off
        lam2, vec2 = jacobi_eigh(a, jacobi_sweeps(t) + 6)
        assert float(((vec2 * lam2) @ vec2.T - (vec * lam) @ vec.T).norm()) <= 1e-14 * t * scale, kind


def budget_cases() -> list[tuple[str, torch.Tensor]]:
    """float64 and float32 Grams: conflicting, non-conflicting, rank-deficient (positive mixing), zero row."""
    out = []
    for t in (2, 3, 5, 8):
        gen = torch.Generator().manual_seed(40 + t)
        base = torch.randn(50, generator=gen, dtype=F64)
        conflict = 0.4 * torch.randn(t, 50, generator=gen, dtype=F64)
        conflict[0::2] += base
        conflict[1::2] -= base
        aligned = torch.rand(t, 50, generator=gen, dtype=F64) + 0.1
        r = max(1, t // 2)
        low = (torch.rand(t, r, generator=gen, dtype=F64) + 0.1) @ torch.randn(
            r, 50, generator=gen, dtype=F64
        )
        zero = torch.randn(t, 50, generator=gen, dtype=F64)
        zero[-1] = 0.0
        for kind, j in (("conflict", conflict), ("aligned", aligned), ("lowrank", low), ("zero_row", zero)):
            for dtype in (F64, torch.float32):
                out.append((kind, (j @ j.T).to(dtype)))
    return out


# each solver's budget: (the default, given explicitly; a larger one). MGDA's default (epsilon 1e-3, 100
# iterations, TorchJD's) ends before the Frank-Wolfe step falls below epsilon on the non-conflicting Grams, so its
# freeze is shown with epsilon = 1e-2, which every case here meets within 100 iterations.
BUDGETS = {
    "gem": lambda t, k: {"max_iter": k * (3 * t + 10)},
    "upgrad": lambda t, k: {"max_iter": k * (3 * t + 10)},
    "dualproj": lambda t, k: {"max_iter": k * (3 * t + 10)},
    "imtlg": lambda t, k: {"sweeps": k * jacobi_sweeps(t)},
    "alignedmtl": lambda t, k: {"sweeps": k * jacobi_sweeps(t)},
    "fairgrad": lambda t, k: {"max_iter": 40 + 20 * (k - 1)},
    "nashmtl": lambda t, k: {"max_iter": 40 + 20 * (k - 1)},
    "mgda": lambda t, k: {"epsilon": 1e-2, "max_iters": 100 * k},
}


@pytest.mark.parametrize("name", list(BUDGETS))
def test_fake_suite_iterations_past_the_budget_change_nothing(name):
    for kind, gram in budget_cases():
        if name in ("fairgrad", "nashmtl") and kind == "zero_row":
            continue  # no root: the zero task's weight (which multiplies a zero gradient) grows with every step
        t = gram.shape[0]
        w = call(name, gram, **BUDGETS[name](t, 1))
        w_long = call(name, gram, **BUDGETS[name](t, 3))
        if name in ("imtlg", "alignedmtl", "fairgrad", "nashmtl"):  # fixed points up to round-off
            scale = float(w.abs().max())
            assert torch.allclose(w_long, w, rtol=1e-12, atol=1e-12 * scale), (name, t, kind, w, w_long)
        else:  # frozen exactly once converged (torch.where(done, old, new))
            assert torch.equal(w_long, w), (name, t, kind, w, w_long)
        if name != "mgda":  # the first budget is the default
            assert torch.equal(call(name, gram), w), (name, t, kind)


# ---------------------------------------------------------------------------------------------------------------
# the weights of the code before the rewrite


# the methods of that code (the later ones: tests/test_weights_extra.py)
@pytest.mark.parametrize("name", NAMES[:13])
def test_fake_suite_weights_equal_the_pre_rewrite_code(name):
    checked = 0
    for ref_name, options, t, kind, expected in REFERENCE:
        if ref_name != name:
            continue
        gram = torch.tensor(GRAMS[(t, kind)], dtype=torch.float32)
        if name in STATEFUL:  # two steps on one state, the second on another Gram
            state = STATEFUL[name]()
            got = [
                call(name, gram, state, seed=0, **options),
                call(name, gram * 1.5 + torch.eye(t), state, seed=1, **options),
            ]
        else:
            got = [call(name, gram, **options)]
        for w, ref in zip(got, expected, strict=True):
            assert w.dtype == torch.float32 and w.shape == (t,)
            torch.testing.assert_close(
                w,
                torch.tensor(ref, dtype=torch.float32),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, case=(name, options, t, kind): f"{case}: {m}",
            )
            checked += 1
    assert checked >= 12


# Recorded with the aggregators of commit 512dd0d (before the rewrite: torch.linalg.pinv / eigh, 0-dim tensor
# indexing) on float32 Grams of 50-dimensional float64 gradients: ``conflict`` (tasks along +-base plus noise),
# ``aligned`` (positive entries: no conflict), ``lowrank`` (rank T // 2 with positive mixing; rank 1 for T = 2, 3),
# ``zero_row`` (the last task's gradient is zero). Stateful methods: two steps, the second on ``1.5 G + I``.
# fmt: off
GRAMS = {
    (2, 'conflict'): [[157.95987, -243.20424], [-243.20424, 463.42578]],
    (2, 'aligned'): [[31.297482, 26.215248], [26.215248, 29.428892]],
    (2, 'lowrank'): [[87.251205, 86.72602], [86.72602, 86.203995]],
    (2, 'zero_row'): [[145.87033, 0], [0, 0]],
    (3, 'conflict'): [[34.74415, -130.57016, 151.80922], [-130.57016, 572.0124, -614.64197], [151.80922, -614.64197, 765.8024]],
    (3, 'aligned'): [[8.280891, 31.234121, 12.504343], [31.234121, 175.94008, 59.481747], [12.504343, 59.481747, 28.763906]],
    (3, 'lowrank'): [[4.8712387, 5.2931285, 8.543536], [5.2931285, 5.7515574, 9.283477], [8.543536, 9.283477, 14.984281]],
    (3, 'zero_row'): [[118.36742, 1.7365533, 0], [1.7365533, 22.592028, 0], [0, 0, 0]],
    (5, 'conflict'): [[209.86179, -76.24496, 191.93832, -62.648323, 178.29645], [-76.24496, 37.59215, -84.14964, 27.517796, -79.99147], [191.93832, -84.14964, 245.45078, -68.81887, 203.46043], [-62.648323, 27.517796, -68.81887, 24.449364, -62.373745], [178.29645, -79.99147, 203.46043, -62.373745, 204.57564]],
    (5, 'aligned'): [[17.940033, 31.264555, 9.665482, 10.640908, 4.8826456], [31.264555, 78.39463, 21.56857, 22.210508, 11.161087], [9.665482, 21.56857, 8.245607, 7.573056, 3.2985864], [10.640908, 22.210508, 7.573056, 9.288772, 3.672136], [4.8826456, 11.161087, 3.2985864, 3.672136, 2.173458]],
    (5, 'lowrank'): [[11.527317, 8.625454, 6.343648, 5.949927, 15.880699], [8.625454, 9.218142, 6.6581516, 3.059046, 11.8485155], [6.343648, 6.6581516, 4.8128347, 2.3109767, 8.715581], [5.949927, 3.059046, 2.3109767, 3.7732, 8.214306], [15.880699, 11.8485155, 8.715581, 8.214306, 21.878597]],
    (5, 'zero_row'): [[74.77753, -2.4319105, 1.0764904, -28.945906, 0], [-2.4319105, 116.460365, -0.87337047, -24.286345, 0], [1.0764904, -0.87337047, 22.96052, 6.5631585, 0], [-28.945906, -24.286345, 6.5631585, 131.96957, 0], [0, 0, 0, 0, 0]],
}
REFERENCE = [
    ('sum', {}, 2, 'conflict', [[1, 1]]),
    ('mean', {}, 2, 'conflict', [[0.5, 0.5]]),
    ('pcgrad', {}, 2, 'conflict', [[2.5396583, 1.5247965]]),
    ('gem', {}, 2, 'conflict', [[1.5396584, 1]]),
    ('gem', {'proposal': 0}, 2, 'conflict', [[1, 0.52479655]]),
    ('upgrad', {}, 2, 'conflict', [[1.2695265, 0.7623631]]),
    ('dualproj', {}, 2, 'conflict', [[0.7695265, 0.5]]),
    ('mgda', {}, 2, 'conflict', [[0.63787127, 0.36212876]]),
    ('imtlg', {}, 2, 'conflict', [[0.6313826, 0.36861745]]),
    ('cagrad', {}, 2, 'conflict', [[0.68487865, 0.5]]),
    ('alignedmtl', {}, 2, 'conflict', [[0.5758982, 0.36271197]]),
    ('alignedmtl', {'scale_mode': 'median'}, 2, 'conflict', [[0.5758982, 0.36271197]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 2, 'conflict', [[2.0936885, 1.3186461]]),
    ('fairgrad', {}, 2, 'conflict', [[0.25022718, 0.14608909]]),
    ('fairgrad', {'alpha': 2.0}, 2, 'conflict', [[0.14598663, 0.08405606]]),
    ('nashmtl', {}, 2, 'conflict', [[0.17693734, 0.10330059], [0.1423906, 0.08324669]]),
    ('gradvac', {}, 2, 'conflict', [[2.5396583, 1.5247965], [2.1516643, 1.3936381]]),
    ('sum', {}, 2, 'aligned', [[1, 1]]),
    ('mean', {}, 2, 'aligned', [[0.5, 0.5]]),
    ('pcgrad', {}, 2, 'aligned', [[1, 1]]),
    ('gem', {}, 2, 'aligned', [[1, 1]]),
    ('gem', {'proposal': 0}, 2, 'aligned', [[1, 0]]),
    ('upgrad', {}, 2, 'aligned', [[0.5, 0.5]]),
    ('dualproj', {}, 2, 'aligned', [[0.5, 0.5]]),
    ('mgda', {}, 2, 'aligned', [[0.38737842, 0.61262155]]),
    ('imtlg', {}, 2, 'aligned', [[0.49230552, 0.5076945]]),
    ('cagrad', {}, 2, 'aligned', [[0.54080373, 0.8552568]]),
    ('alignedmtl', {}, 2, 'aligned', [[0.1287075, 0.1417044]]),
    ('alignedmtl', {'scale_mode': 'median'}, 2, 'aligned', [[0.1287075, 0.1417044]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 2, 'aligned', [[0.34892684, 0.38416153]]),
    ('fairgrad', {}, 2, 'aligned', [[0.13093202, 0.13502482]]),
    ('fairgrad', {'alpha': 2.0}, 2, 'aligned', [[0.065932296, 0.06984401]]),
    ('nashmtl', {}, 2, 'aligned', [[0.09258292, 0.09547696], [0.07517672, 0.07747539]]),
    ('gradvac', {}, 2, 'aligned', [[1, 1], [1, 1]]),
    ('sum', {}, 2, 'lowrank', [[1, 1]]),
    ('mean', {}, 2, 'lowrank', [[0.5, 0.5]]),
    ('pcgrad', {}, 2, 'lowrank', [[1, 1]]),
    ('gem', {}, 2, 'lowrank', [[1, 1]]),
    ('gem', {'proposal': 0}, 2, 'lowrank', [[1, 0]]),
    ('upgrad', {}, 2, 'lowrank', [[0.5, 0.5]]),
    ('dualproj', {}, 2, 'lowrank', [[0.5, 0.5]]),
    ('mgda', {}, 2, 'lowrank', [[0, 1]]),
    ('imtlg', {}, 2, 'lowrank', [[0.49849066, 0.50150937]]),
    ('cagrad', {}, 2, 'lowrank', [[0.5, 0.90121114]]),
    ('alignedmtl', {}, 2, 'lowrank', [[0.5015048, 0.4984861]]),
    ('alignedmtl', {'scale_mode': 'median'}, 2, 'lowrank', [[0.5015048, 0.4984861]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 2, 'lowrank', [[0.5015048, 0.4984861]]),
    ('fairgrad', {}, 2, 'lowrank', [[0.075700596, 0.076159015]]),
    ('fairgrad', {'alpha': 2.0}, 2, 'lowrank', [[0.031958792, 0.03234703]]),
    ('nashmtl', {}, 2, 'lowrank', [[0.053528402, 0.053852554], [0.04362301, 0.043885157]]),
    ('gradvac', {}, 2, 'lowrank', [[1, 1], [1, 1]]),
    ('sum', {}, 2, 'zero_row', [[1, 1]]),
    ('mean', {}, 2, 'zero_row', [[0.5, 0.5]]),
    ('pcgrad', {}, 2, 'zero_row', [[1, 1]]),
    ('gem', {}, 2, 'zero_row', [[1, 1]]),
    ('gem', {'proposal': 0}, 2, 'zero_row', [[1, 0]]),
    ('upgrad', {}, 2, 'zero_row', [[0.5, 0.5]]),
    ('dualproj', {}, 2, 'zero_row', [[0.5, 0.5]]),
    ('mgda', {}, 2, 'zero_row', [[0, 1]]),
    ('imtlg', {}, 2, 'zero_row', [[1, 0]]),
    ('cagrad', {}, 2, 'zero_row', [[0, 0]]),
    ('alignedmtl', {}, 2, 'zero_row', [[0.5, 0]]),
    ('alignedmtl', {'scale_mode': 'median'}, 2, 'zero_row', [[0.5, 0]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 2, 'zero_row', [[0.5, 0]]),
    ('fairgrad', {}, 2, 'zero_row', [[0.08279736, 1.8207333e+11]]),
    ('fairgrad', {'alpha': 2.0}, 2, 'zero_row', [[0.03608738, 1.10555125e+18]]),
    ('nashmtl', {}, 2, 'zero_row', [[0.08279736, 1.8207333e+11], [0.047694217, 0.70710677]]),
    ('gradvac', {}, 2, 'zero_row', [[1, 1], [1, 1]]),
    ('sum', {}, 3, 'conflict', [[1, 1, 1]]),
    ('mean', {}, 3, 'conflict', [[0.33333334, 0.33333334, 0.33333334]]),
    ('pcgrad', {}, 3, 'conflict', [[1.2511591, 2.3027902, 1.8026117]]),
    ('gem', {}, 3, 'conflict', [[1, 1.3027902, 1]]),
    ('gem', {'proposal': 0}, 3, 'conflict', [[1, 0.22826457, 0]]),
    ('upgrad', {}, 3, 'conflict', [[0.9417531, 0.76749253, 0.48023385]]),
    ('dualproj', {}, 3, 'conflict', [[0.33333334, 0.43415922, 0.33333334]]),
    ('mgda', {}, 3, 'conflict', [[0.7423235, 0.2171241, 0.040552363]]),
    ('imtlg', {}, 3, 'conflict', [[0.5779753, 0.28995478, 0.13206996]]),
    ('cagrad', {}, 3, 'conflict', [[0.33333334, 0.4093142, 0.33333334]]),
    ('alignedmtl', {}, 3, 'conflict', [[0.3253123, 0.13159147, 0.05201058]]),
    ('alignedmtl', {'scale_mode': 'median'}, 3, 'conflict', [[1.1722658, 0.47419107, 0.1874206]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 3, 'conflict', [[3.6698549, 1.4844862, 0.5867325]]),
    ('fairgrad', {}, 3, 'conflict', [[0.44502136, 0.21393819, 0.09695814]]),
    ('fairgrad', {'alpha': 2.0}, 3, 'conflict', [[0.37352034, 0.12977897, 0.03691369]]),
    ('nashmtl', {}, 3, 'conflict', [[0.2569332, 0.123517275, 0.055978805], [0.19631205, 0.09834256, 0.046248958]]),
    ('gradvac', {}, 3, 'conflict', [[1.2511591, 2.3027902, 1.8026117], [1.8585035, 2.0230188, 1.632757]]),
    ('sum', {}, 3, 'aligned', [[1, 1, 1]]),
    ('mean', {}, 3, 'aligned', [[0.33333334, 0.33333334, 0.33333334]]),
    ('pcgrad', {}, 3, 'aligned', [[1, 1, 1]]),
    ('gem', {}, 3, 'aligned', [[1, 1, 1]]),
    ('gem', {'proposal': 0}, 3, 'aligned', [[1, 0, 0]]),
    ('upgrad', {}, 3, 'aligned', [[0.33333334, 0.33333334, 0.33333334]]),
    ('dualproj', {}, 3, 'aligned', [[0.33333334, 0.33333334, 0.33333334]]),
    ('mgda', {}, 3, 'aligned', [[1, 0, 0]]),
    ('imtlg', {}, 3, 'aligned', [[0.59479916, 0.11213389, 0.29306695]]),
    ('cagrad', {}, 3, 'aligned', [[1.2822487, 0.33333334, 0.33333334]]),
    ('alignedmtl', {}, 3, 'aligned', [[0.23163827, -0.018193461, 0.08004074]]),
    ('alignedmtl', {'scale_mode': 'median'}, 3, 'aligned', [[0.44929844, -0.035289045, 0.15525147]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 3, 'aligned', [[1.3335545, -0.104740776, 0.46079904]]),
    ('fairgrad', {}, 3, 'aligned', [[0.21485537, 0.04618692, 0.11455955]]),
    ('fairgrad', {'alpha': 2.0}, 3, 'aligned', [[0.17276591, 0.009438057, 0.054414548]]),
    ('nashmtl', {}, 3, 'aligned', [[0.1240468, 0.02666603, 0.06614099], [0.09906803, 0.02187005, 0.053870782]]),
    ('gradvac', {}, 3, 'aligned', [[1, 1, 1], [1, 1, 1]]),
    ('sum', {}, 3, 'lowrank', [[1, 1, 1]]),
    ('mean', {}, 3, 'lowrank', [[0.33333334, 0.33333334, 0.33333334]]),
    ('pcgrad', {}, 3, 'lowrank', [[1, 1, 1]]),
    ('gem', {}, 3, 'lowrank', [[1, 1, 1]]),
    ('gem', {'proposal': 0}, 3, 'lowrank', [[1, 0, 0]]),
    ('upgrad', {}, 3, 'lowrank', [[0.33333334, 0.33333334, 0.33333334]]),
    ('dualproj', {}, 3, 'lowrank', [[0.33333334, 0.33333334, 0.33333334]]),
    ('mgda', {}, 3, 'lowrank', [[1, 0, 0]]),
    ('imtlg', {}, 3, 'lowrank', [[0.7158744, 0.25362453, 0.030501109]]),
    ('cagrad', {}, 3, 'lowrank', [[0.84539753, 0.33333334, 0.33333334]]),
    ('alignedmtl', {}, 3, 'lowrank', [[0.24352518, 0.26461646, 0.4271123]]),
    ('alignedmtl', {'scale_mode': 'median'}, 3, 'lowrank', [[0.24352518, 0.26461646, 0.4271123]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 3, 'lowrank', [[0.24352518, 0.26461646, 0.4271123]]),
    ('fairgrad', {}, 3, 'lowrank', [[0.2615891, 0.2407391, 0.14914937]]),
    ('fairgrad', {'alpha': 2.0}, 3, 'lowrank', [[0.18940315, 0.16041358, 0.061573055]]),
    ('nashmtl', {}, 3, 'lowrank', [[0.15102854, 0.13899079, 0.08611143], [0.119909026, 0.11105887, 0.070388086]]),
    ('gradvac', {}, 3, 'lowrank', [[1, 1, 1], [1, 1, 1]]),
    ('sum', {}, 3, 'zero_row', [[1, 1, 1]]),
    ('mean', {}, 3, 'zero_row', [[0.33333334, 0.33333334, 0.33333334]]),
    ('pcgrad', {}, 3, 'zero_row', [[1, 1, 1]]),
    ('gem', {}, 3, 'zero_row', [[1, 1, 1]]),
    ('gem', {'proposal': 0}, 3, 'zero_row', [[1, 0, 0]]),
    ('upgrad', {}, 3, 'zero_row', [[0.33333334, 0.33333334, 0.33333334]]),
    ('dualproj', {}, 3, 'zero_row', [[0.33333334, 0.33333334, 0.33333334]]),
    ('mgda', {}, 3, 'zero_row', [[0, 0, 1]]),
    ('imtlg', {}, 3, 'zero_row', [[0.30404735, 0.69595265, 0]]),
    ('cagrad', {}, 3, 'zero_row', [[0, 0, 0]]),
    ('alignedmtl', {}, 3, 'zero_row', [[0.14216395, 0.3298683, 0]]),
    ('alignedmtl', {'scale_mode': 'median'}, 3, 'zero_row', [[0.14216395, 0.3298683, 0]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 3, 'zero_row', [[0.2512735, 0.5830392, 0]]),
    ('fairgrad', {}, 3, 'zero_row', [[0.090408996, 0.2069427, 2.74466e+11]]),
    ('fairgrad', {'alpha': 2.0}, 3, 'zero_row', [[0.040285695, 0.12307467, 1.9108876e+18]]),
    ('nashmtl', {}, 3, 'zero_row', [[0.06392881, 0.1463306, 1.9407677e+11], [0.042511575, 0.09617234, 0.57735026]]),
    ('gradvac', {}, 3, 'zero_row', [[1, 1, 1], [1, 1, 1]]),
    ('sum', {}, 5, 'conflict', [[1, 1, 1, 1, 1]]),
    ('mean', {}, 5, 'conflict', [[0.2, 0.2, 0.2, 0.2, 0.2]]),
    ('pcgrad', {}, 5, 'conflict', [[1.4027979, 5.334158, 1, 4.2505736, 1.3792645]]),
    ('gem', {}, 5, 'conflict', [[1, 3.3557422, 1, 4.151368, 1]]),
    ('gem', {'proposal': 0}, 5, 'conflict', [[1, 0.8660808, 0, 1.587595, 0]]),
    ('upgrad', {}, 5, 'conflict', [[0.24426357, 0.8739213, 0.23783812, 1.0247176, 0.26294935]]),
    ('dualproj', {}, 5, 'conflict', [[0.2, 0.6739213, 0.2, 0.8247176, 0.2]]),
    ('mgda', {}, 5, 'conflict', [[0.085913666, 0.3102645, 0.07134506, 0.42085138, 0.11162539]]),
    ('imtlg', {}, 5, 'conflict', [[0.08703583, 0.33770558, 0.074250944, 0.3863606, 0.11464706]]),
    ('cagrad', {}, 5, 'conflict', [[0.2, 0.62398756, 0.2, 0.2, 0.2]]),
    ('alignedmtl', {}, 5, 'conflict', [[0.048060082, 0.14738384, 0.04121012, 0.17731822, 0.056233373]]),
    ('alignedmtl', {'scale_mode': 'median'}, 5, 'conflict', [[0.13817932, 0.42374873, 0.11848473, 0.50981414, 0.16167864]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 5, 'conflict', [[0.36766478, 1.1275022, 0.3152618, 1.3565032, 0.43019134]]),
    ('fairgrad', {}, 5, 'conflict', [[0.15809812, 0.56264555, 0.14400971, 0.6851337, 0.17570071]]),
    ('fairgrad', {'alpha': 2.0}, 5, 'conflict', [[0.10488931, 0.3707447, 0.091461085, 0.48447537, 0.1241726]]),
    ('nashmtl', {}, 5, 'conflict', [[0.07070363, 0.25162274, 0.0644031, 0.3064011, 0.078575745], [0.054886304, 0.19792539, 0.050106097, 0.23112053, 0.06072461]]),
    ('gradvac', {}, 5, 'conflict', [[1.4027979, 5.334158, 1, 4.2505736, 1.3792645], [1.5311933, 3.1033573, 1.0981032, 5.746974, 1.1356893]]),
    ('sum', {}, 5, 'aligned', [[1, 1, 1, 1, 1]]),
    ('mean', {}, 5, 'aligned', [[0.2, 0.2, 0.2, 0.2, 0.2]]),
    ('pcgrad', {}, 5, 'aligned', [[1, 1, 1, 1, 1]]),
    ('gem', {}, 5, 'aligned', [[1, 1, 1, 1, 1]]),
    ('gem', {'proposal': 0}, 5, 'aligned', [[1, 0, 0, 0, 0]]),
    ('upgrad', {}, 5, 'aligned', [[0.2, 0.2, 0.2, 0.2, 0.2]]),
    ('dualproj', {}, 5, 'aligned', [[0.2, 0.2, 0.2, 0.2, 0.2]]),
    ('mgda', {}, 5, 'aligned', [[0, 0, 0, 0, 1]]),
    ('imtlg', {}, 5, 'aligned', [[0.16402768, 0.019339658, 0.21995905, 0.099680565, 0.49699306]]),
    ('cagrad', {}, 5, 'aligned', [[0.2, 0.2, 0.2, 0.2, 1.2408535]]),
    ('alignedmtl', {}, 5, 'aligned', [[0.018958451, -0.023572497, 0.05265643, 0.024356103, 0.14721282]]),
    ('alignedmtl', {'scale_mode': 'median'}, 5, 'aligned', [[0.04498008, -0.055927183, 0.12493058, 0.057786334, 0.34927136]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 5, 'aligned', [[0.1330052, -0.16537559, 0.36941728, 0.17087306, 1.0327885]]),
    ('fairgrad', {}, 5, 'aligned', [[0.11541258, 0.053667773, 0.16825609, 0.15697561, 0.3316897]]),
    ('fairgrad', {'alpha': 2.0}, 5, 'aligned', [[0.04652126, 0.010022683, 0.09645956, 0.08272268, 0.3432174]]),
    ('nashmtl', {}, 5, 'aligned', [[0.051614072, 0.024000958, 0.075246416, 0.07020163, 0.14833614], [0.04220552, 0.019772215, 0.060949415, 0.057016365, 0.11466283]]),
    ('gradvac', {}, 5, 'aligned', [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
    ('sum', {}, 5, 'lowrank', [[1, 1, 1, 1, 1]]),
    ('mean', {}, 5, 'lowrank', [[0.2, 0.2, 0.2, 0.2, 0.2]]),
    ('pcgrad', {}, 5, 'lowrank', [[1, 1, 1, 1, 1]]),
    ('gem', {}, 5, 'lowrank', [[1, 1, 1, 1, 1]]),
    ('gem', {'proposal': 0}, 5, 'lowrank', [[1, 0, 0, 0, 0]]),
    ('upgrad', {}, 5, 'lowrank', [[0.2, 0.2, 0.2, 0.2, 0.2]]),
    ('dualproj', {}, 5, 'lowrank', [[0.2, 0.2, 0.2, 0.2, 0.2]]),
    ('mgda', {}, 5, 'lowrank', [[0, 0, 0.36886814, 0.6311319, 0]]),
    ('imtlg', {}, 5, 'lowrank', [[-0.22071949, -0.7307858, 1.5740268, 0.7181748, -0.34069642]]),
    ('cagrad', {}, 5, 'lowrank', [[0.2, 0.2, 0.2, 0.79171664, 0.2]]),
    ('alignedmtl', {}, 5, 'lowrank', [[0.056020286, 0.07104871, 0.050973866, 0.014233612, 0.076814145]]),
    ('alignedmtl', {'scale_mode': 'median'}, 5, 'lowrank', [[0.056020286, 0.07104871, 0.050973866, 0.014233612, 0.076814145]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 5, 'lowrank', [[0.13765457, 0.17458281, 0.12525436, 0.03497522, 0.18874979]]),
    ('fairgrad', {}, 5, 'lowrank', [[0.13288677, 0.16333386, 0.22315498, 0.27499458, 0.09651545]]),
    ('fairgrad', {'alpha': 2.0}, 5, 'lowrank', [[0.055444956, 0.08643613, 0.1610636, 0.2312783, 0.029241025]]),
    ('nashmtl', {}, 5, 'lowrank', [[0.05942877, 0.07304513, 0.099797934, 0.12298132, 0.04316302], [0.04852212, 0.059224904, 0.07974657, 0.096926965, 0.03543771]]),
    ('gradvac', {}, 5, 'lowrank', [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
    ('sum', {}, 5, 'zero_row', [[1, 1, 1, 1, 1]]),
    ('mean', {}, 5, 'zero_row', [[0.2, 0.2, 0.2, 0.2, 0.2]]),
    ('pcgrad', {}, 5, 'zero_row', [[1.4196156, 1.2450018, 1, 1.4143438, 1]]),
    ('gem', {}, 5, 'zero_row', [[1, 1, 1, 1, 1]]),
    ('gem', {'proposal': 0}, 5, 'zero_row', [[1, 0.069280796, 0, 0.23208746, 0]]),
    ('upgrad', {}, 5, 'zero_row', [[0.3014528, 0.25868857, 0.2, 0.28816947, 0.2]]),
    ('dualproj', {}, 5, 'zero_row', [[0.2, 0.2, 0.2, 0.2, 0.2]]),
    ('mgda', {}, 5, 'zero_row', [[0, 0, 0, 0, 1]]),
    ('imtlg', {}, 5, 'zero_row', [[0.28418884, 0.2098697, 0.27435356, 0.23158789, 0]]),
    ('cagrad', {}, 5, 'zero_row', [[0, 0, 0, 0, 0]]),
    ('alignedmtl', {}, 5, 'zero_row', [[0.12870425, 0.101853415, 0.18632263, 0.10337984, 0]]),
    ('alignedmtl', {'scale_mode': 'median'}, 5, 'zero_row', [[0.21141064, 0.16730526, 0.30605507, 0.16981256, 0]]),
    ('alignedmtl', {'scale_mode': 'rmse'}, 5, 'zero_row', [[0.25311226, 0.20030688, 0.36642566, 0.20330876, 0]]),
    ('fairgrad', {}, 5, 'zero_row', [[0.13924342, 0.10727883, 0.19246751, 0.10975325, 3.488336e+11]]),
    ('fairgrad', {'alpha': 2.0}, 5, 'zero_row', [[0.070634775, 0.05119792, 0.11314114, 0.052392796, 2.6307212e+18]]),
    ('nashmtl', {}, 5, 'zero_row', [[0.06962171, 0.053639416, 0.096233755, 0.054876626, 1.744168e+11], [0.05054804, 0.039019305, 0.06938338, 0.03992275, 0.4472136]]),
    ('gradvac', {}, 5, 'zero_row', [[1.4196156, 1.2450018, 1, 1.4143438, 1], [1.2127705, 1.1407712, 1.0195898, 1.2023715, 1]]),
]
# fmt: on
