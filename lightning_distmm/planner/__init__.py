"""The planner, pure Python above :mod:`lightning_distmm.core`: cluster specs, tower profiles, the
cost model, partitioner, balancer, placement, baselines and the search (docs/planner.md). It
imports neither torch.distributed nor Lightning (torch only inside the functions that measure)."""

from lightning_distmm.core.plan import (  # re-exported: plans are what the planner makes
    SCHEDULES,
    Plan,
    PlanError,
    TowerPlan,
    colocated_plan,
    proportional_plan,
    split_batch,
)

__all__ = ["SCHEDULES", "Plan", "PlanError", "TowerPlan", "colocated_plan", "proportional_plan", "split_batch"]

from lightning_distmm.planner.balance import (  # noqa: E402
    Balance,
    barrier_allocation,
    brute_force_barrier,
    brute_force_minmax,
    minmax_allocation,
)
from lightning_distmm.planner.baselines import Evaluated, colocated_search  # noqa: E402
from lightning_distmm.planner.cluster import (  # noqa: E402
    Cluster,
    ConcurrencyProbe,
    Device,
    Link,
    host_busy_seconds,
    list_presets,
    load_cluster,
    measure_local_cpu,
)
from lightning_distmm.planner.cost import CostOptions, StepCost, TowerChoice, TowerCost, evaluate_plan, replica_timeline  # noqa: E402
from lightning_distmm.planner.partition import Candidates, InfeasibleError, SearchSpace, tower_candidates  # noqa: E402
from lightning_distmm.planner.placement import place, tp_groups_inside_nodes  # noqa: E402
from lightning_distmm.planner.planner import (  # noqa: E402
    DEFAULT_SCHEDULES,
    PlannerOptions,
    Report,
    TowerInfo,
    auto_plan,
    local_cluster,
    make_plan,
    plan_choices,
    price_plan,
    runtime_cost_defaults,
    to_plan,
    tower_info_from_batch,
)
from lightning_distmm.planner.profile import (  # noqa: E402
    MeasuredFit,
    TowerProfile,
    measure_tower,
    measured_profile,
    model_profiles,
    tower_profile,
)

__all__ += [
    "Balance",
    "barrier_allocation",
    "brute_force_barrier",
    "brute_force_minmax",
    "minmax_allocation",
    "Evaluated",
    "colocated_search",
    "Cluster",
    "ConcurrencyProbe",
    "Device",
    "Link",
    "host_busy_seconds",
    "list_presets",
    "load_cluster",
    "measure_local_cpu",
    "CostOptions",
    "StepCost",
    "TowerChoice",
    "TowerCost",
    "evaluate_plan",
    "replica_timeline",
    "Candidates",
    "InfeasibleError",
    "SearchSpace",
    "tower_candidates",
    "place",
    "tp_groups_inside_nodes",
    "DEFAULT_SCHEDULES",
    "PlannerOptions",
    "Report",
    "TowerInfo",
    "auto_plan",
    "local_cluster",
    "make_plan",
    "plan_choices",
    "price_plan",
    "runtime_cost_defaults",
    "to_plan",
    "tower_info_from_batch",
    "MeasuredFit",
    "TowerProfile",
    "measure_tower",
    "measured_profile",
    "model_profiles",
    "tower_profile",
]
