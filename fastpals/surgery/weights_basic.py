"""Aggregators: a ``T x T`` Gram matrix of task gradients -> a weight vector ``w [T]``.

Every aggregator has the signature ``aggregator(gram, generator=None, **options) -> w`` where

- ``gram [T, T]`` float32 or float64, symmetric, on any device: ``gram[i, j] = <g_i, g_j>`` over the parameters
  shared by the tasks,
- ``w [T]`` (float64 when ``gram`` is float64, else float32), on ``gram``'s device, such that the update is
  ``sum_t w[t] * g_t``.

All arithmetic runs on ``gram``'s device in float64 (the matrix is tiny) with no device-to-host synchronisation:
the weights can be fed straight into the combine kernel. The code is branch-free tensor code: no ``.item()``,
``.tolist()``, ``bool(tensor)``, data-dependent output sizes (boolean masks, ``nonzero``), indexing with a 0-dim
device tensor, blocking host-to-device copies, ``torch.linalg`` calls that check errors on the host, or loops
whose exit reads a tensor. Iterative solvers run a fixed iteration budget (an argument); once converged, the
iterate is frozen (``torch.where(done, old, new)``), so iterations past convergence change nothing. The random
PCGrad orders are drawn on the host from a CPU ``torch.Generator`` (no device read). Only Python arguments are
validated (types, shapes, option values), never tensor values. ``tests/test_aggregators_fake.py`` runs every
aggregator on a ``FakeTensorMode`` Gram, where any data-dependent host read raises.

Non-finite Gram matrices never reach an aggregator (``TaskGradients.apply`` skips the step); the aggregators do
not check because checking needs a sync.
"""

from __future__ import annotations

import torch

from fastpals.functional import MAX_TASKS  # one limit for the buffer, the kernels and the weightings
from fastpals.surgery import compiled

__all__ = [
    "check_gram",
    "gem_weights",
    "mean_weights",
    "pcgrad_orders",
    "pcgrad_weights",
    "sum_weights",
    "weights_dtype",
]


def _check_gram(gram: object) -> torch.Tensor:
    if not isinstance(gram, torch.Tensor):
        raise TypeError(f"gram must be a torch.Tensor, got {type(gram).__name__}")
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1] or gram.shape[0] == 0:
        raise ValueError(f"gram must be a non-empty square [T, T] matrix, got shape {tuple(gram.shape)}")
    if gram.shape[0] > MAX_TASKS:
        raise ValueError(f"gram has T = {gram.shape[0]} tasks; at most {MAX_TASKS} are supported")
    if gram.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"gram must be float32 or float64, got {gram.dtype}")
    return gram


def _out_dtype(gram: torch.Tensor) -> torch.dtype:
    return torch.float64 if gram.dtype == torch.float64 else torch.float32


def check_gram(gram: object) -> torch.Tensor:
    """Validate a Gram matrix argument: a float32/float64 tensor of shape ``[T, T]``,
    ``1 <= T <= fastpals.functional.MAX_TASKS`` (raises ``TypeError``/``ValueError`` naming the problem); returns
    it unchanged. Only metadata is checked (shape, dtype), never values: that would need a device read."""
    return _check_gram(gram)


def weights_dtype(gram: torch.Tensor) -> torch.dtype:
    """The dtype of an aggregator's weights for ``gram``: float64 for a float64 Gram, else float32."""
    return _out_dtype(gram)


