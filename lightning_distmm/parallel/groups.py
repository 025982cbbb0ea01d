"""Every process group and mesh a plan needs on this rank, built in one place: :class:`Topology`.

:func:`build_topology` makes them once, in one fixed order, on every rank (torch.distributed
requires every rank to create every group, in the same order): each tower's meshes, the group of
CPU collectives for host-side flags, the batch-sync group, and the pipelines' point-to-point
links. The runtime receives the topology and creates no group of its own.

One DeviceMesh per tower, over the ranks the plan gives it.

Each tower's mesh has the dimensions ``("dp", "pp", "tp")`` (tensor-parallel innermost, as the
plan lays ranks out), ``("dp", "pp", "cp", "tp")`` for a tower with context parallelism:
data-parallel gradient sums run on ``mesh.get_group("dp")`` and tensor parallelism shards over
``mesh["tp"]``. With ``cp > 1`` every cp rank holds a partial gradient (its tokens' share), so the
sums run over the replicas and the cp ranks together: :attr:`TowerGroups.sum_mesh`, a 1-D mesh of
the ``dp * cp`` ranks of the same stage and tensor coordinate (FSDP shards over it too). Pipeline
stages do not use the mesh's ``pp`` groups: their sends and receives run in a group per stage pair
and direction (:class:`lightning_distmm.parallel.pipeline.PipelineLinks`). Every rank constructs every tower's
mesh in the same order, as torch.distributed requires of group creation; a rank outside a tower
simply has no coordinate in its mesh.

A sharded tower (``shard: full | hybrid | zero2``) also gets the mesh FSDP shards over
(:attr:`TowerGroups.shard_mesh`): the ``dp`` dimension of its mesh for ``full`` (for a pipelined
tower, the rank's stage in every replica); for ``hybrid`` across several nodes a 2-D
``("replicate", "shard")`` mesh of its replicas (of the rank's stage), one row per node (shard
inside a node, replicate across nodes), built from the node of every rank that the launcher reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_distmm.core.plan import Plan, TowerPlan
from lightning_distmm.core.schedule import sync_ranks
from lightning_distmm.parallel.pipeline import PipelineLinks


@dataclass
class TowerGroups:
    name: str
    plan: TowerPlan
    mesh: DeviceMesh
    #: the mesh FSDP shards the tower over (None: the tower is replicated)
    shard_mesh: DeviceMesh | None = None
    #: FSDP's MixedPrecisionPolicy for the tower (None: compute in the parameters' dtype)
    mp_policy: Any = None
    #: cp > 1: the 1-D mesh of this rank's replicas x cp ranks (same stage and tp coordinate)
    sum_mesh: DeviceMesh | None = None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The group a tower's gradients are summed over (its replicas, and with ``cp > 1`` their cp
        ranks too), or None when this rank is not in the tower."""
        if self.mesh.get_coordinate() is None:
            return None
        if self.sum_mesh is not None:
            return self.sum_mesh.get_group()
        return self.mesh.get_group("dp")


def nodes_of_ranks(node_rank: int, world_size: int) -> list[int]:
    """The node of every global rank, as the launcher numbers them (torchrun's GROUP_RANK, SLURM's
    node id): what HSDP's rows and node-aware placement go by. Collective."""
    nodes: list[int] = [0] * world_size
    dist.all_gather_object(nodes, node_rank)
    return nodes


@dataclass
class Topology:
    """This rank's view of every group a plan needs (:func:`build_topology`)."""

    #: each tower's meshes
    towers: dict[str, TowerGroups]
    #: every rank, collectives on CPU tensors (None: the default group, gloo's)
    host: dist.ProcessGroup | None
    #: the ranks that meet at the batch-sync (every rank of a last stage), and their group (None: the world)
    batch_sync_ranks: tuple[int, ...]
    batch_sync: dist.ProcessGroup | None
    #: the pipelines' sends and receives, a group per stage pair and direction
    links: PipelineLinks


def build_topology(
    plan: Plan, device: torch.device, nodes: Sequence[int] | None = None, mp_policy: Any = None
) -> Topology:
    """Every group of ``plan``, in one fixed order. Collective: every rank calls it with the same arguments."""
    towers = build_tower_groups(plan, device.type, nodes, mp_policy)
    host = host_group()
    ranks = tuple(sync_ranks(plan))
    batch_sync = dist.new_group(list(ranks)) if len(ranks) < dist.get_world_size() else None
    return Topology(towers, host, ranks, batch_sync, PipelineLinks(plan, host, device))


