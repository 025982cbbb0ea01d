"""The search: model config + cluster + global batch -> the fastest :class:`Plan` the cost model
can price, with its :class:`Report`.

:func:`make_plan` runs, in order:

1. profiles (analytic from the model config, or given / measured);
2. the search space and hard limits (degrees each tower may use, memory it needs at least,
   enough samples for every replica);
3. partitioner: per tower every (tp, pp, schedule, microbatches) on every device count;
4. balancer: devices per tower minimising the barrier step ``max F + sync + max B`` (exact);
5. placement: ranks per tower, TP inside nodes, layouts scored with link contention;
6. the colocated family (per-tower parallelism on shared devices) and the baselines
   (:data:`~lightning_distmm.planner.search.baselines.BASELINES`: Megatron-LM, FSDP, DDP and the
   uniform+batchsync ablation) priced by the same model; the fastest of all is chosen, so the plan
   is never predicted slower than a baseline its options allow (``shards`` must list a baseline's
   sharding for it to join: the default, ``none``, leaves Megatron-LM's ZeRO-1 and FSDP out).

The ``distmm`` schedule is opt-in: it splits the batch into two sync groups, each with its own
negatives, so it changes the loss (the module must set ``sync_groups = 2``). The default
``schedules`` (:data:`DEFAULT_SCHEDULES`) are ``gpipe`` and ``cached``; listing ``distmm`` lets
the planner consider it, on every tower or on none.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_distmm.core.plan import Plan, split_batch
from lightning_distmm.planner.cost import (
    RECOMPUTE,
    Evaluated,
    TowerChoice,
    batch_syncs,
    contrastive_features,
    evaluate_plan,
    loss_bytes,
    plan_choices,
    to_plan,
)
from lightning_distmm.planner.machine.cluster import GB, Cluster
from lightning_distmm.planner.machine.config import to_plain
from lightning_distmm.planner.options import DEFAULT_SCHEDULES, PlannerOptions
from lightning_distmm.planner.price import price_plan
from lightning_distmm.planner.profiles.profile import TowerProfile, model_profiles
from lightning_distmm.planner.search.balance import (
    Balance,
    barrier_allocation,
    best_by_devices,
    even_allocation,
    minmax_allocation,
    proportional_allocation,
)
from lightning_distmm.planner.search.baselines import (
    BASELINES,
    baseline_options,
    baseline_space,
    colocated_search,
    partial_recompute,
)
from lightning_distmm.planner.search.job import SearchJob
from lightning_distmm.planner.search.limits import describe_no_fit, min_memory
from lightning_distmm.planner.search.partition import (
    Candidates,
    InfeasibleError,
    SearchSpace,
    tower_candidates,
    tower_space,
)
from lightning_distmm.planner.search.placement import place
from lightning_distmm.planner.search.report import Report
from lightning_distmm.planner.search.sequence import refine_sequence


def make_plan(
    model_cfg: Mapping[str, Any] | None,
    cluster: Cluster | str | Mapping[str, Any],
    global_batch: int,
    options: PlannerOptions | Mapping[str, Any] | None = None,
    profiles: Mapping[str, TowerProfile] | None = None,
) -> tuple[Plan, Report]:
    """Plan ``model_cfg`` (or the given ``profiles``) on ``cluster`` for ``global_batch`` samples per step."""
    from lightning_distmm.planner.measure.local import load_cluster  # a ``measure: true`` spec measures this machine

    opts = PlannerOptions.from_any(options)
    spec = load_cluster(cluster)  # may measure this machine (local_cpu): not part of the solve time
    t0 = time.perf_counter()
    if opts.world_size is not None and opts.world_size != spec.world_size:
        spec = spec.with_world(int(opts.world_size))
    if profiles is None:
        if model_cfg is None:
            raise ValueError("make_plan needs a model config or profiles")
        profiles = model_profiles(model_cfg)
    profiles = dict(profiles)
    model_name = str((to_plain(model_cfg) or {}).get("name", "model")) if model_cfg is not None else "model"
    n_global = int(global_batch)
    if n_global < 1:
        raise InfeasibleError(f"global batch must be at least 1, got {global_batch}")

    _check_tp(profiles, spec, opts)
    job = search_job(profiles, spec, n_global, opts)
    for p in profiles.values():
        need = min_memory(p, job)
        if need["total"] > job.memory_limit:
            raise InfeasibleError(describe_no_fit(p, job, need))
    _check_replicas(profiles, job)

    candidates: dict[str, Evaluated | None] = {}
    separate = Separate()
    if "separate" in opts.layouts and 1 < len(profiles) <= spec.world_size:
        separate = separate_search(profiles, job, opts)
        best = separate.best
        candidates["separate"] = best and partial_recompute(best, profiles, job.cluster, job.costs, n_global)
    if "colocated" in opts.layouts:
        candidates["colocated"] = colocated_search(profiles, job, "colocated")
    baselines = {
        kind: colocated_search(profiles, baseline_job(kind, profiles, job, opts), kind)
        for kind in (opts.baselines if opts.baselines is not None else BASELINES)
    }

    pool = [e for e in candidates.values() if e is not None]
    if "colocated" in opts.layouts:
        # the baselines are colocated plans: part of DistMM's space whenever their degrees and
        # schedules are allowed (always, unless the options restrict DistMM)
        pool += [b for b in baselines.values() if b is not None and _in_space(b, profiles, job, opts)]
    if not pool:
        raise InfeasibleError(_why_nothing(profiles, job, opts))
    chosen = min(pool, key=lambda e: e.step_time)
    plan = to_plan(chosen, spec.world_size, n_global)
    sequence_notes: list[str] = []
    if opts.sequence:
        plan, refined, sequence_notes = refine_sequence(
            plan, profiles, spec, lambda pl: price_plan(pl, profiles, spec, opts, n_global), n_global
        )
        if sequence_notes:
            choices, ranks = plan_choices(plan, n_global)
            chosen = Evaluated(chosen.name, choices, ranks, refined)
    report = Report(
        model=model_name,
        cluster=spec,
        global_batch=n_global,
        plan=plan,
        chosen=chosen,
        candidates=candidates,
        baselines=baselines,
        profiles=profiles,
        solve_time=time.perf_counter() - t0,
        options=opts,
        balance=separate.balance,
        placement_scores=separate.placement_scores,
        sequence_notes=sequence_notes,
    )
    return plan, report


@dataclass
class Separate:
    """What the separate-towers family gives the search: its fastest plan that fits (None when none
    does), the balance behind it and its layouts' scores (those of the first family balanced when
    no plan fits)."""

    best: Evaluated | None = None
    balance: Balance | None = None
    placement_scores: dict[str, float] = field(default_factory=dict)


def separate_search(profiles: Mapping[str, TowerProfile], job: SearchJob, opts: PlannerOptions) -> Separate:
    """The fastest plan with every tower on devices of its own: candidates per tower, devices per
    tower by the balancer, ranks by the placement, the whole plan priced.

    A plan runs ``distmm`` on every tower or on none (one or two sync groups): each family is
    balanced, the second only when its lower bound (the min-max of F + B, plus its batch-syncs) can
    beat the first's objective plus its batch-sync, and placed only when its objective does."""
    spec, costs, n_devices, n_global = job.cluster, job.costs, job.devices, job.global_batch
    names = list(profiles)
    n_contrastive, embed = contrastive_features(profiles)
    syncs = {
        k: batch_syncs(spec, costs, n_global, embed, n_devices, spec.nodes, n_contrastive, k)["total"] for k in (1, 2)
    }
    cands = [tower_candidates(profiles[n], job, max_devices=n_devices - len(names) + 1) for n in names]
    fixed = None
    if opts.balancer == "proportional":
        fixed = proportional_allocation({n: profiles[n].train_flops_per_sample() or 1.0 for n in names}, n_devices)
    elif opts.balancer == "even":
        fixed = even_allocation(names, n_devices)
    out = Separate()
    errors: list[InfeasibleError] = []
    first: float | None = None
    for n_sync, family in _sync_families(cands):
        if fixed is not None:
            family = [c.take(c.n == fixed[c.tower]) for c in family]
        if not all(len(c) for c in family):
            continue
        if first is not None:
            bound, _ = minmax_allocation(best_by_devices(family, n_devices, [c.F + c.B for c in family]), n_devices)
            if bound + syncs[n_sync] >= first:
                continue
        try:
            balance = barrier_allocation(family, n_devices, opts.max_points, fixed=fixed)
        except InfeasibleError as err:
            errors.append(err)
            continue
        if first is None:
            first = balance.objective + syncs[n_sync]
        elif balance.objective + syncs[n_sync] >= first:
            continue
        choices = balance.choices()

        def score(layout: Mapping[str, list[int]], choices: dict[str, TowerChoice] = choices) -> float:
            cost = evaluate_plan(profiles, spec, costs, choices, layout, n_global)
            return cost.step_time if cost.fits else math.inf

        layout, scores = place(
            {n: choices[n].n for n in names}, {n: choices[n].tp for n in names}, spec, opts.placement, score
        )
        cost = evaluate_plan(profiles, spec, costs, choices, layout, n_global)
        if out.balance is None:
            out.balance, out.placement_scores = balance, scores
        if cost.fits and (out.best is None or cost.step_time < out.best.step_time):
            out.best = Evaluated("separate", choices, {n: list(layout[n]) for n in names}, cost)
            out.balance, out.placement_scores = balance, scores
    if out.balance is None and errors and fixed is None:
        raise errors[0]
    return out


