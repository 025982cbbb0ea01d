"""The schema of a plan's plain data: the names it may use and the type of every value.

Plain data comes from YAML files, Hydra configs and users' dicts; every value is checked here
with its key path (``towers.image.ranks: expected a list of ints, got 0``), and a YAML mapping
that gives a key twice is refused, before :class:`lightning_distmm.core.plan.Plan` checks that
the values make a plan that can run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import yaml

SCHEDULES = ("gpipe", "distmm", "cached")
#: how a tower's parameters, gradients and optimizer state are held over its data-parallel ranks:
#: ``none`` replicated (DDP-style sums), ``optimizer`` the optimizer state sharded over all of them,
#: weights and gradients whole (ZeRO-1: gradients reduce-scattered, the weights all-gathered after the
#: step), ``zero2`` sharded over all of them with each layer's weights
#: kept whole from its forward to its backward (ZeRO-2: FSDP2's ``reshard_after_forward=False``),
#: ``full`` sharded over all of them (ZeRO-3, FSDP2's default), ``hybrid`` sharded inside a node and
#: replicated across nodes (HSDP)
SHARDS = ("none", "optimizer", "zero2", "full", "hybrid")
#: the shardings FSDP2 runs (the tower's parameters become its sharded DTensors)
FSDP_SHARDS = ("zero2", "full", "hybrid")


class PlanError(ValueError):
    """A plan that cannot run: the message names the tower and the problem.

    ``key`` is the plan key the refusal is about, as a path into the plan's plain data
    (``towers.image.sp``, ``world_size``; None where no single key is to blame), so that a sweep can
    tell its refusals apart without parsing the message.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across ranks and launchers with its key
        return (type(self), (str(self), self.key))


def is_int(value: Any) -> bool:
    """An integer that is not a bool (YAML's ``true`` is a Python ``bool``, itself an ``int``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _expect(ok: bool, path: str, what: str, value: Any) -> None:
    if not ok:
        raise PlanError(f"{path}: expected {what}, got {value!r}", path)


def check_types(data: Mapping[str, Any]) -> None:
    """The type of every value of a plan's plain data, failing with its key path (``towers.image.tp``)."""
    _expect(is_int(data["world_size"]) and data["world_size"] >= 1, "world_size", "a positive int", data["world_size"])
    batch = data.get("global_batch")
    _expect(batch is None or (is_int(batch) and batch >= 1), "global_batch", "a positive int or null", batch)
    balance = data.get("balance")
    _expect(balance in (None, "cost", "rows"), "balance", "'cost', 'rows' or null", balance)
    towers = data["towers"]
    _expect(isinstance(towers, Mapping), "towers", "a mapping of tower name to settings", towers)
    ints = "a list of ints"
    for name, tower in towers.items():
        _expect(isinstance(name, str), "towers", "tower names that are strings", name)
        where = f"towers.{name}"
        if dataclasses.is_dataclass(tower):  # a TowerPlan already built
            continue
        _expect(isinstance(tower, Mapping), where, "a mapping of tower settings", tower)
        for key, value in tower.items():
            path = f"{where}.{key}"
            if key == "ranks":
                _expect(isinstance(value, list) and all(is_int(r) for r in value), path, ints, value)
            elif key == "replica_batch":
                ok = value is None or (isinstance(value, list) and all(is_int(b) for b in value))
                _expect(ok, path, f"{ints} or null", value)
            elif key in ("tp", "pp", "cp"):
                _expect(is_int(value) and value >= 1, path, "a positive int", value)
            elif key == "microbatch":
                _expect(value is None or (is_int(value) and value >= 1), path, "a positive int or null", value)
            elif key == "schedule":
                _expect(isinstance(value, str), path, f"one of {', '.join(SCHEDULES)}", value)
            elif key in ("sp", "compile"):
                _expect(isinstance(value, bool), path, "true or false", value)
            elif key == "recompute":
                ok = isinstance(value, bool) or (is_int(value) and value >= 0)
                _expect(ok, path, "true, false or a number of blocks per stage", value)
            elif key == "shard":
                _expect(isinstance(value, str), path, f"one of {', '.join(SHARDS)}", value)


def check_sequence_split(name: str, cp: int, tp: int, pp: int, sp: Any, shard: str, ranks: int) -> None:
    """The rules of tower ``name``'s context / sequence parallelism that the plan alone can check (the
    head count, the tower's kind and its sequence length are checked against the module before the
    runtime builds a process group: :func:`lightning_distmm.parallel.plan_checks.check_plan_runs`)."""
    where, key = f"tower {name!r}", f"towers.{name}"
    if ranks % (cp * tp * pp):
        raise PlanError(
            f"{where}: {ranks} ranks do not divide into replicas of cp*tp*pp = {cp}*{tp}*{pp} = {cp * tp * pp}"
            " (a replica is pp stages of cp*tp ranks)",
            f"{key}.ranks",
        )
    if not isinstance(sp, bool):
        raise PlanError(f"{where}: sp must be true or false, got {sp!r}", f"{key}.sp")
    if sp and tp == 1:
        raise PlanError(
            f"{where}: sp: true shards along the sequence the regions that tensor parallelism replicates over its"
            " tp ranks, so it needs tp > 1 (this tower has tp=1); set tp > 1 or use cp to split the sequence",
            f"{key}.sp",
        )
    if sp and cp > 1:
        raise PlanError(
            f"{where}: sp: true with cp={cp} is not supported; choose one way to split the sequence (sp: false, or"
            " cp: 1)",
            f"{key}.sp",
        )
    if sp and shard in FSDP_SHARDS:
        raise PlanError(
            f"{where}: sp: true with shard: {shard} is not supported (FSDP replaces the parameters whose partial"
            " gradients sp sums over tp); use shard: none, or sp: false",
            f"{key}.sp",
        )
    if cp > 1 and shard == "hybrid":
        raise PlanError(
            f"{where}: cp={cp} with shard: hybrid is not supported (HSDP would need a mesh of the replicas and"
            " their cp ranks per node); use shard: full, which shards over the replicas and cp ranks together",
            f"{key}.shard",
        )


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a mapping with a key given twice is refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                continue  # the SafeLoader refuses an unhashable key with its own message
            if key in seen:
                raise PlanError(
                    f"line {line}: key {key!r} is given twice (first on line {seen[key]}); YAML would keep only"
                    f" the last one: merge them into one entry"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)
