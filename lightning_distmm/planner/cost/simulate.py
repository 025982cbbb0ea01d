"""The simulator: every rank's instruction list played as the collectives and transfers run it.

:func:`simulate` replays the lists :func:`lightning_distmm.core.schedule.schedules` gives (the
same lists the runtime's executor runs) with a duration per instruction and returns each
instruction's interval; :func:`simulate_handoff` does the same for the lists of a model whose
towers consume each other's outputs (:mod:`lightning_distmm.core.handoff_schedule`). The cost model prices
plans with it and :mod:`lightning_distmm.planner.pictures.timeline` draws its intervals. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lightning_distmm.core.handoff_schedule import RecvTokenGrads, RecvTokens, SendTokenGrads, SendTokens, TokenLoss
from lightning_distmm.core.schedule import (
    Backward,
    BatchSync,
    Forward,
    GradSync,
    Instruction,
    SyncPost,
    SyncWait,
)


@dataclass(frozen=True)
class Interval:
    rank: int
    instruction: Instruction
    start: float
    end: float


def simulate(
    plan_schedules: Mapping[int, Sequence[Instruction]],
    duration: Callable[[int, Instruction], float],
    link: float | Callable[[Instruction], float] = 0.0,
    rendezvous: bool = False,
    blocking_sends: bool = False,
) -> list[Interval]:
    """Play every rank's list as NCCL runs it; return each instruction's interval.

    * A receive waits for its send (plus ``link`` seconds).
    * A collective waits for every member: :class:`BatchSync` and :class:`SyncWait` (the feature
      gradients' all-reduce) for the batch-sync ranks, :class:`GradSync` for every rank.
    * ``rendezvous`` (NCCL): a send is complete only once its receiver has reached the receive.
      The sending rank goes on past it (the runtime posts sends, one communicator per tower and
      direction), but it posts no collective (:class:`SyncPost`, :class:`SyncWait`,
      :class:`BatchSync`, :class:`GradSync`) while a send of its own is still unmatched: NCCL runs a
      device's kernels with no guarantee that a collective proceeds beside a send that waits for
      its peer, and its guidance is that operations on different communicators be ordered alike on
      every rank. With ``rendezvous=False`` (gloo; the default, which the planner's cost model and
      its closed forms price with) a send completes without its receiver. Under rendezvous a
      collective can start up to one transfer later (its rank waits for the receiver to post the
      last receive); ``tests/test_schedule.py`` checks every schedule for deadlocks with it on.

    An asynchronous batch-sync costs its rank nothing at :class:`SyncPost`: the gather is in flight
    from the last of its ranks' posts for ``duration(rank, post)`` seconds (its interval, which
    :func:`bubble_fraction` does not count as busy), while the rank runs on; :class:`SyncWait`
    starts when every batch-sync rank has reached it and the gather is done, and takes
    ``duration(rank, wait)`` (the loss, its backward, the feature gradient sum). Pricing a
    :class:`BatchSync` as the post's seconds plus the wait's gives the blocking equivalent.

    ``link``: seconds from a send to its receive, a number or a function of the receiving
    instruction (a ``Forward`` receives the microbatch's activations, a ``Backward`` its gradient).
    ``blocking_sends``: the strictest model, a send holds its whole rank until the receiver has
    reached the receive (what one stream for all of a rank's transfers, or a blocking ``send``,
    would do); the runtime's sends are posted on a group per stage pair and direction, so this is
    more than it needs, and the lists complete under it too.

    Raises ``RuntimeError`` naming what every blocked rank waits for when the lists deadlock.
    """
    clock = {r: 0.0 for r in plan_schedules}
    held: dict[int, tuple] = {}  # blocking_sends: the send a rank is held at until its receiver reaches it
    pc = {r: 0 for r in plan_schedules}
    sent: dict[tuple, float] = {}
    reached: dict[tuple, float] = {}  # a receive -> when its rank reached it (a rendezvous send completes then)
    unmatched: dict[int, list[tuple]] = {r: [] for r in plan_schedules}  # each rank's sends not yet received
    out: list[Interval] = []
    barrier_arrivals: dict[tuple[str, int], dict[int, float]] = {}
    posted: dict[tuple[int, int], SyncPost] = {}  # (rank, sync group) -> its post, priced at the wait
    collectives = (SyncPost, SyncWait, BatchSync, GradSync)
    while any(pc[r] < len(plan_schedules[r]) or r in held for r in plan_schedules):
        progressed = False
        for r, instrs in plan_schedules.items():
            while pc[r] < len(instrs) or r in held:
                if r in held:
                    if not _released(r, held, reached, clock):
                        break
                    progressed = True
                    continue
                ins = instrs[pc[r]]
                if rendezvous and isinstance(ins, collectives) and unmatched[r]:
                    if any(k not in reached for k in unmatched[r]):
                        break  # a send of this rank still waits for its receiver
                    clock[r] = max([clock[r], *(reached[k] for k in unmatched[r])])
                    unmatched[r] = []
                if isinstance(ins, SyncPost):
                    barrier_arrivals.setdefault(("SyncPost", ins.sync_group), {}).setdefault(r, clock[r])
                    posted[r, ins.sync_group] = ins
                    pc[r] += 1
                    progressed = True
                    continue
                if isinstance(ins, SyncWait):
                    members = ins.ranks or tuple(plan_schedules)
                    arrivals = barrier_arrivals.setdefault(("SyncWait", ins.sync_group), {})
                    arrivals.setdefault(r, clock[r])
                    posts = barrier_arrivals.get(("SyncPost", ins.sync_group), {})
                    if len(posts) < len(members) or len(arrivals) < len(members):
                        break  # the gather needs every post; the all-reduce every rank's wait
                    post = posted.pop((r, ins.sync_group))
                    gathered = max(posts.values())
                    done = gathered + duration(r, post)
                    out.append(Interval(r, post, gathered, done))
                    start = max(max(arrivals.values()), done)
                    end = start + duration(r, ins)
                elif isinstance(ins, (BatchSync, GradSync)):
                    key = (type(ins).__name__, getattr(ins, "sync_group", 0))
                    arrivals = barrier_arrivals.setdefault(key, {})
                    arrivals.setdefault(r, clock[r])
                    members = ins.ranks if isinstance(ins, BatchSync) and ins.ranks else tuple(plan_schedules)
                    if len(arrivals) < len(members):
                        break
                    start = max(arrivals.values())
                    end = start + duration(r, ins)
                else:
                    direction = "act" if isinstance(ins, Forward) else "grad"
                    start = clock[r]
                    if ins.recv_from is not None:
                        key = (direction, ins.tower, ins.mb, ins.recv_from, r)
                        reached.setdefault(key, clock[r])
                        if key not in sent:
                            break
                        start = max(start, sent[key] + (link(ins) if callable(link) else link))
                    end = start + duration(r, ins)
                    if ins.send_to is not None:
                        key = (direction, ins.tower, ins.mb, r, ins.send_to)
                        sent[key] = end
                        unmatched[r].append(key)
                        if blocking_sends:
                            held[r] = key
                out.append(Interval(r, ins, start, end))
                clock[r] = end
                pc[r] += 1
                progressed = True
        if not progressed:
            blocked = {
                r: f"its send {held[r]}" if r in held else plan_schedules[r][pc[r]]
                for r in plan_schedules
                if pc[r] < len(plan_schedules[r]) or r in held
            }
            raise RuntimeError(f"the schedule deadlocks: each blocked rank and the instruction it waits at: {blocked}")
    return out


def _released(rank: int, held: dict[int, tuple], reached: Mapping[tuple, float], clock: dict[int, float]) -> bool:
    """``blocking_sends``: whether ``rank``'s held send has met its receiver; if so the rank goes on
    from when the receiver got there."""
    if held[rank] not in reached:
        return False
    clock[rank] = max(clock[rank], reached[held.pop(rank)])
    return True


def bubble_fraction(intervals: Sequence[Interval]) -> float:
    """Idle share of the ranks' time over the step (compute and sync intervals count as busy; an
    asynchronous gather in flight does not: the rank computes beside it)."""
    if not intervals:
        return 0.0
    span = max(i.end for i in intervals) - min(i.start for i in intervals)
    ranks = {i.rank for i in intervals}
    busy = sum(i.end - i.start for i in intervals if not isinstance(i.instruction, SyncPost))
    return max(0.0, 1.0 - busy / (span * len(ranks))) if span > 0 else 0.0


def simulate_handoff(
    lists: Mapping[int, Sequence],
    duration: Callable[[int, object], float],
    link: float | Callable[[object], float] = 0.0,
    dp_groups: Mapping[str, Sequence[int]] | None = None,
    blocking_sends: bool = False,
) -> list[Interval]:
    """Replay every rank's handoff list (:func:`handoff_schedule`); return each instruction's interval.

    A ``RecvTokens`` / ``RecvTokenGrads`` waits for its send (plus ``link`` seconds, a number or a
    function of the receiving instruction); sends complete without their receiver (gloo, as
    :func:`simulate` prices by default). A consumer's first
    ``TokenLoss`` (microbatch 0) waits for every rank of its data-parallel group's last stage
    (``dp_groups[tower]``; the step's target count is all-reduced there), ``GradSync`` for every
    rank. ``blocking_sends``: a send to another rank holds its rank until the receiver has reached
    the receive (as :func:`simulate`). Raises ``RuntimeError`` naming what every blocked rank waits
    for when the lists deadlock.
    """
    clock = {r: 0.0 for r in lists}
    pc = {r: 0 for r in lists}
    sent: dict[tuple, float] = {}
    reached: dict[tuple, float] = {}
    held: dict[int, tuple] = {}
    arrivals: dict[tuple, dict[int, float]] = {}
    out: list[Interval] = []
    while any(pc[r] < len(lists[r]) or r in held for r in lists):
        progressed = False
        for r, instrs in lists.items():
            while pc[r] < len(instrs) or r in held:
                if r in held:
                    if not _released(r, held, reached, clock):
                        break
                    progressed = True
                    continue
                ins = instrs[pc[r]]
                start = clock[r]
                if isinstance(ins, (RecvTokens, RecvTokenGrads)):
                    key = ("tokens", ins.route, r) if isinstance(ins, RecvTokens) else ("grads", ins.route, r)
                    reached.setdefault(key, clock[r])
                    if key not in sent:
                        break
                    start = max(start, sent[key] + (link(ins) if callable(link) else link))
                elif isinstance(ins, GradSync) or (isinstance(ins, TokenLoss) and ins.mb == 0):
                    # the target count's all-reduce runs at each consumer rank's first TokenLoss
                    members = (
                        tuple(lists) if isinstance(ins, GradSync) else tuple((dp_groups or {}).get(ins.tower, (r,)))
                    )
                    key = (type(ins).__name__, getattr(ins, "tower", ""))
                    arrivals.setdefault(key, {}).setdefault(r, clock[r])
                    if len(arrivals[key]) < len(members):
                        break
                    start = max(clock[r], *arrivals[key].values())
                elif isinstance(ins, (Forward, Backward)) and ins.recv_from is not None:
                    key = (type(ins).__name__, ins.tower, ins.mb, ins.recv_from, r)
                    reached.setdefault(key, clock[r])
                    if key not in sent:
                        break
                    start = max(start, sent[key] + (link(ins) if callable(link) else link))
                end = start + duration(r, ins)
                out_key: tuple | None = None
                if isinstance(ins, (Forward, Backward)) and ins.send_to is not None:
                    out_key = (type(ins).__name__, ins.tower, ins.mb, r, ins.send_to)
                elif isinstance(ins, SendTokens):
                    out_key = ("tokens", ins.route, ins.route.dst)
                elif isinstance(ins, SendTokenGrads):
                    out_key = ("grads", ins.route, ins.peer)
                if out_key is not None:
                    sent[out_key] = end
                    if blocking_sends and out_key[-1] != r:
                        held[r] = out_key
                out.append(Interval(r, ins, start, end))
                clock[r] = end
                pc[r] += 1
                progressed = True
        if not progressed:
            blocked = {
                r: f"its send {held[r]}" if r in held else lists[r][pc[r]]
                for r in lists
                if pc[r] < len(lists[r]) or r in held
            }
            raise RuntimeError(
                f"the handoff schedule deadlocks: each blocked rank and the instruction it waits at: {blocked}"
            )
    return out
