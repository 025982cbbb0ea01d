"""Step assembly: the time, memory and link bytes of one training step of a complete plan.

Why one model for everything: the DistMM plan, the colocated DDP baseline and the Megatron-style
baseline are all priced by :func:`evaluate_plan`, so a comparison between them measures the plans,
not two different models.

A batch-sync (features of its rows -> loss -> feature gradients) is a barrier between the towers'
segments (:mod:`.pipeline`), so for towers on *separate* devices

    step = sum_g max_t segment_g,t + syncs + max_t (last segment_t + exposed all-reduce_t + optimizer_t)

(``gpipe``, ``cached``: one batch-sync, ``max F + sync + max B``; ``distmm``: two, each over half
of the global batch). Towers *colocated* on the same devices run one after the other: every
segment is a sum over the towers instead of a max.

:func:`evaluate_plan` runs these steps: check the layout (separate or colocated), price the
batch-syncs, collect each tower's data-parallel gradient traffic (the NIC load every node
carries), price each tower (microbatch durations, its replica's pipeline, cross-attention
transfers, compute, memory, link bytes), price the gradient sums (overlapped with the backward
as the runtime's DDP-style buckets are) and assemble the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_distmm.core.plan import split_batch, sync_group_count
from lightning_distmm.planner.cost.breakdown import StepCost, TowerChoice, TowerCost
from lightning_distmm.planner.cost.comm import (
    batch_syncs,
    contrastive_features,
    cp_comm,
    cross_attention_time,
    last_slot,
    link_waits,
    pp_comm,
    shard_comm,
    sharded_stage,
    tp_comm,
)
from lightning_distmm.planner.cost.compute import optimizer_time, runtime_work, shared_host_phases, stage_compute
from lightning_distmm.planner.cost.gradients import GradientTraffic, gradient_traffic, price_gradient_sums
from lightning_distmm.planner.cost.groups import hybrid_runs, rank_groups
from lightning_distmm.planner.cost.memory import loss_bytes, memory_per_device
from lightning_distmm.planner.cost.options import LAYER_SHARDS, CostOptions, shard_group
from lightning_distmm.planner.cost.pipeline import (
    RECOMPUTE,
    SIMULATE_MAX_INSTRUCTIONS,
    microbatch_rows,
    phases,
    recomputes,
    replica_instructions,
    replica_timeline,
)
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.profiles.profile import TowerProfile


def sync_groups(choices: Mapping[str, TowerChoice]) -> int:
    """Batch-syncs per step: 2 when the towers run ``distmm`` (every tower must), else 1."""
    groups = sync_group_count({n: c.schedule for n, c in choices.items()})
    if groups is None:
        odd = sorted(n for n, c in choices.items() if c.schedule == "distmm")
        raise ValueError(
            f"schedule 'distmm' is on tower(s) {odd} but not on all towers: it splits the whole batch into two sync groups"
        )
    return groups


def recompute_fraction(profile: TowerProfile, choice: TowerChoice) -> float:
    """The share of a stage's forward that ``choice`` runs again in its backward: 1 for ``cached``
    and full recomputation, ``recompute_layers / (layers / pp)`` for a partial one, else 0."""
    if choice.schedule == RECOMPUTE and choice.recompute_layers is not None:
        per_stage = max(profile.layers // choice.pp, 1)
        if not 0 <= choice.recompute_layers <= per_stage:
            raise ValueError(
                f"tower {choice.name!r}: recompute_layers={choice.recompute_layers} is not within the"
                f" stage's {per_stage} layers"
            )
        return choice.recompute_layers / per_stage
    return 1.0 if recomputes(choice.schedule) else 0.0


def _is_colocated(ranks: Mapping[str, Sequence[int]]) -> bool:
    """Whether the towers all hold the same ranks (else they must hold disjoint ones)."""
    sets = {name: frozenset(r) for name, r in ranks.items()}
    colocated = len(set(sets.values())) == 1 and len(sets) > 1
    if not colocated and sum(len(s) for s in sets.values()) != len(frozenset().union(*sets.values())):
        raise ValueError("towers must hold either disjoint ranks or all the same ranks")
    return colocated


def price_tower(
    name: str,
    profiles: Mapping[str, TowerProfile],
    cluster: Cluster,
    opts: CostOptions,
    choice: TowerChoice,
    ranks: Mapping[str, Sequence[int]],
    groups: Mapping[str, list[list[int]]],
    traffic: GradientTraffic,
    colocated: bool,
    sync_seconds: Sequence[float],
    lb: float,
    global_batch: int,
) -> tuple[TowerCost, dict[str, Any]]:
    """One tower's :class:`TowerCost` (its gradient sum still unpriced) and the details the gradient
    sums need (``slot``: the backward that can hide it). ``sync_seconds``: each batch-sync's
    seconds; ``lb``: the loss buffers of a batch-sync (bytes per device)."""
    p, c = profiles[name], choice
    node = lambda r: r // cluster.devices_per_node  # noqa: E731
    bel = opts.bytes_el
    tp_cross = c.tp > 1 and any(len({node(r) for r in grp}) > 1 for grp in groups["tp"])
    pp_cross = c.pp > 1 and any(node(a) != node(b) for a, b in groups["pp"])
    mb, P = c.microbatch, c.pp
    if c.schedule == "distmm" and c.max_batch < 2:
        raise ValueError(
            f"tower {name!r}: schedule 'distmm' needs at least 2 rows per replica (one per sync group), got {c.max_batch}"
        )
    # seconds per microbatch, by its rows: compute + tensor-parallel all-reduces of a stage (never
    # below the transfer: a stage cannot pass microbatches on faster than its link carries
    # them), and the transfer to the next stage
    counts, distinct = microbatch_rows(c.schedule, c.max_batch, mb)
    K = sum(counts)
    sizes = sorted(distinct | {mb})
    at = float(sizes[0]) if len(sizes) == 1 else np.asarray(sizes, dtype=float)  # (scalars are quicker)
    # context parallelism: each cp rank computes 1/cp of the tokens (and of the attention), plus the
    # all-to-alls; sequence parallelism: TP's bytes as all-gathers and reduce-scatters, one more
    # all-gather per gathered linear in backward (its input is gathered again)
    fc_r, bc_r = (np.atleast_1d(x) for x in stage_compute(p, cluster, opts, np.asarray(at) / c.cp, c.tp, c.pp))
    tpc_r = np.atleast_1d(tp_comm(p, cluster, opts, np.asarray(at) / c.cp, c.tp, c.pp, tp_cross))
    cpc_r = np.atleast_1d(cp_comm(p, cluster, opts, at, c.tp, c.cp, c.pp))
    ppc_r = np.atleast_1d(pp_comm(p, cluster, opts, np.asarray(at) / c.cp, c.pp, pp_cross))
    fx_r, bx_r = fc_r + tpc_r + cpc_r, bc_r + tpc_r * (1.5 if c.sp else 1.0) + cpc_r
    fx_r, bx_r = (
        fx_r + runtime_work(p, c.tp, c.pp, c.shard, np.asarray(at) / c.cp, 0),
        bx_r + runtime_work(p, c.tp, c.pp, c.shard, np.asarray(at) / c.cp, 1),
    )
    # partial (block) recomputation: the first ``recompute_layers`` of a stage's layers run their
    # forward again in the backward; priced as gpipe whose backward carries that share of the forward
    frac = recompute_fraction(p, c)
    schedule = c.schedule
    if c.schedule == RECOMPUTE and frac < 1.0:
        schedule = "gpipe"
        bc_r, bx_r = bc_r + frac * fc_r, bx_r + frac * fx_r
    link_f = link_b = 0.0  # of them, the seconds spent waiting on the inter-node link
    if c.shard in LAYER_SHARDS:  # per-layer weight gathers and gradient scatters (compact packing estimate)
        ag, agrs = shard_comm(p, cluster, opts, c.dp * c.cp, c.tp, c.pp, c.shard)
        if cluster.device.concurrency != 1.0 and len({node(r) for r in ranks[name]}) > 1:
            fast = dataclasses.replace(cluster, inter=dataclasses.replace(cluster.inter, bandwidth=math.inf))
            ag_in, agrs_in = shard_comm(p, fast, opts, c.dp * c.cp, c.tp, c.pp, c.shard)
            link_f, link_b = (np.atleast_1d(np.asarray(x) - np.asarray(y)) for x, y in ((ag, ag_in), (agrs, agrs_in)))
        layers = p.layers // P
        fx_r, bx_r = (sharded_stage(x, y, layers, opts.overlap_grad_sync) for x, y in ((fx_r, ag), (bx_r, agrs)))
    f_r = np.maximum(fx_r, ppc_r)
    b_r = np.zeros_like(f_r) if p.frozen else np.maximum(bx_r, ppc_r)
    row = {r: i for i, r in enumerate(sizes)}
    fc, bc, f, b, ppc = (float(x[row[mb]]) for x in (fc_r, bc_r, f_r, b_r, ppc_r))

    # the replica's pipeline: its segments between the batch-syncs
    if replica_instructions(schedule, P, c.max_batch, mb) <= SIMULATE_MAX_INSTRUCTIONS:
        timeline = replica_timeline(
            schedule,
            p.frozen,
            P,
            c.max_batch,
            mb,
            lambda r: f_r[row[r]],
            lambda r: b_r[row[r]],
            lambda r: ppc_r[row[r]],
            sync_seconds,
        )
        segments, bubble, mbs = list(timeline.segments), timeline.bubble, list(timeline.microbatches)
    else:  # too long to simulate quickly: the closed form of the same lists (microbatches of ``mb`` rows)
        closed, closed_bubble = phases(schedule, p.frozen, counts[0], P, f, b, ppc, counts[-1])
        segments, bubble, mbs = [float(x) for x in closed], float(closed_bubble), [mb] * K
    pp_critical = 0.0  # the transfers' share of the critical path
    if P > 1:
        with_link, no_link = (phases(schedule, p.frozen, counts[0], P, f, b, x, counts[-1])[0] for x in (ppc, 0.0))
        pp_critical = float(sum(with_link) - sum(no_link))

    # a decoder's cross-attention context from another tower: before the forward, its gradient after
    # (colocated towers hold it already)
    cross = 0.0
    if p.cross_from and p.cross_from in ranks and not colocated:
        src_nodes = {node(r) for r in ranks[p.cross_from]}
        mine = {node(r) for r in ranks[name]}
        cross = cross_attention_time(cluster, bel * c.max_batch * p.cross_elems, src_nodes == mine and len(mine) == 1)
        segments[0] += cross
        segments[-1] += cross if not p.frozen else 0.0

    recompute = recomputes(schedule) and not p.frozen  # (a partial recompute is already in bc_r)
    compute = sum(
        float(fc_r[row[r]] + (0.0 if p.frozen else bc_r[row[r]] + (fc_r[row[r]] if recompute else 0.0))) for r in mbs
    )
    group = shard_group(c.shard, c.dp, c.tp, c.pp, cluster.devices_per_node)  # replicas the state is split over
    memory = {
        k: float(v)
        for k, v in memory_per_device(
            p, opts, c.schedule, mb, K, c.max_batch, c.tp, c.pp, lb, c.shard, group, c.recompute_layers, c.cp, c.sp
        ).items()
    }
    if c.shard == "hybrid" and not hybrid_runs(groups["replicas"], c.tp, cluster.devices_per_node):
        memory["total"] = math.inf  # the runtime's HSDP mesh refuses this layout: never a fit
    again = 0.0 if p.frozen else (1.0 if recompute else frac if c.schedule == RECOMPUTE else 0.0)
    intra_b, inter_b = link_bytes(p, c, opts, K, again, traffic, tp_cross, pp_cross)
    if cross:
        inter_b += 2 * bel * global_batch * p.cross_elems
    cost = TowerCost(
        name=name,
        forward_phase=segments[0],
        backward_phase=sum(segments[1:]),
        compute=compute,
        # tensor- and context-parallel collectives of every microbatch's forward, backward and recompute
        tp_comm=sum(float(tpc_r[row[r]] + cpc_r[row[r]]) for r in mbs) * (1 if p.frozen else 2 + again)
        + (0.0 if p.frozen or not c.sp else 0.5 * sum(float(tpc_r[row[r]]) for r in mbs)),  # sp's regather
        pp_comm=pp_critical,
        bubble=bubble,
        dp_allreduce=0.0,
        dp_exposed=0.0,
        optimizer=optimizer_time(p, cluster, opts, c.tp, c.pp, c.shard, group * c.cp),  # and their cp ranks
        cross_comm=cross * (1 if p.frozen else 2),
        memory=memory,
        bytes_intra=intra_b,
        bytes_inter=inter_b,
        segments=tuple(segments),
        link_waits=link_waits(segments, K * float(np.max(link_f)), 0.0 if p.frozen else K * float(np.max(link_b))),
    )
    details = {
        "tp_cross_node": tp_cross,
        "pp_cross_node": pp_cross,
        "f": f,
        "b": b,
        "K": K,
        "slot": float(last_slot(schedule, f, b)) if not p.frozen else 0.0,
    }
    return cost, details


def link_bytes(
    p: TowerProfile,
    c: TowerChoice,
    opts: CostOptions,
    K: int,
    recompute: float,
    traffic: GradientTraffic,
    tp_cross: bool,
    pp_cross: bool,
) -> tuple[float, float]:
    """Bytes a tower moves per step over intra-node links and across nodes: its gradient sums, its
    tensor-parallel all-reduces (per microbatch forward, backward and recompute) and its stage
    transfers, each on the link class its groups span. ``recompute``: the share of the forward run
    again in the backward (0, a partial recompute's fraction, or 1)."""
    bel = opts.bytes_el
    P = c.pp
    msg = bel * c.microbatch * (p.layer.tp_allreduce / max(2 * len(p.layer.attn), 1)) if p.analytic else 0.0
    tp_bytes = 0.0
    if c.tp > 1:
        calls = 2 * len(p.layer.attn) * (p.layers // P) * K * (1 if p.frozen else 2 + float(recompute))
        tp_bytes = calls * 2 * (c.tp - 1) / c.tp * msg * c.tp * c.dp * P  # a ring all-reduce per call
    passes = 1 if p.frozen else 2 + float(recompute)
    pp_bytes = (P - 1) * K * c.dp * bel * c.microbatch * p.layer.boundary * passes
    intra_b = traffic.intra_bytes + (0.0 if tp_cross else tp_bytes) + (0.0 if pp_cross else pp_bytes)
    inter_b = traffic.inter_bytes + (tp_bytes if tp_cross else 0.0) + (pp_bytes if pp_cross else 0.0)
    return intra_b, inter_b


def assemble_step(
    costs: Mapping[str, TowerCost],
    sync_total: float,
    groups: int,
    ranks: Mapping[str, Sequence[int]],
    cluster: Cluster,
    opts: CostOptions,
    colocated: bool,
) -> float:
    """The step time from the towers' segments (the optimizer step ends the last), the batch-syncs
    and the exposed gradient sums; devices sharing a host stretch the segments (``contention``)."""
    seg = {n: [*c.segments[:-1], c.segments[-1] + c.optimizer] for n, c in costs.items()}
    parts = [{n: seg[n][g] for n in costs} for g in range(groups + 1)]
    conc = cluster.device.concurrency
    if conc != 1.0:  # the cores stretch the work; the waits on the link take no core
        waits = [{n: c.link_waits[g] if c.link_waits else 0.0 for n, c in costs.items()} for g in range(groups + 1)]
        parts = [
            {
                n: t + wait[n]
                for n, t in shared_host_phases(
                    {n: part[n] - wait[n] for n in part}, ranks, cluster.devices_per_node, conc, colocated
                ).items()
            }
            for part, wait in zip(parts, waits, strict=True)
        ]
        for n, tc in costs.items():
            tc.contention = sum(part[n] for part in parts) - sum(seg[n])
    if colocated:
        step = sum(sum(part.values()) for part in parts) + sync_total + sum(c.dp_exposed for c in costs.values())
    else:
        step = (
            sum(max(part.values()) for part in parts[:-1])
            + sync_total
            + max(parts[-1][n] + c.dp_exposed for n, c in costs.items())
        )
    return step + opts.step_overhead


def evaluate_plan(
    profiles: Mapping[str, TowerProfile],
    cluster: Cluster,
    opts: CostOptions,
    choices: Mapping[str, TowerChoice],
    ranks: Mapping[str, Sequence[int]],
    global_batch: int,
) -> StepCost:
    """Price a complete plan (towers, degrees, microbatches, schedules and physical ranks).

    Towers either hold disjoint ranks (*separate*) or all hold the same ranks (*colocated*, run one
    after the other). Link contention: the gradient all-reduces of all groups that cross nodes run
    together and share each node's NIC; a group's inter-node time is set by its busiest node.
    """
    colocated = _is_colocated(ranks)
    used = frozenset().union(*(frozenset(r) for r in ranks.values()))
    world, nodes = len(used), len({r // cluster.devices_per_node for r in used})
    n_contrastive, embed = contrastive_features(profiles)
    groups = sync_groups(choices)
    sync = batch_syncs(cluster, opts, global_batch, embed, world, nodes, n_contrastive, groups)
    lb = loss_bytes(split_batch(global_batch, None, groups)[0], world, n_contrastive, opts, embed)

    rank_sets = {name: rank_groups(list(ranks[name]), c.tp, c.pp, c.cp) for name, c in choices.items()}
    traffic, node_load = gradient_traffic(profiles, cluster, opts, choices, rank_sets)
    costs: dict[str, TowerCost] = {}
    details: dict[str, dict[str, Any]] = {}
    mem_by_rank: dict[int, float] = {}
    for name, c in choices.items():
        costs[name], details[name] = price_tower(
            name,
            profiles,
            cluster,
            opts,
            c,
            ranks,
            rank_sets[name],
            traffic[name],
            colocated,
            sync["per_group"],
            lb,
            global_batch,
        )
        for r in ranks[name]:
            # the loss buffers exist once per rank, however many towers it holds
            mem_by_rank[r] = mem_by_rank.get(r, lb) + costs[name].memory["total"] - lb
    order = price_gradient_sums(costs, traffic, node_load, details, cluster, opts, colocated)
    step = assemble_step(costs, sync["total"], groups, ranks, cluster, opts, colocated)

    limit = cluster.device.memory * opts.memory_margin
    peak = max(mem_by_rank.values())
    if colocated:
        for tc in costs.values():
            tc.memory["total_device"] = peak
    return StepCost(
        towers=costs,
        sync=sync,
        step_time=float(step),
        layout="colocated" if colocated else "separate",
        extra={
            "fits": peak <= limit,
            "peak_memory": peak,
            "memory_limit": limit,
            "details": details,
            "world": world,
            "backward_order": order,
        },
    )


__all__ = [
    "hybrid_runs",
    "recompute_fraction",
    "sync_groups",
    "rank_groups",
    "GradientTraffic",
    "gradient_traffic",
    "price_tower",
    "link_bytes",
    "price_gradient_sums",
    "assemble_step",
    "evaluate_plan",
]
