"""Aggregators ``fn(gram, [state,] generator=None, **options) -> w``: ``gram [T, T]`` float32/float64 ->
``w [T]`` on its device (float64 for a float64 Gram, else float32), the update being ``sum_t w[t] g_t``;
float64 inside, no host read (fixed iteration budgets, converged iterates frozen with ``torch.where``). Here
the closed forms (sum, mean, PCGrad, GEM) and TorchJD 0.18's further weightings: constant, random, Krum, and
the stateful MoDo, SDMGrad, PCD and ExcessMTL (on the ``[T, P]`` rows, not the Gram; MoDo and SDMGrad run on
one batch's ``J J^T`` as TorchJD runs them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fastpals.functional import MAX_TASKS  # one limit for the buffer, the kernels and the weightings
from fastpals.surgery import compiled
from fastpals.surgery.solvers import nonneg_qp

F64 = torch.float64


def check_gram(gram: object) -> torch.Tensor:
    """``gram`` if it is a float32/float64 ``[T, T]`` tensor with ``1 <= T <= MAX_TASKS`` (metadata only)."""
    if not isinstance(gram, torch.Tensor):
        raise TypeError(f"gram must be a torch.Tensor, got {type(gram).__name__}")
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1] or gram.shape[0] == 0:
        raise ValueError(f"gram must be a non-empty square [T, T] matrix, got shape {tuple(gram.shape)}")
    if gram.shape[0] > MAX_TASKS:
        raise ValueError(f"gram has T = {gram.shape[0]} tasks; at most {MAX_TASKS} are supported")
    if gram.dtype not in (torch.float32, F64):
        raise TypeError(f"gram must be float32 or float64, got {gram.dtype}")
    return gram


def weights_dtype(gram: torch.Tensor) -> torch.dtype:
    """float64 for a float64 Gram, else float32."""
    return F64 if gram.dtype == F64 else torch.float32


def preference(pref_vector: torch.Tensor | None, t: int, device: torch.device, name: str) -> torch.Tensor:
    """The preference vector ``[T]`` float64 on ``device``: ``pref_vector``, or ``1 / T`` when it is ``None``."""
    if pref_vector is None:
        return torch.full((t,), 1.0 / t, dtype=F64, device=device)
    if not isinstance(pref_vector, torch.Tensor) or pref_vector.shape != (t,):
        raise ValueError(f"{name}: pref_vector must be a tensor of shape ({t},), got {pref_vector!r}")
    return pref_vector.to(device=device, dtype=F64, non_blocking=True)


def _constant(gram: torch.Tensor, method: str, value: float | None) -> torch.Tensor:
    """``w = value`` (``1 / T`` for ``None``) for every task."""
    gram = check_gram(gram)
    if compiled.enabled(gram):
        return compiled.solve_weights(gram, method, None, [])
    t = gram.shape[0]
    return torch.full(
        (t,), 1.0 / t if value is None else value, dtype=weights_dtype(gram), device=gram.device
    )


def sum_weights(gram: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Plain multi-task sum: ``w = 1`` for every task."""
    return _constant(gram, "sum", 1.0)


