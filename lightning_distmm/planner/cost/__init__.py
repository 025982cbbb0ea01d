"""Cost model: time, memory and link bytes of one training step of a plan, cut by what it prices.

* :mod:`.options` the software-side assumptions (:class:`CostOptions`);
* :mod:`.compute` device time of a stage's forward and backward, the optimizer step, shared hosts;
* :mod:`.memory` static bytes, kept activations, loss buffers;
* :mod:`.comm` collectives (the one all-reduce formula), tensor-parallel and pipeline transfers,
  gradient sums, batch-syncs;
* :mod:`.pipeline` one replica's pipeline through the runtime's instruction lists (simulated, or
  in closed form);
* :mod:`.breakdown` the question and the answer (:class:`TowerChoice`, :class:`TowerCost`,
  :class:`StepCost`);
* :mod:`.nccl` NCCL's ring model and protocol choice;
* :mod:`.step` :func:`evaluate_plan`, which assembles a whole step from the above;
* :mod:`.instructions` the seconds of each instruction of a plan's lists (for drawing a step);
* :mod:`.plans` a priced plan (:class:`Evaluated`) and the converters between the runtime's
  :class:`~lightning_distmm.core.plan.Plan` and the cost model's per-tower choices;
* :mod:`.simulate` the simulator that plays every rank's instruction list, which the pipeline
  and handoff prices run.

The functions accept numpy arrays (the partitioner evaluates thousands of (replicas,
microbatches) combinations at once) and plain numbers (the final evaluation).
"""

from lightning_distmm.planner.cost import breakdown, instructions, options, pipeline
from lightning_distmm.planner.cost.breakdown import *  # noqa: F403 (re-exported whole)
from lightning_distmm.planner.cost.comm import (
    allgather_time,
    allreduce_time,
    batch_syncs,
    compact_dp_allreduce,
    contrastive_features,
    cross_attention_time,
    exposed_allreduce,
    last_slot,
    pp_comm,
    ring_bytes,
    ring_latency,
    shard_comm,
    sharded_stage,
    sync_time,
    tp_comm,
)
from lightning_distmm.planner.cost.compute import (
    ATTN_BWD_FLOPS,
    block_time,
    block_times,
    optimizer_time,
    shared_host_phases,
    stage_compute,
)
from lightning_distmm.planner.cost.instructions import *  # noqa: F403 (re-exported whole)
from lightning_distmm.planner.cost.memory import (
    act_per_sample,
    grad_bytes_per_device,
    loss_bytes,
    memory_per_device,
    stage_params,
    static_per_param,
)
from lightning_distmm.planner.cost.options import *  # noqa: F403 (re-exported whole)
from lightning_distmm.planner.cost.pipeline import *  # noqa: F403 (re-exported whole)
from lightning_distmm.planner.cost.plans import Evaluated, plan_choices, to_plan, tower_choice, tower_plan
from lightning_distmm.planner.cost.step import evaluate_plan, rank_groups, sync_groups

__all__ = [
    *options.__all__,  # re-exported whole: their own lists say what they offer
    *pipeline.__all__,
    *breakdown.__all__,
    *instructions.__all__,
    "ATTN_BWD_FLOPS",
    "block_time",
    "block_times",
    "stage_compute",
    "optimizer_time",
    "shared_host_phases",
    "stage_params",
    "act_per_sample",
    "memory_per_device",
    "loss_bytes",
    "grad_bytes_per_device",
    "static_per_param",
    "ring_latency",
    "ring_bytes",
    "allreduce_time",
    "allgather_time",
    "tp_comm",
    "pp_comm",
    "cross_attention_time",
    "compact_dp_allreduce",
    "shard_comm",
    "sharded_stage",
    "exposed_allreduce",
    "last_slot",
    "contrastive_features",
    "sync_time",
    "batch_syncs",
    "sync_groups",
    "rank_groups",
    "evaluate_plan",
    "Evaluated",
    "to_plan",
    "tower_plan",
    "tower_choice",
    "plan_choices",
]
