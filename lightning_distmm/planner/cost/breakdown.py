"""What the cost model is asked about and what it answers: a tower's parallelism
(:class:`TowerChoice`) in, its share of a step (:class:`TowerCost`) and the whole step
(:class:`StepCost`) out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TowerChoice:
    """One tower's parallelism: devices, degrees, microbatching and schedule."""

    name: str
    n: int
    tp: int
    pp: int
    microbatch: int
    schedule: str
    replica_batch: tuple[int, ...]
    shard: str = "none"  # how the replicas hold the training state (cost.options.SHARDS)
    # under gpipe+recompute: how many of a stage's layers are recomputed (Megatron-LM's
    # --recompute-method block --recompute-num-layers N; the runtime's recompute: N); None: all of them
    recompute_layers: int | None = None
    cp: int = 1  # context parallelism: each replica's stages are cp x tp ranks splitting the tokens
    sp: bool = False  # sequence parallelism with tp (Megatron-LM)

    @property
    def dp(self) -> int:
        return self.n // (self.tp * self.pp * self.cp)

    @property
    def max_batch(self) -> int:
        return max(self.replica_batch)

    @property
    def K(self) -> int:
        return math.ceil(self.max_batch / self.microbatch)


@dataclass
class TowerCost:
    """One tower's share of a step (seconds, bytes). ``memory`` is per device."""

    name: str
    forward_phase: float
    backward_phase: float
    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_allreduce: float
    dp_exposed: float
    optimizer: float
    cross_comm: float
    memory: dict[str, float]
    bytes_intra: float
    bytes_inter: float
    # seconds the tower's compute is stretched by other devices of its node (Device.concurrency)
    contention: float = 0.0
    segments: tuple[float, ...] = ()  # before the first batch-sync, between the batch-syncs, after the last
    #: seconds of each segment a rank waits on the inter-node link (a sharded stage's gathers and
    #: scatters across nodes): they take no core, so a shared host does not stretch them
    link_waits: tuple[float, ...] = ()

    @property
    def comm(self) -> float:
        return self.tp_comm + self.pp_comm + self.dp_exposed + self.cross_comm

    @property
    def busy(self) -> float:
        return self.forward_phase + self.backward_phase + self.dp_exposed + self.optimizer


@dataclass
class StepCost:
    """A whole step: per-tower costs, the batch sync and the step time."""

    towers: dict[str, TowerCost]
    sync: dict[str, float]
    step_time: float
    layout: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether the fullest rank's memory stays under the device's limit (``extra["fits"]``)."""
        return bool(self.extra["fits"])


__all__ = ["TowerChoice", "TowerCost", "StepCost"]
