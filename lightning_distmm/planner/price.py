"""The predicted step of any runtime :class:`~lightning_distmm.core.plan.Plan`, not only the
planner's: what the default plan, re-planning and the search's sequence step price plans with,
without importing the search."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_distmm.core.plan import Plan
from lightning_distmm.planner.cost import StepCost, evaluate_plan, plan_choices
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.machine.presets import read_cluster
from lightning_distmm.planner.options import PlannerOptions
from lightning_distmm.planner.profiles.profile import TowerProfile


def price_plan(
    plan: Plan,
    profiles: Mapping[str, TowerProfile],
    cluster: Cluster | str | Mapping[str, Any],
    options: PlannerOptions | Mapping[str, Any] | None = None,
    global_batch: int | None = None,
) -> StepCost:
    """The predicted :class:`StepCost` of a runtime :class:`Plan` (any plan, not only the planner's).

    Pricing measures nothing: ``cluster`` is a :class:`Cluster` or a spec read as it is written; a
    ``measure: true`` spec is refused here (``planner.measure.local.load_cluster`` measures it first)."""
    cl = read_cluster(cluster)
    if cl.world_size != plan.world_size:
        cl = cl.with_world(plan.world_size)
    choices, ranks = plan_choices(plan, global_batch)
    G = global_batch if global_batch is not None else int(plan.global_batch)  # type: ignore[arg-type]
    return evaluate_plan(profiles, cl, PlannerOptions.from_any(options).cost, choices, ranks, G)


__all__ = ["price_plan"]
