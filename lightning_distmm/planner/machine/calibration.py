"""A measured device profile: the JSON written by ``benchmarks/gpu_calibrate.py``, as a :class:`Cluster`.

Why: the GPU presets price a GEMM with a datasheet peak and published efficiencies (the maximum
achievable matmul FLOPS of one size class, FlashAttention's fraction of peak, the bandwidth
memory-bound kernels reach; docs/planner.md, "Cluster"). A calibration run on one GPU measures, for
a grid of transformer-layer GEMM shapes, the fraction of peak really reached; here those
measurements become an efficiency per GEMM size class (:attr:`Device.gemm_class_efficiency`) that
the roofline of :meth:`Device.gemm_time` uses in place of the preset's. A class is a decade of GEMM FLOPs;
its efficiency is the median over its measured GEMMs of the *kernel* efficiency, the measured
fraction divided by the wave quantisation the roofline applies for that shape
(:meth:`Device.wave_efficiency`), so that the roofline reproduces the measured times and still
quantises shapes that were not measured (a tensor-parallel split's narrower GEMMs). The measured
copy bandwidth replaces the datasheet's HBM bandwidth. One GPU measures no link: nodes, links and
the NCCL model come from a base preset (``h200_8x8`` by default), and so does the attention efficiency
(the run times GEMMs and whole towers, not attention alone).

A preset names the file (``conf/cluster/h200_measured.yaml``)::

    name: h200_measured
    calibration: benchmarks/results/h200_calibration.json   # relative to the repository root
    base: h200_8x8

Reading JSON measures nothing: this module imports neither torch nor anything that does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_distmm.planner.machine.cluster import GB, Cluster, Device
from lightning_distmm.planner.machine.config import CONF_DIR

SCHEMA = "lightning_distmm.gpu_calibration/1"
REPO_DIR = CONF_DIR.parent
REQUIRED = ("schema", "kind", "device", "gemm", "models", "nccl", "budget", "errors")
GEMM_KEYS = ("m", "n", "k", "flops", "seconds", "fraction_of_peak")


class CalibrationError(ValueError):
    """A calibration file that is missing, of another schema, or without GEMM measurements."""


def load_calibration(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The calibration JSON as a dict, checked: schema, required sections, GEMM rows' fields.

    A relative path is tried as given, then from the repository root (presets name files so)."""
    if isinstance(source, Mapping):
        data = dict(source)
        where = "<mapping>"
    else:
        path = Path(source)
        if not path.is_file() and not path.is_absolute() and (REPO_DIR / path).is_file():
            path = REPO_DIR / path
        if not path.is_file():
            raise CalibrationError(
                f"no calibration file {str(source)!r}: run benchmarks/gpu_calibrate.py on the GPU first"
                " (docs/planner.md, 'Calibrating on a lent GPU')"
            )
        data = json.loads(path.read_text())
        where = str(path)
    if data.get("schema") != SCHEMA:
        raise CalibrationError(f"{where}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise CalibrationError(f"{where}: lacks section(s) {missing}")
    if not data["gemm"]:
        raise CalibrationError(f"{where}: no GEMM was measured (budget: {data['budget']})")
    for row in data["gemm"]:
        lacking = [k for k in GEMM_KEYS if k not in row]
        if lacking:
            raise CalibrationError(f"{where}: GEMM row {row.get('label', row)} lacks {lacking}")
    if not data["device"].get("peak_tflops"):
        raise CalibrationError(f"{where}: no peak FLOP/s recorded for the device")
    return data


def gemm_class_efficiency(calibration: Mapping[str, Any], sm_count: int | None) -> list[list[float]]:
    """``[[flops, efficiency], ...]``, one point per decade of GEMM FLOPs that was measured.

    ``flops`` is the geometric mean of the class's GEMMs; ``efficiency`` the median over them of
    ``fraction_of_peak / wave_efficiency(m, n)`` (at most 1) with ``sm_count`` SMs (no division
    without one: CPUs)."""
    probe = Device("probe", 1.0, 1.0, 1.0, sm_count=sm_count)
    classes: dict[int, list[tuple[float, float]]] = {}
    for row in calibration["gemm"]:
        wave = float(probe.wave_efficiency(row["m"], row["n"]))
        eff = min(1.0, float(row["fraction_of_peak"]) / max(wave, 1e-9))
        classes.setdefault(math.floor(math.log10(row["flops"])), []).append((float(row["flops"]), eff))
    points = []
    for _, rows in sorted(classes.items()):
        effs = sorted(e for _, e in rows)
        mid = len(effs) // 2
        median = effs[mid] if len(effs) % 2 else (effs[mid - 1] + effs[mid]) / 2
        centre = math.exp(sum(math.log(f) for f, _ in rows) / len(rows))
        points.append([centre, median])
    return points


def device_from_calibration(source: str | Path | Mapping[str, Any], base: Device | None = None) -> Device:
    """A :class:`Device` priced from a calibration: datasheet peak, measured copy bandwidth (the
    streaming bandwidth itself: ``memory_efficiency`` 1), efficiency per GEMM size class, memory and
    SM count from the driver. ``base`` supplies what one device's run does not measure (kernel
    overhead, attention efficiency) and what it failed to (bandwidth)."""
    cal = load_calibration(source)
    dev = cal["device"]
    sm = int(dev["sm_count"]) if dev.get("sm_count") else None
    classes = gemm_class_efficiency(cal, sm)
    bandwidth = dev.get("memory_bandwidth_gbps")
    memory_efficiency = 1.0
    if bandwidth:
        bandwidth = float(bandwidth) * GB
    elif base is not None:
        bandwidth, memory_efficiency = base.memory_bandwidth, base.memory_efficiency
    else:
        raise CalibrationError("the calibration has no copy bandwidth and no base device supplies one")
    return Device(
        name=f"{dev['name']} (measured)",
        memory=float(dev["memory_gb"]) * GB,
        peak_flops=float(dev["peak_tflops"]) * 1e12,
        memory_bandwidth=bandwidth,
        gemm_efficiency=max(e for _, e in classes),  # what large GEMMs sustain; the classes are used
        kernel_overhead=base.kernel_overhead if base is not None else 0.0,
        sm_count=sm,
        gemm_class_efficiency=classes,
        attention_efficiency=base.attention_efficiency if base is not None else None,
        memory_efficiency=memory_efficiency,
    )


def cluster_from_calibration(source: str | Path | Mapping[str, Any], base: Cluster, name: str | None = None) -> Cluster:
    """``base``'s nodes, links and NCCL model with the device measured in ``source``."""
    base_cluster = base
    device = device_from_calibration(source, base_cluster.device)
    cal = load_calibration(source)
    return dataclasses.replace(
        base_cluster,
        name=name or f"{base_cluster.name}_measured",
        device=device,
        notes=f"device measured by benchmarks/gpu_calibrate.py ({cal['kind']}, {cal.get('created', '?')});"
        f" links from {base_cluster.name}",
    )


def cluster_from_spec(data: Mapping[str, Any], base: Cluster) -> Cluster:
    """A preset that names a calibration file (keys ``calibration``, ``base``, ``name``), over the
    ``base`` cluster the caller loaded (:func:`~lightning_distmm.planner.machine.presets.read_cluster`
    resolves the preset name)."""
    return cluster_from_calibration(data["calibration"], base=base, name=str(data.get("name") or "") or None)


def tower_steps(source: str | Path | Mapping[str, Any]) -> list[dict[str, Any]]:
    """The measured tower steps (model, microbatch, seconds, MFU, ...): the sanity check that a
    whole step's predicted MFU lands near what the device reached."""
    return [dict(r) for r in load_calibration(source)["models"] if not r.get("oom")]


__all__ = [
    "SCHEMA",
    "CalibrationError",
    "load_calibration",
    "gemm_class_efficiency",
    "device_from_calibration",
    "cluster_from_calibration",
    "cluster_from_spec",
    "tower_steps",
]