def mean_weights(gram: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Plain multi-task mean: ``w = 1 / T`` for every task."""
    return _constant(gram, "mean", None)


def pcgrad_orders(num_tasks: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """One PCGrad step's random projection orders, ``int64 [T, T-1]`` (CPU), drawn from ``generator``."""
    if not isinstance(num_tasks, int) or num_tasks < 1:
        raise ValueError(f"num_tasks must be a positive int, got {num_tasks!r}")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != "cpu":
            raise ValueError(
                f"generator must be a CPU generator (orders are drawn on the host), got {generator.device}"
            )
    t = num_tasks
    orders = torch.empty((t, max(t - 1, 0)), dtype=torch.int64)
    for i in range(t):
        others = torch.tensor([j for j in range(t) if j != i], dtype=torch.int64)
        orders[i] = others[torch.randperm(t - 1, generator=generator)]
    return orders


def pcgrad_weights(
    gram: torch.Tensor, generator: torch.Generator | None = None, orders: torch.Tensor | None = None
) -> torch.Tensor:
    """PCGrad (Yu et al. 2020, Algorithm 1) as task weights: each ``g_i`` projected, in the order
    ``orders[i]`` (default :func:`pcgrad_orders`), onto the normal plane of each original ``g_j`` it conflicts
    with, summed; ``g_i^PC = sum_k C[i, k] g_k`` is tracked on the Gram, ``w = C.sum(0)``."""
    gram = check_gram(gram)
    t = gram.shape[0]
    if orders is None:
        orders = pcgrad_orders(t, generator)
    elif not isinstance(orders, torch.Tensor) or orders.shape != (t, t - 1) or orders.dtype != torch.int64:
        raise ValueError(f"orders must be an int64 tensor of shape ({t}, {t - 1})")
    device = gram.device
    if compiled.enabled(gram):
        vec = orders.to(device=device, dtype=F64, non_blocking=True).reshape(-1)
        return compiled.solve_weights(gram, "pcgrad", vec, [])
    g = gram.to(F64)
    orders = orders.to(device, non_blocking=True)
    coef = torch.eye(t, dtype=F64, device=device)
    rows = torch.arange(t, device=device)
    diag = torch.diagonal(g)
    safe_diag = torch.where(diag > 0, diag, torch.ones_like(diag))
    for step in range(t - 1):
        j = orders[:, step]
        dots = (coef * g[:, j].T).sum(dim=1)  # <g_i^PC, g_{j_i}> = sum_k C[i, k] G[k, j_i]
        shift = torch.where((dots < 0) & (diag[j] > 0), dots / safe_diag[j], torch.zeros_like(dots))
        coef[rows, j] -= shift
    return coef.sum(dim=0).to(weights_dtype(gram))


def proposal_vector(proposal: object, t: int, device: torch.device) -> torch.Tensor:
    """GEM's proposal ``a [T]`` float64: ``sum_t a_t g_t`` is the update it stays closest to."""
    if isinstance(proposal, str):
        if proposal in ("sum", "mean"):
            return torch.full((t,), 1.0 if proposal == "sum" else 1.0 / t, dtype=F64, device=device)
        raise ValueError(f"proposal must be 'sum', 'mean', a task index or a [T] tensor, got {proposal!r}")
    if isinstance(proposal, int) and not isinstance(proposal, bool):
        if not 0 <= proposal < t:
            raise ValueError(f"proposal task index {proposal} is out of range for T = {t}")
        a = torch.zeros(t, dtype=F64, device=device)
        a[proposal] = 1.0
        return a
    if isinstance(proposal, torch.Tensor):
        if proposal.shape != (t,) or not proposal.is_floating_point():
            raise ValueError(
                f"proposal tensor must be floating point of shape ({t},), got {tuple(proposal.shape)}"
            )
        return proposal.to(device=device, dtype=F64, non_blocking=True)
    raise TypeError(
        f"proposal must be 'sum', 'mean', a task index or a [T] tensor, got {type(proposal).__name__}"
    )


def _constraint_mask(constraints: object, t: int, proposal: object, device: torch.device) -> torch.Tensor:
    if isinstance(constraints, torch.Tensor) and constraints.device.type != "cpu":
        # Indices already on a device: validating their values would read them back (a sync); scatter unchecked.
        if constraints.dim() != 1 or constraints.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"constraints must be a 1-D integer tensor, got {constraints.dtype} {constraints.shape}"
            )
        idx = constraints.to(device=device, dtype=torch.int64, non_blocking=True)
        return torch.zeros(t, dtype=torch.bool, device=device).index_fill_(0, idx, True)
    mask = torch.full((t,), constraints is None)
    if constraints is None:
        if isinstance(proposal, int) and not isinstance(proposal, bool):
            mask[proposal] = False  # GEM constrains the other tasks, not the one being trained
    else:
        for k in constraints.tolist() if isinstance(constraints, torch.Tensor) else constraints:
            if not isinstance(k, int) or not 0 <= k < t:
                raise ValueError(f"constraints must hold task indices in [0, {t}), got {k!r}")
            mask[k] = True
    return mask.to(device, non_blocking=True)


