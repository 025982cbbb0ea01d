"""Which rows of one global batch each tower replica computes: the step's row assignment.

A plan fixes how many rows each replica of a tower takes (:meth:`TowerPlan.split`), which is fair
only when every row costs the same. Multimodal rows do not: a sample carries 0 to 7 images, a
caption has its own length. :func:`balance_rows` assigns one step's rows by their cost instead.

The runtime works on the batch in *step order*: one permutation of the batch's rows shared by every
tower (``order[p]`` is the sample row at step position ``p``), each replica of each tower taking
a contiguous run of step positions of each sync group (``sizes[tower][group][replica]`` rows). One
order for every tower keeps every exchange contiguous (the batch-sync's gather, the handoff's
routes, a rank's loaded rows); the towers still balance separately through their own run lengths.
A sync group's positions hold the same sample rows in any order (the group's negatives are
unchanged), and the batch-sync puts the features back in sample order before the loss, so the
loss and its gradients are the one-process ones.

Pure Python: every rank computes the same assignment from the same costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_distmm.core.plan import Plan


class RowAssignment:
    """One step's rows: their ``order`` (None: sample order) and each replica's run of them.

    Not a dataclass on purpose: it rides in the batch dict, and Lightning's device transfer walks
    into dataclasses but leaves other objects as they are.
    """

    __slots__ = ("n", "order", "sizes", "_key", "_inverse")

    def __init__(self, n: int, order: Sequence[int] | None, sizes: Mapping[str, Sequence[Sequence[int]]]):
        self.n = int(n)
        self.order = tuple(order) if order is not None and list(order) != list(range(n)) else None
        self.sizes = {name: tuple(tuple(int(s) for s in g) for g in groups) for name, groups in sizes.items()}
        self._key = (self.n, self.order, tuple(sorted(self.sizes.items())))
        self._inverse: dict[int, list[int] | None] = {}

    @classmethod
    def even(cls, plan: Plan, n: int) -> RowAssignment:
        """The plan's own split, in sample order (what every step ran before balancing)."""
        return cls(n, None, {name: [t.split(g) for g in plan.group_split(n)] for name, t in plan.towers.items()})

    # ------------------------------------------------------------------ queries
    def offsets(self, tower: str, group: int) -> list[int]:
        """Start of each replica's run within sync group ``group`` (relative to the group), plus its end."""
        out = [0]
        for s in self.sizes[tower][group]:
            out.append(out[-1] + s)
        return out

    def rows(self, start: int, stop: int) -> tuple[int, ...]:
        """The sample rows at step positions ``[start, stop)``."""
        return tuple(range(start, stop)) if self.order is None else self.order[start:stop]

    def group_inverse(self, start: int, stop: int) -> list[int] | None:
        """For the sync group at step positions ``[start, stop)``: the step position (relative to
        ``start``) of each of the group's sample rows in sample order; None when they are in order."""
        if start not in self._inverse:
            if self.order is None or self.order[start:stop] == tuple(range(start, stop)):
                self._inverse[start] = None
            else:
                inv = [0] * (stop - start)
                for p, row in enumerate(self.order[start:stop]):
                    inv[row - start] = p
                self._inverse[start] = inv
        return self._inverse[start]

    @property
    def key(self) -> Any:
        """Everything a rank's batch depends on (a cache key)."""
        return self._key

    @property
    def sizes_key(self) -> Any:
        """Everything a schedule, a route or a gather's slots depend on: the run lengths, not the order."""
        return (self.n, self._key[2])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowAssignment) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RowAssignment, (self.n, self.order, self.sizes))

    def __repr__(self) -> str:
        order = "sample order" if self.order is None else f"order {list(self.order)}"
        return f"RowAssignment(n={self.n}, {order}, sizes={ {k: [list(g) for g in v] for k, v in self.sizes.items()} })"


# ---------------------------------------------------------------------- balancing
def count_fixed(plan: Plan, tower: str) -> bool:
    """A tower whose replicas must keep the plan's row counts: a sharded tower cut into microbatches
    (its replicas run one set of collectives per microbatch, so their microbatch counts must agree)."""
    t = plan.towers[tower]
    return t.sharded and t.microbatch is not None


def balance_rows(plan: Plan, n: int, costs: Mapping[str, Sequence[float]]) -> RowAssignment:
    """Assign a batch of ``n`` rows to every tower's replicas by the rows' ``costs`` (tower -> one
    number per sample row); towers without costs keep the plan's split.

    In each sync group: one tower with a cost (the lead) takes the rows largest-first, each to the
    replica whose load (over its share ``replica_batch``) is then the least (LPT, greedy: within
    4/3 of the best); the step order is the lead's replicas' rows one after another, lightest row
    first inside each. Every other tower with a cost cuts that order into runs of the least largest
    load (an exact search over the run boundaries). Each tower with a cost is tried as the lead;
    the assignment kept is the one whose worst tower (slowest replica over its mean) is best. A
    replica always gets at least one row; a count-fixed tower (:func:`count_fixed`) keeps its
    counts and is balanced only by which rows it gets.
    """
    for name, c in costs.items():
        if len(c) != n:
            raise ValueError(f"tower {name!r}: {len(c)} row costs for a batch of {n} rows")
    costed = [name for name in plan.towers if name in costs]
    if not costed:
        return RowAssignment.even(plan, n)
    # most replicas first: on a tie of the score below, the tower with the most to balance leads
    leads = sorted(costed, key=lambda name: (-plan.towers[name].dp, costed.index(name)))
    best, score = None, float("inf")
    for lead in leads:
        a = _assign(plan, n, costs, lead)
        worst = max(_imbalance(a, plan, name, costs[name]) for name in costed)
        if worst < score - 1e-12:
            best, score = a, worst
    assert best is not None
    return best


