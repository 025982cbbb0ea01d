"""The machine the planner plans for: nodes of identical devices joined by two kinds of links.

Why a separate spec: every planning decision trades device time against link time, and the two
links differ by 10-50x (NVLink inside a node, Ethernet/InfiniBand between nodes). A cluster is
plain data (YAML presets under ``conf/cluster/``), every constant of a preset cites its source.
Reading a spec never measures anything (:mod:`lightning_distmm.planner.machine.presets`): a
preset that says ``measure: true`` (``local_cpu``) is measured by
:func:`lightning_distmm.planner.measure.local.measure_local_cpu`, which
:func:`lightning_distmm.planner.measure.local.load_cluster` calls for it (this folder imports nothing
that measures).

Compute is priced from shapes (:mod:`lightning_distmm.planner.cost.compute`): a GEMM is a roofline
``max(flops / (peak * e(class) * wave(m, n)), bytes / (memory_bandwidth * memory_efficiency))`` where
``e(class)`` is the efficiency a GEMM kernel reaches on the SMs it occupies, per GEMM size class
(``gemm_class_efficiency``; one ``gemm_efficiency`` when there are no classes), ``wave`` the fraction of
the SMs' tile slots the output's tiles fill (wave and tile quantisation, :meth:`Device.wave_efficiency`),
and the memory term the arithmetic intensity of the shape in the compute dtype. Fused attention runs at
``attention_efficiency`` (FlashAttention's published fraction of peak) over its own tiles; elementwise
work (norms, activations, residual adds, softmax outside fused attention) is bytes moved over the
streaming bandwidth ``memory_bandwidth * memory_efficiency``. A measured table ``efficiency_points``
(GEMM FLOPs -> achieved fraction of peak) replaces the GEMM roofline when present (``local_cpu``
measures one). Link time (collectives over these links) is priced in
:mod:`lightning_distmm.planner.cost.comm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_distmm.planner.machine.config import CONF_DIR, list_presets

GB = 1e9


@dataclass
class Device:
    """One accelerator (or one CPU process's share of a host).

    Units: bytes, FLOP/s, bytes/s, seconds.

    * ``gemm_class_efficiency`` ([[gemm_flops, efficiency], ...]): the efficiency a GEMM kernel reaches
      on the SMs its tiles occupy, per GEMM size class (log-linear in FLOPs between the points,
      clamped outside); wave quantisation and the memory term come on top, from the shape. Published
      figures in the GPU presets, measured by ``benchmarks/gpu_calibrate.py`` and loaded by
      :mod:`lightning_distmm.planner.machine.calibration` for ``cluster=h200_measured``.
      ``gemm_efficiency`` is the single value used when there are no classes.
    * ``attention_efficiency``: the fraction of peak a fused attention kernel (FlashAttention) reaches
      on the tiles it occupies; ``None`` prices attention's FLOPs like a GEMM's (CPUs).
    * ``memory_efficiency``: the fraction of ``memory_bandwidth`` streaming kernels reach (elementwise,
      norms, the optimizer step, the memory term of a GEMM's roofline).
    * ``kernel_overhead``: the fixed cost of one kernel/op (CPU: measured; GPUs: 0, launches are
      asynchronous and overlap compute).
    * ``efficiency_points`` ([[gemm_flops, fraction_of_peak], ...], increasing) replaces the GEMM
      roofline by a measured curve (``local_cpu``).
    * ``concurrency`` is how much longer compute takes while the other devices of the node compute
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
    gemm_class_efficiency: list[list[float]] | None = None
    gemm_tiles: tuple[tuple[int, int], ...] = ((128, 128), (128, 64), (64, 64))
    attention_efficiency: float | None = None
    memory_efficiency: float = 1.0

    @property
    def stream_bandwidth(self) -> float:
        """Bytes per second streaming kernels move (``memory_bandwidth * memory_efficiency``)."""
        return self.memory_bandwidth * self.memory_efficiency

    def wave_efficiency(self, m: Any, n: Any, batch: Any = 1, reduce: Any = None) -> Any:
        """Fraction of the SMs' tile slots doing useful work for ``batch`` GEMM outputs of ``m x n``.

        A GPU computes an output in tiles, one per SM at a time: a problem of fewer tiles than SMs
        leaves SMs idle, a partial last wave and padded edge tiles waste the rest (NVIDIA's "Matrix
        Multiplication Background" guide, "Dimension Quantization Effects"). The best of the usual
        CUTLASS/cuBLAS threadblock tiles is taken. ``reduce`` (the reduction length) allows split-K:
        an output of fewer tiles than SMs may split its reduction into up to ``reduce // 256`` parts
        (our choice of the least work per split), as many as fill one wave; a weight gradient
        reduces over every token of the microbatch. 1 when ``sm_count`` is unknown (CPUs).
        """
        import numpy as np

        if not self.sm_count:
            return 1.0
        m, n, batch = (np.asarray(x, dtype=float)[..., None] for x in (m, n, batch))
        tm, tn = (np.array(t, dtype=float) for t in zip(*self.gemm_tiles))  # one column per tile shape
        tiles = batch * np.ceil(m / tm) * np.ceil(n / tn)
        splits = 1.0
        if reduce is not None:
            most = np.maximum(np.floor(np.asarray(reduce, dtype=float)[..., None] / 256), 1.0)
            splits = np.clip(np.floor(self.sm_count / tiles), 1.0, most)
        waves = np.ceil(tiles * splits / self.sm_count)
        useful = splits * batch * m * n / np.maximum(waves * self.sm_count * tm * tn, 1.0)
        return np.minimum(useful.max(axis=-1), 1.0)

    def gemm_time(
        self, flops: Any, bytes_moved: Any, m: Any = None, n: Any = None, batch: Any = 1, reduce: Any = None
    ) -> Any:
        """Time of GEMM(s) of ``flops`` touching ``bytes_moved`` (numpy arrays or floats); ``m x n``
        is the output shape (``batch`` of them) when known, for the wave-quantisation term, and
        ``reduce`` the reduction length when the kernel may split it (weight gradients)."""
        import numpy as np

        flops = np.asarray(flops, dtype=float)
        if self.efficiency_points:
            return flops / (self.peak_flops * self.efficiency(flops))
        eff = self.compute_efficiency(flops) * (
            self.wave_efficiency(m, n, batch, reduce) if m is not None and n is not None else 1.0
        )
        return np.maximum(flops / (self.peak_flops * eff), np.asarray(bytes_moved) / self.stream_bandwidth)

    def attention_time(self, flops: Any, bytes_moved: Any, q: Any, head_dim: Any, tiles: Any) -> Any:
        """Time of fused attention of ``flops`` moving ``bytes_moved``: one (query block x head dim)
        output tile per ``tiles`` (sample, head) pairs, FlashAttention's work split, at
        ``attention_efficiency`` of peak on the SMs the tiles occupy. Without an attention efficiency
        (CPUs) its FLOPs are priced like a GEMM's."""
        import numpy as np

        if self.attention_efficiency is None or self.efficiency_points:
            return self.gemm_time(flops, bytes_moved, q, head_dim, tiles)
        eff = self.attention_efficiency * self.wave_efficiency(q, head_dim, tiles)
        return np.maximum(
            np.asarray(flops, dtype=float) / (self.peak_flops * eff), np.asarray(bytes_moved) / self.stream_bandwidth
        )

    def stream_time(self, bytes_moved: Any) -> Any:
        """Time of memory-bound work moving ``bytes_moved`` (elementwise, norms, optimizer)."""
        import numpy as np

        return np.asarray(bytes_moved, dtype=float) / self.stream_bandwidth

    def compute_efficiency(self, flops: Any) -> Any:
        """The roofline's efficiency for GEMMs of ``flops``: per size class when given, else the
        single ``gemm_efficiency``."""
        import numpy as np

        if not self.gemm_class_efficiency:
            return self.gemm_efficiency
        if len(self.gemm_class_efficiency) == 1:
            return self.gemm_class_efficiency[0][1]
        return _interp_log(self.gemm_class_efficiency, np.asarray(flops, dtype=float))

    def efficiency(self, flops: Any) -> Any:
        """Measured efficiency at GEMM size ``flops`` (log-linear interpolation, clamped)."""
        import numpy as np

        return _interp_log(self.efficiency_points or [[1.0, self.gemm_efficiency]], np.asarray(flops, dtype=float))


def _interp_log(points: list[list[float]], flops: Any) -> Any:
    """Log-linear interpolation of ``[[flops, efficiency], ...]`` at ``flops``, clamped at both ends."""
    import numpy as np

    pts = sorted(points)
    xs = np.log([max(p[0], 1.0) for p in pts])
    ys = [max(p[1], 1e-6) for p in pts]
    return np.interp(np.log(np.maximum(flops, 1.0)), xs, ys)


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
    base latency of one collective call. ``nccl`` (``ampere``, ``hopper``): collectives follow
    NCCL's ring model with its protocol choice (:mod:`lightning_distmm.planner.cost.nccl`) instead
    of ``collective_latency`` and the links' latencies (which remain the point-to-point latencies).
    """

    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra: Link
    inter: Link
    collective_latency: float = 0.0
    notes: str = ""
    nccl: str | None = None  # GPU generation for NCCL's protocol model (cost/nccl.py); None: one measured ring

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def with_world(self, world_size: int) -> Cluster:
        """The same hardware with ``world_size`` devices (whole nodes where possible)."""
        dpn = min(self.devices_per_node, world_size)
        if world_size % dpn:
            raise ValueError(f"{world_size} devices do not fill nodes of {dpn} devices")
        return dataclasses.replace(self, nodes=world_size // dpn, devices_per_node=dpn)

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
                **(
                    {"gemm_class_efficiency": self.device.gemm_class_efficiency}
                    if self.device.gemm_class_efficiency
                    else {}
                ),
                **(
                    {"attention_efficiency": _r(self.device.attention_efficiency)}
                    if self.device.attention_efficiency is not None
                    else {}
                ),
                **(
                    {"memory_efficiency": _r(self.device.memory_efficiency)}
                    if self.device.memory_efficiency != 1.0
                    else {}
                ),
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
            **({"nccl": self.nccl} if self.nccl else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """Build from a preset mapping (units as in the YAML: GB, TFLOP/s, GB/s, microseconds).

        Pure: a spec that asks to be measured on this machine (``measure: true``) is refused here;
        :func:`lightning_distmm.planner.measure.local.load_cluster` measures it.
        """
        data = dict(data)
        if data.get("measure"):
            raise ValueError(
                f"cluster spec {data.get('name', '?')!r} is measured on this machine (measure: true):"
                " load it with lightning_distmm.planner.measure.local.load_cluster, which measures it"
            )
        if data.get("calibration"):
            raise ValueError(
                f"cluster spec {data.get('name', '?')!r} is priced from a calibration file: load it with"
                " lightning_distmm.planner.measure.local.load_cluster (lightning_distmm.planner.machine.calibration)"
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
            gemm_class_efficiency=[list(map(float, p)) for p in dev["gemm_class_efficiency"]]
            if dev.get("gemm_class_efficiency")
            else None,
            attention_efficiency=float(dev["attention_efficiency"])
            if dev.get("attention_efficiency") is not None
            else None,
            memory_efficiency=float(dev.get("memory_efficiency", 1.0)),
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
            nccl=str(data["nccl"]) if data.get("nccl") else None,
        )


def _r(x: float) -> float:
    """Round away float noise of unit conversions (so YAML round trips are exact)."""
    return float(f"{x:.12g}")


__all__ = ["Device", "Link", "Cluster", "list_presets", "CONF_DIR", "GB"]