def gem_weights(
    gram: torch.Tensor,
    generator: torch.Generator | None = None,
    proposal: str | int | torch.Tensor = "sum",
    constraints: list[int] | torch.Tensor | None = None,
    max_iter: int | None = None,
    tol: float = 1e-12,
    ridge: float = 1e-12,
) -> torch.Tensor:
    """GEM (Lopez-Paz & Ranzato 2017): the update closest to ``proposal`` (``"sum"``, ``"mean"``, a task ``k``
    or ``[T]``) with no negative inner product with a task of ``constraints`` (default all, or all but
    ``k``)."""
    gram = check_gram(gram)
    t = gram.shape[0]
    device = gram.device
    a = proposal_vector(proposal, t, device)
    mask = _constraint_mask(constraints, t, proposal, device)
    iters = 3 * t + 10 if max_iter is None else int(max_iter)
    if compiled.enabled(gram):
        vec = torch.cat([a.to(F64), mask.to(F64)])
        return compiled.solve_weights(gram, "gem", vec, [tol, ridge, iters])
    g = gram.to(F64)
    g = 0.5 * (g + g.T)
    scale = torch.diagonal(g).amax().clamp_min(torch.finfo(F64).tiny)
    eye = torch.eye(t, dtype=F64, device=device)
    # the QP restricted to the constrained rows: the others are pinned to v = 0 (identity rows, zero rhs)
    q = torch.where(mask[:, None] & mask[None, :], g + ridge * scale * eye, eye)
    b = torch.where(mask, g @ a, torch.zeros_like(a))
    v = nonneg_qp(q, b[None, :], max_iter=iters, tol=tol, scale=scale, pivoting=True)[0]
    return (a + v).to(weights_dtype(gram))


