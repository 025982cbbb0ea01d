"""Spans of a step's instructions on this rank, timed as the device runs them.

On a GPU the kernels an instruction launches run after the Python that launched them returns, so a
wall clock around the launch measures the launch. :class:`StepTrace` records a CUDA event on the
current stream at each span's start and end instead, and reads them only when the spans are read,
after the step (one wait for the device then, none during the step). On the CPU the kernels run
when they are launched, and the spans are ``time.perf_counter`` readings.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from lightning_distmm.core.schedule import Instruction


class StepTrace:
    """``(instruction, start, end)`` of this rank's instructions, in seconds; iterate after the step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[Instruction, Any, Any]] = []

    def now(self) -> Any:
        """A mark of the present: a recorded CUDA event on a GPU, a ``perf_counter`` reading otherwise."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, ins: Instruction, start: Any) -> None:
        """The span of ``ins`` from ``start`` (a :meth:`now` mark) to now."""
        self._spans.append((ins, start, self.now()))

    def clear(self) -> None:
        self._spans.clear()

    def __len__(self) -> int:
        return len(self._spans)

    def __iter__(self) -> Iterator[tuple[Instruction, float, float]]:
        if not self.cuda:
            yield from self._spans
            return
        if not self._spans:
            return
        origin = self._spans[0][1]
        self._spans[-1][2].synchronize()
        for ins, start, end in self._spans:
            yield ins, origin.elapsed_time(start) / 1e3, origin.elapsed_time(end) / 1e3
