"""How little memory a tower can need in the search space, and the message that says by how much
an infeasible tower misses (:class:`~lightning_distmm.planner.partition.InfeasibleError`)."""

from __future__ import annotations

import itertools
import math
from typing import Any

from lightning_distmm.planner.cluster import GB, Cluster
from lightning_distmm.planner.cost import CostOptions, memory_per_device
from lightning_distmm.planner.partition import SearchSpace, tower_schedules
from lightning_distmm.planner.profile import TowerProfile


def min_memory(
    profile: TowerProfile,
    cluster: Cluster,
    opts: CostOptions,
    global_batch: int,
    world: int,
    space: SearchSpace,
    loss_b: float,
) -> dict[str, Any]:
    """The least memory per device this tower can need in the search space (largest split, one-sample
    microbatches, the leanest schedule), to say by how much an infeasible tower misses."""
    best: dict[str, Any] | None = None
    tps, pps = space.tps[profile.name] or [1], space.pps[profile.name] or [1]
    for tp in tps:
        for pp in pps:
            w = tp * pp
            if w > world:
                continue
            dp = max(1, min(world // w, global_batch))
            b = math.ceil(global_batch / dp)
            for s, shard in itertools.product(tower_schedules(profile, space.schedules), space.shards):
                K = b
                m = memory_per_device(profile, opts, s, 1, K, b, tp, pp, loss_b, shard, dp)
                tot = float(m["total"])
                if best is None or tot < best["total"]:
                    best = {
                        "total": tot,
                        "static": float(m["static"]),
                        "activations": float(m["activations"]),
                        "tp": tp,
                        "pp": pp,
                        "schedule": s,
                    }
    assert best is not None
    return best


def describe_no_fit(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, need: dict[str, Any], world: int
) -> str:
    limit = cluster.device.memory * opts.memory_margin
    w = need["tp"] * need["pp"]
    return (
        f"tower {profile.name!r} ({profile.params / 1e9:.2f}B parameters) fits no device even split"
        f" tp*pp = {need['tp']}*{need['pp']} = {w} ways (the most its {profile.heads} heads, {profile.layers} layers,"
        f" nodes of {cluster.devices_per_node} and {world} devices allow): it needs {need['total'] / GB:.2f} GB per device"
        f" (static {need['static'] / GB:.2f} GB + activations {need['activations'] / GB:.2f} GB at microbatch 1,"
        f" schedule {need['schedule']}) but one {cluster.device.name} offers {cluster.device.memory / GB:.1f} GB x"
        f" memory_margin {opts.memory_margin} = {limit / GB:.2f} GB: over by {(need['total'] - limit) / GB:.2f} GB"
    )


__all__ = ["min_memory", "describe_no_fit"]