def project_onto_simplex(y: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of each ``y [..., T]`` onto the simplex (Held, Wolfe & Crowder 1974)."""
    desc = torch.sort(y, dim=-1, descending=True).values
    k = torch.arange(1, y.shape[-1] + 1, dtype=y.dtype, device=y.device)
    taus = (torch.cumsum(desc, -1) - 1.0) / k
    count = (desc > taus).sum(-1, keepdim=True)  # the condition holds on a prefix, k = 1 always
    return (y - taus.gather(-1, count - 1)).clamp_min(0.0)


def constant_weights(
    gram: torch.Tensor, generator: torch.Generator | None = None, *, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The fixed ``weights [T]`` whatever the Gram (``--surgery-opt weights=1,2,...``; default ones, the
    sum)."""
    g = check_gram(gram)
    t = g.shape[0]
    if weights is None:
        weights = torch.ones(t, dtype=F64)
    if not isinstance(weights, torch.Tensor) or weights.shape != (t,):
        raise ValueError(f"constant: option weights must be {t} comma-separated values, got {weights!r}")
    if compiled.enabled(g):
        vec = torch.cat([weights.to(F64), torch.zeros(t, dtype=F64, device=weights.device)])
        return compiled.solve_weights(g, "constant", vec.to(g.device, non_blocking=True), [])
    return weights.to(device=g.device, dtype=weights_dtype(gram), non_blocking=True)


def random_weights(gram: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random weighting (Lin et al. 2022): ``softmax(z)``, ``z [T]`` float64 normal drawn on the CPU."""
    g = check_gram(gram)
    z = torch.randn(g.shape[0], dtype=F64, generator=generator)
    if compiled.enabled(g):
        vec = torch.cat([z, torch.zeros_like(z)]).to(g.device, non_blocking=True)
        return compiled.solve_weights(g, "random", vec, [])
    return torch.softmax(z, 0).to(device=g.device, dtype=weights_dtype(gram), non_blocking=True)


def krum_weights(
    gram: torch.Tensor, generator: torch.Generator | None = None, *, n_byzantine: int = 0, n_selected: int = 1
) -> torch.Tensor:
    """(Multi-)Krum (Blanchard et al. 2017): ``1 / n_selected`` on the gradients closest to their others."""
    g = check_gram(gram).to(F64)
    t = g.shape[0]
    if n_byzantine < 0 or n_selected < 1 or t < n_byzantine + 3 or n_selected > t:
        raise ValueError(
            f"krum: needs n_byzantine >= 0, 1 <= n_selected <= T and T >= n_byzantine + 3, got "
            f"n_byzantine={n_byzantine}, n_selected={n_selected}, T={t}"
        )
    if compiled.enabled(g):
        return compiled.solve_weights(gram, "krum", None, [n_byzantine, n_selected])
    sq = torch.diagonal(g)
    dist = (sq[None, :] + sq[:, None] - 2 * g).clamp_min(0.0).sqrt()
    scores = torch.topk(dist, k=t - n_byzantine - 1, largest=False).values[:, 1:].sum(1)
    chosen = torch.topk(scores, k=n_selected, largest=False).indices
    w = torch.zeros(t, dtype=F64, device=g.device).index_fill(0, chosen, 1.0 / n_selected)
    return w.to(weights_dtype(gram))


class WeightsState:
    """Tensors an aggregator carries across calls, named in ``tensors`` (float64, ``None`` at first)."""

    tensors: tuple[str, ...] = ("weights",)
    weights: torch.Tensor | None

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        for name in self.tensors:
            setattr(self, name, None)

    def state_dict(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self.tensors}
        return {name: None if v is None else v.detach().cpu().clone() for name, v in values.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in self.tensors:
            v = state[name]
            setattr(self, name, None if v is None else torch.as_tensor(v, dtype=F64).clone())

    def current(self, t: int, device: torch.device) -> torch.Tensor:
        """The stored ``weights`` on ``device``, uniform ``1 / t`` before the first call or when ``T``
        changed."""
        if self.weights is None or self.weights.shape != (t,):
            return torch.full((t,), 1.0 / t, dtype=F64, device=device)
        return self.weights.to(device=device, dtype=F64, non_blocking=True)


class CountedState(WeightsState):
    """A :class:`WeightsState` that also counts its updates, ``step`` (a Python int: read without a device
    read)."""

    def reset(self) -> None:
        super().reset()
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.step = int(state["step"])


class MoDoState(WeightsState):
    """MoDo's task weights ``lambda [T]`` (float64, on the Gram's device; uniform at the start)."""


class SDMGradState(WeightsState):
    """SDMGrad's inner iterate ``w [T]`` (float64, on the Gram's device; uniform at the start)."""


def modo_weights(
    gram: torch.Tensor,
    state: MoDoState,
    generator: torch.Generator | None = None,
    *,
    gamma: float = 0.1,
    rho: float = 0.1,
) -> torch.Tensor:
    """MoDo (Chen et al. 2024): one projected step ``lambda - gamma (G + rho I) lambda`` per call."""
    if not isinstance(state, MoDoState):
        raise TypeError(f"modo needs a MoDoState, got {type(state).__name__}")
    if gamma <= 0 or rho < 0:
        raise ValueError(f"modo: gamma must be positive and rho non-negative, got {gamma}, {rho}")
    g = check_gram(gram).to(F64)
    lam = state.current(g.shape[0], g.device)
    if compiled.enabled(g):
        state.weights = lam.contiguous()
        return compiled.solve_weights(gram, "modo", None, [gamma, rho], state=state.weights)
    lam = project_onto_simplex(lam - gamma * (g @ lam + rho * lam))
    state.weights = lam
    return lam.to(weights_dtype(gram))


def sdmgrad_weights(
    gram: torch.Tensor,
    state: SDMGradState,
    generator: torch.Generator | None = None,
    *,
    lr: float = 10.0,
    momentum: float = 0.5,
    n_iter: int = 20,
    lambda_: float = 0.3,
    pref_vector: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDMGrad (Xiao, Ban & Ji 2023): ``n_iter`` momentum steps on the simplex for
    ``min_w 1/2 |J^T (w + lambda_ p)|^2`` (``G`` over the squared mean gradient norm) from the stored ``w``;
    returns ``(w + lambda_ p) / (1 + lambda_)``, ``p`` = ``pref_vector`` (default ``1 / T``)."""
    if not isinstance(state, SDMGradState):
        raise TypeError(f"sdmgrad needs an SDMGradState, got {type(state).__name__}")
    if lr <= 0 or not 0 <= momentum < 1 or int(n_iter) < 1 or lambda_ < 0:
        raise ValueError(
            f"sdmgrad: needs lr > 0, 0 <= momentum < 1, n_iter >= 1, lambda_ >= 0, got {lr}, {momentum}, "
            f"{n_iter}, {lambda_}"
        )
    g = check_gram(gram).to(F64)
    t = g.shape[0]
    p = preference(pref_vector, t, g.device, "sdmgrad")
    a = g / (torch.diagonal(g).clamp_min(0.0).sqrt().mean().pow(2) + 1e-8)
    w = state.current(t, g.device)
    if compiled.enabled(g):
        state.weights = w.contiguous()
        vec = torch.cat([p, torch.full((t,), float(lambda_), dtype=F64, device=g.device)])
        return compiled.solve_weights(gram, "sdmgrad", vec, [lr, momentum, int(n_iter)], state=state.weights)
    velocity = torch.zeros_like(w)
    for step in range(int(n_iter)):
        grad = a @ (w + lambda_ * p)
        velocity = grad if step == 0 else momentum * velocity + grad
        w = project_onto_simplex(w - lr * velocity)
    state.weights = w
    return ((w + lambda_ * p) / (1.0 + lambda_)).to(weights_dtype(gram))


