"""Gram-based multi-task weightings: ``T x T`` Gram matrix -> task weights ``w [T]`` (update ``sum_t w_t g_t``).

The methods of the multi-task literature that TorchJD 0.18 expresses as functions of the Gram matrix, computed on
the Gram's device with fixed iteration counts (no scipy, cvxpy or host round trip):

============  =========================================================================================
``upgrad``    UPGrad (Quinton & Rey 2024): each task gradient projected onto the dual cone, averaged
``mgda``      MGDA (Désidéri 2012), Frank-Wolfe solver of Sener & Koltun 2018 (Algorithm 2)
``dualproj``  DualProj: the mean gradient projected onto the dual cone (GEM's Eq. 11)
``imtlg``     IMTL-G (Liu et al. 2021), the pseudo-inverse generalisation of Quinton & Rey 2024
``cagrad``    CAGrad (Liu et al. 2021, Algorithm 1), radius ``c``
``alignedmtl`` Aligned-MTL (Senushkin et al. 2023, Algorithm 1)
``fairgrad``  FairGrad (Ban & Ji 2024, Eq. 4), alpha-fairness ``alpha``
``nashmtl``   Nash-MTL (Navon et al. 2022): ``G a = 1 / a``, stateful (step counter, last weights)
``gradvac``   GradVac (Wang et al. 2021): stateful EMA of the target cosine similarities
============  =========================================================================================

Every function is ``fn(gram, [state,] generator=None, **options) -> w`` with the conventions of
:mod:`fastpals.surgery.weights_basic` (no host read, fixed iteration budgets, float64 arithmetic); ``imtlg`` and
``alignedmtl`` use :func:`jacobi_eigh` because ``torch.linalg.eigh``/``pinv`` check errors on the host on CUDA.
Defaults equal TorchJD 0.18's where TorchJD defines one (CAGrad's ``c = 0.4``, the paper's, and FairGrad's
``alpha = 1`` have none there).
:data:`AGGREGATORS` names every aggregator of the package (:func:`~fastpals.surgery.make_weighting` builds one
from string options).

Loss scaling (fp16): only FairGrad's weights (``S^(-2 alpha / (alpha + 1))``) and Nash-MTL's ``max_norm`` clip
depend on a common gradient scale ``S``: give them unscaled Gram matrices (divide by ``S^2``) or train in
bf16/fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fastpals.surgery import compiled, weights_extra
from fastpals.surgery.solvers import QP_MAX_ITER, jacobi_eigh, jacobi_sweeps, nonneg_qp, spd_solve
from fastpals.surgery.weights_basic import (
    check_gram,
    gem_weights,
    mean_weights,
    pcgrad_orders,
    pcgrad_weights,
    sum_weights,
    weights_dtype,
)
from fastpals.surgery.weights_extra import WeightsState

__all__ = [
    "AGGREGATORS",
    "STATEFUL",
    "CRMOGMState",
    "GradVacState",
    "NashMTLState",
    "alignedmtl_weights",
    "cagrad_weights",
    "crmogm_weights",
    "dualproj_weights",
    "fairgrad_weights",
    "gradvac_weights",
    "imtlg_weights",
    "jacobi_eigh",
    "mgda_weights",
    "nashmtl_weights",
    "nonneg_qp",
    "spd_solve",
    "upgrad_weights",
]

F64 = torch.float64
#: most tasks of CAGrad's exact solver (it enumerates the 2^T - 1 supports); ``pgd`` takes any number
CAGRAD_EXACT_MAX_TASKS = 10


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _normalize(g: torch.Tensor, eps: float) -> torch.Tensor:
    """``G / trace(G)``, or zeros when ``trace(G) < eps`` (TorchJD's Frobenius normalisation of ``J``)."""
    tr = torch.diagonal(g).sum()
    small = tr < eps
    return torch.where(small, torch.zeros_like(g), g / torch.where(small, torch.ones_like(tr), tr))


def _pref(pref_vector: torch.Tensor | None, t: int, device: torch.device) -> torch.Tensor:
    if pref_vector is None:
        return torch.full((t,), 1.0 / t, dtype=F64, device=device)
    if not isinstance(pref_vector, torch.Tensor) or pref_vector.shape != (t,):
        raise ValueError(f"pref_vector must be a tensor of shape ({t},), got {pref_vector!r}")
    return pref_vector.to(device=device, dtype=F64, non_blocking=True)


def _dual_cone_weights(
    g: torch.Tensor, u: torch.Tensor, norm_eps: float, reg_eps: float, max_iter: int | None
):
    """Weights ``v`` of the projections of ``J^T u_k`` onto the dual cone of the rows of ``J``: for each row
    ``u_k`` of ``u [B, T]``, ``argmin_{v >= u_k} v^T G' v`` with ``G' = G / trace(G) + reg_eps I`` (TorchJD's
    regularised QP; ``reg_eps = 0`` is the exact projection for a non-singular ``G``)."""
    t = g.shape[0]
    gr = _normalize(g, norm_eps) + reg_eps * torch.eye(t, dtype=F64, device=g.device)
    # v = u + x, x >= 0: min 1/2 x^T G' x + x^T G' u.
    return u + nonneg_qp(gr, u @ gr, max_iter=max_iter)


def _compiled_dual_cone(
    gram: torch.Tensor, method: str, p: torch.Tensor, norm_eps: float, reg_eps: float, max_iter: int | None
) -> torch.Tensor:
    """UPGrad's or DualProj's weights from the compiled solve (:mod:`fastpals.surgery.compiled`)."""
    t = gram.shape[0]
    iters = min(3 * t + 10, QP_MAX_ITER) if max_iter is None else int(max_iter)
    vec = torch.cat([p, torch.zeros_like(p)])
    return compiled.solve_weights(gram, method, vec, [norm_eps, reg_eps, iters])


def _prepare(gram: torch.Tensor) -> torch.Tensor:
    g = check_gram(gram).to(F64)
    return 0.5 * (g + g.T)


# ----------------------------------------------------------------------------------------------------------------
# stateless weightings
# ----------------------------------------------------------------------------------------------------------------


def upgrad_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    pref_vector: torch.Tensor | None = None,
    norm_eps: float = 1e-4,
    reg_eps: float = 1e-4,
    max_iter: int | None = None,
) -> torch.Tensor:
    """UPGrad (Quinton & Rey, "Jacobian Descent for Multi-Objective Optimization", 2024).

    Each task gradient ``g_i`` (scaled by ``pref_vector[i]``, default ``1 / T``) is projected onto the dual cone
    ``{x : <x, g_j> >= 0 for all j}``; the projections are summed. In Gram terms (their Proposition 1): row ``i``'s
    weights are ``argmin_{v >= p_i e_i} v^T G v``, solved by :func:`nonneg_qp`. As in TorchJD, ``G`` is divided by
    its trace (zeroed below ``norm_eps``) and ``reg_eps * I`` is added before the solve. ``max_iter`` is
    :func:`nonneg_qp`'s fixed iteration budget (default ``min(3 T + 10, 40)``; the free set freezes once optimal).

    ``gram [T, T]`` float32/float64; ``pref_vector`` ``[T]`` floating (any device).

    Returns ``w [T]`` on ``gram``'s device (float64 for a float64 Gram, else float32).
    """
    g = _prepare(gram)
    p = _pref(pref_vector, g.shape[0], g.device)
    if compiled.enabled(g):
        return _compiled_dual_cone(gram, "upgrad", p, norm_eps, reg_eps, max_iter)
    return (
        _dual_cone_weights(g, torch.diag(p), norm_eps, reg_eps, max_iter).sum(dim=0).to(weights_dtype(gram))
    )


