"""Context and sequence parallelism in the planner's search (``planner.sequence: true``).

The search proper (``planner.search.search.make_plan``) chooses each tower's devices, tp, pp, schedule,
microbatch and sharding. With ``sequence`` on, each tower of the chosen plan is then offered the
ways to split its tokens on the *same* devices: cp (DeepSpeed-Ulysses, ``cp * tp`` dividing its
heads, inside a node), tp with ``sp`` (timm ViT and CLIP text towers, unsharded), and cp x tp;
pipeline stages, schedule and sharding are kept. A variant replaces the tower's choice when the
whole plan, priced by the same cost model (``price_plan``), fits and is faster.

With ``sequence`` on, the search proper enumerates them too: :func:`sequence_ways` gives each
(tp, pp, sharding) its (cp, sp), ``partition.tower_candidates`` prices every one on 1..D devices
(1/cp of the tokens per rank, the all-to-alls, sp's regather, activations with cp / sp, gradients
and state over replicas x cp), so the balancer gives the towers their devices with cp / sp in
mind; :func:`refine_sequence` then still tries the same devices' other ways (colocated plans, and
what the exact pricing of the placed plan prefers) (docs/planner.md, "Sequence and context
parallelism").

Pure Python, like the rest of the planner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_distmm.core.plan import Plan, PlanError, TowerPlan
from lightning_distmm.planner.cost.breakdown import StepCost
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.profiles.profile import TowerProfile

#: the tower families the runtime splits over cp ranks (parallel/context_parallel.py)
CP_ARCHS = ("vit", "clip_text")


def sequence_ways(profile: TowerProfile, tp: int, pp: int, shard: str, devices_per_node: int) -> list[tuple[int, bool]]:
    """The (cp, sp) a tower with this tp, pp and sharding may take, the runtime's rules applied: ``cp *
    tp`` divides the heads and stays inside a node; cp on ViT and CLIP text towers only (any length:
    padded, pipelined too), not with ``shard: hybrid``; sp needs tp > 1, a ViT or CLIP text tower, no
    sharding, no cp. (1, False) comes first."""
    out = [(1, False)]
    seq_arch = profile.arch in CP_ARCHS
    if seq_arch and tp > 1 and shard == "none":
        out.append((1, True))
    for cp in (2, 4, 8):
        width = cp * tp
        if not seq_arch or width > devices_per_node or profile.heads % width or shard == "hybrid":
            continue
        out.append((cp, False))
    return out


def sequence_variants(profile: TowerProfile, tower: TowerPlan, devices_per_node: int) -> list[dict[str, Any]]:
    """The (tp, cp, sp) a tower may take on its own devices (:func:`sequence_ways` for each tp whose
    replica's stage, ``cp * tp`` ranks, divides them), its present one left out."""
    out = []
    n = len(tower.ranks)
    for tp in (1, 2, 4, 8):
        if tp > devices_per_node or profile.heads % tp:
            continue
        for cp, sp in sequence_ways(profile, tp, tower.pp, tower.shard, devices_per_node):
            if n % (cp * tp * tower.pp) == 0 and (cp, tp, sp) != (tower.cp, tower.tp, tower.sp):
                out.append({"cp": cp, "tp": tp, "sp": sp})
    return out


def refine_sequence(
    plan: Plan,
    profiles: Mapping[str, TowerProfile],
    cluster: Cluster,
    price: Any,
    global_batch: int,
) -> tuple[Plan, StepCost, list[str]]:
    """``plan`` with each tower's best (tp, cp, sp) on its own devices (``price(plan) -> StepCost``);
    the notes say what changed and what it bought."""
    best, best_cost = plan, price(plan)
    notes: list[str] = []
    for name in plan.towers:
        profile = profiles[name]
        if not profile.analytic:
            continue  # a measured tower's time is known at tp = 1 only
        start = best.towers[name]
        kept = (best_cost.step_time, start)
        for change in sequence_variants(profile, start, cluster.devices_per_node):
            fields = {**dataclasses.asdict(start), **change, "replica_batch": None}
            try:
                candidate = Plan(best.world_size, {**best.towers, name: TowerPlan(**fields)}, global_batch)
                candidate.check_global_batch(global_batch)
                cost = price(candidate)
            except (PlanError, ValueError):
                continue
            if cost.fits and cost.step_time < best_cost.step_time:
                best, best_cost = candidate, cost
        if best.towers[name] is not start:
            t = best.towers[name]
            notes.append(
                f"tower {name!r} ({profile.seq} tokens): cp={t.cp} tp={t.tp}{' +sp' if t.sp else ''} instead of"
                f" cp={start.cp} tp={start.tp}: {kept[0] * 1e3:.1f} -> {best_cost.step_time * 1e3:.1f} ms a step"
            )
    return best, best_cost, notes


__all__ = ["refine_sequence", "sequence_variants"]