class PCDState(CountedState):
    """PCD's moving average of the squared gradient norms ``[T]`` and its number of updates ``step``."""

    tensors = ("sq_norm_ema",)
    sq_norm_ema: torch.Tensor | None


def pcd_weights(
    gram: torch.Tensor,
    state: PCDState,
    generator: torch.Generator | None = None,
    *,
    tau: float | torch.Tensor = 0.02,
    beta: float = 0.999,
    eps: float = 1e-8,
) -> torch.Tensor:
    """PCD (TorchJD's ``PCDWeighting``), task 0 primary: on gradients scaled by their EMA norms, ``d`` closest
    to ``g~_0`` with ``<g~_j, d> >= tau_j |g~_j|^2`` (``tau``: one value or ``[T - 1]``; infeasible:
    ``d = g~_0``), by its dual QP, rescaled to ``|g_0|``."""
    if not isinstance(state, PCDState):
        raise TypeError(f"pcd needs a PCDState, got {type(state).__name__}")
    if not 0.0 <= beta < 1.0 or eps < 0:
        raise ValueError(f"pcd: needs 0 <= beta < 1 and eps >= 0, got beta={beta}, eps={eps}")
    g = check_gram(gram).to(F64)
    t = g.shape[0]
    if isinstance(tau, torch.Tensor):
        if tau.shape != (t - 1,):
            raise ValueError(
                f"pcd: option tau must be one value or {t - 1} comma-separated ones, got {tau!r}"
            )
        taus = tau.to(device=g.device, dtype=F64, non_blocking=True)
    elif 0.0 <= float(tau) <= 1.0:
        taus = torch.full((t - 1,), float(tau), dtype=F64, device=g.device)
    else:
        raise ValueError(f"pcd: option tau must be in [0, 1], got {tau!r}")
    sq = torch.diagonal(g)
    if state.sq_norm_ema is None or state.sq_norm_ema.shape != (t,):
        state.reset()
        state.sq_norm_ema = torch.zeros(t, dtype=F64, device=g.device)
    state.step += 1
    ema = state.sq_norm_ema = beta * state.sq_norm_ema.to(g.device, non_blocking=True) + (1.0 - beta) * sq
    den = (ema / (1.0 - beta**state.step) + eps).sqrt()
    scales = torch.where(
        den > 0, 1.0 / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den)
    )
    precision = 10.0 * torch.finfo(gram.dtype).eps
    if compiled.enabled(g):
        vec = torch.cat([scales, taus, torch.zeros(1, dtype=F64, device=g.device)])
        return compiled.solve_weights(gram, "pcd", vec, [precision])
    ng = g * scales[:, None] * scales[None, :]
    w = torch.ones(t, dtype=F64, device=g.device)
    if t > 1:
        q = ng[1:, 1:]
        q = q + 1e-12 * torch.diagonal(q).amax() * torch.eye(t - 1, dtype=F64, device=g.device)
        lin = ng[1:, 0] - taus * torch.diagonal(ng)[1:]
        mu = nonneg_qp(q, lin[None, :])[0]
        # infeasible constraints (the dual bounded only by the ridge) stay violated: then d = g~_0
        infeasible = (ng[1:, 1:] @ mu + lin < -1e-6 * torch.diagonal(ng).amax()).any()
        w = torch.cat([w[:1], torch.where(infeasible, torch.zeros_like(mu), mu)])
    dsq = w @ ng @ w
    magnitude = (w.abs() @ torch.diagonal(ng).clamp_min(0.0).sqrt()) ** 2
    keep = (sq[0] > 0) & (dsq > precision * magnitude)
    factor = (sq[0] / torch.where(keep, dsq, torch.ones_like(dsq))).sqrt()
    return torch.where(keep, w * scales * factor, torch.zeros_like(w)).to(weights_dtype(gram))