def build_tower_groups(
    plan: Plan, device_type: str, nodes: Sequence[int] | None = None, mp_policy: Any = None
) -> dict[str, TowerGroups]:
    """Every tower's mesh (and, for sharded towers, the mesh FSDP shards over).

    ``nodes[r]`` is the node of global rank ``r`` as the launcher numbers them (None: one node);
    ``mp_policy`` is FSDP's mixed-precision policy for the sharded towers. Collective: every rank
    calls it with the same arguments.
    """
    groups = {}
    for name, tower in plan.towers.items():
        layout = torch.tensor(tower.ranks, dtype=torch.int).reshape(tower.dp, tower.pp, tower.cp, tower.tp)
        sum_mesh = None
        if tower.cp == 1:
            mesh = DeviceMesh(
                device_type, layout.reshape(tower.dp, tower.pp, tower.tp), mesh_dim_names=("dp", "pp", "tp")
            )
        else:
            mesh = DeviceMesh(device_type, layout, mesh_dim_names=("dp", "pp", "cp", "tp"))
            # (pp, tp, dp*cp): the ranks that hold the same parameters and partial gradients of them
            flat = layout.permute(1, 3, 0, 2).reshape(tower.pp, tower.tp, tower.dp * tower.cp)
            both = DeviceMesh(device_type, flat, mesh_dim_names=("pp", "tp", "dp_cp"))
            sum_mesh = both["dp_cp"] if both.get_coordinate() is not None else None
        shard_mesh = None
        if tower.sharded:
            rows = [hybrid_rows(name, tower, nodes, s) for s in range(tower.pp)] if tower.shard == "hybrid" else None
            if tower.cp > 1:
                shard_mesh = sum_mesh  # None off the tower; plan validation refuses cp > 1 with hybrid
            elif rows is None or len(rows[0]) == 1:
                # slicing is local (it reuses the groups the mesh made), but torch can slice a mesh
                # with several dp sub-meshes (tp or pp > 1) only on a rank inside it
                shard_mesh = mesh["dp"] if mesh.get_coordinate() is not None else None
            elif tower.pp == 1:
                shard_mesh = DeviceMesh(
                    device_type, torch.tensor(rows[0], dtype=torch.int), mesh_dim_names=("replicate", "shard")
                )
            else:  # one (replicate, shard) mesh per pipeline stage, over that stage's ranks
                if len({(len(r), len(r[0])) for r in rows}) > 1:
                    raise ValueError(
                        f"tower {name!r}, shard='hybrid': its pipeline stages are spread over nodes differently"
                        f" ({[[len(row) for row in r] for r in rows]} ranks per node, stage by stage); HSDP needs the"
                        " same layout for every stage: change the tower's ranks or use shard: full"
                    )
                stages = DeviceMesh(
                    device_type, torch.tensor(rows, dtype=torch.int), mesh_dim_names=("pp", "replicate", "shard")
                )
                shard_mesh = stages["replicate", "shard"] if stages.get_coordinate() is not None else None
        groups[name] = TowerGroups(name, tower, mesh, shard_mesh, mp_policy if tower.sharded else None, sum_mesh)
    return groups


def host_group() -> dist.ProcessGroup | None:
    """A process group over every rank whose collectives run on CPU tensors (None: the default group
    already does, as gloo's).

    The step exchanges a few host-side flags (whether any rank has gradients outside the contrastive
    loss); over NCCL each would be a device tensor read back, a wait for the GPU. Over this group it is
    a host-to-host exchange while the GPU keeps working. Collective: every rank calls it, in the same
    place of group creation.
    """
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def hybrid_rows(name: str, tower: TowerPlan, nodes: Sequence[int] | None, stage: int = 0) -> list[list[int]]:
    """The tower's replicas by node, one row per node, as ranks of pipeline stage ``stage`` (HSDP
    shards along a row, replicates down a column); every node must hold the same number of them."""
    by_node: dict[int, list[int]] = {}
    for replica in range(tower.dp):
        rank = tower.replica_ranks(replica)[stage * tower.stage_width]
        by_node.setdefault(nodes[rank] if nodes is not None else 0, []).append(rank)
    sizes = {n: len(r) for n, r in by_node.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"tower {name!r}, shard='hybrid': its replicas are spread unevenly over nodes ({sizes} replicas per"
            " node); HSDP needs the same number on every node: change the tower's ranks or use shard: full"
        )
    if len(by_node) > 1 and tower.tp > 1:
        raise ValueError(
            f"tower {name!r}: shard='hybrid' across {len(by_node)} nodes with tp={tower.tp} is not supported;"
            " use shard: full with tensor parallelism"
        )
    return [by_node[n] for n in sorted(by_node)]
