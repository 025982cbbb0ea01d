"""Pipeline pricing: one replica's step through the runtime's own instruction lists.

A replica's pipeline is priced from the schedule the runtime runs: :func:`replica_timeline`
simulates (``planner.cost.simulate.simulate``) the lists ``core.schedule.schedules`` emits for a one-tower
plan of the replica's pipeline depth, microbatch and schedule, with per-microbatch forward and
backward durations, the batch-sync durations and the stage-to-stage transfer time. Its result is
cut at the batch-syncs into *segments*: the time before the first batch-sync, between the
batch-syncs, after the last. :func:`phases` gives the same segments in closed form (uniform
microbatches; numpy arrays over many candidates), derived from that simulation and checked
against it by the tests; the partitioner uses it, and ``evaluate_plan`` when a replica's lists
are too long to simulate quickly.

Per tower replica with ``K`` microbatches over ``P`` stages, stage times ``f`` and ``b`` per
microbatch and transfer time ``L`` between stages (:func:`phases`):

* ``gpipe``  before (K+P-1) f + (P-1) L, after (K+P-1) b + (P-1) L; keeps all K microbatches.
* ``cached`` forward without keeping activations, batch-sync, then per microbatch recompute and
  backward: after (K+P-1) (f+b) + (P-1) L; keeps at most min(K, P) microbatches.
* ``distmm`` two sync groups of K0 and K1 microbatches (half of the replica's rows each): group
  0's forwards, its batch-sync, then 1F1B between the groups (stage ``s`` first runs ``P-1-s`` of
  group 1's forwards, then one group-0 backward and one group-1 forward per slot), group 1's
  batch-sync and backwards: before (K0+P-1) f + (P-1) L, between K1 f + K0 b + 2 (K1 -
  ceil(K1/P)) L, after (K1+P-1) b + (P-1) L; keeps one group's microbatches plus P-1 (stage 0).

The cost model also prices ``gpipe+recompute`` (:data:`RECOMPUTE`): ``gpipe`` with full
activation checkpointing, which a :class:`TowerPlan` states as ``schedule: gpipe, recompute:
true``; :func:`cost_schedule` and :func:`runtime_schedule` translate between the two.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_distmm.core import schedule as ir
from lightning_distmm.core.plan import SCHEDULES, Plan, TowerPlan, split_batch
from lightning_distmm.planner.cost.simulate import simulate

RECOMPUTE = "gpipe+recompute"


def cost_schedule(schedule: str, recompute: bool) -> str:
    """The cost model's name of a tower plan's schedule: ``gpipe`` with ``recompute`` is :data:`RECOMPUTE`."""
    return RECOMPUTE if recompute and schedule == "gpipe" else schedule


def runtime_schedule(schedule: str) -> tuple[str, bool]:
    """A :class:`TowerPlan`'s ``(schedule, recompute)`` for a cost-model schedule name."""
    return ("gpipe", True) if schedule == RECOMPUTE else (schedule, False)


def recomputes(schedule: str) -> bool:
    """Whether the schedule's backward runs the forward again (``cached``, :data:`RECOMPUTE`)."""
    return schedule in ("cached", RECOMPUTE)