def sum_weights(gram: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Plain multi-task sum: ``w = 1`` for every task. ``generator`` is accepted for a uniform signature.

    ``gram [T, T]`` float32/float64 (only its shape, dtype and device are used) -> ``w [T]`` on its device
    (float64 for a float64 Gram, else float32). No iterations."""
    gram = _check_gram(gram)
    if compiled.enabled(gram):
        return compiled.solve_weights(gram, "sum", None, [])
    return torch.ones(gram.shape[0], dtype=_out_dtype(gram), device=gram.device)


def mean_weights(gram: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Plain multi-task mean: ``w = 1 / T`` for every task.

    ``gram [T, T]`` float32/float64 (only its shape, dtype and device are used) -> ``w [T]`` on its device
    (float64 for a float64 Gram, else float32). No iterations."""
    gram = _check_gram(gram)
    if compiled.enabled(gram):
        return compiled.solve_weights(gram, "mean", None, [])
    t = gram.shape[0]
    return torch.full((t,), 1.0 / t, dtype=_out_dtype(gram), device=gram.device)


def pcgrad_orders(num_tasks: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The random projection orders of one PCGrad step, drawn on the host: ``int64 [T, T-1]`` (CPU).

    Row ``i`` lists the other tasks ``j != i`` in the order task ``i`` is projected against them. The rule (the
    contract the tests transcribe): for ``i = 0 .. T-1`` in turn, ``perm = torch.randperm(T - 1,
    generator=generator)`` and row ``i`` is ``others[perm]`` with ``others = [j for j in range(T) if j != i]``.
    ``generator`` must be a CPU ``torch.Generator`` (``None``: PyTorch's default CPU generator). Drawing on the
    host costs no device synchronisation.
    """
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
    """PCGrad (Yu et al. 2020, Algorithm 1) as task weights.

    For each task ``i``, ``g_i`` is projected, in the order ``orders[i]`` (drawn by :func:`pcgrad_orders` from
    ``generator`` unless given), onto the normal plane of the ORIGINAL ``g_j`` of each other task ``j`` whenever
    the current projected ``g_i`` conflicts with it (``<g_i^PC, g_j> < 0``); the projected gradients are summed.

    The projected gradients are tracked as combinations of the original ones, ``g_i^PC = sum_k C[i, k] g_k``
    (``C = I`` at the start), so every inner product is read from the Gram matrix:
    ``<g_i^PC, g_j> = (C @ gram)[i, j]`` and a projection subtracts ``<g_i^PC, g_j> / gram[j, j]`` from
    ``C[i, j]``. All ``T`` tasks are processed together (exactly ``T - 1`` vectorised steps, no convergence
    test); ``w = C.sum(0)``. The conflict test is a ``torch.where`` on the device (no host read); only the
    orders are drawn on the host. A task with a zero gradient (``gram[j, j] == 0``) never conflicts and is never
    projected against.

    Args:
        gram: ``[T, T]`` float32/float64 Gram matrix (any device).
        generator: CPU ``torch.Generator`` for the orders (ignored when ``orders`` is given).
        orders: optional ``int64 [T, T-1]`` explicit orders (row ``i`` a permutation of the tasks other than i).

    Returns:
        ``w [T]`` on ``gram``'s device (float64 for a float64 Gram, else float32).
    """
    gram = _check_gram(gram)
    t = gram.shape[0]
    if orders is None:
        orders = pcgrad_orders(t, generator)
    elif not isinstance(orders, torch.Tensor) or orders.shape != (t, t - 1) or orders.dtype != torch.int64:
        raise ValueError(f"orders must be an int64 tensor of shape ({t}, {t - 1})")
    device = gram.device
    if compiled.enabled(gram):
        vec = orders.to(device=device, dtype=torch.float64, non_blocking=True).reshape(-1)
        return compiled.solve_weights(gram, "pcgrad", vec, [])
    g = gram.to(torch.float64)
    orders = orders.to(device, non_blocking=True)
    coef = torch.eye(t, dtype=torch.float64, device=device)
    rows = torch.arange(t, device=device)
    diag = torch.diagonal(g)
    safe_diag = torch.where(diag > 0, diag, torch.ones_like(diag))
    for step in range(t - 1):
        j = orders[:, step]
        # <g_i^PC, g_{j_i}> = sum_k C[i, k] G[k, j_i]
        dots = (coef * g[:, j].T).sum(dim=1)
        shift = torch.where((dots < 0) & (diag[j] > 0), dots / safe_diag[j], torch.zeros_like(dots))
        coef[rows, j] -= shift
    return coef.sum(dim=0).to(_out_dtype(gram))


def _proposal_vector(proposal: object, t: int, device: torch.device) -> torch.Tensor:
    if isinstance(proposal, str):
        if proposal == "sum":
            return torch.ones(t, dtype=torch.float64, device=device)
        if proposal == "mean":
            return torch.full((t,), 1.0 / t, dtype=torch.float64, device=device)
        raise ValueError(f"proposal must be 'sum', 'mean', a task index or a [T] tensor, got {proposal!r}")
    if isinstance(proposal, int) and not isinstance(proposal, bool):
        if not 0 <= proposal < t:
            raise ValueError(f"proposal task index {proposal} is out of range for T = {t}")
        a = torch.zeros(t, dtype=torch.float64, device=device)
        a[proposal] = 1.0
        return a
    if isinstance(proposal, torch.Tensor):
        if proposal.shape != (t,) or not proposal.is_floating_point():
            raise ValueError(
                f"proposal tensor must be floating point of shape ({t},), got {tuple(proposal.shape)}"
            )
        return proposal.to(device=device, dtype=torch.float64, non_blocking=True)
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
    mask = torch.zeros(t, dtype=torch.bool)
    if constraints is None:
        mask[:] = True
        if isinstance(proposal, int) and not isinstance(proposal, bool):
            mask[proposal] = False  # GEM constrains the other tasks, not the one being trained
    else:
        idx = list(constraints.tolist() if isinstance(constraints, torch.Tensor) else constraints)
        for k in idx:
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
    """GEM (Lopez-Paz & Ranzato 2017) for multi-task training, as task weights.

    The proposed update is ``g = sum_t a_t g_t`` with ``a`` given by ``proposal``: ``"sum"`` (default, the plain
    multi-task update), ``"mean"``, a task index ``k`` (``g = g_k``, as in GEM where the current task proposes)
    or an explicit ``[T]`` tensor. GEM returns the update closest to ``g`` whose inner product with every
    constrained task gradient is non-negative: ``min_z 1/2 |z - g|^2`` s.t. ``<z, g_c> >= 0``. Its dual, in Gram
    entries only, is the QP ``min_{v >= 0} 1/2 v^T G_cc v + v^T (G a)_c`` and ``z = g + sum_c v_c g_c``, so
    ``w = a + v`` (``v`` zero outside the constrained rows).

    ``constraints`` lists the constrained rows (default: every task, or every task but ``k`` when the proposal is
    task ``k``). With an episodic memory, put the memory gradients in their own rows (``2T`` rows: current
    batches, then memories), propose with the current rows (a ``[2T]`` tensor with zeros on memory rows) and
    constrain the memory rows: :class:`fastpals.surgery.GEM` does exactly that. ``constraints`` given as a CPU
    tensor or a list is validated on the host; given as a device tensor it is used unchecked (checking would
    read it back).

    The QP is solved on the device in float64, without synchronising, by block principal pivoting (Judice &
    Pires; Kim & Park's NNLS form) run for exactly ``max_iter`` iterations (default ``3 * T + 10``), with no
    convergence read: once the KKT conditions hold to ``tol`` relative to ``max(diag G)`` the free set is frozen
    (``torch.where(done, old, new)``), so the remaining iterations leave the result unchanged; the Murty
    single-pivot backup rule guarantees finite termination for a positive definite ``G``. Each iteration is one
    ``torch.linalg.solve_ex`` (no host error check). ``ridge * max(diag G)`` is added to the diagonal so that
    linearly dependent gradients (a singular ``G``) stay solvable; it perturbs the update by a relative
    ``O(ridge)``.

    Args:
        gram: ``[T, T]`` float32/float64 Gram matrix (any device).
        generator: unused (uniform signature).
        proposal: ``"sum"``, ``"mean"``, a task index or a floating ``[T]`` tensor.
        constraints: constrained task indices (list or int tensor), default as above.
        max_iter: the fixed iteration budget (default ``3 * T + 10``).
        tol: KKT tolerance relative to ``max(diag G)``.
        ridge: diagonal regularisation relative to ``max(diag G)``.

    Returns:
        ``w [T]`` on ``gram``'s device (float64 for a float64 Gram, else float32).
    """
    gram = _check_gram(gram)
    t = gram.shape[0]
    device = gram.device
    a = _proposal_vector(proposal, t, device)
    mask = _constraint_mask(constraints, t, proposal, device)
    iters = 3 * t + 10 if max_iter is None else int(max_iter)
    if compiled.enabled(gram):
        vec = torch.cat([a.to(torch.float64), mask.to(torch.float64)])
        return compiled.solve_weights(gram, "gem", vec, [tol, ridge, iters])
    g = gram.to(torch.float64)
    g = 0.5 * (g + g.T)
    scale = torch.diagonal(g).amax().clamp_min(torch.finfo(torch.float64).tiny)
    eye = torch.eye(t, dtype=torch.float64, device=device)
    outer = mask[:, None] & mask[None, :]
    # The QP restricted to constrained rows: unconstrained rows are pinned to v = 0 (identity rows, zero rhs).
    q = torch.where(outer, g + ridge * scale * eye, eye)
    b = torch.where(mask, g @ a, torch.zeros_like(a))
    thresh = tol * scale

    passive = torch.zeros(t, dtype=torch.bool, device=device)  # F: free (possibly positive) variables
    # torch.full, not torch.tensor: a Python scalar copied to the device by torch.tensor is a blocking copy
    best_ninf = torch.full((), t + 1, dtype=torch.int64, device=device)
    backup_left = torch.full((), 3, dtype=torch.int64, device=device)
    index = torch.arange(t, device=device)
    for _ in range(iters):
        v = _solve_on(passive, q, b, eye)
        slack = q @ v + b  # gradient of the QP; KKT: v >= 0, slack >= 0, v * slack = 0
        infeasible = mask & ((passive & (v < -thresh)) | (~passive & (slack < -thresh)))
        ninf = infeasible.sum()
        done = ninf == 0
        # Exchange rule: full exchange while the infeasible count decreases (and up to 3 times more), then
        # Murty's backup rule: flip only the largest infeasible index. Once done, the set is frozen.
        improved = ninf < best_ninf
        use_full = improved | (backup_left > 0)
        backup_left = torch.where(improved, torch.full_like(backup_left, 3), backup_left - 1)
        best_ninf = torch.minimum(best_ninf, ninf)
        largest = torch.where(infeasible, index, torch.full_like(index, -1)).amax()
        flip = torch.where(use_full, infeasible, infeasible & (index == largest))
        passive = torch.where(done, passive, passive ^ flip)
    # The solution on the final (frozen once optimal) free set; clamping makes a budget-limited iterate feasible.
    v = _solve_on(passive, q, b, eye).clamp_min(0.0)
    return (a + v).to(_out_dtype(gram))


def _solve_on(passive: torch.Tensor, q: torch.Tensor, b: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """``v_F = -Q_FF^{-1} b_F`` on the free set ``F = passive``, ``v = 0`` elsewhere (no host sync)."""
    system = torch.where(passive[:, None] & passive[None, :], q, eye)
    rhs = torch.where(passive, -b, torch.zeros_like(b))
    sol, _info = torch.linalg.solve_ex(system, rhs)
    return torch.where(passive, sol, torch.zeros_like(sol))