def baseline_job(kind: str, profiles: Mapping[str, TowerProfile], job: SearchJob, opts: PlannerOptions) -> SearchJob:
    """``job`` as baseline ``kind`` runs it: its cost options and the degrees and schedules it may use."""
    spec = job.cluster
    return dataclasses.replace(
        job,
        costs=baseline_options(kind, job.costs),
        space=baseline_space(kind, profiles, spec.devices_per_node, job.devices, opts.max_microbatches),
    )


def _in_space(b: Evaluated, profiles: Mapping[str, TowerProfile], job: SearchJob, opts: PlannerOptions) -> bool:
    """Whether a baseline's plan is one DistMM's options allow and the runtime runs."""
    space = job.space
    return all(
        ch.tp in space.tps[n]
        and ch.pp in space.pps[n]
        and (profiles[n].frozen or ch.schedule in space.schedules)
        and ch.shard in space.shards
        and (ch.tp == 1 or not baseline_options(b.name, opts.cost).sequence_parallel)  # nor runs SP
        for n, ch in b.choices.items()
    )


def _check_tp(profiles: Mapping[str, TowerProfile], spec: Cluster, opts: PlannerOptions) -> None:
    """A fixed ``planner.tp`` must divide the head count of at least one analytic tower."""
    if opts.tp is None or opts.tp > spec.devices_per_node:
        return
    bad = {n: p for n, p in profiles.items() if p.analytic and p.heads % opts.tp}
    if bad and len(bad) == len(profiles):
        heads = ", ".join(
            f"{n} has {p.heads} heads ({p.heads} % {opts.tp} = {p.heads % opts.tp})" for n, p in bad.items()
        )
        raise InfeasibleError(
            f"tp={opts.tp} divides no tower's head count: {heads}; leave planner.tp unset or pick a common divisor"
        )


