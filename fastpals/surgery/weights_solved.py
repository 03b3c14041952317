"""Gram-based weightings of the multi-task literature (UPGrad, MGDA, DualProj, IMTL-G, CAGrad, Aligned-MTL,
FairGrad, Nash-MTL, GradVac, CR-MOGM) with :mod:`.weights_basic`'s conventions, and :data:`AGGREGATORS`, the
registry of every aggregator, built from ``--surgery NAME --surgery-opt KEY=VALUE`` by :func:`make_weighting`.
Defaults are TorchJD 0.18's where it has one. Loss scaling: FairGrad's weights and
Nash-MTL's ``max_norm`` clip depend on a common gradient scale ``S``: give them Grams divided by ``S^2``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from fastpals.surgery import compiled, weights_basic
from fastpals.surgery.solvers import QP_MAX_ITER, jacobi_eigh, jacobi_sweeps, nonneg_qp, spd_solve
from fastpals.surgery.weights_basic import check_gram, preference, weights_dtype

F64 = torch.float64
#: most tasks of CAGrad's exact solver (it enumerates the 2^T - 1 supports); ``pgd`` takes any number
CAGRAD_EXACT_MAX_TASKS = 10


def _normalize(g: torch.Tensor, eps: float) -> torch.Tensor:
    """``G / trace(G)``, or zeros when ``trace(G) < eps`` (TorchJD's Frobenius normalisation of ``J``)."""
    tr = torch.diagonal(g).sum()
    small = tr < eps
    return torch.where(small, torch.zeros_like(g), g / torch.where(small, torch.ones_like(tr), tr))


def _dual_cone(
    gram: torch.Tensor,
    method: str,
    pref_vector: torch.Tensor | None,
    norm_eps: float,
    reg_eps: float,
    max_iter: int | None,
) -> torch.Tensor:
    """UPGrad's or DualProj's weights: the projections of ``J^T u_k`` onto the dual cone of the rows of ``J``,
    ``argmin_{v >= u_k} v^T G' v`` with ``G' = G / trace(G) + reg_eps I`` (TorchJD's regularised QP), for the
    rows ``u_k`` of ``diag(p)`` (UPGrad, summed) or of ``p[None]`` (DualProj)."""
    g = _prepare(gram)
    t = g.shape[0]
    p = preference(pref_vector, t, g.device, method)
    if compiled.enabled(g):
        iters = min(3 * t + 10, QP_MAX_ITER) if max_iter is None else int(max_iter)
        vec = torch.cat([p, torch.zeros_like(p)])
        return compiled.solve_weights(gram, method, vec, [norm_eps, reg_eps, iters])
    u = torch.diag(p) if method == "upgrad" else p[None, :]
    gr = _normalize(g, norm_eps) + reg_eps * torch.eye(t, dtype=F64, device=g.device)
    v = u + nonneg_qp(gr, u @ gr, max_iter=max_iter)  # v = u + x, x >= 0: min 1/2 x^T G' x + x^T G' u
    return v.sum(dim=0).to(weights_dtype(gram))


def _prepare(gram: torch.Tensor) -> torch.Tensor:
    g = check_gram(gram).to(F64)
    return 0.5 * (g + g.T)


def upgrad_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    pref_vector: torch.Tensor | None = None,
    norm_eps: float = 1e-4,
    reg_eps: float = 1e-4,
    max_iter: int | None = None,
) -> torch.Tensor:
    """UPGrad (Quinton & Rey 2024): each task gradient scaled by ``pref_vector`` (default ``1 / T``),
    projected onto the dual cone of the task gradients, summed; ``G / trace(G)`` as in TorchJD,
    :func:`nonneg_qp` with ``max_iter`` iterations (default ``min(3 T + 10, 40)``)."""
    return _dual_cone(gram, "upgrad", pref_vector, norm_eps, reg_eps, max_iter)


def dualproj_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    pref_vector: torch.Tensor | None = None,
    norm_eps: float = 1e-4,
    reg_eps: float = 1e-4,
    max_iter: int | None = None,
) -> torch.Tensor:
    """DualProj: the preference-weighted gradient projected onto the dual cone of the task gradients."""
    return _dual_cone(gram, "dualproj", pref_vector, norm_eps, reg_eps, max_iter)


