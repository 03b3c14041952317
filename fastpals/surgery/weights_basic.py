"""Aggregators ``fn(gram, [state,] generator=None, **options) -> w``: ``gram [T, T]`` float32/float64 -> ``w [T]``
on its device (float64 for a float64 Gram, else float32), the update being ``sum_t w[t] g_t``; float64 inside, no
host read (fixed iteration budgets, converged iterates frozen with ``torch.where``)."""

from __future__ import annotations

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
    """The random projection orders of one PCGrad step, ``int64 [T, T-1]`` (CPU): row ``i`` is the tasks ``j != i``
    permuted by ``torch.randperm(T - 1, generator=generator)``, rows drawn in order."""
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
    """PCGrad (Yu et al. 2020, Algorithm 1) as task weights: each ``g_i`` projected, in the order ``orders[i]``
    (default :func:`pcgrad_orders`), onto the normal plane of each original ``g_j`` it conflicts with, summed;
    ``g_i^PC = sum_k C[i, k] g_k`` is tracked on the Gram, ``w = C.sum(0)``."""
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
    """GEM (Lopez-Paz & Ranzato 2017) as task weights: the update closest to the proposal ``sum_t a_t g_t``
    (``"sum"``, ``"mean"``, a task index ``k`` or a ``[T]`` tensor) with a non-negative inner product with every
    task of ``constraints`` (default all, or all but ``k``), by the dual QP (``max_iter`` default ``3 T + 10``)."""
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