def search_job(
    profiles: Mapping[str, TowerProfile], spec: Cluster, global_batch: int, opts: PlannerOptions
) -> SearchJob:
    """What the search may choose from for ``profiles`` on ``spec`` (each tower's tp and pp, the
    schedules, microbatch counts, shardings, cp and sp) and the memory it must leave for the loss:
    :func:`~lightning_distmm.planner.search.partition.tower_candidates` of each tower over this job is every
    tower plan the search can emit."""
    n_devices, costs = spec.world_size, opts.cost
    tps_all, pps_all = {}, {}
    for n, p in profiles.items():
        tps_all[n], pps_all[n] = tower_space(p, spec, n_devices, opts.max_tp, opts.max_pp, opts.tp, opts.pp)
    scheds = tuple(opts.schedules) + ((RECOMPUTE,) if opts.recompute and "gpipe" in opts.schedules else ())
    space = SearchSpace(tps_all, pps_all, scheds, opts.max_microbatches, tuple(opts.shards), sequence=opts.sequence)
    n_contrastive, embed = contrastive_features(profiles)
    loss_mem = loss_bytes(global_batch, n_devices, n_contrastive, costs, embed)
    loss_mem_distmm = loss_bytes(
        split_batch(global_batch, None, 2)[0], n_devices, n_contrastive, costs, embed
    )  # a batch-sync over half the batch
    return SearchJob(spec, costs, global_batch, n_devices, space, loss_mem, loss_mem_distmm)


