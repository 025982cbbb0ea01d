"""Modality-aware partitioner: every way one tower can run on ``n`` devices, priced and filtered.

For each tower, enumerate ``tp`` (divides the heads, fits in a node), ``pp`` (divides the layers),
sharding, with ``planner.sequence`` cp / sp (:func:`~lightning_distmm.planner.search.sequence.sequence_ways`),
the schedule and the microbatch count ``K``; the replica count follows. What depends on the replica
count is numpy arrays over (replicas x microbatch counts): thousands of combinations cost a few array
operations. Configurations that exceed device memory are dropped.

A configuration's forward phase ``F`` is its time before the (first) batch-sync, its backward
phase ``B`` the rest: the closed forms of :func:`lightning_distmm.planner.cost.phases`, which equal
the simulation of the runtime's instruction lists (``distmm``: ``B`` spans sync group 1's
interleaved forwards and both groups' backwards, the balancer's ``max F + max B`` then leaves out
that the second batch-sync is a barrier too; :func:`evaluate_plan` prices it exactly).

Why keep only the best ``K`` per (tp, pp, schedule, replicas): forward and backward phases both
grow with the microbatch count times the stage time, so the ``K`` that minimises one mostly
minimises the other (up to the constant all-reduce); choosing it here leaves the balancer a few
candidates per device count instead of hundreds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_distmm.core.plan import PlanError, split_batch
from lightning_distmm.planner.cost import (
    LAYER_SHARDS,
    SHARDS,
    TowerChoice,
    compact_dp_allreduce,
    cross_attention_time,
    exposed_allreduce,
    grad_bytes_per_device,
    last_slot,
    memory_per_device,
    optimizer_time,
    phases,
    pp_comm,
    shard_comm,
    shard_group,
    sharded_stage,
    stage_compute,
    sync_group_rows,
    tp_comm,
)
from lightning_distmm.planner.cost.comm import cp_comm
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.profiles.profile import TowerProfile
from lightning_distmm.planner.search.job import SearchJob, SearchSpace, k_grid
from lightning_distmm.planner.search.sequence import sequence_ways


class InfeasibleError(PlanError):
    """No plan exists; the message names the tower, the limit and by how much it is missed."""


def tower_space(
    profile: TowerProfile,
    cluster: Cluster,
    world: int,
    max_tp: int | None,
    max_pp: int | None,
    tp: int | None,
    pp: int | None,
) -> tuple[list[int], list[int]]:
    """The tp and pp values a tower may use, or an :class:`InfeasibleError` naming the limit."""
    dpn = cluster.devices_per_node
    if tp is not None:
        if tp > dpn:
            raise InfeasibleError(
                f"tp={tp} exceeds the {dpn} devices of a node by {tp - dpn}: tensor-parallel groups must stay inside a node"
            )
        _check_fixed_degree(
            profile, "tp", tp, profile.heads, "attention heads", f"within a node of {dpn}", profile.valid_tp(dpn)
        )
        tps = [tp]
    else:
        tps = [t for t in profile.valid_tp(dpn) if max_tp is None or t <= max_tp]
    if pp is not None:
        _check_fixed_degree(profile, "pp", pp, profile.layers, "layers", "", profile.valid_pp(world))
        pps = [pp]
    else:
        pps = [p for p in profile.valid_pp(world) if max_pp is None or p <= max_pp]
    return tps, pps


def _check_fixed_degree(
    profile: TowerProfile, degree: str, value: int, count: int, what: str, where: str, valid: list[int]
) -> None:
    """A tp or pp fixed by the options must divide the tower's heads or layers (analytic profiles),
    and be 1 for a tower known only by measurement."""
    name = profile.name
    if profile.analytic and count % value:
        raise InfeasibleError(
            f"tower {name!r}: {degree}={value} does not divide its {count} {what}"
            f" ({count} % {value} = {count % value}); valid {degree}{' ' + where if where else ''}: {list(valid)}"
        )
    if not profile.analytic and value != 1:
        raise InfeasibleError(
            f"tower {name!r} has only a measured profile: it can only use {degree}=1, not {degree}={value}"
        )


@dataclass
class Candidates:
    """One tower's feasible configurations (one per tp, pp, schedule, replica count: the best K).

    ``F`` forward phase, ``B`` backward phase + exposed gradient all-reduce + optimizer step
    (compact placement), ``mem`` bytes per device.
    """

    tower: str
    n: np.ndarray
    F: np.ndarray
    B: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    sched: np.ndarray
    K: np.ndarray
    mb: np.ndarray
    mem: np.ndarray
    schedules: tuple[str, ...]
    global_batch: int
    notes: dict[str, Any] = field(default_factory=dict)
    shard: np.ndarray | None = None  # index into SHARDS per configuration (None: all "none")
    cp: np.ndarray | None = None  # context-parallel degree per configuration (None: all 1)
    sp: np.ndarray | None = None  # sequence parallelism with tp per configuration (None: all off)

    def __len__(self) -> int:
        return len(self.n)

    def take(self, idx: Any) -> Candidates:
        return Candidates(
            self.tower,
            self.n[idx],
            self.F[idx],
            self.B[idx],
            self.tp[idx],
            self.pp[idx],
            self.sched[idx],
            self.K[idx],
            self.mb[idx],
            self.mem[idx],
            self.schedules,
            self.global_batch,
            self.notes,
            None if self.shard is None else self.shard[idx],
            None if self.cp is None else self.cp[idx],
            None if self.sp is None else self.sp[idx],
        )

    def pareto(self) -> Candidates:
        """Per device count, only configurations no other beats in both F and B."""
        if len(self) == 0:
            return self
        order = np.lexsort((self.B, self.F, self.n))
        n, B = self.n[order], self.B[order]
        keep = np.zeros(len(order), dtype=bool)
        best = math.inf
        prev = None
        for i in range(len(order)):  # F ascending within each n: keep strictly better B
            if n[i] != prev:
                prev, best = n[i], math.inf
            if B[i] < best - 1e-15:
                keep[i], best = True, B[i]
        return self.take(order[keep])

    def choice(self, i: int) -> TowerChoice:
        tp, pp, n = int(self.tp[i]), int(self.pp[i]), int(self.n[i])
        cp, sp = (1 if self.cp is None else int(self.cp[i])), (False if self.sp is None else bool(self.sp[i]))
        dp = n // (tp * pp * cp)
        return TowerChoice(
            name=self.tower,
            n=n,
            tp=tp,
            pp=pp,
            microbatch=int(self.mb[i]),
            schedule=self.schedules[int(self.sched[i])],
            replica_batch=tuple(split_batch(self.global_batch, None, dp)),
            shard=SHARDS[int(self.shard[i])] if self.shard is not None else "none",
            cp=cp,
            sp=sp,
        )


def tower_schedules(profile: TowerProfile, schedules: Sequence[str]) -> list[str]:
    """Schedules a tower is priced under: a frozen tower has no backward, so only ``gpipe`` and,
    when allowed, ``distmm`` (its two sync groups: every tower of a ``distmm`` plan must run it)."""
    if profile.frozen:
        return ["gpipe"] + (["distmm"] if "distmm" in schedules else [])
    return list(schedules)


def _grid(
    profile: TowerProfile,
    job: SearchJob,
    dp: np.ndarray,
    Ks: np.ndarray,
    tp: int,
    pp: int,
    separate: bool,
    shard: str = "none",
    cp: int = 1,
    sp: bool = False,
) -> dict[str, dict[str, np.ndarray]]:
    """Costs over the grid replicas x microbatch-counts for each of the job's schedules (arrays
    [len(dp), len(Ks)]).

    ``K`` counts the replica's microbatches (``distmm``: over both sync groups, at least one each);
    ``separate``: the tower on devices of its own, so it holds the job's loss buffers (``distmm``:
    those of half the batch) and pays for the tokens it reads from another tower (colocated options
    leave both to their caller); ``shard``: how the replicas hold the training state (weights
    gathered per layer under ``full``); ``cp`` / ``sp``: tokens split over ``cp`` ranks (and their
    all-to-alls; state and gradients over replicas x cp); sequence parallelism with tp (its regather).
    """
    cluster, costs, global_batch = job.cluster, job.costs, job.global_batch
    w = tp * pp
    dpn = cluster.devices_per_node
    b = np.ceil(global_batch / dp)[:, None]
    K = Ks[None, :]
    valid = K <= b
    mb = np.ceil(b / K)
    Keff = np.ceil(b / mb)
    fc, bc = stage_compute(profile, cluster, costs, mb / cp, tp, pp)
    tpc = tp_comm(profile, cluster, costs, mb / cp, tp, pp, False)
    ppc = pp_comm(profile, cluster, costs, mb / cp, pp, w * cp > dpn)
    cpc = cp_comm(profile, cluster, costs, mb, tp, cp, pp) if cp > 1 else 0.0
    # a stage's time per microbatch (never below the transfer), the transfer between stages apart
    fx, bx = fc + tpc + cpc, bc + tpc * (1.5 if sp else 1.0) + cpc  # sp: its gathered linears gather again
    if shard in LAYER_SHARDS:
        ag, agrs = (np.asarray(x)[:, None] for x in shard_comm(profile, cluster, costs, dp * cp, tp, pp, shard))
        overlap = costs.overlap_grad_sync
        fx, bx = (
            sharded_stage(fx, ag, profile.layers // pp, overlap),
            sharded_stage(bx, agrs, profile.layers // pp, overlap),
        )
    f = np.maximum(fx, ppc)
    bb = np.zeros_like(f) if profile.frozen else np.maximum(bx, ppc)
    gb = grad_bytes_per_device(profile, costs, tp, pp, shard)
    ar = compact_dp_allreduce(cluster, gb, dp * cp, tp, pp)[:, None] if gb > 0 else np.zeros((len(dp), 1))
    # the optimizer step of one replica's share (sharded over the replicas the state is split over, x cp)
    group = shard_group(shard, dp, tp, pp, cluster.devices_per_node)
    opt_t = np.asarray([optimizer_time(profile, cluster, costs, tp, pp, shard, int(d) * cp) for d in group])[:, None]
    cross = 0.0
    if separate and profile.cross_from:
        cross = cross_attention_time(cluster, costs.bytes_el * b * profile.cross_elems, cluster.nodes == 1)
    out = {}
    for s in tower_schedules(profile, job.space.schedules):
        ok = valid
        loss = job.loss_bytes_for(s) if separate else 0.0
        if s == "distmm":
            # two sync groups: each replica gets rows of both (Plan.check_global_batch), K >= 2
            # microbatches so that none is larger than a sync group
            w0, w1 = sync_group_rows(s, b)
            K0, K1 = np.ceil(w0 / mb), np.ceil(w1 / mb)
            segs, _ = phases(s, profile.frozen, K0, pp, f, bb, ppc, K1)
            Ks_used = K0 + K1
            ok = valid & (K >= 2) & (global_batch // 2 >= dp)[:, None]
        else:
            segs, _ = phases(s, profile.frozen, Keff, pp, f, bb, ppc)
            Ks_used = Keff
        Fp = segs[0] + cross
        Bp = sum(segs[1:]) + (0.0 if profile.frozen else cross)
        window = last_slot(s, f, bb)  # colocated towers may also hide it behind each other (priced exactly later)
        Bx = Bp + exposed_allreduce(ar, window, gb, costs) + opt_t
        mem = memory_per_device(profile, costs, s, mb, Ks_used, b, tp, pp, loss, shard, group[:, None], None, cp, sp)
        shape = mb.shape
        mem = np.broadcast_to(mem["total"], shape)
        ok = ok & (mem <= job.memory_limit)
        out[s] = {
            "F": np.broadcast_to(Fp, shape),
            "B": np.broadcast_to(Bx, shape),
            "mem": mem,
            "ok": ok,
            "mb": mb,
            "K": np.broadcast_to(Ks_used, shape),
            "Bphase": np.broadcast_to(Bp, shape),
            "ar": np.broadcast_to(ar, shape),
            "slot": np.broadcast_to(window, shape),
            "opt": np.broadcast_to(opt_t, shape),
            "gb": gb,
            "shard": shard,
        }
    return out


def tower_candidates(profile: TowerProfile, job: SearchJob, max_devices: int | None = None) -> Candidates:
    """Feasible configurations of one tower on 1..``max_devices`` devices of its own (default: all
    the job's), each holding the job's loss buffers."""
    name, space, global_batch = profile.name, job.space, job.global_batch
    tps, pps = space.tps[name], space.pps[name]
    devices = max_devices if max_devices is not None else job.devices
    Ks = job.microbatch_counts
    scheds = tuple(space.schedules)
    names = scheds if "gpipe" in scheds else scheds + ("gpipe",)  # a frozen tower always runs "gpipe"
    rows: dict[str, list[np.ndarray]] = {k: [] for k in "n F B tp pp sched K mb mem shard cp sp".split()}
    ways = sequence_ways if space.sequence and profile.analytic else lambda *_: [(1, False)]  # planner.sequence
    dpn, degrees = job.cluster.devices_per_node, itertools.product(tps, pps, space.shards)
    for tp, pp, shard, cp, sp in [(t, p, sh, *w) for t, p, sh in degrees for w in ways(profile, t, p, sh, dpn)]:
        w = tp * pp * cp
        if w > devices:
            continue
        dp = np.arange(1, min(devices // w, global_batch) + 1, dtype=float)
        if shard == "hybrid":  # the runtime's HSDP: no tp across nodes, whole nodes when it spans several
            dp = dp[(tp == 1) & ((dp * w <= dpn) | ((dp * w) % dpn == 0))]
        if len(dp) == 0:
            continue
        for s, d in _grid(profile, job, dp, Ks, tp, pp, True, shard, cp, sp).items():
            obj = np.where(d["ok"], d["F"] + d["B"], np.inf)
            j = np.argmin(obj, axis=1)
            i = np.arange(len(dp))
            good = np.isfinite(obj[i, j])
            if not good.any():
                continue
            i, j = i[good], j[good]
            rows["n"].append(dp[i] * w)
            rows["F"].append(d["F"][i, j])
            rows["B"].append(d["B"][i, j])
            rows["tp"].append(np.full(len(i), tp))
            rows["pp"].append(np.full(len(i), pp))
            rows["sched"].append(np.full(len(i), names.index(s)))
            rows["K"].append(d["K"][i, j])
            rows["mb"].append(d["mb"][i, j])
            rows["mem"].append(d["mem"][i, j])
            rows["shard"].append(np.full(len(i), SHARDS.index(shard)))
            rows["cp"].append(np.full(len(i), cp))
            rows["sp"].append(np.full(len(i), sp))
    cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in rows.items()}
    return Candidates(
        name,
        cat["n"].astype(int),
        cat["F"],
        cat["B"],
        cat["tp"].astype(int),
        cat["pp"].astype(int),
        cat["sched"].astype(int),
        cat["K"].astype(int),
        cat["mb"].astype(int),
        cat["mem"],
        names,
        global_batch,
        shard=cat["shard"].astype(int),
        cp=cat["cp"].astype(int),
        sp=cat["sp"].astype(bool),
    )


__all__ = [
    "InfeasibleError",
    "SearchJob",
    "SearchSpace",
    "Candidates",
    "k_grid",
    "tower_space",
    "tower_schedules",
    "tower_candidates",
]
