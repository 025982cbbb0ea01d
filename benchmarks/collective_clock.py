"""Seconds a rank spends blocked in torch.distributed's collectives, and when.

The emulated benchmarks price each plan's waits on the link; this clock measures them inside the
plans' own steps. Every collective called through ``torch.distributed`` (FSDP2's per-unit
all-gathers and reduce-scatters, the runtime's tensor-parallel all-reduces and its optimizer-shard
gathers) is timed from call to return, and the runtime's posted gradient sums from the start of
their ``PendingSum.wait`` to its end. A call posted with ``async_op=True`` costs its caller only the
post; its wait is timed where the runtime waits (the gradient sums here, the batch-sync in the
step's own ``BatchSync`` span). DTensor's functional collectives (``torch.ops._c10d_functional``)
bypass ``torch.distributed``'s functions and are not seen.

The clock keeps ``(name, start, end)`` intervals in ``time.perf_counter`` seconds, the clock the
step's instruction trace uses on a CPU, so :meth:`CollectiveClock.split` can say how much of each
instruction kind was spent waiting.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

#: torch.distributed functions the clock times (those that exist in the running torch)
TIMED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "broadcast",
)


class CollectiveClock:
    """Times the collectives of this process once :meth:`install` ran (before the trainer starts)."""

    def __init__(self) -> None:
        self.intervals: list[tuple[str, float, float]] = []
        self._depth = 0  # a collective calling another is timed once, as the outer call
        self._replaced: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) for uninstall

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.intervals.append((name, t0, time.perf_counter()))

        timed.__wrapped_by_clock__ = True  # type: ignore[attr-defined]
        return timed

    def install(self) -> None:
        """Replace each :data:`TIMED` function in ``torch.distributed`` and in every loaded module of
        torch.distributed or lightning_distmm that bound it at import (``from ... import``)."""
        import torch.distributed as dist

        from lightning_distmm.parallel.exchange import PendingSum

        for name in TIMED:
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "__wrapped_by_clock__", False):
                continue
            timed = self._timed(name, fn)
            for mod in list(sys.modules.values()):
                modname = getattr(mod, "__name__", "") or ""
                if not modname.startswith(("torch.distributed", "lightning_distmm")) or modname.endswith("c10d"):
                    continue  # (distributed_c10d's own calls between its functions stay untimed)
                for attr, value in list(vars(mod).items()):
                    if value is fn:
                        self._replaced.append((mod, attr, fn))
                        setattr(mod, attr, timed)
        if not getattr(PendingSum.wait, "__wrapped_by_clock__", False):
            self._replaced.append((PendingSum, "wait", PendingSum.wait))
            PendingSum.wait = self._timed("gradient_sum_wait", PendingSum.wait)

    def uninstall(self) -> None:
        """Put back every function :meth:`install` replaced."""
        for owner, attr, original in reversed(self._replaced):
            setattr(owner, attr, original)
        self._replaced = []

    def take(self) -> list[tuple[str, float, float]]:
        """The intervals recorded since the last call, and forget them."""
        out, self.intervals = self.intervals, []
        return out

    @staticmethod
    def split(
        intervals: Iterable[tuple[str, float, float]], spans: Iterable[tuple[str, float, float]]
    ) -> dict[str, float]:
        """Seconds of ``intervals`` that fall inside each kind of ``spans`` (``(kind, start, end)``,
        the step's traced instructions), the rest under ``"other"``; overlapping parts counted once
        per interval (an interval is attributed by its overlap with each span)."""
        spans = list(spans)
        out: dict[str, float] = {"other": 0.0}
        for _, a, b in intervals:
            inside = 0.0
            for kind, s, e in spans:
                overlap = min(b, e) - max(a, s)
                if overlap > 0:
                    out[kind] = out.get(kind, 0.0) + overlap
                    inside += overlap
            out["other"] += max(0.0, (b - a) - inside)
        return out