def _sync_families(cands: Sequence[Candidates]) -> list[tuple[int, list[Candidates]]]:
    """The towers' candidates split by batch-syncs per step: plans with one (no tower on
    ``distmm``) and plans with two (every tower on ``distmm``); the schedule is the plan's choice."""

    def family(c: Candidates, distmm: bool) -> Candidates:
        code = c.schedules.index("distmm") if "distmm" in c.schedules else -1
        return c.take((c.sched == code) == distmm)

    out = [(1, [family(c, False) for c in cands])]
    if any("distmm" in c.schedules for c in cands):
        out.append((2, [family(c, True) for c in cands]))
    return out


def _max_split(space: SearchSpace, name: str, devices: int) -> tuple[int, int, int]:
    """The largest split ``(tp * pp, tp, pp)`` the space allows tower ``name`` on ``devices``."""
    best = (1, 1, 1)
    for tp in space.tps[name] or [1]:
        for pp in space.pps[name] or [1]:
            if tp * pp <= devices and tp * pp > best[0]:
                best = (tp * pp, tp, pp)
    return best


def _check_replicas(profiles: Mapping[str, TowerProfile], job: SearchJob) -> None:
    """Every device runs a replica of some tower, and every replica needs a sample."""
    devices, global_batch = job.devices, job.global_batch
    splits = {n: _max_split(job.space, n, devices) for n in profiles}
    colocated_need = max(math.ceil(devices / splits[n][0]) for n in profiles)
    need = colocated_need
    if 1 < len(profiles) <= devices:
        need = min(need, math.ceil(devices / sum(s[0] for s in splits.values())))
    if global_batch < need:
        tight = min(profiles, key=lambda n: splits[n][0])
        ways, tp, pp = splits[tight]
        raise InfeasibleError(
            f"global batch {global_batch} is below the replica count: {devices} devices need at least {need}"
            f" data-parallel replicas (tower {tight!r} splits at most tp*pp = {tp}*{pp} = {ways} ways), and every"
            f" replica needs at least one sample: short by {need - global_batch}; raise global_batch to {need} or"
            " plan for fewer devices"
        )


def _why_nothing(profiles: Mapping[str, TowerProfile], job: SearchJob, opts: PlannerOptions) -> str:
    """Why no plan fits: the device memory, and what each tower needs alone (without loss buffers)."""
    cluster, devices = job.cluster, job.devices
    parts = [
        f"no plan for {devices} devices and global batch {job.global_batch} fits device memory"
        f" ({cluster.device.memory / GB:.1f} GB x {job.costs.memory_margin})"
    ]
    if opts.layouts == ("separate",) and len(profiles) > devices:
        parts.append(
            f"layouts=separate needs at least one device per tower ({len(profiles)} towers, {devices} devices)"
        )
    alone = dataclasses.replace(job, loss_bytes=0.0, distmm_loss_bytes=None)
    for n, p in profiles.items():
        need = min_memory(p, alone)
        parts.append(
            f"tower {n!r} needs at least {need['total'] / GB:.2f} GB per device alone (tp={need['tp']}, pp={need['pp']})"
        )
    parts.append(
        "colocated towers add their memory; allow larger tp/pp (planner.max_tp, planner.max_pp) or the cached schedule"
    )
    return "; ".join(parts)


__all__ = ["make_plan", "search_job", "DEFAULT_SCHEDULES"]
