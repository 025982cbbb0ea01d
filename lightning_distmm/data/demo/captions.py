"""The caption grammar of the shapes dataset: colours, shapes, places, templates, and the words they use.

Plain data, imported by both :mod:`lightning_distmm.data.demo.shapes` (which renders and describes
samples) and :mod:`lightning_distmm.data.demo.tokenizer` (whose vocabulary is these words), so the
imports run one way: shapes -> tokenizer -> captions.
"""

from __future__ import annotations

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.95, 0.12, 0.10),
    "green": (0.10, 0.80, 0.15),
    "blue": (0.15, 0.30, 1.00),
    "yellow": (0.98, 0.90, 0.10),
    "purple": (0.60, 0.15, 0.85),
    "cyan": (0.10, 0.90, 0.90),
    "pink": (1.00, 0.55, 0.75),
    "white": (0.95, 0.95, 0.95),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
#: (row, column) of the 3 x 3 grid -> how a caption says it
POSITIONS: tuple[tuple[str, str], ...] = (
    ("top left", "at the top left"),
    ("top", "at the top"),
    ("top right", "at the top right"),
    ("left", "on the left"),
    ("center", "in the center"),
    ("right", "on the right"),
    ("bottom left", "at the bottom left"),
    ("bottom", "at the bottom"),
    ("bottom right", "at the bottom right"),
)
TEMPLATES: tuple[str, ...] = (
    "a {color} {shape} {where}",
    "a picture of a {color} {shape} {where}",
    "there is a {color} {shape} {where}",
    "{where} there is a {color} {shape}",
)


def vocabulary() -> list[str]:
    """Every word a caption can contain."""
    words: set[str] = set()
    for template in TEMPLATES:
        words.update(w for w in template.split() if not w.startswith("{"))
    for _, where in POSITIONS:
        words.update(where.split())
    words.update(COLORS)
    words.update(SHAPES)
    return sorted(words)


__all__ = ["COLORS", "SHAPES", "POSITIONS", "TEMPLATES", "vocabulary"]
