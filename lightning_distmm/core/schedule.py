"""The schedule is data: per rank, the list of instructions of one training step.

One generator per schedule emits, for every rank, what it does in order: forward a microbatch
through its stage of a tower (receiving the input from the previous stage, sending the output to
the next), the batch-sync, backward a microbatch (receiving the output gradient, sending the
input gradient), the gradient sums. The runtime's executor runs this list
(``lightning_distmm.parallel.runtime``), :func:`simulate` turns the same lists into a timeline
(and a bubble fraction), and :func:`timeline_svg` draws it: one source of truth.

Pure Python: no process groups.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lightning_distmm.core.plan import Plan


@dataclass(frozen=True)
class Forward:
    """Microbatch ``mb`` of ``tower`` through this rank's stage; ``keep``: keep activations for backward.

    ``mb`` numbers the rank's microbatches of the tower across the step (rows in that order);
    ``sync_group`` is the sync group (the rows that meet at one batch-sync) the microbatch belongs to.
    """

    tower: str
    mb: int
    rows: int
    recv_from: int | None
    send_to: int | None
    keep: bool
    sync_group: int = 0


@dataclass(frozen=True)
class BatchSync:
    """Sync group ``sync_group``'s features of every tower meet on ``ranks`` (the last stages): gather, the
    interaction loss forward and backward on that sync group, the feature gradient split."""

    sync_group: int = 0
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Backward:
    """Microbatch ``mb`` of ``tower`` backward through this stage (``recompute``: rerun its forward first)."""

    tower: str
    mb: int
    rows: int
    recv_from: int | None
    send_to: int | None
    recompute: bool
    sync_group: int = 0


@dataclass(frozen=True)
class GradSync:
    """Gradient sums over data-parallel peers (and of the interaction parameters over all ranks)."""


Instruction = Forward | BatchSync | Backward | GradSync


def microbatch_sizes(rows: int, microbatch: int | None) -> list[int]:
    if microbatch is None or microbatch >= rows:
        return [rows]
    return [min(microbatch, rows - a) for a in range(0, rows, microbatch)]


def stage_neighbours(plan: Plan, tower: str, rank: int) -> tuple[int, int, int | None, int | None]:
    """(replica, stage, previous stage's rank, next stage's rank) of ``rank`` in ``tower``."""
    t = plan.towers[tower]
    replica = t.replica_of(rank)
    assert replica is not None
    ranks = t.replica_ranks(replica)
    pos = ranks.index(rank)
    stage, tp = divmod(pos, t.tp)
    prev = ranks[(stage - 1) * t.tp + tp] if stage > 0 else None
    nxt = ranks[(stage + 1) * t.tp + tp] if stage < t.pp - 1 else None
    return replica, stage, prev, nxt


def sync_ranks(plan: Plan) -> tuple[int, ...]:
    """The ranks that take part in the batch-sync: every rank of every tower's last pipeline stage."""
    out: set[int] = set()
    for t in plan.towers.values():
        for replica in range(t.dp):
            out.update(t.replica_ranks(replica)[(t.pp - 1) * t.tp :])
    return tuple(sorted(out))


def rank_schedule(plan: Plan, rank: int, n: int) -> list[Instruction]:
    """What ``rank`` does in one step on a global batch of ``n``.

    ``gpipe`` and ``cached`` have one wave: every forward (towers in the plan's order, microbatches
    in order), the batch-sync (last stages only), the backwards of last stages, then of the other
    stages. ``distmm`` has two waves, each its own sync group: wave 0's forwards, its batch-sync,
    then wave 1's forwards interleaved one for one with wave 0's backwards as in 1F1B (stage
    ``s`` of ``p`` first runs ``p - 1 - s`` of wave 1's forwards, the last stage none, then one
    backward and one forward per slot, so that no gradient waits for a forward round trip through
    the pipeline), wave 1's batch-sync and backwards. So a stage holds one wave's activations plus
    ``p - 1 - s`` microbatches, not the whole replica batch, and while the last stages meet at wave 0's batch-sync the earlier stages
    run wave 1's forwards. Sends do not block (the runtime posts them and waits at the end of the
    step); receives and syncs do; ``tests/test_schedule.py`` simulates random plans to check that
    these lists never deadlock.
    """
    waves = plan.group_split(n)
    participants = sync_ranks(plan)
    forwards: list[dict[str, list[Instruction]]] = [{} for _ in waves]
    backwards: list[dict[str, list[Instruction]]] = [{} for _ in waves]
    ahead: dict[str, int] = {}  # wave-(w+1) forwards a stage runs before its first wave-w backward
    for name, t in plan.towers.items():
        if rank not in t.ranks:
            continue
        replica, stage, prev, nxt = stage_neighbours(plan, name, rank)
        ahead[name] = t.pp - 1 - stage  # 1F1B warm-up: one per later stage (none on the last)
        cached = t.schedule == "cached"
        mb = 0
        for w, wave_rows in enumerate(waves):
            fw, bw = forwards[w].setdefault(name, []), backwards[w].setdefault(name, [])
            for rows in microbatch_sizes(t.split(wave_rows)[replica], t.microbatch):
                fw.append(Forward(name, mb, rows, prev, nxt, keep=not cached, sync_group=w))
                bw.append(Backward(name, mb, rows, nxt, prev, recompute=cached, sync_group=w))
                mb += 1
    out: list[Instruction] = [i for ins in forwards[0].values() for i in ins]
    for w in range(len(waves)):
        if rank in participants:
            out.append(BatchSync(w, participants))
        if w + 1 == len(waves):
            # last stages first: their backwards need nothing but the batch-sync
            out.extend(i for name in ahead if ahead[name] == 0 for i in backwards[w][name])
            out.extend(i for name in ahead if ahead[name] > 0 for i in backwards[w][name])
            break
        # per tower: the next wave's first forwards, then backward / forward pairs (1F1B)
        slots = {name: _one_f_one_b(forwards[w + 1][name], backwards[w][name], ahead[name]) for name in ahead}
        for k in range(max(len(v) for v in slots.values())):
            for name in ahead:
                out.extend(slots[name][k] if k < len(slots[name]) else [])
    out.append(GradSync())
    return out


