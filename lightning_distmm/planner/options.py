"""The planner's options: what the search may choose from (Hydra group ``planner`` plus
``placement.strategy``), and the cost model's assumptions nested as ``cost``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_distmm.core.plan import SCHEDULES
from lightning_distmm.planner.cost import PLANNABLE_SHARDS, CostOptions
from lightning_distmm.planner.machine.config import to_plain

BALANCERS = ("dp", "proportional", "even")


DEFAULT_SCHEDULES = ("gpipe", "cached")
"""Schedules the planner considers unless told otherwise: those that leave the loss as it is
(``distmm`` computes it over two sync groups, so a user opts in by listing it)."""


PLACEMENTS = ("hetero", "naive")


LAYOUTS = ("separate", "colocated")


@dataclass
class PlannerOptions:
    """Knobs of the search (Hydra group ``planner`` plus ``placement.strategy``).

    ``max_tp``/``max_pp`` bound the degrees (``1``/``1``: data parallel only, as ``plan="auto"``
    uses for towers known only by measurement); ``tp``/``pp`` fix them for every tower;
    ``schedules`` the schedules allowed (default ``gpipe`` and ``cached``; ``distmm`` changes the
    loss, two sync groups, and is considered only when listed, on every tower or on none);
    ``layouts`` whether towers may get their own devices (``separate``) and/or share all devices
    (``colocated``); ``recompute`` whether ``gpipe`` may checkpoint activations (TowerPlan.recompute);
    ``max_points`` the resolution of the balancer's parametric search; ``shards`` how a tower's
    replicas may hold the training state (``none``, the default; any of :data:`PLANNABLE_SHARDS`,
    the shardings the runtime runs and the cost model prices, so the plan written is the plan priced); ``baselines`` which baselines to
    price (default all of ``baselines.BASELINES``); the rest are :class:`CostOptions`.
    ``world_size`` plans for that many devices of the cluster's kind.
    """

    balancer: str = "dp"
    placement: str = "hetero"
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    layouts: tuple[str, ...] = LAYOUTS
    max_tp: int | None = None
    max_pp: int | None = None
    tp: int | None = None
    pp: int | None = None
    max_microbatches: int | None = None
    max_points: int = 256
    world_size: int | None = None
    recompute: bool = True
    shards: tuple[str, ...] = ("none",)
    baselines: tuple[str, ...] | None = None
    #: after the search, offer each tower context / sequence parallelism on its devices (planner.sequence)
    sequence: bool = False
    cost: CostOptions = field(default_factory=CostOptions)

    def __post_init__(self) -> None:
        if self.balancer not in BALANCERS:
            raise ValueError(f"planner.balancer={self.balancer!r}: choose one of {', '.join(BALANCERS)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        self.schedules = tuple(self.schedules)
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise ValueError(f"planner.schedules={list(self.schedules)}: choose from {', '.join(SCHEDULES)}")
        self.shards = tuple(self.shards)
        if not self.shards or any(s not in PLANNABLE_SHARDS for s in self.shards):
            raise ValueError(f"planner.shards={list(self.shards)}: choose from {', '.join(PLANNABLE_SHARDS)}")
        if self.baselines is not None:
            self.baselines = tuple(self.baselines)
        self.layouts = tuple(self.layouts)
        bad = [s for s in self.layouts if s not in LAYOUTS]
        if bad or not self.layouts:
            raise ValueError(f"planner.layouts={list(self.layouts)}: choose from {', '.join(LAYOUTS)}")
        for k in ("max_tp", "max_pp", "tp", "pp", "max_microbatches", "world_size"):
            v = getattr(self, k)
            if v is not None and (int(v) != v or v < 1):
                raise ValueError(f"planner.{k} must be a positive integer or null, got {v!r}")

    @classmethod
    def from_any(cls, options: PlannerOptions | Mapping[str, Any] | None) -> PlannerOptions:
        """From a mapping like the Hydra config: planner keys, ``cost`` keys inline or nested, and
        ``placement`` as a name or a mapping with ``strategy``."""
        if isinstance(options, PlannerOptions):
            return options
        d = dict(to_plain(options) or {})
        cost_keys = set(CostOptions.__dataclass_fields__)
        cost = dict(d.pop("cost", None) or {})
        for k in list(d):
            if k in cost_keys:
                cost[k] = d.pop(k)
        place_opt = d.pop("placement", None)
        if isinstance(place_opt, Mapping):
            place_opt = place_opt.get("strategy", "hetero")
        if place_opt is not None:
            d["placement"] = str(place_opt)
        known = set(cls.__dataclass_fields__) - {"cost"}
        unknown = sorted(set(d) - known - {"name"})
        if unknown:
            raise ValueError(f"unknown planner option(s) {unknown}; known: {sorted(known | cost_keys)}")
        d = {k: v for k, v in d.items() if k in known}
        for k in ("schedules", "layouts", "shards", "baselines"):
            if isinstance(d.get(k), str):
                d[k] = tuple(x.strip() for x in d[k].split(","))
        return cls(**d, cost=CostOptions.from_dict(cost))


__all__ = ["PlannerOptions", "BALANCERS", "DEFAULT_SCHEDULES", "PLACEMENTS", "LAYOUTS"]
