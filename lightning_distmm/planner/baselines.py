"""Colocated plans, priced by the same cost model as DistMM's: the baselines and part of its space.

* ``ddp`` — open_clip style: every device holds every tower, pure data parallelism
  (tp = pp = 1), the whole-batch loss through ``gpipe`` (keep activations) or, when the replica
  batch does not fit, ``cached`` (GradCache / open_clip ``--accum-freq``), best microbatch count.
* ``megatron`` — Megatron-LM style: one uniform tp x pp x dp for the whole model (every tower split
  the same way, stage ``i`` holding the ``i``-th slice of every tower), one microbatch size and one
  schedule; every valid (tp, pp, schedule, microbatches) is tried and the fastest kept.
* ``colocated`` — DistMM's colocated family: towers share all devices but each picks its own
  tp, pp, microbatch and schedule (memory is shared, so they are chosen jointly; ``distmm``, when
  the options list it, is on every tower or on none, as it splits the whole batch into two sync
  groups). It contains both
  baselines, which is why the DistMM plan is never predicted slower than either.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_distmm.core.plan import split_batch, sync_group_count
from lightning_distmm.planner.cluster import Cluster
from lightning_distmm.planner.cost import (
    CostOptions,
    StepCost,
    TowerChoice,
    batch_syncs,
    contrastive_features,
    evaluate_plan,
    loss_bytes,
)
from lightning_distmm.planner.partition import SearchSpace, colocated_options, option
from lightning_distmm.planner.profile import TowerProfile


@dataclass
class Evaluated:
    """A complete priced plan: per-tower choices, ranks and the step cost."""

    name: str
    choices: dict[str, TowerChoice]
    ranks: dict[str, list[int]]
    cost: StepCost

    @property
    def step_time(self) -> float:
        return self.cost.step_time


def _choice(name: str, o: Mapping[str, Any], world: int, G: int) -> TowerChoice:
    dp = world // (o["tp"] * o["pp"])
    return TowerChoice(name, world, o["tp"], o["pp"], o["mb"], o["schedule"], tuple(split_batch(G, None, dp)))


def colocated_search(
    profiles: Mapping[str, TowerProfile],
    cluster: Cluster,
    opts: CostOptions,
    global_batch: int,
    space: SearchSpace,
    mode: str = "colocated",
    top: int = 8,
) -> Evaluated | None:
    """The fastest colocated plan of the given ``mode`` (``ddp``, ``megatron``, ``colocated``), or None."""
    world = cluster.world_size
    names = list(profiles)
    n_contrastive, embed = contrastive_features(profiles)
    limit = cluster.device.memory * opts.memory_margin
    # per sync-group count (1, or 2 under distmm): the loss buffers (memory left for the towers) and
    # the batch-syncs' seconds, which differ between the two families of plans
    budget, sync = {}, {}
    for groups in (1, 2):
        budget[groups] = limit - loss_bytes(
            split_batch(global_batch, None, groups)[0], world, n_contrastive, opts, embed
        )
        sync[groups] = batch_syncs(cluster, opts, global_batch, embed, world, cluster.nodes, n_contrastive, groups)[
            "total"
        ]
    combos: list[tuple[float, tuple[dict[str, Any], ...]]] = []
    if mode == "ddp":
        opts_per = [colocated_options(profiles[n], cluster, opts, global_batch, world, space, [1], [1]) for n in names]
        combos = _combine(opts_per, budget, opts, sync)
    elif mode == "colocated":
        opts_per = [colocated_options(profiles[n], cluster, opts, global_batch, world, space) for n in names]
        combos = _combine(opts_per, budget, opts, sync)
    elif mode == "megatron":
        tps = sorted(set.intersection(*(set(space.tps[n]) for n in names)))
        pps = sorted(set.intersection(*(set(space.pps[n]) for n in names)))
        for tp, pp in itertools.product(tps, pps):
            if world % (tp * pp):
                continue
            per = []
            for n in names:
                entries = {}
                for o in _all_options(profiles[n], cluster, opts, global_batch, world, space, tp, pp):
                    # a frozen tower has no backward: it runs alongside whatever schedule the others use
                    for s in space.schedules if profiles[n].frozen else [o["schedule"]]:
                        entries[(s, o["K"])] = o
                per.append(entries)
            for key in set.intersection(*(set(d) for d in per)):
                group = tuple(d[key] for d in per)
                groups = sync_group_count({n: o["schedule"] for n, o in zip(names, group)})
                if groups is not None and sum(o["mem"] for o in group) <= budget[groups]:
                    combos.append((colocated_estimate(group, opts) + sync[groups], group))
    else:
        raise ValueError(f"unknown colocated mode {mode!r}")
    if not combos:
        return None
    combos.sort(key=lambda c: c[0])
    ranks = {n: list(range(world)) for n in names}
    best: Evaluated | None = None
    for _, group in combos[:top]:
        choices = {n: _choice(n, o, world, global_batch) for n, o in zip(names, group)}
        cost = evaluate_plan(profiles, cluster, opts, choices, ranks, global_batch)
        if not cost.extra["fits"]:
            continue
        if best is None or cost.step_time < best.step_time:
            best = Evaluated(mode, choices, ranks, cost)
    return best


def _all_options(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, G: int, world: int, space: SearchSpace, tp: int, pp: int
) -> list[dict[str, Any]]:
    """Every (schedule, K) of one tower at a fixed tp x pp on all devices (no Pareto pruning)."""
    import numpy as np

    from lightning_distmm.planner.partition import _grid, k_grid

    if world // (tp * pp) > G:
        return []
    dp = np.array([world // (tp * pp)], dtype=float)
    Ks = k_grid(G, space.max_microbatches)
    out = []
    for s, d in _grid(profile, cluster, opts, G, dp, Ks, tp, pp, space.schedules, 0.0, False).items():
        for j in range(len(Ks)):
            if d["ok"][0, j] and Ks[j] == d["K"][0, j]:
                out.append(option(d, tp, pp, s, j))
    return out


def colocated_estimate(group: Sequence[Mapping[str, Any]], opts: CostOptions) -> float:
    """Step of colocated towers without the (constant) sync: forwards, backwards, optimizer steps,
    and the gradient all-reduces on one stream, each hiding behind the later towers' backward."""
    base = sum(o["F"] + o["Bphase"] + o["opt"] for o in group)
    gb = sum(o["gb"] for o in group)
    total_ar = sum(o["ar"] for o in group)
    if not opts.overlap_grad_sync:
        return base + total_ar
    floor = total_ar * min(1.0, opts.bucket_bytes / gb) if gb else 0.0
    best = math.inf
    for order in itertools.permutations(group):
        clock = stream = 0.0
        for o in order:
            clock += o["Bphase"]
            stream = max(stream, clock - o["slot"]) + o["ar"]
        best = min(best, max(stream - clock, floor))
    return base + best


