"""Data load balancer: how many devices each tower gets so that the towers finish together.

Two exact solvers and two simple rules:

* :func:`minmax_allocation` — the DistMM paper's dynamic program: minimise the slowest tower,
  ``f(k, d) = min_n max(T_k(n), f(k-1, d-n))`` over (tower, devices used), every device used.
  ``O(K * D * |n|)`` with numpy over ``d``; the last tower only needs ``d = D`` (one vector op).
* :func:`barrier_allocation` — what a contrastive step actually costs. The batch sync is a
  barrier between all forwards and all backwards, so the step is ``max_t F_t + max_t B_t`` (plus
  the sync), not ``max_t (F_t + B_t)``. The two differ when towers have different forward /
  backward ratios: a frozen tower (LiT) has no backward, a ``cached`` tower recomputes, a tower
  with a heavy all-reduce has a long tail. We solve it exactly by parametric search over the
  forward bound ``phi``: for each candidate ``phi`` (every distinct forward time in a provable
  window) run the min-max DP on backward times restricted to configurations with ``F <= phi``;
  the answer is the best ``max F + max B`` seen. The window is ``[DP(F), best - DP(B)]``: no
  allocation has a smaller max forward than the min-max of forwards, and one with max forward
  ``phi`` costs at least ``phi + DP(B)``. Above ``max_points`` distinct values the window is
  sampled geometrically (the result then says so).
* ``proportional`` (devices in proportion to training FLOPs) and ``even`` (equal devices) fix the
  allocation and only pick each tower's configuration; they are ablations.

Uneven replica batches come from the partitioner (``ceil(G / dp)`` for the slowest replica); a
frozen tower's candidates simply have ``B = 0``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_distmm.planner.cost.breakdown import TowerChoice
from lightning_distmm.planner.search.partition import Candidates, InfeasibleError

INF = math.inf


def minmax_allocation(tables: Sequence[np.ndarray], devices: int) -> tuple[float, list[int]]:
    """Minimise ``max_k tables[k][n_k]`` subject to ``sum_k n_k = devices``, ``n_k >= 1``.

    ``tables[k]`` has entries for ``n = 0..devices`` (``inf`` where tower ``k`` cannot use ``n``
    devices). Returns the optimum and the allocation (``inf`` and ``[]`` when none exists).
    """
    D = devices
    K = len(tables)
    T = [np.asarray(t[: D + 1], dtype=float).copy() for t in tables]
    for t in T:
        if len(t) < D + 1:
            raise ValueError("each table needs entries for n = 0..devices")
        t[0] = INF
    if K == 1:
        return (float(T[0][D]), [D]) if np.isfinite(T[0][D]) else (INF, [])
    f = T[0]
    args: list[np.ndarray] = []
    for k in range(1, K - 1):
        new = np.full(D + 1, INF)
        arg = np.zeros(D + 1, dtype=int)
        for n in np.flatnonzero(np.isfinite(T[k])):
            cand = np.maximum(T[k][n], f[: D + 1 - n])
            seg = new[n:]
            better = cand < seg
            seg[better] = cand[better]
            arg[n:][better] = n
        args.append(arg)
        f = new
    last = T[K - 1]
    ns = np.arange(1, D + 1)
    vals = np.maximum(last[1:], f[D - ns])
    j = int(np.argmin(vals))
    best = float(vals[j])
    if not np.isfinite(best):
        return INF, []
    alloc = [0] * K
    alloc[K - 1] = int(ns[j])
    d = D - alloc[K - 1]
    for k in range(K - 2, 0, -1):
        alloc[k] = int(args[k - 1][d])
        d -= alloc[k]
    alloc[0] = d
    return best, alloc


@dataclass
class Balance:
    """The balancer's answer: devices per tower, the chosen candidate per tower and the objective."""

    objective: float
    alloc: dict[str, int]
    index: dict[str, int]
    method: str
    exact: bool = True
    evaluations: int = 0
    #: each tower's candidates as the balancer chose among them (its Pareto set): ``index`` points here
    pareto: list[Candidates] = field(default_factory=list)
    #: the window of the forward bound ``phi`` the barrier DP swept, and how many points it tried
    phi_window: tuple[float, float] | None = None
    phi_points: int = 0

    def choices(self) -> dict[str, TowerChoice]:
        """Each tower's chosen configuration, in the order the towers were balanced."""
        return {c.tower: c.choice(self.index[c.tower]) for c in self.pareto}