def dualproj_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    pref_vector: torch.Tensor | None = None,
    norm_eps: float = 1e-4,
    reg_eps: float = 1e-4,
    max_iter: int | None = None,
) -> torch.Tensor:
    """DualProj: the preference-weighted gradient (default the mean) projected onto the dual cone of the task
    gradients (GEM's Eq. 11 with every task as a constraint), with UPGrad's normalisation and ``reg_eps``.
    ``max_iter`` is :func:`nonneg_qp`'s fixed iteration budget (default ``min(3 T + 10, 40)``; frozen once optimal).

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32)."""
    g = _prepare(gram)
    p = _pref(pref_vector, g.shape[0], g.device)
    if compiled.enabled(g):
        return _compiled_dual_cone(gram, "dualproj", p, norm_eps, reg_eps, max_iter)
    return _dual_cone_weights(g, p[None, :], norm_eps, reg_eps, max_iter)[0].to(weights_dtype(gram))


def mgda_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    epsilon: float = 1e-3,
    max_iters: int = 100,
) -> torch.Tensor:
    """MGDA: the minimum-norm point of the convex hull of the task gradients, by the Frank-Wolfe solver of Sener &
    Koltun 2018 (Algorithm 2), started at ``1 / T``, stopping once the step size falls below ``epsilon``
    (TorchJD's rule). It runs exactly ``max_iters`` iterations (default 100, the fixed budget) and freezes the
    iterate after the stopping one (``torch.where(done, old, new)``): no host sync.

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32)."""
    if epsilon <= 0 or int(max_iters) <= 0:
        raise ValueError(f"mgda: epsilon and max_iters must be positive, got {epsilon}, {max_iters}")
    if compiled.enabled(check_gram(gram)):
        return compiled.solve_weights(gram, "mgda", None, [epsilon, int(max_iters)])
    g = check_gram(gram).to(F64)
    t = g.shape[0]
    alpha = torch.full((t,), 1.0 / t, dtype=F64, device=g.device)
    done = torch.zeros((), dtype=torch.bool, device=g.device)
    one, zero = torch.ones((), dtype=F64, device=g.device), torch.zeros((), dtype=F64, device=g.device)
    index = torch.arange(t, device=g.device)
    for _ in range(int(max_iters)):
        ga = g @ alpha
        k = torch.argmin(ga).reshape(1)  # a 1-element index: g[:, k] with a 0-dim k would read k on the host
        gk = g.index_select(1, k)[:, 0]
        a = alpha @ gk
        b = alpha @ ga
        c = gk.index_select(0, k)[0]
        den = b + c - 2 * a
        gamma = torch.where(c <= a, one, torch.where(b <= a, zero, (b - a) / torch.where(den > 0, den, one)))
        new = (1 - gamma) * alpha
        new = new + gamma * (index == k).to(F64)
        alpha = torch.where(done, alpha, new)
        done = done | (gamma < epsilon)
    return alpha.to(weights_dtype(gram))