def sync_group_rows(schedule: str, rows: Any) -> tuple[Any, ...]:
    """Rows of a replica's sync groups: ``distmm`` halves them, the first group taking the odd row
    (:func:`split_batch`'s even split; numpy arrays of row counts too), else one group of all."""
    if schedule != "distmm":
        return (rows,)
    if np.ndim(rows) == 0:
        return tuple(split_batch(int(rows), None, 2))
    rows = np.asarray(rows)
    return (rows - rows // 2, rows // 2)


def phases(
    schedule: str, frozen: bool, K: Any, P: int, f: Any, b: Any, link: Any = 0.0, K1: Any = None
) -> tuple[tuple[Any, ...], Any]:
    """Closed form of :func:`replica_timeline` for microbatches of equal durations.

    ``K`` microbatches (``distmm``: ``K`` in sync group 0 and ``K1`` in group 1, ``K1`` in ``{K, K-1}``,
    default ``K``), ``P`` stages, ``f``/``b`` forward/backward seconds of a microbatch on a stage
    (``cached`` and ``gpipe+recompute`` add the recompute ``f`` to each backward), ``link`` seconds
    from a stage's send to the next stage's receive. Returns the segments (before the first
    batch-sync, between the batch-syncs, after the last) and the bubble (their sum less a stage's
    compute). Every argument but ``schedule``, ``frozen`` and ``P`` may be a numpy array.

    The formulas are the critical paths of the schedule's instruction lists (the tests check them
    against the simulation). They do not depend on the batch-sync durations: every critical path
    after a batch-sync runs through it. ``distmm``'s middle segment is 1F1B between the groups:
    stage ``s`` has run ``P-1-s`` of group 1's forwards before group 0's batch-sync ends (as if the
    forward stream of group 0 went on), then runs one group-0 backward and one group-1 forward per
    slot. Without transfer time that packs the last stage exactly (``K1 (f+b)``, plus one ``b``
    when group 0 has one microbatch more); every critical path to the last stage's last group-1
    forward does the same work, so the transfer time adds ``L`` per message on the path with the
    most: a gradient going ``m <= P-1`` stages down and activations coming back up cost ``2 m L``
    over ``m+1`` of the last stage's slots, so the longest path carries ``2 (K1 - ceil(K1/P))``
    transfers: middle ``K1 f + K b + 2 (K1 - ceil(K1/P)) L``. By then the other stages have finished
    group 0's backwards (group 1's gradients reach them
    later along the same path), so the last segment is ``gpipe``'s backward of ``K1`` microbatches.
    """
    if schedule not in (*SCHEDULES, RECOMPUTE):
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    K = np.asarray(K, dtype=float)
    fill = (P - 1) * link
    first = (K + P - 1) * f + fill
    zero = 0.0 * first
    if schedule != "distmm":
        if frozen:
            return (first, zero), first - K * f
        back = f + b if recomputes(schedule) else b
        last = (K + P - 1) * back + fill
        return (first, last), first + last - K * (f + back)
    K1 = K if K1 is None else np.asarray(K1, dtype=float)
    if frozen:
        middle = K1 * f + zero
        return (first, middle, zero), first + middle - (K + K1) * f
    middle = K1 * f + K * b + 2.0 * (K1 - np.ceil(K1 / P)) * link
    last = (K1 + P - 1) * b + fill
    return (first, middle, last), first + middle + last - (K + K1) * (f + b)


SIMULATE_MAX_INSTRUCTIONS = 2048
"""Above this many instructions (all stages of a replica) :func:`evaluate_plan` uses the closed
form :func:`phases` instead of simulating (a long simulation takes a noticeable fraction of a second)."""


@dataclass(frozen=True)
class ReplicaTimeline:
    """One replica's pipeline, simulated: segments between the batch-syncs and the bubble (seconds)."""

    segments: tuple[float, ...]
    bubble: float
    microbatches: tuple[int, ...]  # rows of each microbatch, in the order a stage runs them


def replica_plan(schedule: str, P: int, microbatch: int | None) -> Plan:
    """A one-tower plan of one replica: ``P`` stages on ranks ``0..P-1`` (``gpipe+recompute`` is
    ``gpipe`` with ``recompute``)."""
    name, recompute = runtime_schedule(schedule)
    tower = TowerPlan(ranks=list(range(P)), pp=P, microbatch=microbatch, schedule=name, recompute=recompute)
    return Plan(P, {"tower": tower})


@functools.lru_cache(maxsize=512)
def _replica_lists(
    schedule: str, P: int, rows: int, microbatch: int | None, frozen: bool
) -> dict[int, tuple[ir.Instruction, ...]]:
    lists = ir.schedules(replica_plan(schedule, P, microbatch), rows)
    # a frozen tower's backward is skipped by the runtime: no compute, no gradient sent or awaited
    return {r: tuple(i for i in ins if not (frozen and isinstance(i, ir.Backward))) for r, ins in lists.items()}


def microbatch_rows(schedule: str, rows: int, microbatch: int | None) -> tuple[list[int], set[int]]:
    """Per sync group, how many microbatches the runtime cuts a replica's ``rows`` into, and the
    distinct microbatch sizes: what ``core.schedule.microbatch_sizes`` lists, counted without
    listing them (a replica may hold tens of thousands of one-row microbatches)."""
    counts, sizes = [], set()
    for w in sync_group_rows(schedule, int(rows)):
        mb = w if microbatch is None or microbatch >= w else int(microbatch)
        counts.append(max(1, math.ceil(w / mb)) if mb else 1)
        sizes.update({mb, w % mb} - {0} if mb else {0})
    return counts, sizes


def replica_instructions(schedule: str, P: int, rows: int, microbatch: int | None) -> int:
    """How many instructions all stages of such a replica run in a step (without building them)."""
    counts, _ = microbatch_rows(schedule, rows, microbatch)
    return P * (2 * sum(counts) + 1) + len(counts)


def replica_timeline(
    schedule: str,
    frozen: bool,
    P: int,
    rows: int,
    microbatch: int | None,
    forward: float | Callable[[int], float],
    backward: float | Callable[[int], float],
    link: float | Callable[[int], float] = 0.0,
    syncs: Sequence[float] = (),
) -> ReplicaTimeline:
    """Price one replica's pipeline by simulating the runtime's instruction lists.

    The lists are ``schedule.schedules`` of a one-tower plan (:func:`replica_plan`) on ``rows``
    samples; ``forward``, ``backward`` and ``link`` are the seconds of a microbatch's forward and
    backward on a stage and of its transfer to the next stage (activations) or previous one
    (gradient), each a number or a function of the microbatch's rows; a recomputing backward
    (``cached``, ``gpipe+recompute``) lasts forward + backward. ``syncs``: seconds of each
    batch-sync (0 when omitted). A frozen tower's backwards are left out, as the runtime skips them.
    """
    lists = _replica_lists(schedule, P, int(rows), None if microbatch is None else int(microbatch), frozen)
    sizes = sorted({i.rows for i in lists[P - 1] if isinstance(i, ir.Forward)})
    table = tuple((r, *(float(x(r)) if callable(x) else float(x) for x in (forward, backward, link))) for r in sizes)
    return _simulate_replica(schedule, frozen, P, int(rows), microbatch, table, tuple(float(x) for x in syncs))


@functools.lru_cache(maxsize=4096)
def _simulate_replica(
    schedule: str, frozen: bool, P: int, rows: int, microbatch: int | None, table: tuple, syncs: tuple[float, ...]
) -> ReplicaTimeline:
    lists = _replica_lists(schedule, P, rows, microbatch, frozen)
    by_rows = {r: (f, b, L) for r, f, b, L in table}
    recompute = recomputes(schedule)

    def duration(rank: int, ins: ir.Instruction) -> float:
        if isinstance(ins, ir.Forward):
            return by_rows[ins.rows][0]
        if isinstance(ins, ir.Backward):
            f, b, _ = by_rows[ins.rows]
            return b + (f if recompute else 0.0)
        if isinstance(ins, ir.BatchSync):
            return syncs[ins.sync_group] if ins.sync_group < len(syncs) else 0.0
        return 0.0

    intervals = simulate(lists, duration, lambda ins: by_rows[ins.rows][2])
    last = sorted(
        (i for i in intervals if i.rank == P - 1 and isinstance(i.instruction, ir.BatchSync)),
        key=lambda i: i.instruction.sync_group,
    )
    end = max(i.end for i in intervals)
    segments, clock = [], 0.0
    for i in last:
        segments.append(i.start - clock)
        clock = i.end
    segments.append(end - clock)
    work = max(
        sum(i.end - i.start for i in intervals if i.rank == r and isinstance(i.instruction, (ir.Forward, ir.Backward)))
        for r in range(P)
    )
    mbs = tuple(i.rows for i in lists[P - 1] if isinstance(i, ir.Forward))
    return ReplicaTimeline(tuple(segments), sum(segments) - work, mbs)


__all__ = [
    "RECOMPUTE",
    "cost_schedule",
    "runtime_schedule",
    "recomputes",
    "sync_group_rows",
    "phases",
    "SIMULATE_MAX_INSTRUCTIONS",
    "ReplicaTimeline",
    "replica_plan",
    "microbatch_rows",
    "replica_instructions",
    "replica_timeline",
]
