"""One DeviceMesh per tower, over the ranks the plan gives it.

Each tower's mesh has the dimensions ``("dp", "pp", "tp")`` (tensor-parallel innermost, as the
plan lays ranks out): data-parallel gradient sums run on ``mesh.get_group("dp")`` and tensor
parallelism shards over ``mesh["tp"]``. Pipeline stages do not use the mesh's ``pp`` groups: their
sends and receives run in per-tower process groups of their own, made by the runtime
(:class:`lightning_distmm.parallel.executor.RankRuntime`). Every rank constructs every tower's
mesh in the same order, as torch.distributed requires of group creation; a rank outside a tower
simply has no coordinate in its mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_distmm.core.plan import Plan, TowerPlan


@dataclass
class TowerGroups:
    name: str
    plan: TowerPlan
    mesh: DeviceMesh

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group of this rank's replica set, or None when this rank is not in the tower."""
        if self.mesh.get_coordinate() is None:
            return None
        return self.mesh.get_group("dp")


def build_tower_groups(plan: Plan, device_type: str) -> dict[str, TowerGroups]:
    groups = {}
    for name, tower in plan.towers.items():
        layout = torch.tensor(tower.ranks, dtype=torch.int).reshape(tower.dp, tower.pp, tower.tp)
        mesh = DeviceMesh(device_type, layout, mesh_dim_names=("dp", "pp", "tp"))
        groups[name] = TowerGroups(name, tower, mesh)
    return groups
