"""Context and sequence parallelism in the planner's search (``planner.sequence: true``).

The search proper (``planner.search.make_plan``) chooses each tower's devices, tp, pp, schedule,
microbatch and sharding. With ``sequence`` on, each tower of the chosen plan is then offered the
ways to split its tokens on the *same* devices: cp (DeepSpeed-Ulysses, ``cp * tp`` dividing its
heads, inside a node), tp with ``sp`` (timm ViT towers, unsharded), and cp x tp; pipeline stages,
schedule and sharding are kept. A variant replaces the tower's choice when the whole plan, priced
by the same cost model (``price_plan``), fits and is faster. A local search around the optimum the
search found, not a joint one: the balancer does not see cp / sp when it gives towers their devices
(docs/planner.md, "Sequence and context parallelism").

Pure Python, like the rest of the planner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_distmm.core.plan import Plan, PlanError, TowerPlan
from lightning_distmm.planner.cluster import Cluster
from lightning_distmm.planner.cost.breakdown import StepCost
from lightning_distmm.planner.profile import TowerProfile

#: the tower families the runtime splits over cp ranks (parallel/context_parallel.py)
CP_ARCHS = ("vit", "clip_text")


def sequence_variants(profile: TowerProfile, tower: TowerPlan, devices_per_node: int) -> list[dict[str, Any]]:
    """The (tp, cp, sp) a tower may take on its devices, the runtime's rules applied: ``cp * tp``
    divides the heads and a replica's stage (inside a node); cp on ViT and CLIP text towers only (a
    pipelined text tower's length divisible by cp), not with ``shard: hybrid``; sp needs tp > 1, a
    ViT, no sharding, no cp."""
    out = []
    n = len(tower.ranks)
    for cp in (1, 2, 4, 8):
        for tp in (1, 2, 4, 8):
            width = cp * tp
            if width > devices_per_node or n % (width * tower.pp) or profile.heads % width:
                continue
            if cp > 1 and (
                profile.arch not in CP_ARCHS
                or tower.shard == "hybrid"
                or (profile.arch != "vit" and tower.pp > 1 and profile.seq % cp)
            ):
                continue
            for sp in (False, True):
                if sp and (tp == 1 or cp > 1 or profile.arch != "vit" or tower.shard != "none"):
                    continue
                if (cp, tp, sp) != (tower.cp, tower.tp, tower.sp):
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
            if cost.extra["fits"] and cost.step_time < best_cost.step_time:
                best, best_cost = candidate, cost
        if best.towers[name] is not start:
            t = best.towers[name]
            notes.append(
                f"tower {name!r} ({profile.seq} tokens): cp={t.cp} tp={t.tp}{' +sp' if t.sp else ''} instead of"
                f" cp={start.cp} tp={start.tp}: {kept[0] * 1e3:.1f} -> {best_cost.step_time * 1e3:.1f} ms a step"
            )
    return best, best_cost, notes


__all__ = ["refine_sequence", "sequence_variants"]