def mgda_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    epsilon: float = 1e-3,
    max_iters: int = 100,
) -> torch.Tensor:
    """MGDA: the min-norm point of the gradients' hull, ``max_iters`` Frank-Wolfe steps (Sener & Koltun)."""
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
        alpha = torch.where(done, alpha, (1 - gamma) * alpha + gamma * (index == k).to(F64))
        done = done | (gamma < epsilon)
    return alpha.to(weights_dtype(gram))


def imtlg_weights(
    gram: torch.Tensor, generator: torch.Generator | None = None, *, sweeps: int | None = None
) -> torch.Tensor:
    """IMTL-G (Liu et al. 2021) as TorchJD generalises it: ``w ∝ G^+ d`` (``d_i = |g_i|``), summing to 1."""
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
    w = torch.where(small, torch.zeros_like(v), v / torch.where(small, torch.ones_like(s), s))
    return w.to(weights_dtype(gram))


def alignedmtl_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    pref_vector: torch.Tensor | None = None,
    scale_mode: str = "min",
    sweeps: int | None = None,
) -> torch.Tensor:
    """Aligned-MTL (Senushkin et al. 2023, Algorithm 1): ``w = sqrt(s) V Λ^{-1/2} V^T p`` over the eigenpairs
    of ``G``'s upper triangle above ``max(λ) T eps``, ``s`` their min / median / mean (``rmse``) eigenvalue,
    ``w = p`` for a zero ``G``; ``p`` is ``pref_vector`` (default ``1 / T``)."""
    if scale_mode not in ("min", "median", "rmse"):
        raise ValueError(f"alignedmtl: scale_mode must be 'min', 'median' or 'rmse', got {scale_mode!r}")
    g = check_gram(gram).to(F64)
    t = g.shape[0]
    p = preference(pref_vector, t, g.device, "alignedmtl")
    if compiled.enabled(g):
        budget = jacobi_sweeps(t) if sweeps is None else int(sweeps)
        mode = ("min", "median", "rmse").index(scale_mode)
        vec = torch.cat([p, torch.zeros_like(p)])
        return compiled.solve_weights(gram, "alignedmtl", vec, [budget, mode, torch.finfo(gram.dtype).eps])
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


