"""The plan: which ranks run which tower, with what parallelism and which share of the batch.

A plan is plain data (dataclasses) so that it can be read, printed, saved as YAML, swept by Hydra
and drawn. It is validated on creation: a bad plan fails at once with a message naming the
problem, on every rank, before any process group exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_distmm.core.plan_schema import (
    SCHEDULES,
    SHARDS,
    PlanError,
    check_sequence_split,
    check_types,
    is_int,
)
from lightning_distmm.core.plan_yaml import dump_plan, load_plan_data
from lightning_distmm.core.tower_plan import TowerPlan, split_batch


def sync_group_count(schedules: Mapping[str, str]) -> int | None:
    """Batch-syncs per step of towers running ``schedules`` (tower -> schedule): 2 when every tower
    runs ``distmm``, 1 when none does, None when only some do. ``distmm`` splits the whole batch into
    two sync groups that every tower must share, so a mix is not a plan."""
    uses = {s == "distmm" for s in schedules.values()}
    if len(uses) > 1:
        return None
    return 2 if True in uses else 1


@dataclass
class Plan:
    """Per tower: ranks, parallel degrees, replica batches; plus the world size they must fill."""

    world_size: int
    towers: dict[str, TowerPlan]
    global_batch: int | None = None
    #: how each step's rows go to a tower's replicas: "cost" (by the cost fields its Tower names),
    #: "rows" (by count, as the plan splits them); None: the strategy's ``balance``
    balance: str | None = None

    def __post_init__(self) -> None:
        self.towers = {name: _as_tower_plan(name, tp) for name, tp in self.towers.items()}
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Every rule the plan alone decides, each refusal a :class:`PlanError` naming its key; with a
        ``global_batch``, the batch's rules too (:meth:`check_global_batch`)."""
        if not is_int(self.world_size) or self.world_size < 1:
            raise PlanError(f"world_size must be a positive integer, got {self.world_size!r}", "world_size")
        if self.balance not in (None, "cost", "rows"):
            raise PlanError(f"balance must be 'cost' or 'rows', got {self.balance!r}", "balance")
        if self.global_batch is not None and (not is_int(self.global_batch) or self.global_batch < 1):
            raise PlanError(
                f"global_batch must be a positive integer or None, got {self.global_batch!r}", "global_batch"
            )
        if not self.towers:
            raise PlanError("a plan needs at least one tower", "towers")
        held: set[int] = set()
        for name, t in self.towers.items():
            where, key = f"tower {name!r}", f"towers.{name}"
            if not t.ranks:
                raise PlanError(f"{where} has no ranks", f"{key}.ranks")
            if len(set(t.ranks)) != len(t.ranks):
                raise PlanError(f"{where} lists a rank twice: {t.ranks}", f"{key}.ranks")
            bad = [r for r in t.ranks if not is_int(r) or not 0 <= r < self.world_size]
            if bad:
                raise PlanError(
                    f"{where} uses ranks {bad} outside the world of {self.world_size} ranks (0..{self.world_size - 1})",
                    f"{key}.ranks",
                )
            for degree in ("tp", "pp", "cp"):
                value = getattr(t, degree)
                if not is_int(value) or value < 1:
                    raise PlanError(f"{where}: {degree} must be a positive integer, got {value!r}", f"{key}.{degree}")
            check_sequence_split(name, t.cp, t.tp, t.pp, t.sp, t.shard, len(t.ranks))
            if t.schedule not in SCHEDULES:
                raise PlanError(
                    f"{where}: unknown schedule {t.schedule!r}; choose one of {', '.join(SCHEDULES)}", f"{key}.schedule"
                )
            if not isinstance(t.compile, bool):
                raise PlanError(f"{where}: compile must be true or false, got {t.compile!r}", f"{key}.compile")
            if not (isinstance(t.recompute, bool) or (is_int(t.recompute) and t.recompute >= 0)):
                raise PlanError(
                    f"{where}: recompute must be true, false or a number of blocks per stage, got {t.recompute!r}",
                    f"{key}.recompute",
                )
            if t.shard not in SHARDS:
                raise PlanError(
                    f"{where}: unknown shard {t.shard!r}; choose one of {', '.join(SHARDS)}", f"{key}.shard"
                )
            if t.microbatch is not None and (not is_int(t.microbatch) or t.microbatch < 1):
                raise PlanError(
                    f"{where}: microbatch must be a positive integer or null, got {t.microbatch!r}", f"{key}.microbatch"
                )
            if t.replica_batch is not None:
                if len(t.replica_batch) != t.dp:
                    raise PlanError(
                        f"{where}: replica_batch has {len(t.replica_batch)} entries but the tower has dp={t.dp} replicas",
                        f"{key}.replica_batch",
                    )
                if any(not is_int(b) or b < 1 for b in t.replica_batch):
                    raise PlanError(
                        f"{where}: replica_batch entries must be positive integers, got {t.replica_batch}",
                        f"{key}.replica_batch",
                    )
                if self.global_batch is not None and sum(t.replica_batch) != self.global_batch:
                    raise PlanError(
                        f"{where}: replica_batch {t.replica_batch} sums to {sum(t.replica_batch)},"
                        f" not the global batch {self.global_batch}",
                        f"{key}.replica_batch",
                    )
            held.update(t.ranks)
        if sync_group_count({n: t.schedule for n, t in self.towers.items()}) is None:
            in_distmm = sorted(n for n, t in self.towers.items() if t.schedule == "distmm")
            others = sorted(set(self.towers) - set(in_distmm))
            raise PlanError(
                f"schedule 'distmm' splits the whole batch into two sync groups that every tower must share;"
                f" tower(s) {in_distmm} use it but {others} do not: set schedule: distmm on every tower or on none",
                f"towers.{others[0]}.schedule",
            )
        idle = sorted(set(range(self.world_size)) - held)
        if idle:
            raise PlanError(
                f"ranks {idle} run no tower: every rank of the world of {self.world_size} must hold one (add them to"
                " the ranks of one of the towers, or make world_size smaller)",
                "towers",
            )
        if self.global_batch is not None:
            self.check_global_batch(self.global_batch)

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise PlanError(
                f"the plan is for world_size={self.world_size} but the trainer runs {world_size} processes"
                f" (devices x num_nodes); make a plan for {world_size} ranks or change devices",
                "world_size",
            )

    def check_towers(self, names: Sequence[str]) -> None:
        unknown = sorted(set(self.towers) - set(names))
        missing = sorted(set(names) - set(self.towers))
        if unknown:
            raise PlanError(
                f"the plan names tower(s) {unknown} that the module does not define; the module's towers() are {sorted(names)}",
                f"towers.{unknown[0]}",
            )
        if missing:
            raise PlanError(f"the plan has no entry for tower(s) {missing} of the module", "towers")

    def batch_note(self, n: int) -> str | None:
        """What a batch of ``n`` rows does to a plan written for another global batch with replica
        batches of its own (they are scaled, not kept), or None when there is nothing to say."""
        if self.global_batch is None or n == self.global_batch:
            return None
        written = {name: t.replica_batch for name, t in self.towers.items() if t.replica_batch is not None}
        if not written:
            return None
        was = ", ".join(f"{name}: {rb}" for name, rb in written.items())
        now = ", ".join(f"{name}: {self.towers[name].split(n)}" for name in written)
        return (
            f"the plan's replica batches were written for a global batch of {self.global_batch} ({was}); batches of"
            f" {n} rows split as {now}, in the same proportions. Write the plan for {n} (or set the DataLoader's"
            f" batch_size to {self.global_batch}) to choose the split yourself"
        )

    def check_global_batch(self, n: int) -> None:
        """Every rule of a global batch of ``n`` rows: enough rows for every replica of every sync
        group, then :meth:`check_batch_split`."""
        self._check_batch_rows(n)
        self.check_batch_split(n)

    def check_batch_split(self, n: int) -> None:
        """How a batch of ``n`` rows splits: no replica left without a row by uneven replica batches,
        the same number of microbatches on every replica of a sharded tower. (Too few rows for the
        replicas is :meth:`check_global_batch`'s and the data loader's to say, with the loader's
        numbers: nothing is refused here then.)"""
        if any(min(self.group_split(n)) < t.dp for t in self.towers.values()):
            return
        for name, t in self.towers.items():
            for g, rows in enumerate(self.group_split(n)):
                split = t.split(rows)
                if 0 in split:
                    where = f" in sync group {g} ({rows} rows)" if self.sync_groups > 1 else ""
                    raise PlanError(
                        f"tower {name!r}: replica_batch {t.replica_batch} splits the {rows} rows of a global batch"
                        f" of {n}{where} as {split}, leaving replica {split.index(0)} without a row; every replica"
                        " needs at least one: write replica batches in which each replica's share is at least one"
                        " row, or leave replica_batch out (an even split)",
                        f"towers.{name}.replica_batch",
                    )
        self.check_sharded_microbatches(n)

    def check_sharded_microbatches(self, n: int) -> None:
        """A sharded tower's replicas meet in FSDP's collectives once per microbatch (an all-gather
        in each forward and backward), so in every sync group each replica must run the same number
        of microbatches; uneven replica batches with a microbatch size can break that: refused."""
        for name, t in self.towers.items():
            if not t.sharded or t.microbatch is None or t.dp == 1:
                continue
            for g, rows in enumerate(self.group_split(n)):
                counts = [-(-r // t.microbatch) for r in t.split(rows)]
                if len(set(counts)) > 1:
                    where = f" in sync group {g} ({rows} rows)" if self.sync_groups > 1 else ""
                    raise PlanError(
                        f"tower {name!r}, shard={t.shard!r}: its replicas get {t.split(rows)} rows of a global batch of"
                        f" {n}{where}, which microbatch={t.microbatch} cuts into {counts} microbatches; the replicas of"
                        " a sharded tower meet in FSDP's collectives once per microbatch and must run the same number:"
                        " choose a microbatch size that gives every replica as many, or even replica batches",
                        f"towers.{name}.microbatch",
                    )

    def _check_batch_rows(self, n: int) -> None:
        if self.sync_groups > 1 and n < self.sync_groups:
            raise PlanError(
                f"schedule 'distmm' needs a global batch of at least {self.sync_groups} (one row per sync group), got {n}",
                f"towers.{next(iter(self.towers))}.schedule",
            )
        for name, t in self.towers.items():
            if min(self.group_split(n)) < t.dp:
                if self.sync_groups > 1:
                    raise PlanError(
                        f"tower {name!r}: each of the {self.sync_groups} sync groups of a global batch of {n}"
                        f" ({self.group_split(n)}) must give each of its {t.dp} data-parallel replicas (ranks"
                        f" {t.ranks}) a sample",
                        f"towers.{name}.ranks",
                    )
                raise PlanError(
                    f"tower {name!r}: global batch {n} is smaller than its {t.dp} data-parallel replicas (ranks"
                    f" {t.ranks});"
                    f" raise the DataLoader batch_size or use drop_last=True to avoid a short last batch",
                    f"towers.{name}.ranks",
                )

    # ------------------------------------------------------------------ queries
    @property
    def sync_groups(self) -> int:
        """How many batch-syncs a step has: 2 under ``distmm`` (two sync groups, each with its own negatives), else 1."""
        count = sync_group_count({n: t.schedule for n, t in self.towers.items()})
        assert count is not None, "a plan mixing distmm with other schedules is refused when it is made"
        return count

    def group_split(self, n: int) -> list[int]:
        """Rows of each sync group of a global batch of ``n`` (contiguous, the first groups one larger)."""
        return split_batch(n, None, self.sync_groups)

    def group_offsets(self, n: int) -> list[int]:
        """First row of each sync group, plus ``n``."""
        out = [0]
        for size in self.group_split(n):
            out.append(out[-1] + size)
        return out

    @property
    def colocated(self) -> bool:
        """Every rank holds every tower (the DDP-like baseline)."""
        everyone = list(range(self.world_size))
        return all(sorted(t.ranks) == everyone for t in self.towers.values())

    def towers_on(self, rank: int) -> list[str]:
        return [name for name, t in self.towers.items() if rank in t.ranks]

    # ------------------------------------------------------------------ YAML
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"world_size": self.world_size, "global_batch": self.global_batch}
        if self.balance is not None:
            data["balance"] = self.balance
        data["towers"] = {name: dataclasses.asdict(t) for name, t in self.towers.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """A plan from plain data (parsed YAML); a value of the wrong type fails naming its key path."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a mapping, got {type(data).__name__}")
        allowed = {"world_size", "global_batch", "balance", "towers"}
        unknown = sorted(set(data) - allowed, key=str)
        if unknown:
            raise PlanError(f"unknown plan key(s) {unknown}; allowed keys are {sorted(allowed)}")
        if "world_size" not in data or "towers" not in data:
            raise PlanError("a plan needs 'world_size' and 'towers'")
        check_types(data)
        return cls(
            world_size=data["world_size"],
            towers=dict(data["towers"]),
            global_batch=data.get("global_batch"),
            balance=data.get("balance"),
        )

    def to_yaml(self, path: str | Path | None = None) -> str:
        return dump_plan(self.to_dict(), path)

    @classmethod
    def from_yaml(cls, source: str | Path) -> Plan:
        """Load from a YAML file path or a YAML string. Errors name the file (when there is one) and the
        key: malformed YAML, a key given twice, a value of the wrong type, or a plan that does not validate."""
        data, where = load_plan_data(source)
        try:
            return cls.from_dict(data)
        except PlanError as e:
            raise PlanError(f"{where}{e}") from None

    # ------------------------------------------------------------------ printout
    def table(self) -> str:
        head = ("tower", "ranks", "dp", "cp", "tp", "pp", "shard", "replica batch", "microbatch", "schedule")
        rows = []
        for name, t in self.towers.items():
            batch = "+".join(map(str, t.replica_batch)) if t.replica_batch else "even"
            rows.append(
                (
                    name,
                    _ranks_str(t.ranks),
                    str(t.dp),
                    str(t.cp),
                    str(t.tp) + ("+sp" if t.sp else ""),
                    str(t.pp),
                    t.shard,
                    batch,
                    str(t.microbatch or "-"),
                    t.schedule + _recompute_str(t.recompute) + ("+compile" if t.compile else ""),
                )
            )
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        layout = "colocated" if self.colocated else "separate"
        title = f"Plan(world_size={self.world_size}, global_batch={self.global_batch}, layout={layout})"
        lines = [title, fmt.format(*head), *(fmt.format(*r) for r in rows)]
        if self.sync_groups > 1:
            lines.append(
                f"loss over {self.sync_groups} sync groups of the batch, each with its own negatives (module sync_groups = {self.sync_groups})"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _as_tower_plan(name: str, value: Any) -> TowerPlan:
    if isinstance(value, TowerPlan):
        return value
    if not isinstance(value, Mapping):
        raise PlanError(f"tower {name!r}: expected a mapping of tower settings, got {type(value).__name__}")
    allowed = {f.name for f in dataclasses.fields(TowerPlan)}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise PlanError(f"tower {name!r}: unknown key(s) {unknown}; allowed keys are {sorted(allowed)}")
    if "ranks" not in value:
        raise PlanError(f"tower {name!r}: 'ranks' is required")
    kwargs = dict(value)
    kwargs["ranks"] = list(kwargs["ranks"])
    if kwargs.get("replica_batch") is not None:
        kwargs["replica_batch"] = list(kwargs["replica_batch"])
    return TowerPlan(**kwargs)


def _ranks_str(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def colocated_plan(towers: Sequence[str], world_size: int, global_batch: int | None = None) -> Plan:
    """Every rank holds every tower: the DDP-like baseline, run through the same code path."""
    everyone = list(range(world_size))
    return Plan(world_size, {name: TowerPlan(ranks=list(everyone)) for name in towers}, global_batch)


def _recompute_str(recompute: bool | int) -> str:
    """``+recompute`` (every block), ``+recompute(N)`` (the first N blocks of each stage) or nothing."""
    if recompute is True:
        return "+recompute"
    return f"+recompute({recompute})" if recompute else ""


__all__ = [
    "Plan",
    "TowerPlan",
    "PlanError",
    "SCHEDULES",
    "SHARDS",
    "sync_group_count",
    "split_batch",
    "colocated_plan",
]
