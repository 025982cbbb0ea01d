"""Towers that consume other towers' outputs (a vision encoder feeding a language model): which rank
sends which rows where, and each rank's instruction list of one step (docs/vlm.md).

Every tower splits the global batch over its replicas by the step's row assignment (the plan's
own split by default, :mod:`lightning_distmm.core.assignment`), as
:class:`~lightning_distmm.core.layout.RankLayout` does; rows are step positions, so the rows of a
replica are contiguous whatever the assignment. The rows a producer replica computed and a
consumer replica owns go from the producer's feature rank to the consumer replica's first stage,
and their gradient comes back. Computed from the plan alone: every rank agrees without talking.

Pure Python: no torch, no process groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_distmm.core.assignment import RowAssignment
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import Backward, Forward, GradSync, microbatch_sizes, stage_neighbours


@dataclass(frozen=True)
class Route:
    """Global rows ``[start, stop)``: computed by ``producer``'s replica on ``src``, owned by ``consumer``'s replica on ``dst``."""

    producer: str
    consumer: str
    start: int
    stop: int
    src: int
    dst: int
    src_offset: int  # the first global row of the producer's microbatch ``src_mb``
    dst_offset: int  # the first global row of the consumer's microbatch ``dst_mb``
    returns: bool = True  # the gradient goes back from this dst (one tensor-parallel rank of the replica)
    src_mb: int = 0  # the producer replica's microbatch that computed the rows
    dst_mb: int = 0  # the consumer replica's microbatch that reads them
    #: every rank of the producer's last stage (its tensor-parallel ranks, ``src`` first): each needs the gradient
    src_ranks: tuple[int, ...] = ()

    @property
    def grad_ranks(self) -> tuple[int, ...]:
        return self.src_ranks or (self.src,)


@dataclass(frozen=True)
class SendTokens:
    """Post the send of ``route``'s rows of the producer's output to the consumer (non-blocking)."""

    route: Route


@dataclass(frozen=True)
class RecvTokens:
    """Receive ``route``'s rows of the producer's output: a leaf of the consumer's forward."""

    route: Route


@dataclass(frozen=True)
class TokenLoss:
    """The consumer's per-token loss on its rows over the global target count; loss forward and
    backward give the output gradient its ``Backward`` starts from."""

    tower: str
    mb: int = 0


@dataclass(frozen=True)
class SendTokenGrads:
    """Post the send of the gradient of ``route``'s received rows back to ``to``, a rank of the
    producer's last stage (each of its tensor-parallel ranks gets it)."""

    route: Route
    to: int = -1

    @property
    def peer(self) -> int:
        return self.route.src if self.to < 0 else self.to


@dataclass(frozen=True)
class RecvTokenGrads:
    """Receive the gradient of ``route``'s rows of this rank's producer output (from ``route.dst``)."""

    route: Route


HandoffInstruction = SendTokens | RecvTokens | TokenLoss | SendTokenGrads | RecvTokenGrads


def _microbatches(plan: Plan, name: str, assignment: RowAssignment) -> list[list[tuple[int, int]]]:
    """Per replica of tower ``name``: the step positions ``[start, stop)`` of each of its microbatches."""
    out, start = [], 0
    t = plan.towers[name]
    for rows in assignment.sizes[name][0]:
        mbs = []
        for size in microbatch_sizes(rows, t.microbatch):
            mbs.append((start, start + size))
            start += size
        out.append(mbs)
    return out


def check_handoff_plan(plan: Plan, consumes: Mapping[str, Sequence[str]]) -> None:
    """What the handoff runtime supports so far (docs/vlm.md says what is next); the runtime checks
    it when it is built, on every rank, so a plan it cannot run stops every rank before a step."""
    if plan.sync_groups != 1:
        raise ValueError(
            "a model whose towers consume each other's outputs has no batch-sync: use schedule 'gpipe' (one"
            " sync group), not 'distmm'"
        )
    for consumer, producers in consumes.items():
        for p in producers:
            if p not in plan.towers or consumer not in plan.towers:
                raise ValueError(f"tower {consumer!r} consumes {p!r}: both must be in the plan")


def routes(
    plan: Plan, consumes: Mapping[str, Sequence[str]], n: int, assignment: RowAssignment | None = None
) -> list[Route]:
    """Every transfer of a global batch of ``n`` (rows assigned by ``assignment``, default the plan's
    split): the rows a producer replica's microbatch computed that a consumer replica's microbatch
    reads, in a fixed order (by consumer replica and microbatch)."""
    a = assignment if assignment is not None else RowAssignment.even(plan, n)
    out: list[Route] = []
    for consumer, producers in consumes.items():
        ct, c_mbs = plan.towers[consumer], _microbatches(plan, consumer, a)
        for producer in producers:
            pt, p_mbs = plan.towers[producer], _microbatches(plan, producer, a)
            for r, cm in enumerate(c_mbs):
                for j, (ca, cb) in enumerate(cm):
                    for q, pm in enumerate(p_mbs):
                        for i, (pa, pb) in enumerate(pm):
                            start, stop = max(pa, ca), min(pb, cb)
                            if start >= stop:
                                continue
                            src = pt.feature_rank(q)  # to every tensor-parallel rank of the consumer's first stage
                            last = tuple(pt.replica_ranks(q)[(pt.pp - 1) * pt.tp :])
                            for k, dst in enumerate(ct.replica_ranks(r)[: ct.tp]):
                                out.append(Route(producer, consumer, start, stop, src, dst, pa, ca, k == 0, i, j, last))
    return out


