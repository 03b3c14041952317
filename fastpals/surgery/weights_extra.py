"""TorchJD 0.18's further weightings, with :mod:`.weights_basic`'s conventions: ``constant`` (fixed weights),
``random`` (softmax of a normal draw), ``krum`` (Multi-Krum), and the stateful ``modo``, ``sdmgrad``, ``pcd`` and
``excessmtl`` (the only one on the ``[T, P]`` gradient rows, not the Gram). MoDo and SDMGrad are defined on
``J_1 J_2^T`` of two mini-batches; on one batch's ``J J^T`` they run as TorchJD runs on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fastpals.surgery import compiled
from fastpals.surgery.solvers import nonneg_qp
from fastpals.surgery.weights_basic import check_gram, preference, weights_dtype

F64 = torch.float64


def project_onto_simplex(y: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of each ``y [..., T]`` onto the probability simplex (sort-based, no host read;
    Held, Wolfe & Crowder 1974, as the official MoDo and SDMGrad code)."""
    desc = torch.sort(y, dim=-1, descending=True).values
    k = torch.arange(1, y.shape[-1] + 1, dtype=y.dtype, device=y.device)
    taus = (torch.cumsum(desc, -1) - 1.0) / k
    count = (desc > taus).sum(-1, keepdim=True)  # the condition holds on a prefix, k = 1 always
    return (y - taus.gather(-1, count - 1)).clamp_min(0.0)


def constant_weights(
    gram: torch.Tensor, generator: torch.Generator | None = None, *, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The fixed ``weights [T]`` whatever the Gram (``--surgery-opt weights=1,2,...``; default ones, the sum)."""
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
    """Random weighting (Lin et al. 2022): ``softmax(z)``, ``z [T]`` float64 normal drawn on the CPU from
    ``generator`` (torch's default if ``None``)."""
    g = check_gram(gram)
    z = torch.randn(g.shape[0], dtype=F64, generator=generator)
    if compiled.enabled(g):
        vec = torch.cat([z, torch.zeros_like(z)]).to(g.device, non_blocking=True)
        return compiled.solve_weights(g, "random", vec, [])
    return torch.softmax(z, 0).to(device=g.device, dtype=weights_dtype(gram), non_blocking=True)


def krum_weights(
    gram: torch.Tensor, generator: torch.Generator | None = None, *, n_byzantine: int = 0, n_selected: int = 1
) -> torch.Tensor:
    """(Multi-)Krum (Blanchard et al. 2017): the ``n_selected`` gradients with the lowest sums of distances to
    their ``T - n_byzantine - 2`` nearest others get weight ``1 / n_selected``, the others 0."""
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
    """Tensors an aggregator carries across calls, named in ``tensors`` (float64, ``None`` until the first call);
    ``state_dict()`` holds host copies."""

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
        """The stored ``weights`` on ``device``, uniform ``1 / t`` before the first call or when ``T`` changed."""
        if self.weights is None or self.weights.shape != (t,):
            return torch.full((t,), 1.0 / t, dtype=F64, device=device)
        return self.weights.to(device=device, dtype=F64, non_blocking=True)


class CountedState(WeightsState):
    """A :class:`WeightsState` that also counts its updates, ``step`` (a Python int: read without a device read)."""

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
    """MoDo (Chen et al., JMLR 2024): one step ``lambda <- Proj_simplex(lambda - gamma (G lambda + rho lambda))``
    per call from the stored ``lambda``; returns the new ``lambda``."""
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
    """SDMGrad (Xiao, Ban & Ji 2023): ``n_iter`` momentum steps on the simplex for ``min_w 1/2 |J^T (w + lambda_
    p)|^2`` (``G`` over the squared mean gradient norm) from the stored ``w``; returns ``(w + lambda_ p) / (1 +
    lambda_)``, ``p`` = ``pref_vector`` (default ``1 / T``)."""
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
    """PCD (TorchJD's ``PCDWeighting``), task 0 primary: on gradients scaled by their EMA norms, ``d`` closest to
    ``g~_0`` with ``<g~_j, d> >= tau_j |g~_j|^2`` (``tau``: one value or ``[T - 1]``; infeasible: ``d = g~_0``),
    by its dual QP, rescaled to ``|g_0|``."""
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
        # infeasible constraints make the dual unbounded (bounded only by the ridge): a constraint then stays
        # violated without the ridge, and d = g~_0
        infeasible = (ng[1:, 1:] @ mu + lin < -1e-6 * torch.diagonal(ng).amax()).any()
        w = torch.cat([w[:1], torch.where(infeasible, torch.zeros_like(mu), mu)])
    dsq = w @ ng @ w
    magnitude = (w.abs() @ torch.diagonal(ng).clamp_min(0.0).sqrt()) ** 2
    keep = (sq[0] > 0) & (dsq > precision * magnitude)
    factor = (sq[0] / torch.where(keep, dsq, torch.ones_like(dsq))).sqrt()
    return torch.where(keep, w * scales * factor, torch.zeros_like(w)).to(weights_dtype(gram))


class ExcessMTLState(CountedState):
    """ExcessMTL's ``weights [T]``, squared-gradient sums ``sq_grad_sum [T, P]``, baseline excess risks
    ``initial [T]``, warm-up sums ``warmup_sum [T]`` and number of calls ``step``."""

    tensors = ("weights", "sq_grad_sum", "initial", "warmup_sum")


def excessmtl_weights(
    rows: torch.Tensor,
    state: ExcessMTLState,
    generator: torch.Generator | None = None,
    *,
    robust_step_size: float = 1.0,
    n_warmup_steps: int = 0,
) -> torch.Tensor:
    """ExcessMTL (He et al. 2024; TorchJD's ``ExcessMTLWeighting``) on the task gradients ``rows [T, P]`` (not a
    Gram): after ``n_warmup_steps`` uniform calls, ``w <- softmax(log w + robust_step_size e)``, ``e`` the excess
    risks over their baseline."""
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