def imtlg_weights(
    gram: torch.Tensor, generator: torch.Generator | None = None, *, sweeps: int | None = None
) -> torch.Tensor:
    """IMTL-G (Liu et al., "Towards Impartial Multi-task Learning", 2021): the combination ``w`` (summing to 1)
    whose update has equal projections on every unit task gradient, ``G w ∝ d`` with ``d_i = |g_i|``. For linearly
    dependent gradients TorchJD's generalisation ``w ∝ G^+ d`` is used; ``w = 0`` when ``sum(G^+ d) ~ 0``.

    ``G^+`` is ``torch.linalg.pinv``'s (singular values ``|lam|`` at most ``T eps max|lam|`` dropped, float64
    ``eps``), computed from :func:`jacobi_eigh` with ``sweeps`` sweeps (the fixed budget, default
    :func:`jacobi_sweeps`) instead of ``pinv``, whose error check reads the device on CUDA.

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32)."""
    g = check_gram(gram).to(F64)
    t = g.shape[0]
    if compiled.enabled(g):
        return compiled.solve_weights(
            gram, "imtlg", None, [jacobi_sweeps(t) if sweeps is None else int(sweeps)]
        )
    d = torch.diagonal(g).clamp_min(0.0).sqrt()
    lam, vec = jacobi_eigh(0.5 * (g + g.T), sweeps)
    sig = lam.abs()
    keep = sig > t * torch.finfo(F64).eps * sig.amax()
    inv = torch.where(keep, 1.0 / torch.where(keep, lam, torch.ones_like(lam)), torch.zeros_like(lam))
    v = vec @ (inv * (vec.T @ d))
    s = v.sum()
    small = s.abs() < 1e-12
    return torch.where(small, torch.zeros_like(v), v / torch.where(small, torch.ones_like(s), s)).to(
        weights_dtype(gram)
    )