def handoff_links(plan: Plan, consumes: Mapping[str, Sequence[str]]) -> list[tuple[str, int, int]]:
    """Every ``(kind, src, dst)`` that may carry a handoff message at any global batch, in one fixed
    order: ``tokens`` from a producer replica's feature rank to each rank of a consumer replica's first
    stage, ``grads`` from a consumer replica's first rank back to each rank of the producer replica's
    last stage; none from a rank to itself. The runtime gives each its own process group (NCCL runs a
    communicator's operations in order, so one pair's pending send must not hold up another's)."""
    out: list[tuple[str, int, int]] = []
    for consumer, producers in consumes.items():
        ct = plan.towers[consumer]
        firsts = [ct.replica_ranks(r)[: ct.tp] for r in range(ct.dp)]
        for producer in producers:
            pt = plan.towers[producer]
            for q in range(pt.dp):
                last = pt.replica_ranks(q)[(pt.pp - 1) * pt.tp :]
                for first in firsts:
                    out += [("tokens", pt.feature_rank(q), d) for d in first if d != pt.feature_rank(q)]
                    out += [("grads", first[0], s) for s in last if s != first[0]]
    return list(dict.fromkeys(out))


def handoff_schedule(
    plan: Plan,
    consumes: Mapping[str, Sequence[str]],
    order: Sequence[str],
    trains: Mapping[str, bool],
    rank: int,
    n: int,
    links: Sequence[Route] | None = None,
    assignment: RowAssignment | None = None,
) -> list:
    """``rank``'s instructions of one step: forwards in consumption ``order`` (a consumer receives its
    rows first, a producer sends them after its forward), then backwards in reverse (the consumer's
    loss, backward and the tokens' gradients sent back; a producer receives them before its
    backward), then the gradient sums. ``trains[tower]``: whether any of its parameters trains (a
    frozen producer gets no gradients back). Every receive's send comes earlier in its sender's
    list and sends never block, so the lists cannot deadlock. ``links``: :func:`routes` of the plan,
    when the caller builds every rank's list (computed once, not once per rank). ``assignment``: the
    step's rows (default: the plan's split)."""
    check_handoff_plan(plan, consumes)
    a = assignment if assignment is not None else RowAssignment.even(plan, n)
    every = routes(plan, consumes, n, a) if links is None else links
    links = [r for r in every if r.dst == rank or r.src == rank or rank in r.grad_ranks]
    consumers = set(consumes)
    local = [name for name in order if rank in plan.towers[name].ranks]
    sizes = {}
    for name in local:
        replica = plan.towers[name].replica_of(rank)
        assert replica is not None
        sizes[name] = microbatch_sizes(a.sizes[name][0][replica], plan.towers[name].microbatch)
    out: list = []
    for name in local:  # forwards: microbatch m's rows go out as soon as its forward ends
        _, _, prev, nxt = stage_neighbours(plan, name, rank)
        for mb, size in enumerate(sizes[name]):
            if name in consumers and prev is None:
                out.extend(RecvTokens(r) for r in links if r.consumer == name and r.dst == rank and r.dst_mb == mb)
            out.append(Forward(name, mb, size, prev, nxt, keep=True))
            out.extend(SendTokens(r) for r in links if r.producer == name and r.src == rank and r.src_mb == mb)
    for name in reversed(local):  # backwards: the consumer's first, each microbatch's gradient back at once
        _, _, prev, nxt = stage_neighbours(plan, name, rank)
        for mb, size in enumerate(sizes[name]):
            out.extend(
                RecvTokenGrads(r)
                for r in links
                if r.producer == name and rank in r.grad_ranks and r.src_mb == mb and trains[name] and r.returns
            )
            if name in consumers and nxt is None:  # the loss on the last stage
                out.append(TokenLoss(name, mb))
            out.append(Backward(name, mb, size, nxt, prev, recompute=False))
            if name in consumers and prev is None:
                out.extend(
                    SendTokenGrads(r, to)
                    for r in links
                    if r.consumer == name and r.dst == rank and r.dst_mb == mb and trains[r.producer] and r.returns
                    for to in r.grad_ranks
                )
    out.append(GradSync())
    return out


def handoff_schedules(
    plan: Plan, consumes: Mapping[str, Sequence[str]], order: Sequence[str], trains: Mapping[str, bool], n: int
) -> dict[int, list]:
    """Every rank's list (:func:`handoff_schedule`)."""
    links = routes(plan, consumes, n)
    return {rank: handoff_schedule(plan, consumes, order, trains, rank, n, links) for rank in range(plan.world_size)}
