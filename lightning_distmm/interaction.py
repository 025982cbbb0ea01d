"""Which loss rows this process computes.

The interaction (the contrastive loss) sees the features of the whole batch on every rank that
takes part in the batch-sync (the towers' last pipeline stages), but such a rank only needs to
compute the loss *rows* it is responsible for: the rows are split evenly over the batch-sync's
ranks, each sums its rows, and the sum over them is the whole-batch loss (open_clip's
``local_loss=True``). Row-decomposable losses ask :func:`local_rows` which rows are theirs; outside
a distmm run (an ordinary ``Trainer``) every row is local, so the same loss code gives the plain
whole-batch loss.

A loss that never asks is a whole-batch loss computed identically on every batch-sync rank; the
runtime notices and divides it by the number of those ranks, so their sum is still exactly the loss.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class RowShare:
    """This rank's rows: ``[start, stop)`` of a batch of ``n``, one of ``parts`` even shares."""

    index: int
    parts: int
    asked: bool = False

    def rows(self, n: int) -> slice:
        self.asked = True
        base, extra = divmod(n, self.parts)
        start = self.index * base + min(self.index, extra)
        return slice(start, start + base + (1 if self.index < extra else 0))


_SHARE: contextvars.ContextVar[RowShare | None] = contextvars.ContextVar("distmm_row_share", default=None)


def local_rows(n: int) -> slice:
    """The rows of a batch of ``n`` whose loss terms this process computes (all of them outside distmm)."""
    share = _SHARE.get()
    return slice(0, n) if share is None else share.rows(n)


@contextlib.contextmanager
def row_share(index: int, parts: int) -> Iterator[RowShare]:
    """Inside the block, :func:`local_rows` gives share ``index`` of ``parts``; ``asked`` records whether it was called."""
    share = RowShare(index, parts)
    token = _SHARE.set(share)
    try:
        yield share
    finally:
        _SHARE.reset(token)
