"""Which samples and fields a rank works on, for a global batch of ``n`` samples.

Pure bookkeeping shared by the data loader (what to load) and the runtime (which rows of the
loaded batch each local tower encodes, and where its features go in the whole batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

from lightning_distmm.plan.plan import Plan


@dataclass(frozen=True)
class TowerShare:
    """A tower's replica on this rank: global rows ``[start, stop)``, local rows ``[local_start, local_stop)``."""

    replica: int
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
class RankBatch:
    """This rank's part of a global batch of ``n``: the rows to load and each local tower's share."""

    n: int
    rows: tuple[int, ...]
    towers: Mapping[str, TowerShare]


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

    def offsets(self, name: str, n: int) -> list[int]:
        """Start row of each replica of tower ``name`` in a global batch of ``n`` (plus the end)."""
        sizes = self.plan.towers[name].split(n)
        out = [0]
        for s in sizes:
            out.append(out[-1] + s)
        return out

    def batch(self, n: int) -> RankBatch:
        return self._batch(n)

    def _compute(self, n: int) -> RankBatch:
        self.plan.check_global_batch(n)
        spans = {}
        for name in self.local_towers:
            replica = self.plan.towers[name].replica_of(self.rank)
            off = self.offsets(name, n)
            spans[name] = (replica, off[replica], off[replica + 1])
        rows = sorted({r for _, a, b in spans.values() for r in range(a, b)})
        position = {r: i for i, r in enumerate(rows)}
        shares = {
            name: TowerShare(replica, a, b, position[a] if b > a else 0) for name, (replica, a, b) in spans.items()
        }
        return RankBatch(n, tuple(rows), shares)
