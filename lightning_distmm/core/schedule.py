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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

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
class SyncPost:
    """The first half of an asynchronous batch-sync: post the all-gather of sync group ``sync_group``'s
    features over ``ranks`` and go on; the gather is in flight until the matching :class:`SyncWait`."""

    sync_group: int = 0
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class SyncWait:
    """The second half: wait for the gather posted by :class:`SyncPost`, then the interaction loss
    forward and backward on that sync group and the feature gradient split (as in :class:`BatchSync`)."""

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


Instruction = Forward | BatchSync | SyncPost | SyncWait | Backward | GradSync


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
    stage, inner = divmod(pos, t.stage_width)  # inner: the (cp, tp) coordinate, kept from stage to stage
    prev = ranks[(stage - 1) * t.stage_width + inner] if stage > 0 else None
    nxt = ranks[(stage + 1) * t.stage_width + inner] if stage < t.pp - 1 else None
    return replica, stage, prev, nxt


def sync_ranks(plan: Plan) -> tuple[int, ...]:
    """The ranks that take part in the batch-sync: every rank of every tower's last pipeline stage."""
    out: set[int] = set()
    for t in plan.towers.values():
        for replica in range(t.dp):
            out.update(t.replica_ranks(replica)[(t.pp - 1) * t.stage_width :])
    return tuple(sorted(out))


