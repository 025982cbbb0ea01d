"""What the placement map shows, as data: each device's roles (tower, replica, stage, shard) and the
groups of devices that carry a step's heavy traffic (tensor-parallel groups, pipeline transfers,
gradient sums), with the bytes the cost model counts on each (:func:`link_traffic`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_distmm.core.plan import Plan, TowerPlan

if TYPE_CHECKING:
    from lightning_distmm.planner.search.report import Report


KIND_NAMES = {"tp": "tensor-parallel all-reduce", "pp": "pipeline stage transfers", "dp": "gradient all-reduce"}


@dataclass(frozen=True)
class Role:
    """What one device does for one tower: its data-parallel replica, pipeline stage,
    tensor-parallel shard and context-parallel chunk of the tokens."""

    tower: str
    replica: int
    stage: int
    shard: int
    chunk: int = 0

    def label(self, t: TowerPlan) -> str:
        """``rep 3``, then ``stage 1`` when the tower has stages and ``tp 0`` when it has shards."""
        parts = [f"rep {self.replica}"]
        if t.pp > 1:
            parts.append(f"stage {self.stage}")
        if t.cp > 1:
            parts.append(f"cp {self.chunk}")
        if t.tp > 1:
            parts.append(f"tp {self.shard}")
        return " / ".join(parts)


@dataclass(frozen=True)
class LinkGroup:
    """A group of ranks that talk: a ``tp`` group, a ``pp`` pair (stage ``s`` to ``s + 1``, one
    tensor-parallel lane) or a ``dp`` group (one stage and lane over every replica)."""

    tower: str
    kind: str
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]
    lane: int = 0  # tp: the stage; pp: the tensor-parallel shard; dp: the position in a replica

    @property
    def inter(self) -> bool:
        return len(self.nodes) > 1


@dataclass
class Traffic:
    """Bytes a tower's groups of one kind move per step over NVLink (``intra``) and across nodes
    (``inter``); ``nic``: bytes through each node's network interfaces (gradient sums)."""

    intra: float = 0.0
    inter: float = 0.0
    nic: dict[int, float] = field(default_factory=dict)


def device_roles(plan: Plan) -> dict[int, list[Role]]:
    """Every rank's roles, in the plan's tower order (a colocated rank has one per tower)."""
    out: dict[int, list[Role]] = {r: [] for r in range(plan.world_size)}
    for name, t in plan.towers.items():
        for pos, r in enumerate(t.ranks):
            replica, within = divmod(pos, t.stage_width * t.pp)
            stage, inner = divmod(within, t.stage_width)  # inner: (cp, tp) coordinate, tp innermost
            out.setdefault(r, []).append(Role(name, replica, stage, inner % t.tp, inner // t.tp))
    return out


def heavy_links(plan: Plan, devices_per_node: int) -> list[LinkGroup]:
    """The groups whose traffic dominates a step: tensor-parallel groups, stage-to-stage pairs and
    gradient all-reduce groups, each with the nodes it spans."""
    out: list[LinkGroup] = []
    for name, t in plan.towers.items():
        sw, reps = t.stage_width, [t.replica_ranks(i) for i in range(t.dp)]
        width = sw * t.pp
        lanes = [(s * sw + c * t.tp, s) for s in range(t.pp) for c in range(t.cp)]  # first rank of each tp group
        groups = [("tp", rep[a : a + t.tp], s) for rep in reps for a, s in lanes] if t.tp > 1 else []
        groups += [("pp", [rep[k], rep[k + sw]], k % sw) for rep in reps for k in range(width - sw)]
        # gradient sums: a stage's tp lane over every replica and its cp ranks
        sums = [
            [rep[s * sw + c * t.tp + j] for rep in reps for c in range(t.cp)] for s in range(t.pp) for j in range(t.tp)
        ]
        groups += [("dp", g, k) for k, g in enumerate(sums)] if t.dp * t.cp > 1 else []
        for kind, ranks, lane in groups:
            nodes = tuple(sorted({r // devices_per_node for r in ranks}))
            out.append(LinkGroup(name, kind, tuple(ranks), nodes, lane))
    return out


def link_traffic(report: Report) -> dict[tuple[str, str], Traffic]:
    """Per (tower, kind) the bytes the chosen plan moves per step, as the cost model counts them
    (:func:`lightning_distmm.planner.cost.step.link_bytes` and the gradient sums' traffic): the
    tower's ``bytes_intra`` and ``bytes_inter`` of the report, split by kind."""
    from lightning_distmm.planner.cost.gradients import GradientTraffic, gradient_traffic
    from lightning_distmm.planner.cost.pipeline import microbatch_rows, recomputes
    from lightning_distmm.planner.cost.step import link_bytes, rank_groups

    ev, opts, dpn = report.chosen, report.options.cost, report.cluster.devices_per_node
    groups = {n: rank_groups(list(ev.ranks[n]), c.tp, c.pp, c.cp) for n, c in ev.choices.items()}
    grads, _ = gradient_traffic(report.profiles, report.cluster, opts, ev.choices, groups)
    out: dict[tuple[str, str], Traffic] = {}
    for name, c in ev.choices.items():
        p = report.profiles[name]
        K = sum(microbatch_rows(c.schedule, c.max_batch, c.microbatch)[0])
        recompute = recomputes(c.schedule) and not p.frozen
        # tp counted as crossing and pp as not, to read the two apart
        pp_bytes, tp_bytes = link_bytes(p, c, opts, K, recompute, GradientTraffic(0.0), True, False)
        tp_cross = any(len({r // dpn for r in g}) > 1 for g in groups[name]["tp"])
        pp_cross = any(a // dpn != b // dpn for a, b in groups[name]["pp"])
        out[(name, "tp")] = Traffic(0.0, tp_bytes) if tp_cross else Traffic(tp_bytes, 0.0)
        out[(name, "pp")] = Traffic(0.0, pp_bytes) if pp_cross else Traffic(pp_bytes, 0.0)
        g = grads[name]
        out[(name, "dp")] = Traffic(g.intra_bytes, g.inter_bytes, dict(g.own_load))
    return out
