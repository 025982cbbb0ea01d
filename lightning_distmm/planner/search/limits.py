"""How little memory a tower can need in the search space, and the message that says by how much
an infeasible tower misses (:class:`~lightning_distmm.planner.search.partition.InfeasibleError`)."""

from __future__ import annotations

import itertools
import math
from typing import Any

from lightning_distmm.planner.cost import memory_per_device
from lightning_distmm.planner.machine.cluster import GB
from lightning_distmm.planner.profiles.profile import TowerProfile
from lightning_distmm.planner.search.job import SearchJob
from lightning_distmm.planner.search.partition import tower_schedules


def min_memory(profile: TowerProfile, job: SearchJob) -> dict[str, Any]:
    """The least memory per device this tower can need in the job's space (largest split, one-sample
    microbatches, the leanest schedule, the job's loss buffers), to say by how much an infeasible
    tower misses."""
    best: dict[str, Any] | None = None
    space, costs, global_batch = job.space, job.costs, job.global_batch
    tps, pps = space.tps[profile.name] or [1], space.pps[profile.name] or [1]
    for tp in tps:
        for pp in pps:
            ways = tp * pp
            if ways > job.devices:
                continue
            replicas = max(1, min(job.devices // ways, global_batch))
            rows = math.ceil(global_batch / replicas)  # the largest replica batch
            for schedule, shard in itertools.product(tower_schedules(profile, space.schedules), space.shards):
                # one-sample microbatches: as many as the replica has rows
                m = memory_per_device(profile, costs, schedule, 1, rows, rows, tp, pp, job.loss_bytes, shard, replicas)
                total = float(m["total"])
                if best is None or total < best["total"]:
                    best = {
                        "total": total,
                        "static": float(m["static"]),
                        "activations": float(m["activations"]),
                        "tp": tp,
                        "pp": pp,
                        "schedule": schedule,
                    }
    assert best is not None
    return best


def describe_no_fit(profile: TowerProfile, job: SearchJob, need: dict[str, Any]) -> str:
    """Why ``profile`` fits no device of the job's cluster: ``need`` (:func:`min_memory`) against the limit."""
    cluster, limit = job.cluster, job.memory_limit
    ways = need["tp"] * need["pp"]
    return (
        f"tower {profile.name!r} ({profile.params / 1e9:.2f}B parameters) fits no device even split"
        f" tp*pp = {need['tp']}*{need['pp']} = {ways} ways (the most its {profile.heads} heads, {profile.layers} layers,"
        f" nodes of {cluster.devices_per_node} and {job.devices} devices allow): it needs {need['total'] / GB:.2f} GB per device"
        f" (static {need['static'] / GB:.2f} GB + activations {need['activations'] / GB:.2f} GB at microbatch 1,"
        f" schedule {need['schedule']}) but one {cluster.device.name} offers {cluster.device.memory / GB:.1f} GB x"
        f" memory_margin {job.costs.memory_margin} = {limit / GB:.2f} GB: over by {(need['total'] - limit) / GB:.2f} GB"
    )


__all__ = ["min_memory", "describe_no_fit"]