def _imbalance(assignment: RowAssignment, plan: Plan, tower: str, cost: Sequence[float]) -> float:
    """The slowest replica's load over the mean replica load (per unit of share); 1 when nothing costs."""
    t = plan.towers[tower]
    share = list(t.replica_batch) if t.replica_batch else [1] * t.dp
    per = [x / s for x, s in zip(loads(assignment, plan, tower, cost), share)]
    mean = sum(cost) / sum(share)
    return max(per) / mean if mean > 0 else 1.0


def _assign(plan: Plan, n: int, costs: Mapping[str, Sequence[float]], lead: str) -> RowAssignment:
    """:func:`balance_rows` with ``lead`` taking the rows largest-first."""
    order: list[int] = []
    sizes: dict[str, list[list[int]]] = {name: [] for name in plan.towers}
    start = 0
    for rows in plan.group_split(n):
        group = list(range(start, start + rows))
        t = plan.towers[lead]
        capacity = t.split(rows) if count_fixed(plan, lead) else None
        bins = _lpt(group, costs[lead], t.split(rows), capacity)
        group_order = [r for b in bins for r in sorted(b, key=lambda r: (costs[lead][r], r))]
        order.extend(group_order)
        for name, tp in plan.towers.items():
            if name == lead:
                sizes[name].append([len(b) for b in bins])
            elif name in costs and not count_fixed(plan, name):
                sizes[name].append(_cut([costs[name][r] for r in group_order], tp.split(rows)))
            else:
                sizes[name].append(tp.split(rows))
        start += rows
    return RowAssignment(n, order, sizes)


def _lpt(
    rows: Sequence[int], cost: Sequence[float], share: Sequence[int], capacity: Sequence[int] | None
) -> list[list[int]]:
    """Greedy largest-first: each row to the replica with the least load per unit of ``share``."""
    bins: list[list[int]] = [[] for _ in share]
    load = [0.0] * len(share)
    for r in sorted(rows, key=lambda r: (-cost[r], r)):
        open_ = [i for i in range(len(share)) if capacity is None or len(bins[i]) < capacity[i]]
        i = min(open_, key=lambda i: ((load[i] + cost[r]) / share[i], len(bins[i]), i))
        bins[i].append(r)
        load[i] += cost[r]
    empty = [i for i, b in enumerate(bins) if not b]
    for i in empty:  # only when rows cost nothing: move one from the fullest replica
        j = max(range(len(bins)), key=lambda j: len(bins[j]))
        bins[i].append(bins[j].pop())
    return bins


def _cut(cost: Sequence[float], share: Sequence[int]) -> list[int]:
    """Run lengths cutting ``cost`` (in order) into ``len(share)`` runs of at least one row each
    whose largest load per unit of ``share`` is least: a bisection over that load, each try filled
    greedily (a run takes rows while they fit, leaving one for each run after it)."""
    k, n = len(share), len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    def runs(limit: float) -> list[int] | None:
        out, a = [], 0
        for i in range(k):
            cap = limit * share[i] * (1 + 1e-12) + 1e-12
            last = n if i == k - 1 else n - (k - i - 1)
            b = a + 1
            if prefix[b] - prefix[a] > cap:
                return None
            while b < last and prefix[b + 1] - prefix[a] <= cap:
                b += 1
            if i == k - 1 and b < n:
                return None
            out.append(b - a)
            a = b
        return out

    lo, hi = 0.0, prefix[-1] / min(share) + 1.0
    best = runs(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        got = runs(mid)
        if got is not None:
            best, hi = got, mid
        else:
            lo = mid
    return best if best is not None else [n // k + (1 if i < n % k else 0) for i in range(k)]


def loads(assignment: RowAssignment, plan: Plan, tower: str, cost: Sequence[float]) -> list[float]:
    """Each replica's summed row cost of ``tower`` over the step (every sync group)."""
    out = [0.0] * plan.towers[tower].dp
    start = 0
    for g, rows in enumerate(plan.group_split(assignment.n)):
        off = assignment.offsets(tower, g)
        for i in range(len(out)):
            out[i] += sum(cost[r] for r in assignment.rows(start + off[i], start + off[i + 1]))
        start += rows
    return out
