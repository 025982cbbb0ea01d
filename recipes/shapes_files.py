"""What the recipes that write the embedded shapes pairs to files share (``make_csv.py``,
``make_shards.py``, ``make_litdata.py``): their command line and the two splits they write, so
that the three formats hold the same samples in the same order."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from lightning_distmm.data.demo.shapes import ShapesDataset  # noqa: E402


def shapes_parser(doc: str, out: str) -> argparse.ArgumentParser:
    """The common arguments (``--out``, ``--train``, ``--val``, ``--image-size``, ``--seed``); the
    recipe adds its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default=out, help="output folder")
    parser.add_argument("--train", type=int, default=4000, help="training pairs")
    parser.add_argument("--val", type=int, default=256, help="held-out pairs (<= 288: every description unique)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the data seed")
    return parser


def shapes_splits(args: argparse.Namespace) -> tuple[ShapesDataset, ShapesDataset]:
    """The training and held-out splits ``args`` names."""
    common = {"seed": args.seed, "image_size": args.image_size}
    return ShapesDataset("train", args.train, **common), ShapesDataset("val", args.val, **common)