class ExcessMTLState(CountedState):
    """ExcessMTL's ``weights``, ``sq_grad_sum [T, P]``, baseline ``initial``, ``warmup_sum`` and ``step``."""

    tensors = ("weights", "sq_grad_sum", "initial", "warmup_sum")


def excessmtl_weights(
    rows: torch.Tensor,
    state: ExcessMTLState,
    generator: torch.Generator | None = None,
    *,
    robust_step_size: float = 1.0,
    n_warmup_steps: int = 0,
) -> torch.Tensor:
    """ExcessMTL (He et al. 2024; TorchJD's ``ExcessMTLWeighting``) on the task gradients ``rows [T, P]`` (not
    a Gram): after ``n_warmup_steps`` uniform calls, ``w <- softmax(log w + robust_step_size e)``, ``e`` the
    excess risks over their baseline."""
    if not isinstance(state, ExcessMTLState):
        raise TypeError(f"excessmtl needs an ExcessMTLState, got {type(state).__name__}")
    if robust_step_size <= 0 or int(n_warmup_steps) < 0:
        raise ValueError(
            f"excessmtl: needs robust_step_size > 0 and n_warmup_steps >= 0, got {robust_step_size}, "
            f"{n_warmup_steps}"
        )
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[0] == 0:
        raise ValueError(f"excessmtl: rows must be a [T, P] tensor of task gradients, got {rows!r}")
    out_dtype = F64 if rows.dtype == F64 else torch.float32
    x = rows.detach().to(F64)
    t = x.shape[0]
    if state.sq_grad_sum is None or state.sq_grad_sum.shape != x.shape:
        state.reset()
        state.sq_grad_sum = torch.zeros_like(x)
        state.warmup_sum = torch.zeros(t, dtype=F64, device=x.device)
        state.weights = torch.full((t,), 1.0 / t, dtype=F64, device=x.device)
    sq = x * x
    state.sq_grad_sum = state.sq_grad_sum.to(x.device) + sq
    excess = (sq / (state.sq_grad_sum + 1e-7).sqrt()).sum(1)
    state.step += 1
    if state.step <= int(n_warmup_steps):
        state.warmup_sum = state.warmup_sum + excess
        return state.weights.to(out_dtype)
    if state.initial is None and not int(n_warmup_steps):
        state.initial = excess
    else:
        if state.initial is None:
            state.initial = state.warmup_sum / int(n_warmup_steps)
        excess = excess / (state.initial + 1e-7)
    state.weights = torch.softmax(state.weights.to(x.device).log() + robust_step_size * excess, 0)
    return state.weights.to(out_dtype)


excessmtl_weights.reads_rows = True  # type: ignore[attr-defined]  # TaskGradients.apply hands it the rows
