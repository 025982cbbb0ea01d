"""Reading configuration: the ``conf/`` folder of presets, and Hydra/OmegaConf containers as plain Python.

The planner takes model and cluster configs either as plain mappings or as the Hydra recipe's
``DictConfig``; :func:`to_plain` turns the latter into the former without importing omegaconf
unless it is handed one (the planner does not depend on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def to_plain(obj: Any) -> Any:
    """OmegaConf containers (resolved) and nested mappings and sequences as plain dicts and lists."""
    if type(obj).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def list_presets(kind: str = "cluster") -> list[str]:
    """Names of the presets of one config group (``conf/<kind>/*.yaml``)."""
    return sorted(p.stem for p in (CONF_DIR / kind).glob("*.yaml"))


__all__ = ["CONF_DIR", "to_plain", "list_presets"]