def _combine(
    per: Sequence[list[dict[str, Any]]],
    budget: Mapping[int, float],
    opts: CostOptions,
    sync: Mapping[int, float],
    cap: int = 20_000,
    keep: int = 16,
) -> list[tuple[float, tuple[dict[str, Any], ...]]]:
    """The ``keep`` best combinations (one option per tower, ``distmm`` on all or none, memory
    within ``budget[sync groups]``) by :func:`colocated_estimate` plus ``sync[sync groups]``,
    scanned in order of their all-reduce-free lower bound."""
    scored = []
    for n_sync in (1, 2):  # one family at a time: no tower on distmm, or every tower on it
        family = [[o for o in p if (o["schedule"] == "distmm") == (n_sync == 2)] for p in per]
        if any(not p for p in family):
            continue
        if math.prod(len(p) for p in family) > cap:  # keep the fastest options of each tower
            k = max(2, int(cap ** (1 / len(family))))
            family = [p[:k] for p in family]
        for group in itertools.product(*family):
            if sum(o["mem"] for o in group) <= budget[n_sync]:
                # lower bound: whichever tower goes last exposes at least its all-reduce minus its last slot
                tail = (
                    max(0.0, min(o["ar"] - o["slot"] for o in group))
                    if opts.overlap_grad_sync
                    else sum(o["ar"] for o in group)
                )
                scored.append(
                    (sum(o["F"] + o["Bphase"] + o["opt"] for o in group) + tail + sync[n_sync], n_sync, group)
                )
    scored.sort(key=lambda g: g[0])
    best: list[tuple[float, tuple[dict[str, Any], ...]]] = []
    for lower, n_sync, group in scored:
        if len(best) >= keep and lower >= best[-1][0]:
            break
        best.append((colocated_estimate(group, opts) + sync[n_sync], group))
        best.sort(key=lambda g: g[0])
        del best[keep:]
    return best


__all__ = ["Evaluated", "colocated_search"]
