"""How much CPU "devices" of one host slow each other down: :class:`ConcurrencyProbe` times a
transformer-like block in N processes at once against one alone (``Device.concurrency``), and
:func:`host_busy_seconds` tells whether anything else kept the host busy meanwhile (a measurement
taken on a busy host is not cached). Used by :func:`lightning_distmm.planner.measure.local.measure_local_cpu`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

CONCURRENCY_WORKER = r"""
import json, sys, time
import torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
# one transformer-like MLP block (width 128, 4x expansion, 1024 tokens: activations of 0.5-2 MB,
# beyond a core's L2 like a real microbatch's), forward and backward
x = torch.randn(1024, 128)
w1 = (torch.randn(512, 128) * 0.05).requires_grad_()
w2 = (torch.randn(128, 512) * 0.05).requires_grad_()
def step():
    F.layer_norm(F.linear(F.gelu(F.linear(x, w1)), w2) + x, (128,)).pow(2).mean().backward()
for _ in range(5):
    step()
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    print(json.dumps(ts[len(ts) // 2]), flush=True)
"""


def host_busy_seconds() -> float | None:
    """CPU seconds all processes of this host have run (all cores, user + system, from /proc/stat);
    None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [float(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLK_TCK  # minus idle and iowait


def _proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0 if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (float(fields[11]) + float(fields[12])) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


_CLK_TCK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


class ConcurrencyProbe:
    """``devices`` worker processes that time a fixed compute step (a transformer-like MLP block,
    forward and backward), alone and all at once, on request (:meth:`measure`).

    Started once (the workers import torch, a few seconds), it can then re-measure in under a
    second, e.g. right before each of several jobs on a host whose load changes. Use as a context
    manager or call :meth:`close`.
    """

    def __init__(self, devices: int, threads: int = 1, timeout: float = 120.0) -> None:

        self.timeout = timeout
        self.quiet = True
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", CONCURRENCY_WORKER, str(threads)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for _ in range(devices)
        ]
        try:
            for p in self.procs:
                if p.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                    raise RuntimeError("concurrency worker failed to start")
        except BaseException:
            self.close()
            raise

    def _ask(self, procs: list[Any], iters: int) -> list[float]:
        deadline = time.monotonic() + self.timeout
        for p in procs:
            p.stdin.write(f"{iters}\n")
            p.stdin.flush()
        out = []
        for p in procs:
            line = p.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError("concurrency worker stopped")
            out.append(float(json.loads(line)))
        return out

    def measure(self, rounds: int = 3, iters: int = 20, quiet: float = 0.25, attempts: int = 3) -> float:
        """Median over ``rounds`` of (mean step time with all workers busy) / (step time of one alone),
        at least 1.

        Only rounds during which other processes of the host kept fewer than ``quiet`` cores busy
        count (up to ``attempts * rounds`` tries): the factor describes the host, not a passing job
        of someone else. :attr:`quiet` says whether it was measured so; if no round was, the
        median of all rounds is returned (it then includes that foreign load).
        """
        quiet_ratios, all_ratios = [], []
        for _ in range(max(1, attempts) * rounds):
            busy, mine, t0 = host_busy_seconds(), self._cpu_seconds(), time.perf_counter()
            alone = self._ask(self.procs[:1], iters)[0]
            together = self._ask(self.procs, iters)
            ratio = sum(together) / len(together) / alone
            all_ratios.append(ratio)
            if busy is None:
                quiet_ratios.append(ratio)
            else:
                wall = time.perf_counter() - t0
                other = ((host_busy_seconds() or 0.0) - busy - (self._cpu_seconds() - mine)) / max(wall, 1e-9)
                if other < quiet:
                    quiet_ratios.append(ratio)
            if len(quiet_ratios) >= rounds:
                break
        self.quiet = bool(quiet_ratios)
        use = sorted(quiet_ratios or all_ratios)
        return max(1.0, use[len(use) // 2])

    def _cpu_seconds(self) -> float:
        """CPU seconds of the workers and of this process."""
        t = os.times()
        return t.user + t.system + sum(_proc_cpu_seconds(p.pid) for p in self.procs)

    def close(self) -> None:

        for p in self.procs:
            try:
                p.stdin.close()  # type: ignore[union-attr]
                p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
        self.procs = []

    def __enter__(self) -> ConcurrencyProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _measure_concurrency(devices: int, threads: int) -> tuple[float, bool] | None:
    """``Device.concurrency`` of this host and whether it was measured with the host otherwise quiet
    (see :class:`ConcurrencyProbe`); None when it fails (the caller then assumes 1)."""
    try:
        with ConcurrencyProbe(devices, threads) as probe:
            return probe.measure(), probe.quiet
    except (RuntimeError, ValueError, OSError):
        return None


__all__ = ["ConcurrencyProbe", "host_busy_seconds"]
