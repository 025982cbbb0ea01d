"""Labelled images in the ImageNet layout (``root/<class>/<image>``) for zero-shot classification on
a user's own classes, and open_clip's prompt templates.

``ClassFolder`` gives ``image`` and ``label`` fields (loading only those asked for) and ``classnames``:
the folder names, or readable names from a file (ImageNet's ``n01440764`` -> ``tench``).
:class:`~lightning_distmm.models.evaluation.ZeroShotClassification` reads all three; the recipe builds
them from ``zeroshot.folder=<root>`` (``recipes/train.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_distmm.data.datasets.pairs import IMAGE_EXTENSIONS, PairDecoding
from lightning_distmm.data.samples.fields import FieldDataset

#: open_clip's ``SIMPLE_IMAGENET_TEMPLATES`` (open_clip/zero_shot_metadata.py), as format strings
SIMPLE_TEMPLATES: tuple[str, ...] = (
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
)


def templates(spec: str | Sequence[str]) -> tuple[str, ...]:
    """Prompt templates: a list of ``{}`` strings, ``"simple"`` (open_clip's 7 ImageNet templates, bundled
    here) or ``"openai"`` (the 80 of CLIP's paper, read from an installed open_clip, offline)."""
    if isinstance(spec, str):
        if spec == "simple":
            return SIMPLE_TEMPLATES
        if spec == "openai":
            try:
                from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES
            except ImportError as e:
                raise ImportError(
                    "templates='openai' reads open_clip's list: install open_clip, or pass 'simple'"
                ) from e
            return tuple(t("{}") for t in OPENAI_IMAGENET_TEMPLATES)
        spec = [spec]
    out = tuple(str(t) for t in spec)
    bad = [t for t in out if t.count("{}") != 1]
    if not out or bad:
        raise ValueError(f"each template needs exactly one '{{}}' for the class name; got {bad or 'none'}")
    return out


class ClassFolder(PairDecoding, FieldDataset):
    """``root/<class>/<image>``: one class per sub-folder (sorted by name: label 0, 1, ...), images
    searched recursively inside each.

    Args:
        root: the folder of class folders.
        classnames: readable class names: None (the folder names, ``_`` read as a space), a JSON file
            ``{folder: name}``, a text file of one name per line in sorted folder order, or a list.
        transform: a PIL image -> tensor callable (the image tower's eval transform).
        extensions: image file suffixes.
    """

    fields = ("image", "label")

    def __init__(
        self,
        root: str | os.PathLike,
        classnames: str | os.PathLike | Sequence[str] | None = None,
        transform: Callable[[Any], Tensor] | None = None,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
    ):
        super().__init__(transform)
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise FileNotFoundError(f"ClassFolder: no folder {str(self.root)!r}")
        exts = tuple(e.lower() for e in extensions)
        self.folders = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.samples: list[tuple[Path, int]] = []
        empty = []
        for label, name in enumerate(self.folders):
            images = sorted(p for p in (self.root / name).rglob("*") if p.is_file() and p.suffix.lower() in exts)
            empty += [name] if not images else []
            self.samples += [(p, label) for p in images]
        if len(self.folders) < 2 or empty:
            raise ValueError(
                f"{self.root}: zero-shot classification needs the ImageNet layout, root/<class>/<image>, with at least"
                f" two classes holding images; found class folders {self.folders[:8]}"
                + (f", of which {empty[:8]} hold no images (suffixes {list(exts)})" if empty else "")
            )
        self.classnames = _classnames(classnames, self.folders)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        fields = tuple(fields)
        unknown = [f for f in fields if f not in self.fields]
        if unknown:
            raise KeyError(f"ClassFolder has no field(s) {unknown}; fields are {self.fields}")
        path, label = self.samples[index]
        out: dict[str, Any] = {"label": label}
        if "image" in fields:
            out.update(self.decode_pair(("image",), path, str, f"{self.root} image {path}"))
        return {f: out[f] for f in fields}

    def __repr__(self) -> str:
        return f"ClassFolder({str(self.root)!r}, {len(self.classnames)} classes, {len(self)} images)"


def _classnames(spec: str | os.PathLike | Sequence[str] | None, folders: list[str]) -> list[str]:
    if spec is None:
        return [f.replace("_", " ") for f in folders]
    if isinstance(spec, str | os.PathLike):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no classnames file {str(path)!r}")
        if path.suffix.lower() == ".json":
            table = json.loads(path.read_text(encoding="utf-8"))
            missing = [f for f in folders if f not in table]
            if missing:
                raise KeyError(f"{path} names no class for folder(s) {missing[:8]}")
            return [str(table[f]) for f in folders]
        spec = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    names = [str(s) for s in spec]
    if len(names) != len(folders):
        raise ValueError(f"{len(names)} class names for {len(folders)} class folders ({folders[:4]} ...)")
    return names


__all__ = ["SIMPLE_TEMPLATES", "ClassFolder", "templates"]