def alignedmtl_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    pref_vector: torch.Tensor | None = None,
    scale_mode: str = "min",
    sweeps: int | None = None,
) -> torch.Tensor:
    """Aligned-MTL (Senushkin et al. 2023, Algorithm 1): ``w = B p`` with the balance transformation
    ``B = sqrt(s) V Λ^{-1/2} V^T`` over the eigenpairs of ``G`` above ``max(λ) T eps`` (eps of the Gram's dtype),
    ``s`` their smallest (``"min"``, default), median (``"median"``) or mean (``"rmse"``) eigenvalue; ``B = I``
    when ``G`` is zero. ``p`` is ``pref_vector`` (default ``1 / T``).

    The eigenpairs come from :func:`jacobi_eigh` on the upper triangle of ``G`` (as ``eigh(UPLO="U")``) with
    ``sweeps`` sweeps (the fixed budget, default :func:`jacobi_sweeps`), not ``torch.linalg.eigh``, whose error
    check reads the device on CUDA.

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32)."""
    if scale_mode not in ("min", "median", "rmse"):
        raise ValueError(f"alignedmtl: scale_mode must be 'min', 'median' or 'rmse', got {scale_mode!r}")
    g = check_gram(gram).to(F64)
    t = g.shape[0]
    p = _pref(pref_vector, t, g.device)
    if compiled.enabled(g):
        mode = ("min", "median", "rmse").index(scale_mode)
        budget = jacobi_sweeps(t) if sweeps is None else int(sweeps)
        eps = torch.finfo(gram.dtype).eps
        return compiled.solve_weights(
            gram, "alignedmtl", torch.cat([p, torch.zeros_like(p)]), [budget, mode, eps]
        )
    lam, vec = jacobi_eigh(torch.triu(g) + torch.triu(g, 1).T, sweeps)
    tol = lam.amax() * t * torch.finfo(gram.dtype).eps
    keep = lam > tol
    rank = keep.sum()
    inv_sqrt = torch.where(
        keep, 1.0 / torch.where(keep, lam, torch.ones_like(lam)).sqrt(), torch.zeros_like(lam)
    )
    if scale_mode == "min":
        scale = torch.where(keep, lam, torch.full_like(lam, math.inf)).amin()
    elif scale_mode == "rmse":
        scale = torch.where(keep, lam, torch.zeros_like(lam)).sum() / rank.clamp_min(1)
    else:  # torch.median's lower median of the kept eigenvalues
        asc = torch.sort(torch.where(keep, lam, torch.full_like(lam, math.inf))).values
        scale = asc.index_select(0, ((rank - 1).clamp_min(0) // 2).reshape(1))[0]
    scale = torch.where(rank > 0, scale, torch.ones_like(scale))
    b = scale.sqrt() * (vec * inv_sqrt) @ vec.T
    b = torch.where(rank > 0, b, torch.eye(t, dtype=F64, device=g.device))
    return (b @ p).to(weights_dtype(gram))


def _subsets(t: int, device: torch.device) -> torch.Tensor:
    """``bool [2^T - 1, T]``: every non-empty subset of the tasks, built on ``device`` (no host copy)."""
    codes = torch.arange(1, 2**t, device=device)
    return ((codes[:, None] >> torch.arange(t, device=device)[None, :]) & 1).bool()


def _cagrad_on_supports(
    g: torch.Tensor, b: torch.Tensor, rho: torch.Tensor, masks: torch.Tensor, batched_solve: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CAGrad's KKT solution on each support of ``masks [K, T]`` (bool): ``w_S = (λ G_SS^{-1} 1 - G_SS^{-1} b_S) /
    sqrt(disc)`` with ``λ`` the root of a quadratic, one batched solve. Returns ``(w [K, T]`` on the simplex,
    ``ok [K]`` bool: the support's solution exists and is non-negative)."""
    t = g.shape[0]
    eye = torch.eye(t, dtype=F64, device=g.device)
    scale = torch.diagonal(g).amax().clamp_min(1e-300)
    outer = masks[:, :, None] & masks[:, None, :]
    system = torch.where(outer, g + 1e-12 * scale * eye, eye)
    rhs = torch.stack([masks.to(F64), torch.where(masks, b, torch.zeros_like(b))], dim=2)  # [K, T, 2]
    sol = spd_solve(system, rhs) if batched_solve is None else batched_solve(system, rhs)[0]
    sol = torch.where(masks[:, :, None], sol, torch.zeros_like(sol))
    a_vec, c_vec = sol[..., 0], sol[..., 1]
    big_a = a_vec.sum(1)
    big_b = c_vec.sum(1)
    big_c = c_vec @ b
    disc = big_b * big_b - big_a * (big_c - rho * rho)
    ok = (disc > 0) & (big_a > 0)
    sd = torch.where(ok, disc, torch.ones_like(disc)).sqrt()
    lam = (big_b + sd) / torch.where(ok, big_a, torch.ones_like(big_a))
    w = (lam[:, None] * a_vec - c_vec) / sd[:, None]
    ok = ok & (w >= -1e-9).all(1)
    w = w.clamp_min(0.0)
    return w / w.sum(1, keepdim=True).clamp_min(1e-300), ok


def _simplex_projection(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each row of ``v [K, T]`` onto the probability simplex (sort-based, Held, Wolfe &
    Crowder 1974; Duchi et al. 2008): ``max(v - θ, 0)`` with ``θ`` from the sorted prefix sums, no host read."""
    u = torch.sort(v, dim=1, descending=True).values
    css = u.cumsum(1) - 1.0
    k = torch.arange(1, v.shape[1] + 1, dtype=F64, device=v.device)
    count = (u - css / k > 0).sum(1, keepdim=True).clamp_min(1)  # the condition holds on a prefix
    theta = css.gather(1, count - 1) / count.to(F64)
    return (v - theta).clamp_min(0.0)


def _cagrad_projected_gradient(
    g: torch.Tensor, b: torch.Tensor, rho: torch.Tensor, iters: int
) -> torch.Tensor:
    """An approximate minimiser of ``f(w) = <b, w> + ρ sqrt(wᵀ G w)`` on the simplex: projected (sub)gradient
    steps from ``1/T``, each trying the 40 step sizes ``2^-k`` at once and keeping the candidate with the lowest
    ``f`` (the current point included, so ``f`` never rises). ``O(T^2 + 40 T log T)`` per iteration, exactly
    ``iters`` iterations. Returns ``w [T]``."""
    t = g.shape[0]
    dev = g.device
    w = torch.full((t,), 1.0 / t, dtype=F64, device=dev)
    steps = torch.cat(
        [torch.pow(0.5, torch.arange(40, dtype=F64, device=dev)), torch.zeros(1, dtype=F64, device=dev)]
    )  # [K]: the last candidate is the current point

    def objective(x: torch.Tensor) -> torch.Tensor:  # x [K, T]
        return x @ b + rho * ((x @ g) * x).sum(1).clamp_min(0.0).sqrt()

    for _ in range(iters):
        gw = g @ w
        norm = (w @ gw).clamp_min(0.0).sqrt()
        grad = b + rho * gw / norm.clamp_min(1e-150)
        grad = (
            grad - grad.mean()
        )  # the component along the simplex (1ᵀ x = 1 is kept by the projection anyway)
        scale = grad.abs().amax().clamp_min(1e-300)  # the largest step moves some coordinate by 1
        cand = _simplex_projection(w[None, :] - (steps / scale)[:, None] * grad[None, :])
        best = torch.argmin(objective(cand)).reshape(1)
        w = cand.index_select(0, best)[0]
    return w


def _cagrad_active_set(
    g: torch.Tensor, b: torch.Tensor, rho: torch.Tensor, start: torch.Tensor, iters: int
) -> torch.Tensor:
    """A primal active-set method for CAGrad's problem from the support ``S`` of ``start [T]`` (a point of the
    simplex): on ``S`` the KKT solution (one ``solve_ex``); the coordinates that come out negative leave ``S``
    (no solution on ``S``, as for a singular ``G_SS``: ``S``'s smallest coordinate of the best point so far
    leaves); when none does, the task with the most violated optimality condition (``∂f/∂w_i < μ``, ``μ`` the
    common value on ``S``) comes in; none violated: optimal, ``S`` freezes. Exactly ``iters`` iterations,
    ``O(T^3)`` each. Returns the best feasible point met (``start`` included): the objective never rises."""
    t = g.shape[0]
    dev = g.device
    eye = torch.eye(t, dtype=F64, device=dev)
    scale = torch.diagonal(g).amax().clamp_min(1e-300)
    index = torch.arange(t, device=dev)
    inf = torch.full((t,), math.inf, dtype=F64, device=dev)

    def objective(x: torch.Tensor) -> torch.Tensor:
        return x @ b + rho * (x @ g @ x).clamp_min(0.0).sqrt()

    best, best_f = start, objective(start)
    support = (start > 1e-6 * start.amax()) | (index == torch.argmax(start))
    done = torch.zeros((), dtype=torch.bool, device=dev)
    for _ in range(iters):
        outer = support[:, None] & support[None, :]
        system = torch.where(outer, g + 1e-12 * scale * eye, eye)
        rhs = torch.stack([support.to(F64), torch.where(support, b, torch.zeros_like(b))], dim=1)  # [T, 2]
        sol, _info = torch.linalg.solve_ex(system, rhs)
        sol = torch.where(support[:, None], sol, torch.zeros_like(sol))
        a_vec, c_vec = sol[:, 0], sol[:, 1]
        big_a, big_b, big_c = a_vec.sum(), c_vec.sum(), c_vec @ b
        disc = big_b * big_b - big_a * (big_c - rho * rho)
        valid = (disc > 0) & (big_a > 0)
        sd = torch.where(valid, disc, torch.ones_like(disc)).sqrt()
        lam = (big_b + sd) / torch.where(valid, big_a, torch.ones_like(big_a))
        w = (lam * a_vec - c_vec) / sd  # sums to 1 on S
        neg = support & (w < 0)
        feasible = valid & ~neg.any()
        f = objective(w.clamp_min(0.0))
        better = feasible & (f < best_f)
        best = torch.where(better, w.clamp_min(0.0), best)
        best_f = torch.where(better, f, best_f)
        gw = g @ w
        grad = b + rho * gw / (w @ gw).clamp_min(1e-300).sqrt()
        mu = (grad * w).sum()
        tol = 1e-12 * (grad.abs().amax() + 1e-300)
        violated = ~support & (grad < mu - tol)
        most = torch.argmin(torch.where(violated, grad, inf))
        grown = support | (violated.any() & (index == most))
        smallest = torch.argmin(torch.where(support, best, inf))
        shrunk = torch.where(valid, support & ~neg, support & (index != smallest))
        shrunk = shrunk | (~shrunk.any() & (index == torch.argmax(best)))  # never empty
        step = torch.where(neg.any() | ~valid, shrunk, grown)
        done = done | (feasible & ~violated.any())
        support = torch.where(done, support, step)
    return best


def cagrad_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    c: float = 0.4,
    norm_eps: float = 1e-4,
    solver: str = "auto",
    max_iter: int = 100,
    search_iters: int | None = None,
) -> torch.Tensor:
    """CAGrad (Liu et al., "Conflict-Averse Gradient Descent", 2021, Algorithm 1).

    With ``g_0`` the mean gradient and ``φ = c^2 |g_0|^2``: ``w* = argmin_{w in simplex} <g_w, g_0> + sqrt(φ)
    |g_w|`` and the update is ``g_0 + sqrt(φ) / |g_w*| g_w*``, i.e. weights ``1/T + sqrt(φ) / |g_w*| w*`` (zero
    when ``|g_w*| < norm_eps``). ``G`` is divided by its trace first, as in TorchJD.

    On an active set ``S`` the problem's KKT conditions give ``w_S = (λ G_SS^{-1} 1 - G_SS^{-1} b_S) /
    sqrt(disc)`` with ``b = G 1/T`` and ``λ`` the root of a quadratic. ``solver`` picks the candidate supports:

    - ``exact``: every support (``2^T - 1`` of them, one batched solve; at most ``T = 10`` tasks), the best
      feasible one kept: the exact minimiser, no iterations.
    - ``pgd``: any ``T``, polynomial cost. ``max_iter`` projected-gradient steps on the simplex (each a batched
      line search over 40 step sizes; ``O(max_iter (T^2 + 40 T log T))``), then ``search_iters`` (default
      ``2 T + 10``) steps of a primal active-set method from the iterate's support (``O(T^3)`` each). The best
      point met and the vertices are the candidates, so the objective is never above the projected-gradient
      iterate's, and it is the exact minimiser once the active set reaches the optimal support (checked against ``exact`` for T <= 10 and against TorchJD's cvxpy solve up
      to T = 64 in ``tests/test_many_tasks.py``).
    - ``auto`` (default): ``exact`` up to 10 tasks, ``pgd`` beyond.

    Either way the best candidate is picked by ``argmin`` and gathered on the device: no host read.

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32).
    """
    if c < 0:
        raise ValueError(f"cagrad: c must be non-negative, got {c}")
    if solver not in ("auto", "exact", "pgd"):
        raise ValueError(f"cagrad: solver must be 'auto', 'exact' or 'pgd', got {solver!r}")
    if int(max_iter) < 0 or (search_iters is not None and int(search_iters) < 0):
        raise ValueError(f"cagrad: max_iter and search_iters must be >= 0, got {max_iter}, {search_iters}")
    t = check_gram(gram).shape[0]
    if solver == "auto":
        solver = "exact" if t <= CAGRAD_EXACT_MAX_TASKS else "pgd"
    if solver == "exact" and t > CAGRAD_EXACT_MAX_TASKS:
        raise ValueError(
            f"cagrad: solver='exact' enumerates 2^T supports, at most {CAGRAD_EXACT_MAX_TASKS} tasks, got {t}; "
            "use solver='pgd' (or 'auto')"
        )
    search_iters = 2 * t + 10 if search_iters is None else int(search_iters)
    if compiled.enabled(gram):
        vec = torch.zeros(2 * t, dtype=F64)
        vec[0], vec[1] = int(max_iter), search_iters
        vec = vec.to(gram.device, non_blocking=True)
        return compiled.solve_weights(gram, "cagrad", vec, [c, norm_eps, float(solver == "exact")])
    g = _normalize(_prepare(gram), norm_eps)
    dev = g.device
    u = torch.full((t,), 1.0 / t, dtype=F64, device=dev)
    b = g @ u
    rho = c * (u @ b).clamp_min(0.0).sqrt()
    eye = torch.eye(t, dtype=F64, device=dev)
    if solver == "exact":
        w, ok = _cagrad_on_supports(g, b, rho, _subsets(t, dev))
    else:
        it = _cagrad_projected_gradient(g, b, rho, int(max_iter))
        w = _cagrad_active_set(g, b, rho, it, search_iters)[None, :]
        ok = torch.ones(1, dtype=torch.bool, device=dev)
    # the vertices are always feasible candidates (they cover rho = 0 and degenerate supports)
    w = torch.cat([w, eye])
    ok = torch.cat([ok, torch.ones(t, dtype=torch.bool, device=dev)])
    norms = ((w @ g) * w).sum(1).clamp_min(0.0).sqrt()
    obj = w @ b + rho * norms
    best = torch.argmin(torch.where(ok, obj, torch.full_like(obj, math.inf))).reshape(1)
    w_opt, norm = w.index_select(0, best)[0], norms.index_select(0, best)[0]
    small = norm < norm_eps
    weights = u + rho / torch.where(small, torch.ones_like(norm), norm) * w_opt
    return torch.where(small, torch.zeros_like(weights), weights).to(weights_dtype(gram))


def _alpha_fair_solve(g: torch.Tensor, alpha: float, max_iter: int) -> torch.Tensor:
    """The positive root ``x`` of ``G x = x^{-1/alpha}`` (the minimiser of the strictly convex
    ``1/2 x^T G x - sum_i psi(x_i)``, ``psi' = x^{-1/alpha}``), by damped Newton with a batched backtracking line
    search (no host sync): exactly ``max_iter`` Newton steps, each trying the 40 step sizes ``2^-k`` at once and
    taking the first that satisfies Armijo's rule (none: ``x`` is kept). At the root the Newton step is at the
    round-off level, so iterations past convergence leave ``x`` unchanged up to round-off. ``G`` is first divided
    by its trace; the root scales back as ``tr^{-alpha/(alpha+1)}``."""
    if compiled.enabled(g):
        return compiled.solve_weights(g, "alpha_fair", None, [alpha, max_iter])
    t = g.shape[0]
    dev = g.device
    tr = torch.diagonal(g).sum().clamp_min(1e-300)
    gn = g / tr
    p = -1.0 / alpha

    def psi(x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) if alpha == 1.0 else (alpha / (alpha - 1.0)) * x.pow(1.0 + p)

    def objective(x: torch.Tensor) -> torch.Tensor:  # x [..., T]
        return 0.5 * ((x @ gn) * x).sum(-1) - psi(x).sum(-1)

    s = (gn.sum() / (t * t)).clamp_min(1e-6)
    x = torch.full((t,), 1.0, dtype=F64, device=dev) * s.pow(-alpha / (alpha + 1.0))
    steps = torch.pow(0.5, torch.arange(40, dtype=F64, device=dev))  # [K]
    eye = torch.eye(t, dtype=F64, device=dev)
    for _ in range(max_iter):
        grad = gn @ x - x.pow(p)
        hess = gn + eye * (-p * x.pow(p - 1.0))
        d, _ = torch.linalg.solve_ex(hess, -grad)
        cand = x[None, :] + steps[:, None] * d[None, :]  # [K, T]
        pos = (cand > 0).all(1)
        f0 = objective(x)
        fc = objective(torch.where(pos[:, None], cand, x[None, :]))
        good = pos & (fc <= f0 + 1e-4 * steps * (grad @ d)) & torch.isfinite(fc)
        first = torch.argmax(good.to(torch.int8)).reshape(1)  # cand[first] with a 0-dim index would sync
        x = torch.where(good.any(), cand.index_select(0, first)[0], x)
    # all task gradients zero: no root; the update is zero whatever the weights, return zeros
    zero = torch.diagonal(g).sum() <= 0
    return torch.where(zero, torch.zeros_like(x), x * tr.pow(-alpha / (alpha + 1.0)))


def fairgrad_weights(
    gram: torch.Tensor, generator: torch.Generator | None = None, *, alpha: float = 1.0, max_iter: int = 40
) -> torch.Tensor:
    """FairGrad (Ban & Ji, "Fair Resource Allocation in Multi-Task Learning", 2024, Eq. 4): the weights ``w > 0``
    with ``G w = w^{-1/alpha}`` (alpha-fair utilities; ``alpha = 1`` is proportional fairness, the Nash-MTL
    equation). ``alpha = 0`` gives ``1 / T``. Damped Newton, exactly ``max_iter`` iterations (the fixed budget,
    default 40; quadratic convergence: the default reaches float64 round-off on the tests' Gram matrices, and
    further iterations leave it there).

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32)."""
    if alpha < 0:
        raise ValueError(f"fairgrad: alpha must be non-negative, got {alpha}")
    g = _prepare(gram)
    t = g.shape[0]
    if alpha == 0:
        return torch.full((t,), 1.0 / t, dtype=weights_dtype(gram), device=g.device)
    return _alpha_fair_solve(g, float(alpha), int(max_iter)).to(weights_dtype(gram))


# ----------------------------------------------------------------------------------------------------------------
# stateful weightings
# ----------------------------------------------------------------------------------------------------------------


class NashMTLState(WeightsState):
    """Nash-MTL's state across steps: the step counter and the last weights (reused between updates when
    ``update_weights_every > 1``)."""

    def reset(self) -> None:
        super().reset()
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, **super().state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.step = int(state["step"])


def nashmtl_weights(
    gram: torch.Tensor,
    state: NashMTLState,
    generator: torch.Generator | None = None,
    *,
    max_norm: float = 1.0,
    update_weights_every: int = 1,
    max_iter: int = 40,
) -> torch.Tensor:
    """Nash-MTL (Navon et al., "Multi-Task Learning as a Bargaining Game", 2022, Algorithm 1).

    The Nash bargaining solution ``G' a = 1 / a`` on ``G' = G / |G|_F`` (the official code's normalisation), solved
    to convergence by damped Newton (the paper's and TorchJD's sequence of convex programs approximate this root,
    stopping at a residual of 1e-3), then scaled so that ``|sum_t a_t g_t| <= max_norm`` (``0`` disables it).
    Every ``update_weights_every`` calls the weights are recomputed, in between the last ones are reused.
    ``state`` is a :class:`NashMTLState`; the recompute decision reads only its Python step counter, and its
    weights stay on the device. Exactly ``max_iter`` Newton iterations (the fixed budget, default 40).

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32).
    """
    if not isinstance(state, NashMTLState):
        raise TypeError(f"nashmtl needs a NashMTLState, got {type(state).__name__}")
    if max_norm < 0 or int(update_weights_every) <= 0:
        raise ValueError(
            f"nashmtl: max_norm >= 0 and update_weights_every > 0 needed, got {max_norm}, "
            f"{update_weights_every}"
        )
    g = _prepare(gram)
    t = g.shape[0]
    recompute = (
        state.step % int(update_weights_every) == 0 or state.weights is None or state.weights.numel() != t
    )
    state.step += 1
    if recompute:
        nf = torch.linalg.matrix_norm(g).clamp_min(1e-300)
        a = _alpha_fair_solve(g / nf, 1.0, int(max_iter))
        state.weights = a
    a = state.weights.to(device=g.device, dtype=F64, non_blocking=True)
    if max_norm > 0:
        norm = (a @ g @ a).clamp_min(0.0).sqrt()
        a = torch.where(norm > max_norm, a * (max_norm / norm.clamp_min(1e-300)), a)
    return a.to(weights_dtype(gram))


class GradVacState(WeightsState):
    """GradVac's state: the EMA targets ``phi [T, T]`` (float64; zeros at the start)."""

    tensors = ("phi",)
    phi: torch.Tensor | None


def gradvac_weights(
    gram: torch.Tensor,
    state: GradVacState,
    generator: torch.Generator | None = None,
    *,
    beta: float = 0.5,
    eps: float = 1e-8,
    orders: torch.Tensor | None = None,
) -> torch.Tensor:
    """GradVac (Wang et al., "Gradient Vaccine", ICLR 2021), whole-model variant, as task weights.

    For each task ``i`` and each other task ``j`` in a random order (drawn as :func:`pcgrad_orders` draws, from
    ``generator``), the cosine ``phi`` between the current ``g_i^PC`` and the original ``g_j`` is compared with the
    EMA target ``phi_hat[i, j]``; when ``phi < phi_hat``, ``g_i^PC += |g_i^PC| (phi_hat sqrt(1 - phi^2) - phi
    sqrt(1 - phi_hat^2)) / (|g_j| sqrt(1 - phi_hat^2) + eps) g_j``; then ``phi_hat[i, j] <- (1 - beta) phi_hat +
    beta phi``. The weights are the column sums of the coefficients (vectorised over ``i`` as in
    :func:`pcgrad_weights`; exactly ``T - 1`` steps, the test ``phi < phi_hat`` a ``torch.where``). ``state`` is a
    :class:`GradVacState`; its targets stay on the Gram's device.

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32).
    """
    if not isinstance(state, GradVacState):
        raise TypeError(f"gradvac needs a GradVacState, got {type(state).__name__}")
    if not 0.0 <= beta <= 1.0 or eps < 0:
        raise ValueError(f"gradvac: beta must be in [0, 1] and eps >= 0, got {beta}, {eps}")
    g = check_gram(gram).to(F64)
    t = g.shape[0]
    dev = g.device
    if orders is None:
        orders = pcgrad_orders(t, generator)
    orders = orders.to(dev, non_blocking=True)
    if state.phi is None or state.phi.shape != (t, t):
        state.phi = torch.zeros((t, t), dtype=F64, device=dev)
    if compiled.enabled(g):
        state.phi = state.phi.to(device=dev, dtype=F64, non_blocking=True).contiguous()
        vec = orders.to(F64).reshape(-1)
        return compiled.solve_weights(gram, "gradvac", vec, [beta, eps], state=state.phi)
    phi_t = state.phi.to(dev, non_blocking=True)
    coef = torch.eye(t, dtype=F64, device=dev)
    rows = torch.arange(t, device=dev)
    norm_j_all = torch.diagonal(g).clamp_min(0.0).sqrt()
    for step in range(t - 1):
        j = orders[:, step]
        cg = coef @ g
        dot = cg[rows, j]
        norm_i = (cg * coef).sum(1).clamp_min(0.0).sqrt()
        norm_j = norm_j_all[j]
        phi = dot / (norm_i * norm_j + eps)
        hat = phi_t[rows, j]
        s_phi = (1.0 - phi * phi).clamp_min(0.0).sqrt()
        s_hat = (1.0 - hat * hat).clamp_min(0.0).sqrt()
        w = norm_i * (hat * s_phi - phi * s_hat) / (norm_j * s_hat + eps)
        coef[rows, j] += torch.where(phi < hat, w, torch.zeros_like(w))
        phi_t[rows, j] = (1.0 - beta) * hat + beta * phi
    state.phi = phi_t
    return coef.sum(0).to(weights_dtype(gram))


class CRMOGMState(WeightsState):
    """CR-MOGM's smoothed weights ``lambda [T]`` (float64, on the Gram's device; ``None`` before the first call)."""


def crmogm_weights(
    gram: torch.Tensor,
    state: CRMOGMState,
    generator: torch.Generator | None = None,
    *,
    base: str = "mgda",
    alpha: float = 0.9,
) -> torch.Tensor:
    """CR-MOGM (Zhou et al., "On the Convergence of Stochastic Multi-Objective Gradient Manipulation", NeurIPS
    2022): the weights of the stateless aggregator ``base`` (default ``mgda``, with its default options),
    smoothed across calls, ``lambda <- alpha lambda + (1 - alpha) lambda_hat`` (the first call returns
    ``lambda_hat``). ``state`` is a :class:`CRMOGMState`.

    ``gram [T, T]`` float32/float64 -> ``w [T]`` on its device (float64 for a float64 Gram, else float32)."""
    if not isinstance(state, CRMOGMState):
        raise TypeError(f"crmogm needs a CRMOGMState, got {type(state).__name__}")
    if base not in AGGREGATORS or base in STATEFUL:
        stateless = ", ".join(k for k in AGGREGATORS if k not in STATEFUL and k != "constant")
        raise ValueError(f"crmogm: option base={base!r} must be a stateless weighting: {stateless}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"crmogm: alpha must be in [0, 1], got {alpha}")
    lam_hat = AGGREGATORS[base](gram, generator).to(F64)
    t = lam_hat.shape[0]
    if state.weights is None or state.weights.shape != (t,):
        lam = lam_hat
    else:
        lam = (
            alpha * state.weights.to(device=lam_hat.device, dtype=F64, non_blocking=True)
            + (1.0 - alpha) * lam_hat
        )
    state.weights = lam
    return lam.to(weights_dtype(gram))


AGGREGATORS: dict[str, Callable[..., torch.Tensor]] = {
    "sum": sum_weights,
    "mean": mean_weights,
    "pcgrad": pcgrad_weights,
    "gem": gem_weights,
    "upgrad": upgrad_weights,
    "mgda": mgda_weights,
    "dualproj": dualproj_weights,
    "imtlg": imtlg_weights,
    "cagrad": cagrad_weights,
    "alignedmtl": alignedmtl_weights,
    "fairgrad": fairgrad_weights,
    "nashmtl": nashmtl_weights,
    "gradvac": gradvac_weights,
    "constant": weights_extra.constant_weights,
    "random": weights_extra.random_weights,
    "krum": weights_extra.krum_weights,
    "modo": weights_extra.modo_weights,
    "sdmgrad": weights_extra.sdmgrad_weights,
    "crmogm": crmogm_weights,
    "pcd": weights_extra.pcd_weights,
    "excessmtl": weights_extra.excessmtl_weights,
}
"""Name -> aggregator ``fn(gram, [state,] generator=None, **options) -> w``."""

STATEFUL: dict[str, type] = {
    "nashmtl": NashMTLState,
    "gradvac": GradVacState,
    "modo": weights_extra.MoDoState,
    "sdmgrad": weights_extra.SDMGradState,
    "crmogm": CRMOGMState,
    "pcd": weights_extra.PCDState,
    "excessmtl": weights_extra.ExcessMTLState,
}
"""Names whose function takes a state object (second argument / ``state=``), and the state's class."""