def rank_schedule(plan: Plan, rank: int, n: int, overlap: bool = False) -> list[Instruction]:
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
    these lists never deadlock, also where a send waits for its receive (NCCL).

    ``overlap`` (``distmm`` only; the runtime's lists): every batch-sync but the last is split into
    :class:`SyncPost` (the features' all-gather posted where the batch-sync was) and
    :class:`SyncWait` (right after the first slot of the next wave: one forward per local tower,
    so that no rank waits before its own ``SyncWait`` for a message another rank sends after its
    ``SyncWait``, an all-reduce over every batch-sync rank), and every stage
    runs one more of the next wave's forwards ahead (``p - s``: the last stage one, during the
    gather), as if the gather were one more stage after the last. The last batch-sync stays
    blocking: nothing of the step is left to run beside it.
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
        if overlap and len(waves) > 1:
            ahead[name] += 1  # the in-flight gather counts as one more stage
        cached = t.schedule == "cached"
        mb = 0
        for w, wave_rows in enumerate(waves):
            fw, bw = forwards[w].setdefault(name, []), backwards[w].setdefault(name, [])
            for rows in microbatch_sizes(t.split(wave_rows)[replica], t.microbatch):
                fw.append(Forward(name, mb, rows, prev, nxt, keep=not cached, sync_group=w))
                bw.append(Backward(name, mb, rows, nxt, prev, recompute=cached, sync_group=w))
                mb += 1
    split = overlap and len(waves) > 1
    last_stage = {name for name in ahead if ahead[name] == int(split)}  # towers whose backward starts at the sync
    out: list[Instruction] = [i for ins in forwards[0].values() for i in ins]
    for w in range(len(waves)):
        sync = rank in participants
        if w + 1 == len(waves):
            if sync:
                out.append(BatchSync(w, participants))
            # last stages first: their backwards need nothing but the batch-sync
            out.extend(i for name in ahead if name in last_stage for i in backwards[w][name])
            out.extend(i for name in ahead if name not in last_stage for i in backwards[w][name])
            break
        waiting = sync and split
        if sync:
            out.append(SyncPost(w, participants) if split else BatchSync(w, participants))
        # per tower: the next wave's first forwards, then backward / forward pairs (1F1B)
        slots = {name: _one_f_one_b(forwards[w + 1][name], backwards[w][name], ahead[name]) for name in ahead}
        for k in range(max(len(v) for v in slots.values())):
            for name in ahead:
                for i in slots[name][k] if k < len(slots[name]) else []:
                    if waiting and (k > 0 or not isinstance(i, Forward)):
                        # the wait follows the first slot's forwards of every tower and precedes all else:
                        # every rank's first-slot forwards feed only first-slot forwards, so no rank
                        # waits here for a message another rank sends after its own wait
                        out.append(SyncWait(w, participants))
                        waiting = False
                    out.append(i)
        if waiting:
            out.append(SyncWait(w, participants))
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


def schedules(plan: Plan, n: int, overlap: bool = False) -> dict[int, list[Instruction]]:
    return {rank: rank_schedule(plan, rank, n, overlap) for rank in range(plan.world_size)}


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
    rendezvous: bool = False,
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
    Raises ``RuntimeError`` naming what every blocked rank waits for when the lists deadlock.
    """
    clock = {r: 0.0 for r in plan_schedules}
    pc = {r: 0 for r in plan_schedules}
    sent: dict[tuple, float] = {}
    reached: dict[tuple, float] = {}  # a receive -> when its rank reached it (a rendezvous send completes then)
    unmatched: dict[int, list[tuple]] = {r: [] for r in plan_schedules}  # each rank's sends not yet received
    out: list[Interval] = []
    barrier_arrivals: dict[tuple[str, int], dict[int, float]] = {}
    posted: dict[tuple[int, int], SyncPost] = {}  # (rank, sync group) -> its post, priced at the wait
    collectives = (SyncPost, SyncWait, BatchSync, GradSync)
    while any(pc[r] < len(plan_schedules[r]) for r in plan_schedules):
        progressed = False
        for r, instrs in plan_schedules.items():
            while pc[r] < len(instrs):
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
                out.append(Interval(r, ins, start, end))
                clock[r] = end
                pc[r] += 1
                progressed = True
        if not progressed:
            blocked = {r: plan_schedules[r][pc[r]] for r in plan_schedules if pc[r] < len(plan_schedules[r])}
            raise RuntimeError(f"the schedule deadlocks: each blocked rank and the instruction it waits at: {blocked}")
    return out


def bubble_fraction(intervals: Sequence[Interval]) -> float:
    """Idle share of the ranks' time over the step (compute and sync intervals count as busy; an
    asynchronous gather in flight does not: the rank computes beside it)."""
    if not intervals:
        return 0.0
    span = max(i.end for i in intervals) - min(i.start for i in intervals)
    ranks = {i.rank for i in intervals}
    busy = sum(i.end - i.start for i in intervals if not isinstance(i.instruction, SyncPost))
    return max(0.0, 1.0 - busy / (span * len(ranks))) if span > 0 else 0.0


# instruction kind (a backward that recomputes its forward is its own kind) -> colour, legend text
KINDS: dict[str, tuple[str, str]] = {
    "Forward": ("#4C9BE8", "forward: a microbatch through the stage"),
    "Backward": ("#E8894C", "backward"),
    "Backward+recompute": ("#C0504D", "backward, recomputing the forward first"),
    "BatchSync": ("#6BBF59", "batch-sync: features meet, loss, feature gradients"),
    "GradSync": ("#9B59B6", "gradient sync: sums over the replicas"),
    "SyncPost": ("#B5DFAA", "batch-sync gather in flight (posted, not waited for)"),
    "SyncWait": ("#3E8E2F", "batch-sync wait: loss, feature gradients"),
    # a tower consuming another's output (core/handoff.py, docs/mllm.md)
    "SendTokens": ("#F2C14E", "image tokens sent to the LLM replica owning the rows"),
    "RecvTokens": ("#D9A21B", "image tokens received"),
    "TokenLoss": ("#6BBF59", "per-token loss over the global target count"),
    "SendTokenGrads": ("#8FD3D9", "the tokens' gradient sent back"),
    "RecvTokenGrads": ("#3A9EA5", "the tokens' gradient received"),
}
_IDLE = ("#ECECEC", "idle: waiting for a stage, a peer or a sync")


def instruction_kind(ins: Instruction) -> str:
    """The kind a timeline colours ``ins`` by: its type's name, ``Backward+recompute`` for a
    backward that reruns its forward."""
    if isinstance(ins, Backward) and ins.recompute:
        return "Backward+recompute"
    return type(ins).__name__


def nice_ticks(span: float, target: int = 8) -> list[float]:
    """Ticks from 0 to ``span`` at a round spacing (1, 2, 2.5 or 5 times a power of ten), about
    ``target`` of them."""
    if span <= 0:
        return [0.0]
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    return [round(k * step, 12) for k in range(int(span / step * (1 + 1e-9)) + 1)]


def timeline_svg(
    intervals: Sequence[Interval], title: str = "", width: int = 900, row: int = 28, note: str = ""
) -> str:
    """A timeline picture (SVG) of a simulated step: one row per rank, one box per instruction
    (labelled tower initial and microbatch: ``i3`` is the image tower's microbatch 3, ``r`` when the
    backward recomputes, ``S0`` sync group 0's batch-sync), grey where the rank idles; a time axis
    in ms (the durations are seconds) and a legend of the kinds drawn; ``note`` a line under it."""
    ranks = sorted({i.rank for i in intervals})
    span = max((i.end for i in intervals), default=0.0) or 1.0
    left, top, right = 70, 30, 20
    scale = (width - left - right) / span
    axis_y = top + row * len(ranks) + 4
    kinds = [k for k in KINDS if any(instruction_kind(i.instruction) == k for i in intervals)]
    per_line = max(1, (width - left) // 290)
    legend_y = axis_y + 44
    legend_rows = (len(kinds) + 1 + per_line - 1) // per_line
    towers = sorted({i.instruction.tower for i in intervals if isinstance(i.instruction, (Forward, Backward))})
    labels = ", ".join(f"{t[0]}: {t}" for t in towers)
    labels = f"box labels: {labels}, then the microbatch (r: recomputes); S0: sync group 0's batch-sync"
    below = [labels, *([note] if note else [])]
    height = legend_y + 18 * (legend_rows + len(below)) + 6
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="10">',
        f'<text class="title" x="{left}" y="18" font-size="13">{escape(title)}</text>',
    ]
    for idx, r in enumerate(ranks):
        y = top + idx * row
        parts.append(f'<text x="4" y="{y + row / 2 + 4}">rank {r}</text>')
        parts.append(
            f'<rect class="idle" x="{left}" y="{y + 3}" width="{span * scale:.1f}" height="{row - 6}" fill="{_IDLE[0]}"/>'
        )
    for i in intervals:
        y = top + ranks.index(i.rank) * row
        ins = i.instruction
        kind = instruction_kind(ins)
        x, w = left + i.start * scale, max((i.end - i.start) * scale, 1.0)
        box_y, box_h = y + 3, row - 6
        if isinstance(ins, SyncPost):  # in flight beside the rank's compute: a thin bar under it
            box_y, box_h = y + row - 7, 4
        label, what = "", kind
        if isinstance(ins, (Forward, Backward)):
            label = f"{ins.tower[0]}{ins.mb}" + ("r" if isinstance(ins, Backward) and ins.recompute else "")
            what = f"{ins.tower} {kind.lower()} microbatch {ins.mb} ({ins.rows} rows)"
        elif isinstance(ins, BatchSync):
            label, what = f"S{ins.sync_group}", f"batch-sync of sync group {ins.sync_group}"
        elif isinstance(ins, SyncWait):
            label, what = f"W{ins.sync_group}", f"batch-sync wait of sync group {ins.sync_group}"
        elif isinstance(ins, SyncPost):
            what = f"gather of sync group {ins.sync_group} in flight"
        parts.append(
            f'<rect class="box" data-kind="{kind}" x="{x:.1f}" y="{box_y}" width="{w:.1f}" height="{box_h}"'
            f' fill="{KINDS[kind][0]}" stroke="white"><title>{escape(what)}: {i.start * 1e3:.3g}-{i.end * 1e3:.3g} ms</title></rect>'
        )
        if label and w > 14:
            parts.append(f'<text x="{x + 2:.1f}" y="{y + row / 2 + 4}" fill="white">{label}</text>')
    parts.append(
        f'<g class="axis"><line x1="{left}" y1="{axis_y}" x2="{left + span * scale:.1f}" y2="{axis_y}" stroke="black"/>'
    )
    for t in nice_ticks(span * 1e3):
        x = left + t / 1e3 * scale
        parts.append(
            f'<line class="tick" data-ms="{t:g}" x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 5}" stroke="black"/>'
            f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle">{t:g}</text>'
        )
    parts.append(f'<text x="{left + span * scale / 2:.1f}" y="{axis_y + 30}" text-anchor="middle">time (ms)</text></g>')
    parts.append('<g class="legend">')
    entries = [(k, *KINDS[k]) for k in kinds] + [("idle", *_IDLE)]
    for n, (kind, colour, text) in enumerate(entries):
        x, y = left + (n % per_line) * 290, legend_y + (n // per_line) * 18
        parts.append(
            f'<g class="legend-item" data-kind="{kind}"><rect x="{x}" y="{y - 9}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{x + 16}" y="{y + 1}">{escape(text)}</text></g>'
        )
    parts.append("</g>")
    for n, line in enumerate(below):
        css = "labels" if n == 0 else "note"
        parts.append(
            f'<text class="{css}" x="{left}" y="{legend_y + 18 * (legend_rows + n) + 4}">{escape(line)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)
