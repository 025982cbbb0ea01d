"""Pure-Python planning: no process groups. Plans, and (later) profiles, partitioner, balancer, placement."""

from lightning_distmm.plan.plan import (
    SCHEDULES,
    Plan,
    PlanError,
    TowerPlan,
    colocated_plan,
    proportional_plan,
    split_batch,
)

__all__ = ["SCHEDULES", "Plan", "PlanError", "TowerPlan", "colocated_plan", "proportional_plan", "split_batch"]
