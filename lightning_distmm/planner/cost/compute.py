"""Device time: a tower's forward and backward on one pipeline stage, the optimizer step, and how
devices that share a host stretch each other's compute.

Every GEMM is priced by :meth:`Device.gemm_time` (roofline or measured efficiency curve, with the
GPU's wave quantisation), attention as FlashAttention's work split, elementwise work by memory
bandwidth, plus a fixed cost per kernel. A measured profile (:class:`MeasuredFit`) replaces the
analytic time at ``tp = pp = 1`` and rescales it for other splits. All functions take numpy arrays
of microbatch sizes as well as plain numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_distmm.planner.cluster import Cluster
from lightning_distmm.planner.cost.memory import stage_params
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.profile import Block, TowerProfile


def block_time(block: Block, cluster: Cluster, opts: CostOptions, mb: Any, tp: int) -> np.ndarray:
    """Forward seconds of ``block`` for ``mb`` samples on one device of a ``tp``-way split."""
    dev = cluster.device
    bel = opts.bytes_el
    mb = np.asarray(mb, dtype=float)
    t = np.zeros_like(mb)
    for g in block.gemms:
        k, n = (g.k, g.n / tp) if g.split == "col" else (g.k / tp, g.n) if g.split == "row" else (g.k, g.n)
        T = mb * g.tokens
        t = t + dev.gemm_time(2.0 * T * k * n, bel * (T * k + k * n + T * n), T, n)
    for a in block.attn:
        width = a.width / tp
        flops = 4.0 * mb * a.q * a.kv * width
        io = bel * mb * (2 * a.q + 2 * a.kv) * width
        if not opts.flash_attention:
            io = io + 2 * bel * mb * a.q * a.kv * a.heads / tp
        # one (query block x head dim) output tile per (sample, head): FlashAttention's work split
        t = t + dev.gemm_time(flops, io, a.q, a.width / a.heads, mb * max(a.heads // tp, 1))
    t = t + bel * mb * (block.elem_rep + block.elem_split / tp) / dev.memory_bandwidth
    return t + block.kernels * dev.kernel_overhead


def stage_compute(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int
) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward compute seconds of the slowest pipeline stage for one microbatch."""
    mb = np.asarray(mb, dtype=float)
    fit = profile.measured
    if not profile.analytic:
        if fit is None or tp != 1 or pp != 1:
            raise ValueError(f"tower {profile.name!r} has only a measured profile: it can only run with tp = pp = 1")
        f, b = fit.fwd_time(mb), fit.bwd_time(mb)
    else:
        f = _analytic_stage(profile, cluster, opts, mb, tp, pp)
        b = 2.0 * f
        if fit is not None:
            ref = _analytic_stage(profile, cluster, opts, mb, 1, 1)
            scale = f / np.maximum(ref, 1e-30)
            f, b = fit.fwd_time(mb) * scale, fit.bwd_time(mb) * scale
    if profile.frozen:
        b = np.zeros_like(f)
    return np.asarray(f, dtype=float), np.asarray(b, dtype=float)


def _analytic_stage(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int
) -> np.ndarray:
    layer = block_time(profile.layer, cluster, opts, mb, tp) * (profile.layers // pp)
    pre, post = block_time(profile.pre, cluster, opts, mb, tp), block_time(profile.post, cluster, opts, mb, tp)
    return layer + (pre + post if pp == 1 else np.maximum(pre, post))


def optimizer_time(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, tp: int, pp: int, shard: str = "none", dp: int = 1
) -> float:
    """One Adam step on a device: measured when the profile has a timed step (its share of the
    tower's parameters for tp/pp splits), else the optimizer's memory traffic over HBM bandwidth.
    A sharded optimizer state (``optimizer``, ``full``) is stepped by each replica for its 1/dp."""
    if profile.frozen:
        return 0.0
    share = 1.0 / dp if shard != "none" else 1.0
    fit = profile.measured
    if fit is not None and fit.opt_time is not None:
        return fit.opt_time * stage_params(profile, tp, pp) / max(profile.params, 1) * share
    frac = profile.trainable_params / max(profile.params, 1)
    return stage_params(profile, tp, pp) * frac * opts.optimizer_traffic / cluster.device.memory_bandwidth * share


def shared_host_phases(
    times: Mapping[str, float],
    ranks: Mapping[str, Sequence[int]],
    devices_per_node: int,
    concurrency: float,
    colocated: bool,
) -> dict[str, float]:
    """Wall time of each tower's phase when devices of a node slow each other down.

    ``concurrency`` (``Device.concurrency``, measured for CPU processes) is the factor by which
    compute stretches while other devices of the node compute too. Colocated towers run on every
    rank at once, so each phase stretches by it whenever a node holds two or more of the ranks.
    For separate towers, a tower is stretched only while a device it shares a node with is busy:
    with ``T`` its phase alone and ``O`` the longest phase of the other busy devices of its nodes
    (its own other replicas included, ``O >= T`` then), everyone progresses at ``1/concurrency``
    until the shorter of the two ends, so the wall time is ``T + (concurrency - 1) * min(T, O)``.
    """
    node = lambda r: r // devices_per_node  # noqa: E731
    extra = concurrency - 1.0
    if colocated:
        shared = any(sum(1 for r in rs if node(r) == nd) > 1 for rs in ranks.values() for nd in {node(r) for r in rs})
        return {n: t * (concurrency if shared else 1.0) for n, t in times.items()}
    out = {}
    for n, t in times.items():
        counts: dict[int, int] = {}
        for r in ranks[n]:
            counts[node(r)] = counts.get(node(r), 0) + 1
        other = t if any(k > 1 for k in counts.values()) else 0.0
        for m, rs in ranks.items():
            if m != n and any(node(r) in counts for r in rs):
                other = max(other, times[m])
        out[n] = t + extra * min(t, other)
    return out


__all__ = ["block_time", "stage_compute", "optimizer_time", "shared_host_phases"]
