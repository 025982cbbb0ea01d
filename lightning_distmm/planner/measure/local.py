"""Measuring the machine this process runs on, for plans of live jobs (``local_cpu``, ``plan="auto"``).

:func:`measure_local_cpu` describes this host as one node of CPU processes: matmul throughput at
several sizes (the efficiency curve), memory copy bandwidth, per-op overhead, gloo all-reduce
latency and bandwidth between spawned processes (:data:`GLOO_WORKER`), and how much slower
compute runs when all processes compute at once (:class:`ConcurrencyProbe`, which runs
:data:`CONCURRENCY_WORKER`). Results are cached per host. :func:`local_cluster` does the same for
a CUDA device (memory from the driver, FLOP/s and HBM bandwidth measured, links from the matching
preset). :func:`load_cluster` reads any cluster spec, measuring this machine for one that says
``measure: true``. Everything here imports torch inside the functions: the planner stays
importable without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_distmm.planner.machine.cluster import Cluster, Device, Link
from lightning_distmm.planner.machine.presets import cluster_spec, read_cluster
from lightning_distmm.planner.measure.concurrency import ConcurrencyProbe, _measure_concurrency, host_busy_seconds


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


GLOO_WORKER = r"""
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
            [sys.executable, "-c", GLOO_WORKER, str(r), str(world), str(port)],
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


def load_cluster(spec: str | Path | Mapping[str, Any] | Cluster) -> Cluster:
    """A :class:`Cluster` from a preset name (``conf/cluster/<name>.yaml``), a YAML path or a mapping.

    A spec with ``measure: true`` is this machine, measured now (or from the per-host cache) by
    :func:`measure_local_cpu`; its keys ``devices_per_node``, ``gloo``, ``cache`` and ``name`` steer
    the measurement. Any other spec is read as it is written
    (:func:`lightning_distmm.planner.machine.presets.read_cluster`).
    """
    if isinstance(spec, Cluster):
        return spec
    data = cluster_spec(spec)
    if data.get("measure"):
        return measure_local_cpu(
            devices=int(data.get("devices_per_node") or 2),
            measure_gloo=bool(data.get("gloo", True)),
            cache=bool(data.get("cache", True)),
            name=str(data.get("name", "local_cpu")),
        )
    return read_cluster(data)


def local_cluster(device: Any, world_size: int, devices_per_node: int | None = None) -> Cluster:
    """A cluster of ``world_size`` devices like ``device``: measured CPU processes on this host, or
    GPUs (memory from the driver, FLOP/s and HBM bandwidth measured, links from the matching preset
    when the device name matches one, else PCIe-class links; docs/planner.md, "The measured plan")."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return measure_local_cpu(devices=world_size, measure_gloo=world_size > 1)
    if dev.type != "cuda":
        raise ValueError(f"auto planning supports cpu and cuda devices, not {dev.type}")
    props = torch.cuda.get_device_properties(dev)
    dpn = devices_per_node or min(world_size, torch.cuda.device_count() or 1)
    preset = None
    for key, name in (("H200", "h200_8x8"), ("H100", "h100_8x8"), ("A100", "a100_8x8")):
        if key in props.name:
            preset = load_cluster(name)
            break
    points, peak = [], 0.0
    for n in (256, 1024, 4096):
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        torch.mm(a, a)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(5):
            torch.mm(a, a)
        torch.cuda.synchronize(dev)
        rate = 2.0 * n**3 * 5 / (time.perf_counter() - t0)
        points.append([2.0 * n**3, rate])
        peak = max(peak, rate)
    x = torch.empty(64 * 2**20, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    torch.cuda.synchronize(dev)
    bw = 2 * x.numel() * 4 * 5 / (time.perf_counter() - t0)
    device_spec = Device(props.name, float(props.total_memory), peak, bw, 1.0, 0.0, [[f, r / peak] for f, r in points])
    if preset is not None:
        intra, inter, lat = preset.intra, preset.inter, preset.collective_latency
    else:  # PCIe 4.0 x16: 32 GB/s per direction; 100 Gb/s between nodes
        intra, inter, lat = Link(32e9, 5e-6, 0.8), Link(12.5e9, 10e-6, 1.0), 8.4e-6
    return Cluster(
        f"local_{props.name}", max(1, world_size // dpn), dpn, device_spec, intra, inter, lat, notes="measured"
    )


__all__ = [
    "measure_local_cpu",
    "ConcurrencyProbe",
    "host_busy_seconds",
    "local_cluster",
    "GLOO_WORKER",
    "load_cluster",
]
