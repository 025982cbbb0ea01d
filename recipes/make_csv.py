"""Write the embedded shapes data as files in open_clip's CSV format: PNGs + ``train.csv`` / ``val.csv``.

    python recipes/make_csv.py --out data/shapes_csv --train 4000 --val 256
    python recipes/train.py experiment=clip_shapes_csv data.path=data/shapes_csv/train.csv data.val_path=data/shapes_csv/val.csv

Each CSV has the columns ``filepath`` (relative to the CSV) and ``title`` (the caption), comma
separated: ``open_clip``'s ``--csv-img-key filepath --csv-caption-key title --csv-separator ,``.
The images are the shapes renders in ``[0, 1]`` saved as 8-bit PNGs.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from PIL import Image

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from shapes_files import shapes_parser, shapes_splits  # noqa: E402

from lightning_distmm.data.demo.shapes import ShapesDataset  # noqa: E402


def write_split(dataset: ShapesDataset, out: Path, name: str) -> Path:
    """``out/images/<name>_<i>.png`` for every sample and ``out/<name>.csv`` listing them."""
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["filepath", "title"])
        for i in range(len(dataset)):
            pixels, caption = dataset.for_file(i)
            file = images / f"{name}_{i:06d}.png"
            Image.fromarray(pixels).save(file)
            writer.writerow([file.relative_to(out).as_posix(), caption])
    return path


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    parser = shapes_parser(__doc__, "data/shapes_csv")
    args = parser.parse_args(argv)
    out = Path(args.out)
    train_set, val_set = shapes_splits(args)
    train = write_split(train_set, out, "train")
    val = write_split(val_set, out, "val")
    print(f"wrote {train} ({args.train} pairs) and {val} ({args.val} pairs)")
    return train, val


if __name__ == "__main__":
    main()
