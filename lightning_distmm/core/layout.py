"""Which samples and fields a rank works on, for a global batch of ``n`` samples.

Pure bookkeeping shared by the data loader (what to load) and the runtime (which rows of the
loaded batch each local tower encodes, and where its features go in the whole batch). Rows are
counted in the step's order (:class:`~lightning_distmm.core.assignment.RowAssignment`): sample order
under the plan's own split, the balanced order when a step's rows are assigned by their cost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from lightning_distmm.core.assignment import RowAssignment
from lightning_distmm.core.plan import Plan

#: the batch key under which the distmm data loader tells every rank the global batch size
GLOBAL_BATCH_KEY = "__distmm_global_batch__"
#: the batch key under which the loader hands every rank the step's row assignment, when the rows
#: were assigned by their cost (absent: the plan's own split)
ASSIGNMENT_KEY = "__distmm_assignment__"
#: the batch key under which the loader hands every rank the dataset index of each of its rows (a
#: map-style dataset's), so that a message about a row names the sample a user can look up
SAMPLES_KEY = "__distmm_samples__"
#: the keys the distmm loader adds to a batch (not the user's fields)
LOADER_KEYS = (GLOBAL_BATCH_KEY, ASSIGNMENT_KEY, SAMPLES_KEY)


def row_name(row: int, rows: Sequence[int] | None = None, samples: Sequence[int] | None = None) -> str:
    """How a message names row ``row`` of a rank's batch: the dataset sample it holds where the loader
    said (``samples``, the batch's ``SAMPLES_KEY``), and its row of the DataLoader's global batch
    (``rows``: the global row of each local row; None: the batch is the global batch)."""
    global_row = row if rows is None else int(rows[row])
    if samples is not None and row < len(samples):
        return f"sample {int(samples[row])} of the dataset (row {global_row} of the batch)"
    return f"the sample at row {global_row} of the batch"


@dataclass(frozen=True)
class Span:
    """Step positions ``[start, stop)`` of the batch, found at local rows ``[local_start, ...)`` of this rank's batch."""

    start: int
    stop: int
    local_start: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def local(self) -> slice:
        return slice(self.local_start, self.local_start + self.size)


@dataclass(frozen=True)
class TowerShare:
    """A tower's replica on this rank: its rows of each sync group (one span per sync group)."""

    replica: int
    spans: tuple[Span, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.spans)


@dataclass(frozen=True)
class RankBatch:
    """This rank's part of a global batch of ``n``: the sample rows to load (in step order) and each
    local tower's share (in step positions)."""

    n: int
    rows: tuple[int, ...]
    towers: Mapping[str, TowerShare]
    assignment: RowAssignment


class RankLayout:
    """The rows and fields ``rank`` loads under ``plan``.

    A rank loads the union of its towers' replica rows, with the union of their fields. In the
    usual layouts (colocated, or one tower per rank) that is exactly what it computes on; where a
    rank holds replicas of two towers with different rows, the union is loaded for both fields.
    """

    def __init__(self, plan: Plan, rank: int, tower_fields: Mapping[str, Sequence[str]]):
        self.plan = plan
        self.rank = rank
        self.local_towers = plan.towers_on(rank)
        fields: list[str] = []
        for name in self.local_towers:
            fields.extend(f for f in tower_fields[name] if f not in fields)
        self.fields = tuple(fields)
        self._batch = lru_cache(maxsize=8)(self._compute)

    def batch(self, n: int, assignment: RowAssignment | None = None) -> RankBatch:
        """This rank's part of a batch of ``n`` under ``assignment`` (default: the plan's own split)."""
        return self._batch(assignment if assignment is not None else RowAssignment.even(self.plan, n))

    def _compute(self, assignment: RowAssignment) -> RankBatch:
        n = assignment.n
        self.plan.check_global_batch(n)
        group_start = self.plan.group_offsets(n)
        spans: dict[str, tuple[int, list[tuple[int, int]]]] = {}
        for name in self.local_towers:
            replica = self.plan.towers[name].replica_of(self.rank)
            assert replica is not None
            groups = []
            for g in range(len(group_start) - 1):
                off = assignment.offsets(name, g)
                groups.append((group_start[g] + off[replica], group_start[g] + off[replica + 1]))
            spans[name] = (replica, groups)
        positions = sorted({p for _, groups in spans.values() for a, b in groups for p in range(a, b)})
        local = {p: i for i, p in enumerate(positions)}
        shares = {
            name: TowerShare(replica, tuple(Span(a, b, local[a] if b > a else 0) for a, b in groups))
            for name, (replica, groups) in spans.items()
        }
        rows = tuple(assignment.order[p] for p in positions) if assignment.order is not None else tuple(positions)
        return RankBatch(n, rows, shares, assignment)