def _one_f_one_b(forwards: list[Instruction], backwards: list[Instruction], ahead: int) -> list[list[Instruction]]:
    """Slots of one stage between two waves: ``ahead`` forwards of the next wave, then one backward
    of this wave and one forward of the next per slot, then what is left of either."""
    ahead = min(ahead, len(forwards))
    slots = [[f] for f in forwards[:ahead]]
    rest = forwards[ahead:]
    for k in range(max(len(backwards), len(rest))):
        slots.append(backwards[k : k + 1] + rest[k : k + 1])
    return slots


def schedules(plan: Plan, n: int) -> dict[int, list[Instruction]]:
    return {rank: rank_schedule(plan, rank, n) for rank in range(plan.world_size)}


# ---------------------------------------------------------------------- simulation
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
) -> list[Interval]:
    """Play every rank's list: a receive waits for its send (plus ``link`` seconds), a batch-sync
    waits for its ranks, the gradient sync for every rank. Returns each instruction's interval.

    ``link``: seconds from a send to its receive, a number or a function of the receiving
    instruction (a ``Forward`` receives the microbatch's activations, a ``Backward`` its gradient).
    """
    clock = {r: 0.0 for r in plan_schedules}
    pc = {r: 0 for r in plan_schedules}
    sent: dict[tuple, float] = {}
    out: list[Interval] = []
    barrier_arrivals: dict[tuple[str, int], dict[int, float]] = {}
    while any(pc[r] < len(plan_schedules[r]) for r in plan_schedules):
        progressed = False
        for r, instrs in plan_schedules.items():
            while pc[r] < len(instrs):
                ins = instrs[pc[r]]
                if isinstance(ins, (BatchSync, GradSync)):
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
                        if key not in sent:
                            break
                        start = max(start, sent[key] + (link(ins) if callable(link) else link))
                    end = start + duration(r, ins)
                    if ins.send_to is not None:
                        sent[(direction, ins.tower, ins.mb, r, ins.send_to)] = end
                out.append(Interval(r, ins, start, end))
                clock[r] = end
                pc[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocks: a receive has no matching send")
    return out


def bubble_fraction(intervals: Sequence[Interval]) -> float:
    """Idle share of the ranks' time over the step (compute and sync intervals count as busy)."""
    if not intervals:
        return 0.0
    span = max(i.end for i in intervals) - min(i.start for i in intervals)
    ranks = {i.rank for i in intervals}
    busy = sum(i.end - i.start for i in intervals)
    return max(0.0, 1.0 - busy / (span * len(ranks))) if span > 0 else 0.0


_COLOURS = {"Forward": "#4C9BE8", "Backward": "#E8894C", "BatchSync": "#6BBF59", "GradSync": "#9B59B6"}


def timeline_svg(intervals: Sequence[Interval], title: str = "", width: int = 900, row: int = 28) -> str:
    """A timeline picture (SVG): one row per rank, one box per instruction, labelled tower/microbatch."""
    ranks = sorted({i.rank for i in intervals})
    span = max(i.end for i in intervals) or 1.0
    left, top = 70, 30
    scale = (width - left - 10) / span
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + row * len(ranks) + 30}" font-family="sans-serif" font-size="10">',
        f'<text x="{left}" y="18" font-size="13">{title}</text>',
    ]
    for idx, r in enumerate(ranks):
        y = top + idx * row
        parts.append(f'<text x="4" y="{y + row / 2 + 4}">rank {r}</text>')
    for i in intervals:
        y = top + ranks.index(i.rank) * row
        kind = type(i.instruction).__name__
        x, w = left + i.start * scale, max((i.end - i.start) * scale, 1.0)
        label = ""
        if isinstance(i.instruction, (Forward, Backward)):
            label = f"{i.instruction.tower[0]}{i.instruction.mb}" + (
                "r" if getattr(i.instruction, "recompute", False) else ""
            )
        elif isinstance(i.instruction, BatchSync):
            label = f"S{i.instruction.sync_group}"
        parts.append(
            f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" fill="{_COLOURS[kind]}" stroke="white"/>'
        )
        if label and w > 14:
            parts.append(f'<text x="{x + 2:.1f}" y="{y + row / 2 + 4}" fill="white">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
