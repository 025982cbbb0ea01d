"""Colocated plans, priced by the same cost model and precision policy as DistMM's: the baselines
people run today, and part of DistMM's own space.

Every baseline holds every tower on every device (what a single-model framework does with a
two-tower model) and is searched for its fastest configuration under the same memory limit:

* ``megatron`` -- Megatron-LM as shipped: one uniform tp x pp x dp over the whole model (the text
  tower gets the image tower's degrees, stage ``i`` holds the ``i``-th slice of every tower). Its
  pipeline schedules compute a loss per microbatch, so they cannot split a contrastive batch whose
  loss needs every row's features: one microbatch per pipeline (``K = 1``: a pipeline of ``pp``
  stages runs one stage at a time), or no pipelining. Distributed optimizer (ZeRO-1: optimizer
  state split over the data-parallel replicas, gradients reduce-scattered, weights all-gathered)
  or Megatron-FSDP (``--use-megatron-fsdp``: ZeRO-3 under the same tp x pp); sequence parallelism
  with tensor parallelism (``--sequence-parallel``, :func:`baseline_options`);
  activation recompute per tower as Megatron-LM and NeMo run it (``--recompute-granularity full
  --recompute-method block --recompute-num-layers N``; NeMo's ViT-g/14 recomputes 8 of 40 vision
  layers and none of the text's): the fewest layers per stage that fit (:func:`partial_recompute`).
* ``megatron-tp-pp`` -- the configuration family the DistMM paper's argument implies, labelled as
  such: Megatron-LM with model parallelism on both towers (uniform ``tp x pp >= 2``, the same
  degrees for the text tower as for the image tower), one microbatch per pipeline, the distributed
  optimizer and block recomputation as for ``megatron``. Assumptions: the paper's baseline splits
  every tower with TP/PP (it does not say it would run pure data parallelism where that fits), and
  the best ``tp x pp`` of that family is priced (the same search, not a fixed 4 x 2). Pure data
  parallelism is ``megatron``'s to choose, not this family's.
* ``fsdp`` -- what open_clip users run at scale: pure data parallelism with every tower fully
  sharded (FSDP2 / ZeRO-3: each layer's weights all-gathered before its forward and again for its
  backward, its gradients reduce-scattered, one layer prefetched ahead), activation checkpointing
  (``--grad-checkpointing``) or GradCache-style ``cached`` (``--accum-freq``) allowed.
* ``ddp`` -- open_clip's default: pure data parallelism, replicated state, gradients all-reduced;
  ``gpipe`` (keep activations), checkpointing or ``cached``, best microbatch count.
* ``uniform+batchsync`` -- an ablation, not a system anyone runs: Megatron's uniform degrees but
  with this package's pipeline schedules (many microbatches before one batch-sync), replicated
  state. What the uniform degrees alone cost, apart from Megatron's one-microbatch pipeline.

``colocated`` is DistMM's colocated family: towers share all devices but each picks its own tp, pp,
microbatch, schedule and sharding (memory is shared, so they are chosen jointly; ``distmm``, when
the options list it, is on every tower or on none). The search adds every baseline whose choices
its options allow to its pool, so the DistMM plan is never predicted slower than those; a baseline
with a choice the options do not allow (a sharding not listed in ``shards``, Megatron-LM's sequence
parallelism under its uniform degrees) stays out of the pool and can be predicted faster
(``benchmarks/planner.py`` lists where, and why).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

from lightning_distmm.core.plan import split_batch, sync_group_count
from lightning_distmm.planner.cost import (
    RECOMPUTE,
    CostOptions,
    Evaluated,
    TowerChoice,
    batch_syncs,
    contrastive_features,
    evaluate_plan,
    loss_bytes,
    memory_per_device,
)
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.profiles.profile import TowerProfile
from lightning_distmm.planner.search.colocated import colocated_estimate, colocated_options, combine, uniform_options
from lightning_distmm.planner.search.job import SearchJob, SearchSpace

BASELINES = ("megatron", "megatron-tp-pp", "fsdp", "ddp", "uniform+batchsync")
"""The baselines every plan is compared with, in the order the report prints them."""

UNIFORM = ("megatron", "megatron-tp-pp", "uniform+batchsync")
"""Baselines that split every tower the same tp x pp ways."""

LABELS = {
    "megatron": "Megatron-LM (uniform tp x pp x dp, one microbatch per pipeline, ZeRO-1 or Megatron-FSDP, SP, block recompute)",
    "megatron-tp-pp": "Megatron-LM as the DistMM paper's argument implies (uniform tp x pp >= 2, one microbatch)",
    "fsdp": "FSDP / ZeRO-3 data parallel (open_clip at scale)",
    "ddp": "DDP (open_clip default)",
    "uniform+batchsync": "ablation: uniform tp x pp x dp with this package's batch-sync pipeline",
}


def baseline_space(
    kind: str,
    profiles: Mapping[str, TowerProfile],
    devices_per_node: int,
    world: int,
    max_microbatches: int | None = None,
) -> SearchSpace:
    """The configurations a baseline may choose from (its own full space, not DistMM's options)."""
    names = list(profiles)
    data_parallel = ({n: [1] for n in names}, {n: [1] for n in names})
    uniform = (
        {n: profiles[n].valid_tp(devices_per_node) for n in names},
        {n: profiles[n].valid_pp(world) for n in names},
    )
    if kind == "ddp":
        return SearchSpace(*data_parallel, ("gpipe", RECOMPUTE, "cached"), max_microbatches, ("none",))
    if kind == "fsdp":
        # ZeRO-3 (FSDP2's default), ZeRO-2 (reshard_after_forward=False) or HSDP (sharded in a node)
        return SearchSpace(
            *data_parallel, ("gpipe", RECOMPUTE, "cached"), max_microbatches, ("full", "zero2", "hybrid")
        )
    if kind in ("megatron", "megatron-tp-pp"):  # (megatron-tp-pp: tp x pp >= 2, see colocated_search)
        # the distributed optimizer (ZeRO-1) or Megatron-FSDP (ZeRO-3 under the same tp x pp)
        return SearchSpace(*uniform, ("gpipe", RECOMPUTE), 1, ("optimizer", "full"), max_k=1)
    if kind == "uniform+batchsync":
        return SearchSpace(*uniform, ("gpipe", RECOMPUTE), max_microbatches, ("none",))
    raise ValueError(f"unknown baseline {kind!r}; baselines: {', '.join(BASELINES)}")


def baseline_options(kind: str, opts: CostOptions) -> CostOptions:
    """The cost options a baseline is priced under: the run's, plus what the baseline's system does
    that the runtime does not (Megatron-LM: sequence parallelism with tensor parallelism)."""
    if kind in ("megatron", "megatron-tp-pp"):
        return dataclasses.replace(opts, sequence_parallel=True)
    return opts


def _choice(name: str, o: Mapping[str, Any], devices: int, global_batch: int) -> TowerChoice:
    dp = devices // (o["tp"] * o["pp"])
    rb = tuple(split_batch(global_batch, None, dp))
    return TowerChoice(name, devices, o["tp"], o["pp"], o["mb"], o["schedule"], rb, o.get("shard", "none"))


def colocated_search(
    profiles: Mapping[str, TowerProfile], job: SearchJob, mode: str = "colocated", top: int = 8
) -> Evaluated | None:
    """The fastest colocated plan of the given ``mode`` (``colocated`` or a baseline of :data:`BASELINES`,
    searched within ``job.space``, see :func:`baseline_space`), or None when nothing fits. Every tower
    runs on all ``job.devices``; the loss buffers are counted here, once per device (the job's are
    not used)."""
    cluster, costs, global_batch, devices, space = job.cluster, job.costs, job.global_batch, job.devices, job.space
    names = list(profiles)
    n_contrastive, embed = contrastive_features(profiles)
    # per sync-group count (1, or 2 under distmm): the loss buffers (memory left for the towers) and
    # the batch-syncs' seconds, which differ between the two families of plans
    budget, sync = {}, {}
    for groups in (1, 2):
        budget[groups] = job.memory_limit - loss_bytes(
            split_batch(global_batch, None, groups)[0], devices, n_contrastive, costs, embed
        )
        sync[groups] = batch_syncs(cluster, costs, global_batch, embed, devices, cluster.nodes, n_contrastive, groups)[
            "total"
        ]
    combos: list[tuple[float, tuple[dict[str, Any], ...]]] = []
    if mode in ("ddp", "fsdp"):
        combos = combine([colocated_options(profiles[n], job, [1], [1]) for n in names], budget, costs, sync)
    elif mode == "colocated":
        combos = combine([colocated_options(profiles[n], job) for n in names], budget, costs, sync)
    elif mode in UNIFORM:
        tps = sorted(set.intersection(*(set(space.tps[n]) for n in names)))
        pps = sorted(set.intersection(*(set(space.pps[n]) for n in names)))
        for tp, pp in itertools.product(tps, pps):
            if devices % (tp * pp) or (mode == "megatron-tp-pp" and tp * pp == 1):
                continue
            per = []
            for n in names:
                entries = {}
                for o in uniform_options(profiles[n], job, tp, pp):
                    # a frozen tower has no backward: it runs alongside whatever schedule the others use
                    for s in space.schedules if profiles[n].frozen else [o["schedule"]]:
                        entries[(s, o["K"], o["shard"])] = o
                per.append(entries)
            for key in set.intersection(*(set(d) for d in per)) if per else ():
                group = tuple(d[key] for d in per)
                groups = sync_group_count({n: o["schedule"] for n, o in zip(names, group)})
                if groups is not None and sum(o["mem"] for o in group) <= budget[groups]:
                    combos.append((colocated_estimate(group, costs) + sync[groups], group))
    else:
        raise ValueError(f"unknown colocated mode {mode!r}")
    if not combos:
        return None
    combos.sort(key=lambda c: c[0])
    ranks = {n: list(range(devices)) for n in names}
    best: Evaluated | None = None
    for _, group in combos[:top]:
        choices = {n: _choice(n, o, devices, global_batch) for n, o in zip(names, group)}
        cost = evaluate_plan(profiles, cluster, costs, choices, ranks, global_batch)
        if not cost.fits:
            continue
        ev = Evaluated(mode, choices, ranks, cost)
        if mode in ("megatron", "megatron-tp-pp", "colocated"):
            ev = partial_recompute(ev, profiles, cluster, costs, global_batch)
        if best is None or ev.step_time < best.step_time:
            best = ev
    return best


def partial_recompute(
    ev: Evaluated, profiles: Mapping[str, TowerProfile], cluster: Cluster, opts: CostOptions, global_batch: int
) -> Evaluated:
    """Megatron-LM's block recomputation: every tower of ``ev`` that recomputes all its layers
    recomputes instead the fewest layers per stage with which the plan still fits, one tower after
    the other. Only the tower's kept activations change with the count (falling monotonically: a
    bisection over :func:`~lightning_distmm.planner.cost.memory_per_device`, on the priced plan's
    peak); the result is priced again whole and kept only when it fits and is not slower. Megatron-LM's
    plans get it, and DistMM's (the runtime's ``recompute: N``); FSDP's and DDP's users recompute
    every block (torch's activation checkpointing wrapper), so theirs do not."""
    choices = dict(ev.choices)
    peak, limit = ev.cost.extra["peak_memory"], ev.cost.extra["memory_limit"]

    def activations(ch: TowerChoice, k: int | None) -> float:
        p = profiles[ch.name]
        mem = memory_per_device(
            p, opts, ch.schedule, ch.microbatch, ch.K, ch.max_batch, ch.tp, ch.pp, 0.0, ch.shard, ch.dp, k
        )
        return float(mem["activations"])

    changed = False
    for name, ch in ev.choices.items():
        p = profiles[name]
        if ch.schedule != RECOMPUTE or p.frozen or not p.analytic or ch.recompute_layers is not None:
            continue
        full = activations(ch, None)
        lo, hi = 0, p.layers // ch.pp  # ``hi`` layers (all of them) fit
        while lo < hi:
            mid = (lo + hi) // 2
            if peak + activations(ch, mid) - full <= limit:
                hi = mid
            else:
                lo = mid + 1
        if hi < p.layers // ch.pp:
            # no layer at all: plain gpipe (it fits next to the other towers' recomputation)
            part = dataclasses.replace(ch, recompute_layers=hi) if hi else dataclasses.replace(ch, schedule="gpipe")
            choices[name] = part
            peak += activations(ch, hi) - full
            changed = True
    if not changed:
        return ev
    cost = evaluate_plan(profiles, cluster, opts, choices, ev.ranks, global_batch)
    if not cost.fits or cost.step_time > ev.step_time:
        return ev
    return Evaluated(ev.name, choices, ev.ranks, cost)


__all__ = [
    "baseline_options",
    "colocated_search",
    "partial_recompute",
    "baseline_space",
    "BASELINES",
    "UNIFORM",
    "LABELS",
]
