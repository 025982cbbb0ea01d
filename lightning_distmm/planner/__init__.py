"""The planner, pure Python above :mod:`lightning_distmm.core`: cluster specs (:mod:`.machine`),
tower profiles (:mod:`.profiles`), the cost model (:mod:`.cost`), the search (:mod:`.search`) and
the entries that plan a job (:mod:`.default`, :mod:`.auto`); docs/planner.md, "Module map", lists every module.
It imports neither torch nor Lightning at import time: torch only inside the functions that
measure the live machine or towers (:mod:`.measure`, which this module and :mod:`.auto` import)."""

from lightning_distmm import core
from lightning_distmm.core import SCHEDULES, Plan, PlanError, TowerPlan, colocated_plan, split_batch  # noqa: F401

__all__ = list(core.__all__)  # re-exported: plans are what the planner makes

from lightning_distmm.planner.auto import TowerInfo, auto_plan, runtime_cost_defaults, tower_info_from_batch  # noqa: E402
from lightning_distmm.planner.cost import (  # noqa: E402
    CostOptions,
    Evaluated,
    StepCost,
    TowerChoice,
    TowerCost,
    allreduce_time,
    evaluate_plan,
    plan_choices,
    replica_timeline,
    to_plan,
)
from lightning_distmm.planner.machine.cluster import Cluster, Device, Link, list_presets  # noqa: E402
from lightning_distmm.planner.measure.local import (  # noqa: E402
    ConcurrencyProbe,
    host_busy_seconds,
    load_cluster,
    local_cluster,
    measure_local_cpu,
)
from lightning_distmm.planner.measure.tower_timing import measure_tower, measure_wrapped  # noqa: E402
from lightning_distmm.planner.options import DEFAULT_SCHEDULES, PlannerOptions  # noqa: E402
from lightning_distmm.planner.price import price_plan  # noqa: E402
from lightning_distmm.planner.profiles.profile import (  # noqa: E402
    MeasuredFit,
    TowerProfile,
    measured_profile,
    model_profiles,
    tower_profile,
)
from lightning_distmm.planner.search.balance import (  # noqa: E402
    Balance,
    barrier_allocation,
    brute_force_barrier,
    brute_force_minmax,
    minmax_allocation,
)
from lightning_distmm.planner.search.baselines import colocated_search  # noqa: E402
from lightning_distmm.planner.search.job import SearchJob  # noqa: E402
from lightning_distmm.planner.search.partition import Candidates, InfeasibleError, SearchSpace, tower_candidates  # noqa: E402
from lightning_distmm.planner.search.placement import place, tp_groups_inside_nodes  # noqa: E402
from lightning_distmm.planner.search.report import Report  # noqa: E402
from lightning_distmm.planner.search.search import make_plan  # noqa: E402

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
    "allreduce_time",
    "StepCost",
    "TowerChoice",
    "TowerCost",
    "evaluate_plan",
    "replica_timeline",
    "Candidates",
    "InfeasibleError",
    "SearchJob",
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
    "measure_wrapped",
    "measured_profile",
    "model_profiles",
    "tower_profile",
]
