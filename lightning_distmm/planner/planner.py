"""The planner: model config + cluster + global batch -> :class:`Plan` and a readable report.

``make_plan`` runs the pipeline of DESIGN.md section 4 and returns the fastest plan it can price:

1. profiles (analytic from the model config, or given / measured);
2. partitioner: per tower every (tp, pp, schedule, microbatches) on every device count;
3. balancer: devices per tower minimising the barrier step ``max F + sync + max B`` (exact);
4. placement: ranks per tower, TP inside nodes, layouts scored with link contention;
5. the colocated family (per-tower parallelism on shared devices) and the two baselines
   (DDP, Megatron-style) priced by the same model; the fastest of all is chosen, so the plan is
   never predicted slower than a baseline.

The ``distmm`` schedule is opt-in: it splits the batch into two sync groups, each with its own
negatives, so it changes the loss (the module must set ``sync_groups = 2``). The default
``schedules`` (:data:`DEFAULT_SCHEDULES`) are ``gpipe`` and ``cached``; listing ``distmm`` lets
the planner consider it, on every tower or on none.

``auto_plan`` is the entry point for ``DistMMStrategy(plan="auto")``: it measures the live towers
on the live device and plans for the live world size (tp = pp = 1 by default, what the runtime
executes today).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_distmm.core.plan import SCHEDULES, Plan, TowerPlan, split_batch
from lightning_distmm.planner.balance import (
    Balance,
    barrier_allocation,
    best_by_devices,
    even_allocation,
    minmax_allocation,
    proportional_allocation,
)
from lightning_distmm.planner.baselines import Evaluated, colocated_search
from lightning_distmm.planner.cluster import GB, Cluster, load_cluster
from lightning_distmm.planner.cost import (
    RECOMPUTE,
    CostOptions,
    StepCost,
    TowerChoice,
    batch_syncs,
    evaluate_plan,
    loss_bytes,
)
from lightning_distmm.planner.partition import (
    Candidates,
    InfeasibleError,
    SearchSpace,
    describe_no_fit,
    min_memory,
    tower_candidates,
    tower_space,
)
from lightning_distmm.planner.placement import place
from lightning_distmm.planner.profile import (
    TowerProfile,
    _plain,
    measure_tower,
    measured_profile,
    model_profiles,
    tower_profile,
)

BALANCERS = ("dp", "proportional", "even")
DEFAULT_SCHEDULES = ("gpipe", "cached")
"""Schedules the planner considers unless told otherwise: those that leave the loss as it is
(``distmm`` computes it over two sync groups, so a user opts in by listing it)."""
PLACEMENTS = ("hetero", "naive")
LAYOUTS = ("separate", "colocated")


@dataclass
class PlannerOptions:
    """Knobs of the search (Hydra group ``planner`` plus ``placement.strategy``).

    ``max_tp``/``max_pp`` bound the degrees (``1``/``1``: data parallel only, what the runtime runs
    today); ``tp``/``pp`` fix them for every tower; ``schedules`` the schedules allowed (default
    ``gpipe`` and ``cached``; ``distmm`` changes the loss, two sync groups, and is considered only
    when listed, on every tower or on none); ``layouts``
    whether towers may get their own devices (``separate``) and/or share all devices
    (``colocated``); ``recompute`` whether ``gpipe`` may checkpoint activations (TowerPlan.recompute);
    ``max_points`` the resolution of the balancer's parametric search; the rest are
    :class:`CostOptions`. ``world_size`` plans for that many devices of the cluster's kind.
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
        d = dict(_plain(options) or {})
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
        for k in ("schedules", "layouts"):
            if isinstance(d.get(k), str):
                d[k] = tuple(x.strip() for x in d[k].split(","))
        return cls(**d, cost=CostOptions.from_dict(cost))


