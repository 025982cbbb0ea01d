"""The schedule is data: per rank, the list of instructions of one training step.

One generator per schedule emits, for every rank, what it does in order: forward a microbatch
through its stage of a tower (receiving the input from the previous stage, sending the output to
the next), the batch-sync, backward a microbatch (receiving the output gradient, sending the
input gradient), the gradient sums. The runtime's executor runs this list
(:mod:`lightning_distmm.parallel.step.engine`), the planner's simulator turns the same lists into a
timeline (:mod:`lightning_distmm.planner.cost.simulate`) and draws it
(:mod:`lightning_distmm.planner.pictures.timeline`): one source of truth.

Pure Python: no process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_distmm.core.assignment import RowAssignment
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


def rank_schedule(
    plan: Plan, rank: int, n: int, overlap: bool = False, assignment: RowAssignment | None = None
) -> list[Instruction]:
    """What ``rank`` does in one step on a global batch of ``n`` whose rows are assigned by
    ``assignment`` (default: the plan's own split).

    ``gpipe`` and ``cached`` have one sync group: every forward (towers in the plan's order, microbatches
    in order), the batch-sync (last stages only), the backwards of last stages, then of the other
    stages. ``distmm`` splits the batch into two sync groups, each with its own batch-sync: sync group 0's forwards, its batch-sync,
    then sync group 1's forwards interleaved one for one with sync group 0's backwards as in 1F1B (stage
    ``s`` of ``p`` first runs ``p - 1 - s`` of sync group 1's forwards, the last stage none, then one
    backward and one forward per slot, so that no gradient waits for a forward round trip through
    the pipeline), sync group 1's batch-sync and backwards. So a stage holds one sync group's activations plus
    ``p - 1 - s`` microbatches, not the whole replica batch, and while the last stages meet at sync group 0's batch-sync the earlier stages
    run sync group 1's forwards. Sends do not block (the runtime posts them and waits at the end of the
    step); receives and syncs do; ``tests/test_schedule.py`` simulates random plans to check that
    these lists never deadlock, also where a send waits for its receive (NCCL).

    ``overlap`` (``distmm`` only; the runtime's lists): every batch-sync but the last is split into
    :class:`SyncPost` (the features' all-gather posted where the batch-sync was) and
    :class:`SyncWait` (right after the first slot of the next sync group: one forward per local tower,
    so that no rank waits before its own ``SyncWait`` for a message another rank sends after its
    ``SyncWait``, an all-reduce over every batch-sync rank), and every stage
    runs one more of the next sync group's forwards ahead (``p - s``: the last stage one, during the
    gather), as if the gather were one more stage after the last. The last batch-sync stays
    blocking: nothing of the step is left to run beside it.
    """
    groups = plan.group_split(n)
    if assignment is None:
        assignment = RowAssignment.even(plan, n)
    participants = sync_ranks(plan)
    forwards: list[dict[str, list[Instruction]]] = [{} for _ in groups]
    backwards: list[dict[str, list[Instruction]]] = [{} for _ in groups]
    ahead: dict[str, int] = {}  # next group's forwards a stage runs before its first backward of group w
    for name, t in plan.towers.items():
        if rank not in t.ranks:
            continue
        replica, stage, prev, nxt = stage_neighbours(plan, name, rank)
        ahead[name] = t.pp - 1 - stage  # 1F1B warm-up: one per later stage (none on the last)
        if overlap and len(groups) > 1:
            ahead[name] += 1  # the in-flight gather counts as one more stage
        cached = t.schedule == "cached"
        mb = 0
        for w in range(len(groups)):
            fw, bw = forwards[w].setdefault(name, []), backwards[w].setdefault(name, [])
            for rows in microbatch_sizes(assignment.sizes[name][w][replica], t.microbatch):
                fw.append(Forward(name, mb, rows, prev, nxt, keep=not cached, sync_group=w))
                bw.append(Backward(name, mb, rows, nxt, prev, recompute=cached, sync_group=w))
                mb += 1
    split = overlap and len(groups) > 1
    last_stage = {name for name in ahead if ahead[name] == int(split)}  # towers whose backward starts at the sync
    out: list[Instruction] = [i for ins in forwards[0].values() for i in ins]
    for w in range(len(groups)):
        sync = rank in participants
        if w + 1 == len(groups):
            if sync:
                out.append(BatchSync(w, participants))
            # last stages first: their backwards need nothing but the batch-sync
            out.extend(i for name in ahead if name in last_stage for i in backwards[w][name])
            out.extend(i for name in ahead if name not in last_stage for i in backwards[w][name])
            break
        waiting = sync and split
        if sync:
            out.append(SyncPost(w, participants) if split else BatchSync(w, participants))
        # per tower: the next sync group's first forwards, then backward / forward pairs (1F1B)
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
    """Slots of one stage between two sync groups: ``ahead`` forwards of the next sync group, then one backward
    of this sync group and one forward of the next per slot, then what is left of either."""
    ahead = min(ahead, len(forwards))
    slots = [[f] for f in forwards[:ahead]]
    rest = forwards[ahead:]
    for k in range(max(len(backwards), len(rest))):
        slots.append(backwards[k : k + 1] + rest[k : k + 1])
    return slots


def schedules(plan: Plan, n: int, overlap: bool = False) -> dict[int, list[Instruction]]:
    return {rank: rank_schedule(plan, rank, n, overlap) for rank in range(plan.world_size)}


def overlaps_batch_sync(plan: Plan) -> bool:
    """Whether ``overlap_batch_sync`` changes anything under ``plan``: only schedule ``distmm`` has
    batch-syncs to overlap (one per sync group but the last)."""
    return any(t.schedule == "distmm" for t in plan.towers.values())