def _cagrad_kkt(
    g: torch.Tensor,
    b: torch.Tensor,
    rho: torch.Tensor,
    masks: torch.Tensor,
    solve: Callable[..., torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """CAGrad's KKT point ``w [K, T]`` on each support of ``masks [K, T]``; ``valid [K]`` where it is."""
    eye = torch.eye(g.shape[0], dtype=F64, device=g.device)
    scale = torch.diagonal(g).amax().clamp_min(1e-300)
    system = torch.where(masks[:, :, None] & masks[:, None, :], g + 1e-12 * scale * eye, eye)
    rhs = torch.stack([masks.to(F64), torch.where(masks, b, torch.zeros_like(b))], dim=2)
    sol = solve(system, rhs)
    sol = torch.where(masks[:, :, None], sol, torch.zeros_like(sol))
    a_vec, c_vec = sol[..., 0], sol[..., 1]
    big_a, big_b, big_c = a_vec.sum(1), c_vec.sum(1), c_vec @ b
    disc = big_b * big_b - big_a * (big_c - rho * rho)
    valid = (disc > 0) & (big_a > 0)
    sd = torch.where(valid, disc, torch.ones_like(disc)).sqrt()
    lam = (big_b + sd) / torch.where(valid, big_a, torch.ones_like(big_a))
    return (lam[:, None] * a_vec - c_vec) / sd[:, None], valid


def _cagrad_projected_gradient(
    g: torch.Tensor, b: torch.Tensor, rho: torch.Tensor, iters: int
) -> torch.Tensor:
    """``iters`` projected gradient steps from ``1/T`` on ``<b, w> + ρ sqrt(wᵀ G w)`` over the simplex."""
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
        grad = grad - grad.mean()  # the component along the simplex
        scale = grad.abs().amax().clamp_min(1e-300)  # the largest step moves some coordinate by 1
        cand = weights_basic.project_onto_simplex(w[None, :] - (steps / scale)[:, None] * grad[None, :])
        best = torch.argmin(objective(cand)).reshape(1)
        w = cand.index_select(0, best)[0]
    return w


def _cagrad_active_set(
    g: torch.Tensor, b: torch.Tensor, rho: torch.Tensor, start: torch.Tensor, iters: int
) -> torch.Tensor:
    """The best feasible point of ``iters`` active-set steps for CAGrad's problem from ``start [T]``."""
    t = g.shape[0]
    dev = g.device
    index = torch.arange(t, device=dev)
    inf = torch.full((t,), math.inf, dtype=F64, device=dev)

    def objective(x: torch.Tensor) -> torch.Tensor:
        return x @ b + rho * (x @ g @ x).clamp_min(0.0).sqrt()

    best, best_f = start, objective(start)
    support = (start > 1e-6 * start.amax()) | (index == torch.argmax(start))
    done = torch.zeros((), dtype=torch.bool, device=dev)
    for _ in range(iters):
        w, valid = _cagrad_kkt(g, b, rho, support[None], lambda a, r: torch.linalg.solve_ex(a, r)[0])
        w, valid = w[0], valid[0]
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
    """CAGrad (Liu et al. 2021, Algorithm 1) on ``G / trace(G)``. ``solver``: ``exact`` (every support's KKT
    point, at most 10 tasks), ``pgd`` (``max_iter`` projected-gradient then ``search_iters``, default
    ``2 T + 10``, active-set steps) or ``auto`` (``exact`` up to 10 tasks)."""
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
        codes = torch.arange(1, 2**t, device=dev)  # every non-empty subset of the tasks
        subsets = ((codes[:, None] >> torch.arange(t, device=dev)[None, :]) & 1).bool()
        w, ok = _cagrad_kkt(g, b, rho, subsets, spd_solve)
        ok = ok & (w >= -1e-9).all(1)
        w = w.clamp_min(0.0)
        w = w / w.sum(1, keepdim=True).clamp_min(1e-300)
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
    """The positive root of ``G x = x^{-1/alpha}``: ``max_iter`` damped Newton steps (Armijo's rule)."""
    if compiled.enabled(g):
        return compiled.solve_weights(g, "alpha_fair", None, [alpha, max_iter])
    t = g.shape[0]
    dev = g.device
    tr = torch.diagonal(g).sum().clamp_min(1e-300)
    gn = g / tr
    p = -1.0 / alpha

    def objective(x: torch.Tensor) -> torch.Tensor:  # x [..., T]; psi' = x^p
        psi = torch.log(x) if alpha == 1.0 else (alpha / (alpha - 1.0)) * x.pow(1.0 + p)
        return 0.5 * ((x @ gn) * x).sum(-1) - psi.sum(-1)

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
    """FairGrad (Ban & Ji 2024, Eq. 4): ``w > 0`` with ``G w = w^{-1/alpha}`` (``alpha = 0``: ``1 / T``)."""
    if alpha < 0:
        raise ValueError(f"fairgrad: alpha must be non-negative, got {alpha}")
    g = _prepare(gram)
    t = g.shape[0]
    if alpha == 0:
        return torch.full((t,), 1.0 / t, dtype=weights_dtype(gram), device=g.device)
    return _alpha_fair_solve(g, float(alpha), int(max_iter)).to(weights_dtype(gram))


class NashMTLState(weights_basic.CountedState):
    """Nash-MTL's step counter and last weights (reused between updates when ``update_weights_every > 1``)."""


def nashmtl_weights(
    gram: torch.Tensor,
    state: NashMTLState,
    generator: torch.Generator | None = None,
    *,
    max_norm: float = 1.0,
    update_weights_every: int = 1,
    max_iter: int = 40,
) -> torch.Tensor:
    """Nash-MTL (Navon et al. 2022): the root of ``G' a = 1 / a``, ``|sum_t a_t g_t| <= max_norm``."""
    if not isinstance(state, NashMTLState):
        raise TypeError(f"nashmtl needs a NashMTLState, got {type(state).__name__}")
    if max_norm < 0 or int(update_weights_every) <= 0:
        raise ValueError(
            f"nashmtl: max_norm >= 0 and update_weights_every > 0 needed, got {max_norm}, "
            f"{update_weights_every}"
        )
    g = _prepare(gram)
    t = g.shape[0]
    if state.step % int(update_weights_every) == 0 or state.weights is None or state.weights.numel() != t:
        nf = torch.linalg.matrix_norm(g).clamp_min(1e-300)
        state.weights = _alpha_fair_solve(g / nf, 1.0, int(max_iter))
    state.step += 1
    a = state.weights.to(device=g.device, dtype=F64, non_blocking=True)
    if max_norm > 0:
        norm = (a @ g @ a).clamp_min(0.0).sqrt()
        a = torch.where(norm > max_norm, a * (max_norm / norm.clamp_min(1e-300)), a)
    return a.to(weights_dtype(gram))


class GradVacState(weights_basic.WeightsState):
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
    """GradVac (Wang et al. 2021), whole-model, as combinations: ``g_i^PC`` moved to the EMA cosine target."""
    if not isinstance(state, GradVacState):
        raise TypeError(f"gradvac needs a GradVacState, got {type(state).__name__}")
    if not 0.0 <= beta <= 1.0 or eps < 0:
        raise ValueError(f"gradvac: beta must be in [0, 1] and eps >= 0, got {beta}, {eps}")
    g = check_gram(gram).to(F64)
    t = g.shape[0]
    dev = g.device
    orders = (weights_basic.pcgrad_orders(t, generator) if orders is None else orders).to(
        dev, non_blocking=True
    )
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
        norm_i = (cg * coef).sum(1).clamp_min(0.0).sqrt()
        norm_j = norm_j_all[j]
        phi = cg[rows, j] / (norm_i * norm_j + eps)
        hat = phi_t[rows, j]
        s_phi = (1.0 - phi * phi).clamp_min(0.0).sqrt()
        s_hat = (1.0 - hat * hat).clamp_min(0.0).sqrt()
        w = norm_i * (hat * s_phi - phi * s_hat) / (norm_j * s_hat + eps)
        coef[rows, j] += torch.where(phi < hat, w, torch.zeros_like(w))
        phi_t[rows, j] = (1.0 - beta) * hat + beta * phi
    state.phi = phi_t
    return coef.sum(0).to(weights_dtype(gram))


class CRMOGMState(weights_basic.WeightsState):
    """CR-MOGM's smoothed weights ``lambda [T]`` (float64, on the Gram's device; ``None`` before the first call)."""


def crmogm_weights(
    gram: torch.Tensor,
    state: CRMOGMState,
    generator: torch.Generator | None = None,
    *,
    base: str = "mgda",
    alpha: float = 0.9,
) -> torch.Tensor:
    """CR-MOGM (Zhou et al. 2022): the stateless aggregator ``base``'s weights, exponentially smoothed."""
    if not isinstance(state, CRMOGMState):
        raise TypeError(f"crmogm needs a CRMOGMState, got {type(state).__name__}")
    if base not in AGGREGATORS or base in STATEFUL:
        stateless = ", ".join(k for k in AGGREGATORS if k not in STATEFUL and k != "constant")
        raise ValueError(f"crmogm: option base={base!r} must be a stateless weighting: {stateless}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"crmogm: alpha must be in [0, 1], got {alpha}")
    lam = lam_hat = AGGREGATORS[base](gram, generator).to(F64)
    if state.weights is not None and state.weights.shape == lam_hat.shape:
        previous = state.weights.to(device=lam_hat.device, dtype=F64, non_blocking=True)
        lam = alpha * previous + (1.0 - alpha) * lam_hat
    state.weights = lam
    return lam.to(weights_dtype(gram))


AGGREGATORS: dict[str, Callable[..., torch.Tensor]] = {
    "sum": weights_basic.sum_weights,
    "mean": weights_basic.mean_weights,
    "pcgrad": weights_basic.pcgrad_weights,
    "gem": weights_basic.gem_weights,
    "upgrad": upgrad_weights,
    "mgda": mgda_weights,
    "dualproj": dualproj_weights,
    "imtlg": imtlg_weights,
    "cagrad": cagrad_weights,
    "alignedmtl": alignedmtl_weights,
    "fairgrad": fairgrad_weights,
    "nashmtl": nashmtl_weights,
    "gradvac": gradvac_weights,
    "constant": weights_basic.constant_weights,
    "random": weights_basic.random_weights,
    "krum": weights_basic.krum_weights,
    "modo": weights_basic.modo_weights,
    "sdmgrad": weights_basic.sdmgrad_weights,
    "crmogm": crmogm_weights,
    "pcd": weights_basic.pcd_weights,
    "excessmtl": weights_basic.excessmtl_weights,
}
"""Name -> aggregator ``fn(gram, [state,] generator=None, **options) -> w``."""

STATEFUL: dict[str, type] = {
    "nashmtl": NashMTLState,
    "gradvac": GradVacState,
    "modo": weights_basic.MoDoState,
    "sdmgrad": weights_basic.SDMGradState,
    "crmogm": CRMOGMState,
    "pcd": weights_basic.PCDState,
    "excessmtl": weights_basic.ExcessMTLState,
}
"""Names whose function takes a state object (second argument / ``state=``), and the state's class."""

# the parameters of an aggregator that are not options settable from strings
_NOT_OPTIONS = {"gram", "generator", "state", "orders", "constraints"}


def _parse(name: str, key: str, value: Any, default: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if key in ("pref_vector", "weights") or (key in ("proposal", "tau") and "," in text):
            return torch.tensor([float(x) for x in text.split(",")], dtype=torch.float64)
        if key == "proposal":
            return int(text) if text.lstrip("-").isdigit() else text
        if isinstance(default, bool):
            return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[
                text.lower()
            ]
        if isinstance(default, int) or (default is None and key in ("max_iter", "max_iters", "sweeps")):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except (ValueError, KeyError):
        raise ValueError(f"surgery {name}: option {key}={value!r} is not a valid value") from None
    return text


def make_weighting(name: str, **options: Any) -> tuple[Callable[..., torch.Tensor], Any]:
    """``(fn, state)``: the aggregator ``name`` with ``options`` as ``fn(gram, generator=None) -> w [T]`` and
    its state (``None`` if stateless). String options are parsed by the option's default type (vectors:
    ``1,2``)."""
    key = str(name).lower()
    if key not in AGGREGATORS:
        raise ValueError(f"unknown surgery method {name!r}; choose one of {', '.join(AGGREGATORS)}")
    params = inspect.signature(AGGREGATORS[key]).parameters.items()
    allowed = {k: p for k, p in params if k not in _NOT_OPTIONS}
    parsed: dict[str, Any] = {}
    for opt, value in options.items():
        if opt not in allowed:
            known = ", ".join(allowed) or "none"
            raise ValueError(f"surgery {key}: unknown option {opt!r} (options: {known})")
        parsed[opt] = _parse(key, opt, value, allowed[opt].default)
    fn = AGGREGATORS[key]
    state = STATEFUL[key]() if key in STATEFUL else None

    def weighting(gram: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if state is not None:
            return fn(gram, state, generator, **parsed)
        return fn(gram, generator, **parsed)

    weighting.reads_rows = getattr(fn, "reads_rows", False)  # type: ignore[attr-defined]
    weighting.__name__ = f"{key}_weighting"
    weighting.__qualname__ = weighting.__name__
    return weighting, state


def parse_surgery_options(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["c=0.5", "alpha=2"] -> {"c": "0.5", "alpha": "2"}`` (for ``--surgery-opt KEY=VALUE``,
    repeatable)."""
    out: dict[str, str] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--surgery-opt expects KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        out[k.strip()] = v.strip()
    return out
