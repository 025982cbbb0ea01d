"""The colocated family's building blocks: every configuration of one tower on all devices
(:func:`colocated_options`, :func:`uniform_options`) and the step of towers run one after the
other on the same devices (:func:`colocated_estimate`, :func:`combine`). The searches over them are
in :mod:`lightning_distmm.planner.search.baselines`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_distmm.planner.cost import CostOptions
from lightning_distmm.planner.profiles.profile import TowerProfile
from lightning_distmm.planner.search.job import SearchJob
from lightning_distmm.planner.search.partition import _grid


def colocated_options(
    profile: TowerProfile, job: SearchJob, tps: Sequence[int] | None = None, pps: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """Every (tp, pp, schedule, K) of one tower on all the job's devices, with its time and memory
    *excluding* loss buffers (the caller adds them once per device). Pareto-pruned on (time, memory).
    ``tps`` / ``pps``: the degrees tried (default: the job's space for this tower)."""
    space, devices = job.space, job.devices
    Ks = job.microbatch_counts
    out: list[dict[str, Any]] = []
    for tp in tps if tps is not None else space.tps[profile.name]:
        for pp in pps if pps is not None else space.pps[profile.name]:
            ways = tp * pp
            if devices % ways or devices // ways > job.global_batch:
                continue
            dp = np.array([devices // ways], dtype=float)
            for shard in space.shards:
                if shard == "hybrid" and tp > 1 and devices > job.cluster.devices_per_node:
                    continue  # the runtime's HSDP has no tensor parallelism across nodes
                for s, d in _grid(profile, job, dp, Ks, tp, pp, False, shard).items():
                    for j in range(len(Ks)):
                        if d["ok"][0, j] and (space.max_k is None or d["K"][0, j] <= space.max_k):
                            out.append(option(d, tp, pp, s, j))
    # two Pareto fronts on (time, memory): with the all-reduce exposed after the tower's own last
    # microbatch, and with it fully hidden (behind the other towers' backward); each for plans
    # without and with distmm (the other towers must match, so neither family prunes the other)
    keep: dict[int, dict[str, Any]] = {}
    for family in (False, True):
        rows = [r for r in out if (r["schedule"] == "distmm") == family]
        for key in (lambda r: r["F"] + r["B"], lambda r: r["F"] + r["Bphase"] + r["opt"]):
            best_mem = math.inf
            for r in sorted(rows, key=lambda r: (key(r), r["mem"])):
                if r["mem"] < best_mem:
                    keep[id(r)] = r
                    best_mem = r["mem"]
    return sorted(keep.values(), key=lambda r: (r["F"] + r["B"], r["mem"]))


def option(d: dict[str, np.ndarray], tp: int, pp: int, schedule: str, j: int, i: int = 0) -> dict[str, Any]:
    """One grid point as a plain record (for the colocated searches)."""
    return {
        "tp": tp,
        "pp": pp,
        "schedule": schedule,
        "K": int(d["K"][i, j]),
        "mb": int(d["mb"][i, j]),
        "F": float(d["F"][i, j]),
        "B": float(d["B"][i, j]),
        "Bphase": float(d["Bphase"][i, j]),
        "ar": float(d["ar"][i, j]),
        "slot": float(d["slot"][i, j]),
        "opt": float(d["opt"][i, j]),
        "gb": float(d["gb"]),
        "shard": d["shard"],
        "mem": float(d["mem"][i, j]),
    }


def uniform_options(profile: TowerProfile, job: SearchJob, tp: int, pp: int) -> list[dict[str, Any]]:
    """Every (schedule, K, shard) of one tower at a fixed tp x pp on all the job's devices (no Pareto
    pruning; memory without loss buffers, as :func:`colocated_options`)."""
    replicas = job.devices // (tp * pp)
    if replicas > job.global_batch:
        return []
    dp = np.array([replicas], dtype=float)
    Ks, max_k = job.microbatch_counts, job.space.max_k
    out = []
    for shard in job.space.shards:
        for s, d in _grid(profile, job, dp, Ks, tp, pp, False, shard).items():
            for j in range(len(Ks)):
                if d["ok"][0, j] and Ks[j] == d["K"][0, j] and (max_k is None or Ks[j] <= max_k):
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


def combine(
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


__all__ = ["colocated_options", "option", "uniform_options", "colocated_estimate", "combine"]
