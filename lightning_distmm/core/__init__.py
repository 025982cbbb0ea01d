"""The contract every rank runs by, free of torch and Lightning: plans, the schedule IR, the rank layout.

Nothing here imports another ``lightning_distmm`` package: the planner, the parallel runtime and
the Lightning wiring all build on these types.
"""

from lightning_distmm.core.plan import (
    SCHEDULES,
    Plan,
    PlanError,
    TowerPlan,
    colocated_plan,
    split_batch,
)

__all__ = ["SCHEDULES", "Plan", "PlanError", "TowerPlan", "colocated_plan", "split_batch"]
