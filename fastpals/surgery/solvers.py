"""Small dense solvers of the aggregators, with fixed budgets and no host read (``torch.linalg.eigh`` and ``pinv``
check errors on the host on CUDA): batched SPD solves, a Jacobi eigensolver and a non-negative QP."""

from __future__ import annotations

import torch

F64 = torch.float64
#: the largest systems solved by :func:`spd_solve`; larger ones go to ``torch.linalg.solve_ex`` (no host check)
SPD_SOLVE_MAX_T = 16
#: the most iterations of :func:`nonneg_qp` by default (``min(3 T + 10, QP_MAX_ITER)``): every one runs
QP_MAX_ITER = 40


def spd_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve small SPD systems ``a [B, T, T] x = b [B, T, K]`` by Gauss-Jordan on the calling thread."""
    a = a.clone()
    b = b.clone()
    t = a.shape[-1]
    for k in range(t):
        piv = a[:, k, k].clamp_min(torch.finfo(a.dtype).tiny)
        row_a = a[:, k, :] / piv[:, None]
        row_b = b[:, k, :] / piv[:, None]
        f = a[:, :, k].clone()
        f[:, k] = 0.0
        a = a - f[:, :, None] * row_a[:, None, :]
        b = b - f[:, :, None] * row_b[:, None, :]
        a[:, k, :] = row_a
        b[:, k, :] = row_b
    return b


def _round_robin(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n - 1`` rounds of ``n / 2`` disjoint pairs ``(p, q)`` covering every pair once."""
    r = torch.arange(n - 1, device=device)[:, None]
    k = torch.arange(n, device=device)[None, :]
    seats = torch.where(k == 0, 0, 1 + (k - 1 + r) % (n - 1))  # [n - 1, n]: seat 0 fixed, the others rotate
    return seats[:, : n // 2], seats[:, n // 2 :].flip(1)


def jacobi_sweeps(t: int) -> int:
    """Default sweeps of :func:`jacobi_eigh`: ``2 ceil(log2 n) + 4``, ``n`` = ``T`` rounded up to even."""
    n = t + t % 2
    return 2 * (n - 1).bit_length() + 4


def jacobi_eigh(a: torch.Tensor, sweeps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lam [T], vec [T, T])`` float64 (in no order) with ``a ~= vec @ diag(lam) @ vec.T`` for a symmetric
    ``a [T, T]``: ``sweeps`` cyclic Jacobi sweeps of round-robin rotations, each skipped below Demmel &
    Veselic's threshold."""
    if a.dim() != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
        raise ValueError(f"jacobi_eigh needs a non-empty square matrix, got shape {tuple(a.shape)}")
    t = a.shape[0]
    n = t + t % 2
    budget = jacobi_sweeps(t) if sweeps is None else int(sweeps)
    if budget < 0:
        raise ValueError(f"jacobi_eigh: sweeps must be >= 0, got {sweeps}")
    dev = a.device
    m = a.to(F64)
    if n != t:
        m = torch.nn.functional.pad(m, (0, 1, 0, 1))
    vec = torch.eye(n, dtype=F64, device=dev)
    eps = torch.finfo(F64).eps
    p_all, q_all = _round_robin(n, dev)
    rounds = []
    for p, q in zip(p_all, q_all):
        pq, qp = torch.cat([p, q]), torch.cat([q, p])
        position = torch.argsort(pq)  # index i -> its position in pq
        # the gathers of a_pp, a_qq and a_pq; the partner of each index; the zeroed entries
        rounds.append(((torch.cat([p, q, p]), torch.cat([p, q, q])), qp[position], position, (pq, qp)))
    zeros = torch.zeros(n, dtype=F64, device=dev)
    half = n // 2
    for _ in range(budget):
        for gather, partner, position, off_idx in rounds:
            app, aqq, apq = m[gather].view(3, half)
            skip = apq.abs() <= eps * (app * aqq).abs().sqrt()
            # tan(2 theta) = 2 a_pq / (a_qq - a_pp), |theta| <= pi / 4 (0 / 0 only where skipped)
            theta = torch.where(skip, 0.0, 0.5 * torch.atan(2.0 * apq / (aqq - app)))
            cos, sin = torch.cos(theta), torch.sin(theta)
            # m <- R^T m R, vec <- vec R elementwise (R[i, i] = c_i, R[partner(i), i] = s_i): no tiny GEMMs
            c_i = torch.cat([cos, cos])[position]
            s_i = torch.cat([-sin, sin])[position]
            m = c_i[:, None] * m + s_i[:, None] * m[partner]
            m = (m * c_i + m[:, partner] * s_i).index_put(off_idx, zeros)
            vec = vec * c_i + vec[:, partner] * s_i
    return torch.diagonal(m)[:t].clone(), vec[:t, :t].clone()


def nonneg_qp(
    q: torch.Tensor,
    b: torch.Tensor,
    max_iter: int | None = None,
    tol: float = 1e-13,
    scale: torch.Tensor | None = None,
    pivoting: bool = False,
) -> torch.Tensor:
    """``x [B, T] >= 0`` minimising ``1/2 x^T Q x + b^T x`` for an SPD float64 ``q [T, T]`` and each row of
    ``b``: ``max_iter`` iterations of block principal pivoting with Murty's backup rule (Kim & Park), frozen
    once the KKT conditions hold to ``tol * scale``. ``pivoting``: LU solves, for a ``Q`` that may be
    singular."""
    bsz, t = b.shape
    device = q.device
    eye = torch.eye(t, dtype=F64, device=device)
    thresh = tol * (torch.diagonal(q).amax() if scale is None else scale).clamp_min(torch.finfo(F64).tiny)
    iters = min(3 * t + 10, QP_MAX_ITER) if max_iter is None else int(max_iter)
    passive = torch.zeros((bsz, t), dtype=torch.bool, device=device)
    best = torch.full((bsz,), t + 1, device=device)
    backup_left = torch.full((bsz,), 3, device=device)
    index = torch.arange(t, device=device).expand(bsz, t)

    def solve(free: torch.Tensor) -> torch.Tensor:
        system = torch.where(free[:, :, None] & free[:, None, :], q, eye)
        rhs = torch.where(free, -b, torch.zeros_like(b))[:, :, None]
        # elementwise Gauss-Jordan for small T (no thread pool); beyond, one batched LAPACK solve is faster
        gauss_jordan = t <= SPD_SOLVE_MAX_T and not pivoting
        sol = (spd_solve(system, rhs) if gauss_jordan else torch.linalg.solve_ex(system, rhs)[0])[:, :, 0]
        return torch.where(free, sol, torch.zeros_like(sol))

    for _ in range(iters):
        x = solve(passive)
        slack = x @ q + b  # Q symmetric
        infeasible = (passive & (x < -thresh)) | (~passive & (slack < -thresh))
        ninf = infeasible.sum(dim=1)
        done = (ninf == 0)[:, None]
        improved = ninf < best
        use_full = (improved | (backup_left > 0))[:, None]
        backup_left = torch.where(improved, torch.full_like(backup_left, 3), backup_left - 1)
        best = torch.minimum(best, ninf)
        largest = torch.where(infeasible, index, torch.full_like(index, -1)).amax(dim=1, keepdim=True)
        flip = torch.where(use_full, infeasible, infeasible & (index == largest))
        passive = torch.where(done, passive, passive ^ flip)
    return solve(passive).clamp_min(0.0)