def best_by_devices(cands: Sequence[Candidates], D: int, values: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per tower, the smallest of ``values`` over its candidates with each device count 0..D (inf: none)."""
    out = []
    for c, v in zip(cands, values):
        t = np.full(D + 1, INF)
        sel = c.n <= D
        np.minimum.at(t, c.n[sel], v[sel])
        out.append(t)
    return out


def _pick(c: Candidates, n: int, phi: float = INF) -> int:
    """Among tower candidates on ``n`` devices with ``F <= phi``, the one with the least B (then F)."""
    idx = np.flatnonzero((c.n == n) & (c.F <= phi * (1 + 1e-12)))
    if len(idx) == 0:
        return -1
    order = np.lexsort((c.F[idx], c.B[idx]))
    return int(idx[order[0]])


def _objective(cands: Sequence[Candidates], picks: Sequence[int]) -> float:
    return max(float(c.F[i]) for c, i in zip(cands, picks)) + max(float(c.B[i]) for c, i in zip(cands, picks))


def barrier_allocation(
    cands: Sequence[Candidates],
    devices: int,
    max_points: int = 256,
    fixed: Mapping[str, int] | None = None,
) -> Balance:
    """Minimise ``max_t F_t + max_t B_t`` over device counts (summing to ``devices``) and configurations."""
    D = devices
    if fixed is not None:
        cands = [c.take(c.n == fixed[c.tower]) for c in cands]
    for c in cands:
        if len(c) == 0:
            raise InfeasibleError(
                f"tower {c.tower!r} has no feasible configuration on the devices the balancer gives it"
            )
    cands = [c.pareto() for c in cands]
    evals = 0

    def solve_for(phi: float, tables: list[np.ndarray]) -> tuple[float, list[int], list[int]]:
        nonlocal evals
        evals += 1
        _, alloc = minmax_allocation(tables, D)
        if not alloc:
            return INF, [], []
        picks = [_pick(c, n, phi) for c, n in zip(cands, alloc)]
        if min(picks) < 0:
            return INF, alloc, picks
        return _objective(cands, picks), alloc, picks

    best, best_alloc, best_picks = INF, [], []
    # start: the min-max of F + B (the paper's formulation), and the minimisers of F and of B
    for values in ([c.F + c.B for c in cands], [c.F for c in cands], [c.B for c in cands]):
        _, alloc = minmax_allocation(best_by_devices(cands, D, values), D)
        evals += 1
        if alloc:
            picks = []
            for c, n, v in zip(cands, alloc, values):
                idx = np.flatnonzero(c.n == n)
                picks.append(int(idx[np.argmin(v[idx])]))
            obj = _objective(cands, picks)
            if obj < best:
                best, best_alloc, best_picks = obj, alloc, picks
    if not best_alloc:
        raise InfeasibleError(_no_allocation_message(cands, D))
    g_inf, _ = minmax_allocation(best_by_devices(cands, D, [c.B for c in cands]), D)
    f_lo, _ = minmax_allocation(best_by_devices(cands, D, [c.F for c in cands]), D)
    hi = best - g_inf
    allF = np.unique(np.concatenate([c.F[(c.F >= f_lo * (1 - 1e-12)) & (c.F <= hi * (1 + 1e-12))] for c in cands]))
    exact = len(allF) <= max_points
    phis = allF if exact else np.geomspace(max(f_lo, 1e-30), max(hi, f_lo, 1e-30), max_points)
    # sweep phi upwards, admitting candidates into the B-tables as their F falls under phi
    order = [np.argsort(c.F, kind="stable") for c in cands]
    ptr = [0] * len(cands)
    tables = [np.full(D + 1, INF) for _ in cands]
    for phi in phis:
        if phi + g_inf >= best * (1 - 1e-12):
            break
        for k, c in enumerate(cands):
            o = order[k]
            start = ptr[k]
            while ptr[k] < len(o) and c.F[o[ptr[k]]] <= phi * (1 + 1e-12):
                ptr[k] += 1
            new = o[start : ptr[k]]
            new = new[c.n[new] <= D]
            if len(new):
                np.minimum.at(tables[k], c.n[new], c.B[new])
        if any(not np.isfinite(t).any() for t in tables):
            continue
        obj, alloc, picks = solve_for(float(phi), tables)
        if obj < best:
            best, best_alloc, best_picks = obj, alloc, picks
    return Balance(
        objective=best,
        alloc={c.tower: int(n) for c, n in zip(cands, best_alloc)},
        index={c.tower: int(i) for c, i in zip(cands, best_picks)},
        method="fixed" if fixed is not None else "dp",
        exact=exact,
        evaluations=evals,
        pareto=list(cands),
        phi_window=(float(f_lo), float(hi)),
        phi_points=int(len(phis)),
    )


def _no_allocation_message(cands: Sequence[Candidates], D: int) -> str:
    parts = []
    for c in cands:
        ns = sorted(set(int(n) for n in c.n))
        parts.append(f"{c.tower!r} can use {ns[0]}..{ns[-1]} devices" if ns else f"{c.tower!r} fits on no device count")
    return f"no split of {D} devices gives every tower a feasible configuration: " + "; ".join(parts)


def proportional_allocation(weights: Mapping[str, float], devices: int) -> dict[str, int]:
    """Devices in proportion to ``weights`` (largest remainder), at least one each."""
    names = list(weights)
    if devices < len(names):
        raise InfeasibleError(f"{devices} devices cannot give each of {len(names)} towers its own device")
    total = sum(max(float(w), 0.0) for w in weights.values()) or 1.0
    spare = devices - len(names)
    exact = [spare * max(float(weights[n]), 0.0) / total for n in names]
    counts = [1 + int(x) for x in exact]
    order = sorted(range(len(names)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in order[: devices - sum(counts)]:
        counts[i] += 1
    return dict(zip(names, counts))


def even_allocation(names: Sequence[str], devices: int) -> dict[str, int]:
    return proportional_allocation({n: 1.0 for n in names}, devices)


# ---------------------------------------------------------------------- brute force (tests)
def compositions(total: int, parts: int) -> Any:
    """All ``parts``-tuples of positive integers summing to ``total``."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def brute_force_minmax(tables: Sequence[np.ndarray], devices: int) -> float:
    best = INF
    for alloc in compositions(devices, len(tables)):
        best = min(best, max(float(t[n]) for t, n in zip(tables, alloc)))
    return best


def brute_force_barrier(cands: Sequence[Candidates], devices: int) -> float:
    best = INF
    for alloc in compositions(devices, len(cands)):
        options = [np.flatnonzero(c.n == n) for c, n in zip(cands, alloc)]
        if any(len(o) == 0 for o in options):
            continue
        for picks in itertools.product(*options):
            best = min(best, _objective(cands, picks))
    return best


__all__ = [
    "Balance",
    "minmax_allocation",
    "barrier_allocation",
    "proportional_allocation",
    "even_allocation",
    "brute_force_minmax",
    "brute_force_barrier",
    "compositions",
]
