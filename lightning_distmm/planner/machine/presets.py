"""Cluster specs read as they are written: a preset name (``conf/cluster/<name>.yaml``), a YAML
path or a mapping, as a :class:`~lightning_distmm.planner.machine.cluster.Cluster`.

Nothing here measures: a spec that says ``measure: true`` (``local_cpu``) is this machine, and
:func:`lightning_distmm.planner.measure.local.load_cluster` measures it before anything else is
read; every other spec it hands to :func:`read_cluster`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_distmm.planner.machine.calibration import cluster_from_spec
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.machine.config import CONF_DIR, list_presets, to_plain


def cluster_spec(spec: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The plain mapping a spec stands for: a mapping as it is, a YAML path read, a bare name read
    from ``conf/cluster/<name>.yaml``."""
    if isinstance(spec, Mapping):
        return to_plain(spec)
    import yaml

    path = Path(spec)
    if not path.suffix:
        path = CONF_DIR / "cluster" / f"{spec}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no cluster preset {str(spec)!r}; presets: {list_presets('cluster')}")
    return yaml.safe_load(path.read_text())


def read_cluster(spec: str | Path | Mapping[str, Any] | Cluster) -> Cluster:
    """A :class:`Cluster` from a spec that needs no measuring. A spec with ``calibration: <json>``
    is a device measured earlier by ``benchmarks/gpu_calibrate.py`` on the links of its ``base``
    preset (:func:`~lightning_distmm.planner.machine.calibration.cluster_from_spec`); one with
    ``measure: true`` is refused (:meth:`Cluster.from_dict` says where it is measured)."""
    if isinstance(spec, Cluster):
        return spec
    data = cluster_spec(spec)
    if data.get("calibration"):
        return cluster_from_spec(data, base=read_cluster(str(data.get("base", "h200_8x8"))))
    return Cluster.from_dict(data)


__all__ = ["cluster_spec", "read_cluster"]
