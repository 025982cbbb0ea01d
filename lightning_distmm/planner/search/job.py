"""What a tower search is asked, in one value.

The partitioner (:func:`~lightning_distmm.planner.search.partition.tower_candidates`), the colocated
family (:func:`~lightning_distmm.planner.search.colocated.colocated_options`,
:func:`~lightning_distmm.planner.search.colocated.uniform_options`,
:func:`~lightning_distmm.planner.search.baselines.colocated_search`) and the memory limits
(:func:`~lightning_distmm.planner.search.limits.min_memory`) all price one tower against the same cluster,
cost options, global batch, device count, search space and loss buffers. :class:`SearchJob` names
them once, so that those functions take ``(profile, job)`` instead of a seven-argument group whose
order every caller had to repeat. :class:`SearchSpace` (what each tower may choose) and
:func:`k_grid` (the microbatch counts tried) live here because the job holds and uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_distmm.planner.cost import CostOptions
from lightning_distmm.planner.machine.cluster import Cluster


def k_grid(max_batch: int, limit: int | None = None) -> np.ndarray:
    """Microbatch counts tried: 1, 2, 3, 4, 6, 8, 12, 16, ... up to the replica batch."""
    vals = {1, 2, 3}
    x = 4
    top = max_batch if limit is None else min(max_batch, limit)
    while x <= top:
        vals.update({x, x * 3 // 2})
        x *= 2
    vals.add(top)
    return np.array(sorted(v for v in vals if 1 <= v <= top), dtype=float)


@dataclass
class SearchSpace:
    """Per tower: the tp and pp values allowed, the schedules, the microbatch-count limit."""

    tps: dict[str, list[int]]
    pps: dict[str, list[int]]
    schedules: tuple[str, ...] = ("gpipe", "cached")  # distmm changes the loss: only when listed
    max_microbatches: int | None = None
    shards: tuple[str, ...] = ("none",)  # how replicas may hold the training state (cost.options.SHARDS)
    max_k: int | None = None  # at most this many microbatches per replica (Megatron-LM's baseline: 1)
    sequence: bool = False  # also enumerate context / sequence parallelism (cp, sp) per tower


@dataclass(frozen=True)
class SearchJob:
    """What a tower search is asked: where it runs, how it is priced, the batch, the choices allowed
    and the loss buffers every device of a separate tower holds."""

    cluster: Cluster
    """The devices and links planned for (their memory bounds every configuration)."""
    costs: CostOptions
    """The cost model's options: precision policy, memory margin, gradient-sum overlap, ..."""
    global_batch: int
    """Samples per step over all replicas (the contrastive batch every replica's rows come from)."""
    devices: int
    """The world size: how many devices the plan spans."""
    space: SearchSpace
    """Per tower the tp, pp, schedules, shardings and microbatch limits the search may choose."""
    loss_bytes: float = 0.0
    """Loss buffers per device of a separate tower (gathered features, its loss rows); 0: none."""
    distmm_loss_bytes: float | None = None
    """The loss buffers of a ``distmm`` plan's batch-sync over half the batch (None: ``loss_bytes``)."""

    @property
    def memory_limit(self) -> float:
        """Bytes a device may hold: its memory times the cost options' margin."""
        return self.cluster.device.memory * self.costs.memory_margin

    @property
    def microbatch_counts(self) -> np.ndarray:
        """The microbatch counts tried for the global batch (:func:`k_grid` under the space's limit)."""
        return k_grid(self.global_batch, self.space.max_microbatches)

    def loss_bytes_for(self, schedule: str) -> float:
        """The loss buffers of a tower run under ``schedule`` (``distmm``: half the batch per sync)."""
        if schedule == "distmm" and self.distmm_loss_bytes is not None:
            return self.distmm_loss_bytes
        return self.loss_bytes


__all__ = ["SearchJob", "SearchSpace", "k_grid"]
