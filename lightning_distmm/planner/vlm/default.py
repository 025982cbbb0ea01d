"""The default plan of a model whose language model consumes an encoder's output (``plan=None``
and ``plan="auto"`` for a ``Tower(consumes=...)`` model).

The contrastive default (:mod:`lightning_distmm.planner.default`) prices towers meeting at a batch-sync; an encoder feeding
an LLM is a two-module pipeline instead, which the VLM search prices
(:func:`lightning_distmm.planner.vlm.search.vlm_plan`: every split of the ranks, colocated, FSDP over
both). Here that search runs on the live job's two towers: profiled from their counted FLOPs and
operators (``plan=None``, :func:`~lightning_distmm.planner.default.counted_profile`) or measured
(``plan="auto"``), one row as one unit (no image-count distribution is known), the handoff priced
at the producer's tokens per row and width. Such profiles have no layers to cut, so every plan is
data parallel per module (tp = pp = 1), with or without FSDP2 and recomputation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_distmm.core.plan import Plan
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.default import CountedTower, Host
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.profiles.profile import TowerProfile
from lightning_distmm.planner.vlm.profile import LIVE, VLMProfiles, VLMWorkload
from lightning_distmm.planner.vlm.search import VLMPick, vlm_plan

if TYPE_CHECKING:  # pragma: no cover
    from lightning_distmm.planner.auto import TowerInfo


@dataclass
class VLMChoice:
    """The search's pick for the live towers, renamed to them, and the line to log."""

    plan: Plan
    pick: VLMPick
    others: dict[str, VLMPick]
    where: str

    names: Mapping[str, str]

    def describe(self, pick: VLMPick) -> str:
        """``pick`` in the live towers' names."""
        where = "colocated" if pick.order == "colocated" else f"separate ({self.names[pick.order]} first)"
        return f"{self.names['image']} {pick.image.label()}; {self.names['llm']} {pick.llm.label()}; {where}"

    def line(self, spec: str = "default") -> str:
        mine = self.pick.step
        vs = [
            f"{p.step / mine:.2f}x faster than {label} ({self.describe(p)}: {p.step * 1e3:.0f} ms)"
            for key, label in (("fsdp", "FSDP over both"), ("colocated", "colocated"), ("separate", "separate"))
            if (p := self.others.get(key)) is not None and key != self.pick.kind
        ]
        return (
            f"distmm {spec} plan (VLM search): chose {self.describe(self.pick)} ({mine * 1e3:.0f} ms per"
            f" step), predicted {' and '.join(vs) or 'the only candidate'}; {self.where}"
        )


def live_profiles(
    producer: TowerProfile,
    consumer: TowerProfile,
    image_tokens: int,
    width: int,
    frozen_producer: bool,
    frozen_consumer: bool,
) -> VLMProfiles:
    """The search's profiles for a live producer (one unit: a row) and consumer (one unit: a row);
    the producer's own projection, if any, is inside its profile."""
    from lightning_distmm.planner.profiles.profile import Block

    blank = Block()
    projector = TowerProfile("projector", "mlp", False, 1, 1, width, 1, width, blank, blank, blank)
    workload = VLMWorkload(
        LIVE, images={1: 1.0}, text_tokens=1, frozen_vision=frozen_producer, frozen_llm=frozen_consumer
    )
    return VLMProfiles(workload, producer, projector, consumer, image_tokens=int(image_tokens), hidden=int(width))


def choose_vlm_plan(
    profiles: VLMProfiles,
    names: Mapping[str, str],
    cluster: Cluster,
    global_batch: int,
    options: CostOptions,
    where: str,
) -> VLMChoice:
    """The VLM search's pick on ``cluster`` (``names``: the live towers' names of the
    search's ``image`` and ``llm``); raises ValueError when nothing fits."""
    out = vlm_plan(profiles, cluster, global_batch, options)
    pick = out.get("distmm")
    if pick is None:
        raise ValueError(f"no plan of the VLM search fits {cluster.world_size} ranks at global batch {global_batch}")
    data = pick.plan.to_dict()
    data["towers"] = {names[k]: t for k, t in data["towers"].items()}
    data.pop("global_batch", None)  # priced at this batch, runs at any
    plan = Plan.from_dict(data)
    others = {k: v for k, v in out.items() if v is not None and k != "distmm"}
    return VLMChoice(plan, pick, others, where, dict(names))


def default_vlm_plan(
    towers: Mapping[str, CountedTower],
    producer: str,
    consumer: str,
    world_size: int,
    global_batch: int | None,
    host: Host,
    precision: str | None = None,
) -> VLMChoice:
    """``plan=None`` for an encoder (``producer``) feeding a language model (``consumer``): the
    VLM search on the towers' counts and this host's description (nothing timed)."""
    from lightning_distmm.planner.default import DEFAULT_BATCH, counted_profile, host_cluster
    from lightning_distmm.planner.options import PlannerOptions

    G = int(global_batch) if global_batch else max(DEFAULT_BATCH, world_size)
    cluster = host_cluster(host, world_size)
    cpu = host.kind == "cpu"
    options = PlannerOptions.from_any(
        {"precision": "32" if cpu or not precision else precision, "overlap_grad_sync": not cpu}
    ).cost
    p, c = towers[producer], towers[consumer]
    profiles = live_profiles(
        counted_profile("image", p, cluster),
        counted_profile("llm", c, cluster),
        p.tokens,
        p.embed_dim,
        p.frozen,
        c.frozen,
    )
    where = f"{host.cores} CPU cores, {host.threads} thread(s) per rank" if cpu else host.name or host.kind
    said = f"priced from counted FLOPs on {where}, global batch {G} (plan='auto' measures instead)"
    return choose_vlm_plan(profiles, {"image": producer, "llm": consumer}, cluster, G, options, said)


def auto_vlm_plan(
    infos: Mapping[str, TowerInfo],
    producer: str,
    consumer: str,
    tokens: int,
    width: int,
    world_size: int,
    global_batch: int,
    device: Any,
    devices_per_node: int | None = None,
    autocast: Callable[[], Any] | None = None,
    precision: str | None = None,
) -> VLMChoice:
    """``plan="auto"`` for an encoder (``producer``, handing ``tokens`` vectors of ``width`` per row)
    feeding a language model (``consumer``): the towers timed here, the machine measured, the
    VLM search on them."""
    from lightning_distmm.planner.auto import measure_profiles, runtime_cost_defaults
    from lightning_distmm.planner.measure.local import local_cluster
    from lightning_distmm.planner.options import PlannerOptions

    opts = runtime_cost_defaults({"precision": precision} if precision else {}, device)
    options = PlannerOptions.from_any(opts).cost
    measured = measure_profiles(infos, device, autocast=autocast)  # before the host's probes start processes
    cluster = local_cluster(device, world_size, devices_per_node)
    if cluster.world_size != world_size:
        cluster = cluster.with_world(world_size)
    p, c = infos[producer], infos[consumer]
    profiles = live_profiles(measured[producer], measured[consumer], tokens, width, p.frozen, c.frozen)
    said = f"priced from the towers timed on {cluster.device.name}, global batch {global_batch}"
    return choose_vlm_plan(profiles, {"image": producer, "llm": consumer}, cluster, global_batch, options, said)


__all__ = ["VLMChoice", "auto_vlm_plan", "choose_vlm_plan", "default_vlm_plan", "live_profiles"]