@dataclass
class Report:
    """What the planner decided and why: the chosen plan's costs, the baselines, the solve time."""

    model: str
    cluster: Cluster
    global_batch: int
    plan: Plan
    chosen: Evaluated
    candidates: dict[str, Evaluated | None]
    baselines: dict[str, Evaluated | None]
    profiles: dict[str, TowerProfile]
    solve_time: float
    options: PlannerOptions
    balance: Balance | None = None
    placement_scores: dict[str, float] = field(default_factory=dict)

    @property
    def step_time(self) -> float:
        return self.chosen.step_time

    def timeline(self, max_ranks: int = 64) -> list[Any]:
        """The chosen plan's step, every rank's instruction list simulated with the cost model's
        durations (:func:`lightning_distmm.core.schedule.simulate`); draw it with ``timeline_svg``."""
        from lightning_distmm.core.schedule import schedules, simulate
        from lightning_distmm.planner.cost import instruction_seconds

        world = self.plan.world_size
        if world > max_ranks:
            raise ValueError(f"the plan has {world} ranks; a timeline draws at most {max_ranks} (max_ranks=)")
        nodes = len({r // self.cluster.devices_per_node for r in range(world)})
        seconds, transfer = instruction_seconds(
            self.profiles, self.cluster, self.options.cost, self.chosen.choices, self.global_batch, world, nodes
        )
        return simulate(schedules(self.plan, self.global_batch), seconds, transfer)

    def speedup(self, baseline: str) -> float | None:
        b = self.baselines.get(baseline)
        return None if b is None else b.step_time / self.step_time

    # ------------------------------------------------------------------ printing
    def table(self) -> str:
        c = self.chosen
        head = (
            "tower",
            "params",
            "devices",
            "dp/tp/pp",
            "replica batch",
            "micro x K",
            "schedule",
            "compute",
            "comm",
            "bubble",
            "mem/dev",
            "intra",
            "inter",
        )
        rows = []
        for name, ch in c.choices.items():
            tc = c.cost.towers[name]
            rb = ch.replica_batch
            batch = f"{rb[0]}" if len(set(rb)) == 1 else f"{max(rb)}/{min(rb)}"
            batch += f" x{len(rb)}" if len(rb) > 1 else ""
            rows.append(
                (
                    name,
                    _count(self.profiles[name].params) + (" frozen" if self.profiles[name].frozen else ""),
                    str(ch.n),
                    f"{ch.dp}/{ch.tp}/{ch.pp}",
                    batch,
                    f"{ch.microbatch} x{ch.K}",
                    ch.schedule,
                    _ms(tc.compute),
                    _ms(tc.comm),
                    _ms(tc.bubble),
                    f"{tc.memory.get('total_device', tc.memory['total']) / GB:.1f} GB",
                    f"{tc.bytes_intra / GB:.2f} GB",
                    f"{tc.bytes_inter / GB:.2f} GB",
                )
            )
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        cl = self.cluster
        lines = [
            f"DistMM plan: model {self.model}, cluster {cl.name} ({cl.nodes} x {cl.devices_per_node} {cl.device.name}),"
            f" global batch {self.global_batch}, layout {c.cost.layout}",
            fmt.format(*head),
            *(fmt.format(*r) for r in rows),
            f"batch sync (feature all-gather, loss, gradient scatter): {_ms(c.cost.sync['total'])}",
            f"predicted step time: {_ms(self.step_time)}  ({self.global_batch / self.step_time:,.0f} samples/s)",
        ]
        for name in ("ddp", "megatron"):
            b = self.baselines.get(name)
            label = {"ddp": "colocated DDP (open_clip style)", "megatron": "Megatron-LM style (uniform tp x pp x dp)"}[
                name
            ]
            if b is None:
                lines.append(f"  vs {label}: no configuration fits")
            else:
                cfg = next(iter(b.choices.values()))
                lines.append(
                    f"  vs {label}: {_ms(b.step_time)} (tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}, microbatch {cfg.microbatch},"
                    f" {cfg.schedule}) -> speedup {b.step_time / self.step_time:.2f}x"
                )
        for name, ev in self.candidates.items():
            if ev is not None and ev is not c:
                lines.append(f"  best {name} plan considered: {_ms(ev.step_time)}")
        lines.append(
            f"solve time: {self.solve_time * 1e3:.0f} ms"
            + ("" if self.balance is None or self.balance.exact else " (balancer sampled phi)")
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        def ev(e: Evaluated | None) -> dict[str, Any] | None:
            if e is None:
                return None
            return {
                "step_time": e.step_time,
                "layout": e.cost.layout,
                "towers": {
                    n: {
                        **dataclasses.asdict(ch),
                        "replica_batch": list(ch.replica_batch),
                        **_tower_cost(e.cost.towers[n]),
                    }
                    for n, ch in e.choices.items()
                },
                "sync": e.cost.sync,
            }

        return {
            "model": self.model,
            "cluster": self.cluster.name,
            "world_size": self.cluster.world_size,
            "global_batch": self.global_batch,
            "step_time": self.step_time,
            "samples_per_second": self.global_batch / self.step_time,
            "solve_time": self.solve_time,
            "chosen": ev(self.chosen),
            "baselines": {k: ev(v) for k, v in self.baselines.items()},
            "speedup": {k: self.speedup(k) for k in self.baselines},
            "candidates": {k: (None if v is None else v.step_time) for k, v in self.candidates.items()},
            "options": {
                **{k: v for k, v in dataclasses.asdict(self.options).items() if k != "cost"},
                "cost": dataclasses.asdict(self.options.cost),
            },
            "profiles": {n: p.summary() for n, p in self.profiles.items()},
        }


def _tower_cost(tc: Any) -> dict[str, Any]:
    d = dataclasses.asdict(tc)
    d.pop("name", None)
    return d


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:,.0f}M" if n >= 1e6 else f"{n / 1e3:,.0f}K"


def _ms(t: float) -> str:
    return f"{t * 1e3:,.1f} ms" if t < 100 else f"{t:,.2f} s"


# ---------------------------------------------------------------------- the planner
def make_plan(
    model_cfg: Mapping[str, Any] | None,
    cluster: Cluster | str | Mapping[str, Any],
    global_batch: int,
    options: PlannerOptions | Mapping[str, Any] | None = None,
    profiles: Mapping[str, TowerProfile] | None = None,
) -> tuple[Plan, Report]:
    """Plan ``model_cfg`` (or the given ``profiles``) on ``cluster`` for ``global_batch`` samples per step."""
    opts = PlannerOptions.from_any(options)
    cl = load_cluster(cluster)  # may measure this machine (local_cpu): not part of the solve time
    t0 = time.perf_counter()
    if opts.world_size is not None and opts.world_size != cl.world_size:
        cl = cl.with_world(int(opts.world_size))
    if profiles is None:
        if model_cfg is None:
            raise ValueError("make_plan needs a model config or profiles")
        profiles = model_profiles(model_cfg)
    profiles = dict(profiles)
    model_name = str((_plain(model_cfg) or {}).get("name", "model")) if model_cfg is not None else "model"
    G = int(global_batch)
    if G < 1:
        raise InfeasibleError(f"global batch must be at least 1, got {global_batch}")
    D = cl.world_size
    co = opts.cost
    names = list(profiles)

    # ---------------------------------------------------------------- search space and hard limits
    if opts.tp is not None and opts.tp <= cl.devices_per_node:
        bad = {n: p for n, p in profiles.items() if p.analytic and p.heads % opts.tp}
        if bad and len(bad) == len(profiles):
            heads = ", ".join(
                f"{n} has {p.heads} heads ({p.heads} % {opts.tp} = {p.heads % opts.tp})" for n, p in bad.items()
            )
            raise InfeasibleError(
                f"tp={opts.tp} divides no tower's head count: {heads}; leave planner.tp unset or pick a common divisor"
            )
    tps_all, pps_all = {}, {}
    for n, p in profiles.items():
        tps_all[n], pps_all[n] = tower_space(p, cl, D, opts.max_tp, opts.max_pp, opts.tp, opts.pp)
    scheds = tuple(opts.schedules) + ((RECOMPUTE,) if opts.recompute and "gpipe" in opts.schedules else ())
    space = SearchSpace(tps_all, pps_all, scheds, opts.max_microbatches)
    contrastive = [n for n, p in profiles.items() if p.arch != "text_decoder"]
    embed = max((profiles[n].embed_dim for n in contrastive), default=0)
    lb = loss_bytes(G, D, len(contrastive), co, embed)
    lb_distmm = loss_bytes(
        split_batch(G, None, 2)[0], D, len(contrastive), co, embed
    )  # a batch-sync over half the batch
    syncs = {k: batch_syncs(cl, co, G, embed, D, cl.nodes, len(contrastive), k)["total"] for k in (1, 2)}
    limit = cl.device.memory * co.memory_margin
    for p in profiles.values():
        need = min_memory(p, cl, co, G, D, space, lb)
        if need["total"] > limit:
            raise InfeasibleError(describe_no_fit(p, cl, co, need, D))
    _check_replicas(profiles, space, D, G)

    # ---------------------------------------------------------------- separate towers
    candidates: dict[str, Evaluated | None] = {}
    balance: Balance | None = None
    scores: dict[str, float] = {}
    if "separate" in opts.layouts and 1 < len(names) <= D:
        cands = [
            tower_candidates(
                profiles[n], cl, co, G, D, space, lb, max_devices=D - len(names) + 1, distmm_loss_b=lb_distmm
            )
            for n in names
        ]
        fixed = None
        if opts.balancer == "proportional":
            fixed = proportional_allocation({n: profiles[n].train_flops_per_sample() or 1.0 for n in names}, D)
        elif opts.balancer == "even":
            fixed = even_allocation(names, D)
        # a plan runs distmm on every tower or on none (one or two sync groups): balance each family,
        # the second only when its lower bound (the min-max of F + B, plus its batch-syncs) can beat
        # the first's objective plus its batch-sync, and place it only when its objective does
        errors: list[InfeasibleError] = []
        first: float | None = None
        for n_sync, family in _sync_families(cands):
            if fixed is not None:
                family = [c.take(c.n == fixed[c.tower]) for c in family]
            if not all(len(c) for c in family):
                continue
            if first is not None:
                bound, _ = minmax_allocation(best_by_devices(family, D, [c.F + c.B for c in family]), D)
                if bound + syncs[n_sync] >= first:
                    continue
            try:
                bal = barrier_allocation(family, D, opts.max_points, fixed=fixed)
            except InfeasibleError as err:
                errors.append(err)
                continue
            if first is None:
                first = bal.objective + syncs[n_sync]
            elif bal.objective + syncs[n_sync] >= first:
                continue
            pruned = {c.tower: c for c in bal.notes["pruned"]}
            choices = {n: pruned[n].choice(bal.index[n]) for n in names}

            def score(layout: Mapping[str, list[int]], choices: dict[str, TowerChoice] = choices) -> float:
                cost = evaluate_plan(profiles, cl, co, choices, layout, G)
                return cost.step_time if cost.extra["fits"] else math.inf

            layout, layout_scores = place(
                {n: choices[n].n for n in names}, {n: choices[n].tp for n in names}, cl, opts.placement, score
            )
            cost = evaluate_plan(profiles, cl, co, choices, layout, G)
            if balance is None:
                balance, scores = bal, layout_scores
            best = candidates.get("separate")
            if cost.extra["fits"] and (best is None or cost.step_time < best.step_time):
                candidates["separate"] = Evaluated("separate", choices, {n: list(layout[n]) for n in names}, cost)
                balance, scores = bal, layout_scores
        if balance is None and errors and fixed is None:
            raise errors[0]
        candidates.setdefault("separate", None)
    if "colocated" in opts.layouts:
        candidates["colocated"] = colocated_search(profiles, cl, co, G, space, "colocated")

    # ---------------------------------------------------------------- baselines (in the same model)
    baselines = {
        "ddp": colocated_search(profiles, cl, co, G, _baseline_space(profiles, cl, D, opts, "ddp"), "ddp"),
        "megatron": colocated_search(
            profiles, cl, co, G, _baseline_space(profiles, cl, D, opts, "megatron"), "megatron"
        ),
    }
    pool = [e for e in candidates.values() if e is not None]
    if "colocated" in opts.layouts:
        # the baselines are colocated plans: part of DistMM's space whenever their degrees and
        # schedules are allowed (always, unless the options restrict DistMM)
        for b in baselines.values():
            if b is not None and all(
                ch.tp in space.tps[n]
                and ch.pp in space.pps[n]
                and (profiles[n].frozen or ch.schedule in space.schedules)
                for n, ch in b.choices.items()
            ):
                pool.append(b)
    if not pool:
        raise InfeasibleError(_why_nothing(profiles, cl, co, space, D, G, opts))
    chosen = min(pool, key=lambda e: e.step_time)
    solve = time.perf_counter() - t0
    plan = to_plan(chosen, D, G)
    report = Report(model_name, cl, G, plan, chosen, candidates, baselines, profiles, solve, opts, balance, scores)
    return plan, report


def _sync_families(cands: Sequence[Candidates]) -> list[tuple[int, list[Candidates]]]:
    """The towers' candidates split by batch-syncs per step: plans with one (no tower on
    ``distmm``) and plans with two (every tower on ``distmm``); the schedule is the plan's choice."""

    def family(c: Candidates, distmm: bool) -> Candidates:
        code = c.schedules.index("distmm") if "distmm" in c.schedules else -1
        return c.take((c.sched == code) == distmm)

    out = [(1, [family(c, False) for c in cands])]
    if any("distmm" in c.schedules for c in cands):
        out.append((2, [family(c, True) for c in cands]))
    return out


def to_plan(ev: Evaluated, world: int, global_batch: int) -> Plan:
    """The runtime's :class:`Plan` for a priced plan."""
    towers = {}
    for n, ch in ev.choices.items():
        towers[n] = TowerPlan(
            ranks=list(ev.ranks[n]),
            replica_batch=list(ch.replica_batch),
            tp=ch.tp,
            pp=ch.pp,
            microbatch=ch.microbatch,
            schedule="gpipe" if ch.schedule == RECOMPUTE else ch.schedule,
            recompute=ch.schedule == RECOMPUTE,
        )
    return Plan(world_size=world, towers=towers, global_batch=global_batch)


def plan_choices(plan: Plan, global_batch: int | None = None) -> tuple[dict[str, TowerChoice], dict[str, list[int]]]:
    """The cost model's view of a runtime :class:`Plan`: per tower its :class:`TowerChoice` and ranks."""
    G = global_batch if global_batch is not None else plan.global_batch
    if G is None:
        raise ValueError("plan_choices needs the global batch (the plan has none)")
    choices, ranks = {}, {}
    for name, t in plan.towers.items():
        rb = tuple(t.split(int(G)))
        schedule = RECOMPUTE if t.recompute and t.schedule == "gpipe" else t.schedule
        mb = min(t.microbatch, max(rb)) if t.microbatch else max(rb)
        choices[name] = TowerChoice(name, len(t.ranks), t.tp, t.pp, mb, schedule, rb)
        ranks[name] = list(t.ranks)
    return choices, ranks


def price_plan(
    plan: Plan,
    profiles: Mapping[str, TowerProfile],
    cluster: Cluster | str | Mapping[str, Any],
    options: PlannerOptions | Mapping[str, Any] | None = None,
    global_batch: int | None = None,
) -> StepCost:
    """The predicted :class:`StepCost` of a runtime :class:`Plan` (any plan, not only the planner's)."""
    cl = load_cluster(cluster)
    if cl.world_size != plan.world_size:
        cl = cl.with_world(plan.world_size)
    choices, ranks = plan_choices(plan, global_batch)
    G = global_batch if global_batch is not None else int(plan.global_batch)  # type: ignore[arg-type]
    return evaluate_plan(profiles, cl, PlannerOptions.from_any(options).cost, choices, ranks, G)


def _baseline_space(
    profiles: Mapping[str, TowerProfile], cl: Cluster, D: int, opts: PlannerOptions, kind: str
) -> SearchSpace:
    """Baselines search their own full space (not DistMM's restrictions). DDP: tp = pp = 1 with the
    schedules open_clip offers (keep activations, --grad-checkpointing, --accum-freq = cached);
    Megatron: every uniform tp x pp, keep activations or full recompute."""
    names = list(profiles)
    if kind == "ddp":
        return SearchSpace(
            {n: [1] for n in names}, {n: [1] for n in names}, ("gpipe", RECOMPUTE, "cached"), opts.max_microbatches
        )
    return SearchSpace(
        {n: profiles[n].valid_tp(cl.devices_per_node) for n in names},
        {n: profiles[n].valid_pp(D) for n in names},
        ("gpipe", RECOMPUTE),
        opts.max_microbatches,
    )


def _max_split(space: SearchSpace, name: str, D: int) -> tuple[int, int, int]:
    best = (1, 1, 1)
    for tp in space.tps[name] or [1]:
        for pp in space.pps[name] or [1]:
            if tp * pp <= D and tp * pp > best[0]:
                best = (tp * pp, tp, pp)
    return best


def _check_replicas(profiles: Mapping[str, TowerProfile], space: SearchSpace, D: int, G: int) -> None:
    """Every device runs a replica of some tower, and every replica needs a sample."""
    splits = {n: _max_split(space, n, D) for n in profiles}
    colocated_need = max(math.ceil(D / splits[n][0]) for n in profiles)
    need = colocated_need
    if 1 < len(profiles) <= D:
        need = min(need, math.ceil(D / sum(s[0] for s in splits.values())))
    if G < need:
        tight = min(profiles, key=lambda n: splits[n][0])
        w, tp, pp = splits[tight]
        raise InfeasibleError(
            f"global batch {G} is below the replica count: {D} devices need at least {need} data-parallel replicas"
            f" (tower {tight!r} splits at most tp*pp = {tp}*{pp} = {w} ways), and every replica needs at least one"
            f" sample: short by {need - G}; raise global_batch to {need} or plan for fewer devices"
        )


def _why_nothing(
    profiles: Mapping[str, TowerProfile],
    cl: Cluster,
    co: CostOptions,
    space: SearchSpace,
    D: int,
    G: int,
    opts: PlannerOptions,
) -> str:
    parts = [
        f"no plan for {D} devices and global batch {G} fits device memory ({cl.device.memory / GB:.1f} GB x {co.memory_margin})"
    ]
    if opts.layouts == ("separate",) and len(profiles) > D:
        parts.append(f"layouts=separate needs at least one device per tower ({len(profiles)} towers, {D} devices)")
    for n, p in profiles.items():
        need = min_memory(p, cl, co, G, D, space, 0.0)
        parts.append(
            f"tower {n!r} needs at least {need['total'] / GB:.2f} GB per device alone (tp={need['tp']}, pp={need['pp']})"
        )
    parts.append(
        "colocated towers add their memory; allow larger tp/pp (planner.max_tp, planner.max_pp) or the cached schedule"
    )
    return "; ".join(parts)


# ---------------------------------------------------------------------- plan="auto"
@dataclass
class TowerInfo:
    """What ``auto_plan`` needs to know about a live tower.

    ``module``: the encoder; ``make_inputs(b)``: its positional inputs for a microbatch of ``b``
    samples (any device; moved to the measuring device); ``frozen``: runs without gradients;
    ``config``: optionally the tower's model-config entry (``conf/model`` schema), which enables
    the analytic profile and with it tp/pp > 1 plans; ``embed_dim``: the feature width (inferred
    from one forward pass when omitted).
    """

    module: Any
    make_inputs: Callable[[int], Sequence[Any]]
    frozen: bool = False
    config: Mapping[str, Any] | None = None
    embed_dim: int | None = None


def tower_info_from_batch(tower: Any, batch: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> TowerInfo:
    """A :class:`TowerInfo` for a ``lightning_distmm.Tower`` whose inputs are cut from a sample batch
    (rows repeated when the batch is smaller than the microbatch)."""
    import torch

    fields = tower.fields

    def make_inputs(b: int) -> list[Any]:
        out = []
        for f in fields:
            x = batch[f]
            idx = torch.arange(b) % len(x)
            out.append(x[idx] if isinstance(x, torch.Tensor) else [x[i] for i in idx.tolist()])
        return out

    return TowerInfo(tower.module, make_inputs, bool(getattr(tower, "frozen", False)), config)


def local_cluster(device: Any, world_size: int, devices_per_node: int | None = None) -> Cluster:
    """A cluster of ``world_size`` devices like ``device``: measured CPU processes on this host, or
    GPUs (memory from the driver, FLOP/s and HBM bandwidth measured, links from the matching preset
    when the device name matches one, else PCIe-class links, see docs/planner.md)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        from lightning_distmm.planner.cluster import measure_local_cpu

        return measure_local_cpu(devices=world_size, measure_gloo=world_size > 1)
    if dev.type != "cuda":
        raise ValueError(f"auto planning supports cpu and cuda devices, not {dev.type}")
    props = torch.cuda.get_device_properties(dev)
    dpn = devices_per_node or min(world_size, torch.cuda.device_count() or 1)
    preset = None
    for key, name in (("H200", "h200_8x8"), ("H100", "h100_8x8"), ("A100", "a100_8x8")):
        if key in props.name:
            preset = load_cluster(name)
            break
    from lightning_distmm.planner.cluster import Device, Link

    points, peak = [], 0.0
    for n in (256, 1024, 4096):
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        torch.mm(a, a)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(5):
            torch.mm(a, a)
        torch.cuda.synchronize(dev)
        rate = 2.0 * n**3 * 5 / (time.perf_counter() - t0)
        points.append([2.0 * n**3, rate])
        peak = max(peak, rate)
    x = torch.empty(64 * 2**20, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    torch.cuda.synchronize(dev)
    bw = 2 * x.numel() * 4 * 5 / (time.perf_counter() - t0)
    device_spec = Device(props.name, float(props.total_memory), peak, bw, 1.0, 0.0, [[f, r / peak] for f, r in points])
    if preset is not None:
        intra, inter, lat = preset.intra, preset.inter, preset.collective_latency
    else:  # PCIe 4.0 x16: 32 GB/s per direction; 100 Gb/s between nodes
        intra, inter, lat = Link(32e9, 5e-6, 0.8), Link(12.5e9, 10e-6, 1.0), 8.4e-6
    return Cluster(
        f"local_{props.name}", max(1, world_size // dpn), dpn, device_spec, intra, inter, lat, notes="measured"
    )


def runtime_cost_defaults(options: Mapping[str, Any] | None, device: Any = "cpu") -> dict[str, Any]:
    """``options`` with the cost options of what the runtime does, where the mapping leaves them
    unset: on CPU fp32 and no overlap of the gradient all-reduce with the backward (the runtime
    posts its buckets during the backward, but gloo's reduction competes for the same cores:
    benchmarks/step_time.py measured no gain, docs/runtime.md); on GPUs the overlap is assumed."""
    import torch

    d = dict(_plain(options) or {})
    cost = dict(d.get("cost") or {})
    given = set(d) | set(cost)
    cpu = torch.device(device).type == "cpu"
    if "overlap_grad_sync" not in given:
        d["overlap_grad_sync"] = not cpu
    if "precision" not in given and cpu:
        d["precision"] = "32"
    return d


def auto_plan(
    towers: Mapping[str, TowerInfo],
    world_size: int,
    global_batch: int,
    device: Any = "cpu",
    options: PlannerOptions | Mapping[str, Any] | None = None,
    devices_per_node: int | None = None,
    batch_sizes: Sequence[int] = (1, 2, 4),
    cluster: Cluster | None = None,
) -> Plan:
    """Plan for the live job: measure each tower on ``device`` and plan ``world_size`` ranks.

    Args:
        towers: name -> :class:`TowerInfo` (module, input maker, frozen, optional config).
        world_size: ranks of the job (``trainer.world_size``).
        global_batch: the DataLoader's batch size (the contrastive batch).
        device: where to measure (this rank's device).
        options: planner options; defaults restrict to ``max_tp = max_pp = 1`` (data parallel per
            tower, what the runtime executes today), ``schedules = ("gpipe", "cached")`` and no
            activation checkpointing. Unless a mapping sets them, the cost options follow the
            runtime: ``overlap_grad_sync=False`` (it sums gradients after the whole backward) and,
            on CPU, ``precision="32"``.
        devices_per_node: ranks per node (default: all ranks on one node for CPU, the visible
            GPUs for CUDA).
        batch_sizes: microbatch sizes timed per tower.
        cluster: skip measuring the machine and use this spec.

    Every rank must call it with the same inputs and get the same plan: call it on rank 0 and
    broadcast the plan's ``to_dict()``, since timings differ from rank to rank.
    """
    import torch

    if options is None:
        options = {"max_tp": 1, "max_pp": 1, "schedules": ["gpipe", "cached"], "recompute": False}
    if not isinstance(options, PlannerOptions):
        options = runtime_cost_defaults(options, device)
    cl = cluster or local_cluster(device, world_size, devices_per_node)
    if cl.world_size != world_size:
        cl = cl.with_world(world_size)
    profiles: dict[str, TowerProfile] = {}
    for name, info in towers.items():
        fit = measure_tower(info.module, info.make_inputs, batch_sizes, device, frozen=info.frozen)
        E = info.embed_dim
        if E is None:
            with torch.no_grad():
                out = info.module(*[x.to(device) if hasattr(x, "to") else x for x in info.make_inputs(1)])
            from lightning_distmm.planner.profile import _first_tensor

            E = int(_first_tensor(out).shape[-1])
        analytic = tower_profile(name, info.config, E) if info.config is not None else None
        profiles[name] = measured_profile(name, fit, info.frozen, E, analytic)
    plan, _ = make_plan(None, cl, global_batch, options, profiles=profiles)
    return plan


__all__ = [
    "PlannerOptions",
    "Report",
    "make_plan",
    "to_plan",
    "plan_choices",
    "price_plan",
    "TowerInfo",
    "tower_info_from_batch",
    "local_cluster",
    "runtime_cost_defaults",
    "auto_plan",
    "BALANCERS",
    "DEFAULT_SCHEDULES",
    "PLACEMENTS",
    "LAYOUTS",
]
