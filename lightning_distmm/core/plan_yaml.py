"""A plan's YAML: written with ``yaml.safe_dump``, read with a loader that refuses a key given twice,
every error naming the file (when there is one) and the key."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import yaml

from lightning_distmm.core.plan_schema import PlanError, UniqueKeyLoader


def dump_plan(data: dict[str, Any], path: str | Path | None = None) -> str:
    """``data`` (a plan's plain data) as YAML, also written to ``path`` when given."""
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
    if path is not None:
        Path(path).write_text(text)
    return text


def load_plan_data(source: str | Path) -> tuple[Any, str]:
    """The plain data of a YAML file path or a YAML string, and the prefix its errors carry (the
    file's name). Malformed YAML and a key given twice (YAML's usual last-one-wins would drop a
    tower's settings without a word) fail here."""
    is_path = looks_like_path(source)
    text = Path(source).read_text() if is_path else str(source)
    where = f"{source}: " if is_path else ""
    stream = io.StringIO(text)
    stream.name = str(source) if is_path else "<string>"  # PyYAML's error marks name the stream
    try:
        return yaml.load(stream, Loader=UniqueKeyLoader), where  # a SafeLoader subclass: no arbitrary objects
    except PlanError as e:
        raise PlanError(f"{where}{e}") from None
    except yaml.YAMLError as e:
        raise PlanError(f"{where}not valid YAML: {e}") from None


def looks_like_path(source: str | Path) -> bool:
    if isinstance(source, Path):
        return True
    return "\n" not in source and (source.endswith((".yaml", ".yml")) or Path(source).is_file())
