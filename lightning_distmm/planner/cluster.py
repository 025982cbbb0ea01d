"""The machine the planner plans for: nodes of identical devices joined by two kinds of links.

Why a separate spec: every planning decision trades device time against link time, and the two
links differ by 10-50x (NVLink inside a node, Ethernet/InfiniBand between nodes). A cluster is
plain data (YAML presets under ``conf/cluster/``), every constant of a preset cites its source.

Compute is a roofline per GEMM: ``max(flops / (peak * gemm_efficiency), bytes / memory_bandwidth)``
plus a fixed cost per kernel. That *is* the efficiency curve over microbatch work: a small
microbatch re-reads the whole weight matrix for few tokens and is memory bound, a large one
reaches ``gemm_efficiency``. A measured table ``efficiency_points`` (GEMM FLOPs -> achieved fraction
of peak) replaces the roofline when present (``local_cpu`` measures one).

Collectives follow NCCL's own tuning model (``src/graph/tuning.cc``): a ring of ``n`` ranks over
``m`` nodes costs ``base + (steps - inter_steps) * intra_latency + inter_steps * inter_latency``
plus bytes over the bandwidth of the slowest link class it crosses, computed hierarchically (the
intra-node part over NVLink, the inter-node part over the node's NIC, shared by everything on the
node that crosses nodes at the same time).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass
class Device:
    """One accelerator (or one CPU process's share of a host).

    Units: bytes, FLOP/s, bytes/s, seconds. ``gemm_efficiency`` is the sustained fraction of
    ``peak_flops`` reached by large GEMMs; ``kernel_overhead`` the fixed cost of one kernel/op.
    ``efficiency_points`` ([[gemm_flops, fraction_of_peak], ...], increasing) overrides the roofline.
    ``concurrency`` is how much longer compute takes while the other devices of the node compute
    too (time with all busy / time alone): 1 for GPUs, measured for CPU processes, which share the
    host's cores, caches and memory bandwidth (:func:`measure_local_cpu`).
    """

    name: str
    memory: float
    peak_flops: float
    memory_bandwidth: float
    gemm_efficiency: float = 1.0
    kernel_overhead: float = 0.0
    efficiency_points: list[list[float]] | None = None
    sm_count: int | None = None
    concurrency: float = 1.0
    gemm_tiles: tuple[tuple[int, int], ...] = ((128, 128), (128, 64), (64, 64))

    def wave_efficiency(self, m: Any, n: Any, batch: Any = 1) -> Any:
        """Fraction of the SMs' tile slots doing useful work for ``batch`` GEMM outputs of ``m x n``.

        A GPU computes an output in tiles, one per SM at a time: a problem of fewer tiles than SMs
        leaves SMs idle, a partial last wave and padded edge tiles waste the rest. The best of the
        usual CUTLASS/cuBLAS threadblock tiles is taken. 1 when ``sm_count`` is unknown (CPUs).
        """
        import numpy as np

        if not self.sm_count:
            return 1.0
        m, n, batch = (np.asarray(x, dtype=float) for x in (m, n, batch))
        best = np.zeros(np.broadcast(m, n, batch).shape)
        for tm, tn in self.gemm_tiles:
            tiles = batch * np.ceil(m / tm) * np.ceil(n / tn)
            waves = np.ceil(tiles / self.sm_count)
            best = np.maximum(best, batch * m * n / np.maximum(waves * self.sm_count * tm * tn, 1.0))
        return np.minimum(best, 1.0)

    def gemm_time(self, flops: Any, bytes_moved: Any, m: Any = None, n: Any = None, batch: Any = 1) -> Any:
        """Time of GEMM(s) of ``flops`` touching ``bytes_moved`` (numpy arrays or floats); ``m x n``
        is the output shape (``batch`` of them) when known, for the wave-quantisation term."""
        import numpy as np

        flops = np.asarray(flops, dtype=float)
        if self.efficiency_points:
            return flops / (self.peak_flops * self.efficiency(flops))
        eff = self.gemm_efficiency * (self.wave_efficiency(m, n, batch) if m is not None and n is not None else 1.0)
        return np.maximum(flops / (self.peak_flops * eff), np.asarray(bytes_moved) / self.memory_bandwidth)

    def efficiency(self, flops: Any) -> Any:
        """Measured efficiency at GEMM size ``flops`` (log-linear interpolation, clamped)."""
        import numpy as np

        pts = sorted(self.efficiency_points or [[1.0, self.gemm_efficiency]])
        xs = np.log([max(p[0], 1.0) for p in pts])
        ys = [max(p[1], 1e-6) for p in pts]
        return np.interp(np.log(np.maximum(np.asarray(flops, dtype=float), 1.0)), xs, ys)

    def memory_time(self, bytes_moved: Any) -> Any:
        return bytes_moved / self.memory_bandwidth


@dataclass
class Link:
    """A link class. ``bandwidth`` is per direction; ``efficiency`` the achievable fraction of it."""

    bandwidth: float
    latency: float
    efficiency: float = 1.0

    @property
    def effective(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices.

    ``intra`` is the per-device bandwidth into the node fabric (NVLink/NVSwitch: every device can
    drive it at once). ``inter`` is the bandwidth of one *node's* network interfaces together:
    all traffic of a node that leaves the node shares it. ``collective_latency`` is the fixed
    base latency of one collective call.
    """

    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra: Link
    inter: Link
    collective_latency: float = 0.0
    notes: str = ""

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def with_world(self, world_size: int) -> Cluster:
        """The same hardware with ``world_size`` devices (whole nodes where possible)."""
        dpn = min(self.devices_per_node, world_size)
        if world_size % dpn:
            raise ValueError(f"{world_size} devices do not fill nodes of {dpn} devices")
        return dataclasses.replace(self, nodes=world_size // dpn, devices_per_node=dpn)

    # ------------------------------------------------------------------ collectives
    def ring_latency(self, ranks: int, nodes: int, steps_per_rank: int = 2) -> float:
        """NCCL's ring latency: ``steps_per_rank`` is 2 for all-reduce, 1 for all-gather / reduce-scatter."""
        if ranks <= 1:
            return 0.0
        steps = steps_per_rank * (ranks - 1)
        inter_steps = steps_per_rank * (nodes - 1)
        return self.collective_latency + (steps - inter_steps) * self.intra.latency + inter_steps * self.inter.latency

    def allreduce_time(
        self, nbytes: float, ranks: int, nodes: int = 1, per_node: int | None = None, nic_load: float | None = None
    ) -> float:
        """Hierarchical ring all-reduce of ``nbytes`` over ``ranks`` spread on ``nodes`` nodes.

        ``per_node`` is the largest number of members on one node (default ``ranks / nodes``).
        ``nic_load`` is the total bytes the busiest node pushes through its NIC while this runs
        (default: this collective alone, ``2 (m - 1) / m * nbytes``).
        """
        if ranks <= 1:
            return 0.0
        k = per_node if per_node is not None else max(1, math.ceil(ranks / max(nodes, 1)))
        t = self.ring_latency(ranks, nodes, 2)
        if k > 1:
            t += 2 * (k - 1) / k * nbytes / self.intra.effective
        if nodes > 1:
            load = nic_load if nic_load is not None else 2 * (nodes - 1) / nodes * nbytes
            t += load / self.inter.effective
        return t

    def allgather_time(self, total_bytes: float, ranks: int, nodes: int = 1, per_node: int | None = None) -> float:
        """Ring all-gather producing ``total_bytes`` on every rank (reduce-scatter costs the same)."""
        if ranks <= 1:
            return 0.0
        k = per_node if per_node is not None else max(1, math.ceil(ranks / max(nodes, 1)))
        t = self.ring_latency(ranks, nodes, 1)
        if k > 1:
            t += (k - 1) / k * total_bytes / self.intra.effective
        if nodes > 1:
            t += (nodes - 1) / nodes * total_bytes / self.inter.effective
        return t

    def p2p_time(self, nbytes: float, same_node: bool) -> float:
        """One point-to-point send. Across nodes one device gets a 1/devices_per_node share of the NIC."""
        if same_node:
            return self.intra.latency + nbytes / self.intra.effective
        return self.inter.latency + nbytes / (self.inter.effective / self.devices_per_node)

    # ------------------------------------------------------------------ YAML
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "device": {
                "name": self.device.name,
                "memory_gb": _r(self.device.memory / GB),
                "peak_tflops": _r(self.device.peak_flops / 1e12),
                "memory_bandwidth_gbps": _r(self.device.memory_bandwidth / GB),
                "gemm_efficiency": _r(self.device.gemm_efficiency),
                "kernel_overhead_us": _r(self.device.kernel_overhead * 1e6),
                **({"sm_count": self.device.sm_count} if self.device.sm_count else {}),
                **({"efficiency_points": self.device.efficiency_points} if self.device.efficiency_points else {}),
                **({"concurrency": _r(self.device.concurrency)} if self.device.concurrency != 1.0 else {}),
            },
            "intra_node": {
                "bandwidth_gbps": _r(self.intra.bandwidth / GB),
                "efficiency": _r(self.intra.efficiency),
                "latency_us": _r(self.intra.latency * 1e6),
            },
            "inter_node": {
                "bandwidth_gbps": _r(self.inter.bandwidth / GB),
                "efficiency": _r(self.inter.efficiency),
                "latency_us": _r(self.inter.latency * 1e6),
            },
            "collective_latency_us": _r(self.collective_latency * 1e6),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """Build from a preset mapping (units as in the YAML: GB, TFLOP/s, GB/s, microseconds).

        A mapping with ``measure: true`` is measured on this machine (see :func:`measure_local_cpu`);
        its other keys (``nodes``, ``devices_per_node``, ``gloo``) steer the measurement.
        """
        data = dict(data)
        if data.get("measure"):
            return measure_local_cpu(
                devices=int(data.get("devices_per_node") or 2),
                measure_gloo=bool(data.get("gloo", True)),
                cache=bool(data.get("cache", True)),
                name=str(data.get("name", "local_cpu")),
            )
        missing = [k for k in ("nodes", "devices_per_node", "device", "intra_node", "inter_node") if k not in data]
        if missing:
            raise ValueError(f"cluster spec {data.get('name', '?')!r} lacks key(s) {missing}")
        dev = dict(data["device"])
        device = Device(
            name=str(dev.get("name", "device")),
            memory=float(dev["memory_gb"]) * GB,
            peak_flops=float(dev["peak_tflops"]) * 1e12,
            memory_bandwidth=float(dev["memory_bandwidth_gbps"]) * GB,
            gemm_efficiency=float(dev.get("gemm_efficiency", 1.0)),
            kernel_overhead=float(dev.get("kernel_overhead_us", 0.0)) * 1e-6,
            efficiency_points=[list(map(float, p)) for p in dev["efficiency_points"]]
            if dev.get("efficiency_points")
            else None,
            sm_count=int(dev["sm_count"]) if dev.get("sm_count") else None,
            concurrency=float(dev.get("concurrency", 1.0)),
        )

        def link(d: Mapping[str, Any]) -> Link:
            return Link(
                bandwidth=float(d["bandwidth_gbps"]) * GB,
                latency=float(d.get("latency_us", 0.0)) * 1e-6,
                efficiency=float(d.get("efficiency", 1.0)),
            )

        return cls(
            name=str(data.get("name", "cluster")),
            nodes=int(data["nodes"]),
            devices_per_node=int(data["devices_per_node"]),
            device=device,
            intra=link(data["intra_node"]),
            inter=link(data["inter_node"]),
            collective_latency=float(data.get("collective_latency_us", 0.0)) * 1e-6,
            notes=str(data.get("notes", "")),
        )


def _r(x: float) -> float:
    """Round away float noise of unit conversions (so YAML round trips are exact)."""
    return float(f"{x:.12g}")


def load_cluster(spec: str | Path | Mapping[str, Any] | Cluster) -> Cluster:
    """A :class:`Cluster` from a preset name (``conf/cluster/<name>.yaml``), a YAML path or a mapping."""
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, Mapping):
        return Cluster.from_dict(_plain(spec))
    import yaml

    path = Path(spec)
    if not path.suffix:
        path = CONF_DIR / "cluster" / f"{spec}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "cluster").glob("*.yaml"))
        raise FileNotFoundError(f"no cluster preset {str(spec)!r}; presets: {known}")
    return Cluster.from_dict(yaml.safe_load(path.read_text()))


def _plain(obj: Any) -> Any:
    """OmegaConf containers -> plain Python (without importing omegaconf unless it is one)."""
    if type(obj).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(obj, resolve=True)
    return dict(obj) if isinstance(obj, Mapping) else obj


# ---------------------------------------------------------------------- measuring this machine
def _best_time(fn: Any, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_local_cpu(
    devices: int = 2,
    measure_gloo: bool = True,
    cache: bool = True,
    name: str = "local_cpu",
    measure_concurrency: bool | None = None,
) -> Cluster:
    """Measure this host as one node of ``devices`` CPU processes ("devices").

    Each process gets ``cores // devices`` threads. Measured: fp32 matmul throughput at several sizes
    (the efficiency curve; peak is the best seen), memory copy bandwidth, per-op overhead and, with
    ``measure_gloo``, gloo all-reduce latency and bandwidth between two spawned processes (a few
    seconds, cached per host in ``~/.cache/lightning_distmm``). With ``measure_concurrency``
    (default: as ``measure_gloo``) also how much slower a transformer-like MLP step runs when all
    ``devices`` processes compute at once than in one process alone (``Device.concurrency``: the
    processes share the host's cores, caches and memory bandwidth, and whatever else runs on it).
    ``cache=False`` measures afresh (and stores nothing). Memory per device is the host's RAM
    divided by ``devices``.
    """
    import torch

    cores = os.cpu_count() or 1
    threads = max(1, cores // devices)
    key = f"{platform.node()}-{cores}c-{devices}d-{threads}t-torch{torch.__version__}"
    cache_file = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_distmm" / "local_cpu.json"
    stored: dict[str, Any] = {}
    if cache and cache_file.is_file():
        try:
            stored = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            stored = {}
    m = stored.get(key)
    concurrency: float | None = None  # measured now on a busy host: used, not cached
    if measure_concurrency is None:
        measure_concurrency = measure_gloo
    measure_concurrency = measure_concurrency and devices > 1
    if (
        m is None
        or (measure_gloo and "gloo" not in m and not m.get("gloo_failed"))
        or (measure_concurrency and "host_concurrency" not in m)
    ):
        m = dict(m or {})
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            points = []
            for n in (16, 32, 64, 128, 256, 512):
                a, b = torch.randn(n, n), torch.randn(n, n)
                t = _best_time(lambda: torch.mm(a, b), repeats=5 if n <= 256 else 3)
                points.append([2.0 * n**3, 2.0 * n**3 / t])
            peak = max(p[1] for p in points)
            m["peak_flops"] = peak
            m["efficiency_points"] = [[f, r / peak] for f, r in points]
            x = torch.empty(8 * 2**20)  # 32 MiB
            y = torch.empty_like(x)
            t = _best_time(lambda: y.copy_(x), repeats=5)
            m["memory_bandwidth"] = 2 * x.numel() * 4 / t
            # per-op cost of a small op under autograd recording (dispatch + graph bookkeeping)
            xs = torch.randn(2, 8, requires_grad=True)
            ws = torch.randn(8, 8, requires_grad=True)
            F = torch.nn.functional

            def small_ops() -> None:
                for _ in range(50):
                    F.layer_norm(F.gelu(F.linear(xs, ws)), (8,))

            m["kernel_overhead"] = _best_time(small_ops, repeats=5) / 150
        finally:
            torch.set_num_threads(old)
        if measure_gloo and "gloo" not in m:
            gloo = _measure_gloo()
            if gloo is not None:
                m["gloo"] = gloo
            else:
                m["gloo_failed"] = True
        if measure_concurrency and "host_concurrency" not in m:
            measured = _measure_concurrency(devices, threads)
            if measured is not None:
                concurrency = measured[0]
                if measured[1]:  # kept only when measured on an otherwise quiet host
                    m["host_concurrency"] = concurrency
        if cache:
            stored[key] = m
            try:
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                cache_file.write_text(json.dumps(stored, indent=1))
            except OSError:
                pass
    try:
        import psutil

        ram = float(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    # without a gloo measurement: 50 us per ring step and a quarter of the copy bandwidth (TCP loopback)
    gloo = m.get("gloo") or {"latency": 50e-6, "bandwidth": m["memory_bandwidth"] / 4}
    link = Link(bandwidth=gloo["bandwidth"], latency=gloo["latency"], efficiency=1.0)
    device = Device(
        name=f"cpu/{threads}t",
        memory=ram / devices,
        peak_flops=m["peak_flops"],
        memory_bandwidth=m["memory_bandwidth"],
        gemm_efficiency=1.0,
        kernel_overhead=m["kernel_overhead"],
        efficiency_points=m["efficiency_points"],
        # without a measurement: devices are assumed not to slow each other down
        concurrency=float(m.get("host_concurrency", concurrency or 1.0)) if devices > 1 else 1.0,
    )
    return Cluster(
        name=name,
        nodes=1,
        devices_per_node=devices,
        device=device,
        intra=link,
        inter=dataclasses.replace(link),
        collective_latency=0.0,
        notes=f"measured on {platform.node()} ({cores} cores, {threads} threads per process)",
    )


_GLOO_WORKER = r"""
import json, sys, time
import torch, torch.distributed as dist
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
res = {}
for n in (4, 16 * 2**20):
    x = torch.ones(max(1, n // 4))
    dist.all_reduce(x)
    reps = 20 if n < 2**16 else 4
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    res[n] = (time.perf_counter() - t0) / reps
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(res))
"""


def _measure_gloo(world: int = 2, timeout: float = 120.0) -> dict[str, float] | None:
    """All-reduce latency (4 bytes) and bandwidth (16 MiB, ring formula) between ``world`` gloo
    processes started with ``subprocess`` (independent of how this process was started).
    None when the measurement fails (the caller falls back to a conservative estimate)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GLOO_WORKER, str(r), str(world), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(world)
    ]
    try:
        out, _ = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=30)
        res = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        for p in procs:
            if p.poll() is None:
                p.kill()
        return None
    lat = res[4]
    big = 16 * 2**20
    bw = 2 * (world - 1) / world * big / max(res[big] - lat, 1e-9)  # ring all-reduce: lat + 2 (n-1)/n bytes / bw
    return {"latency": lat / (2 * (world - 1)), "bandwidth": bw}  # the model adds a latency per ring step


_CONCURRENCY_WORKER = r"""
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
        import subprocess
        import sys

        self.timeout = timeout
        self.quiet = True
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", _CONCURRENCY_WORKER, str(threads)],
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
        import subprocess

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


def list_presets(kind: str = "cluster") -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / kind).glob("*.yaml"))


__all__ = [
    "Device",
    "Link",
    "Cluster",
    "load_cluster",
    "measure_local_cpu",
    "ConcurrencyProbe",
    "host_busy_seconds",
    "list_presets",
    "CONF_DIR",
    "GB",
]
