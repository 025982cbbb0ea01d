"""Write the embedded shapes data in LitData's format: ``<out>/train`` and ``<out>/val`` folders.

    python recipes/make_litdata.py --out data/shapes_litdata --train 4000 --val 256
    python recipes/train.py experiment=clip_litdata data.train=data/shapes_litdata/train data.val=data/shapes_litdata/val

Each item is ``{"image": PNG bytes, "caption": str}`` (the renders and captions of
``recipes/make_csv.py``, in the same order), written in chunks of ``--per-chunk`` items by LitData's
``BinaryWriter``: what ``litdata.optimize`` writes, in this process (``optimize`` starts worker
processes, which a few thousand small items do not need). ``litdata.StreamingDataset`` reads the
folders; under distmm ``lightning_distmm.data.datasets.litdata_pairs.LitDataPairs`` reads them as one
process does, and each rank decodes only its rows' fields.
"""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

from PIL import Image

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from shapes_files import shapes_parser, shapes_splits  # noqa: E402

from lightning_distmm.data.demo.shapes import ShapesDataset  # noqa: E402


def write_split(dataset: ShapesDataset, folder: Path, per_chunk: int) -> Path:
    """``folder`` (emptied first): the items of ``dataset``, ``per_chunk`` to a chunk."""
    from litdata.streaming.writer import BinaryWriter

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    writer = BinaryWriter(str(folder), chunk_size=per_chunk)
    for i in range(len(dataset)):
        pixels, caption = dataset.for_file(i)
        encoded = io.BytesIO()
        Image.fromarray(pixels).save(encoded, format="PNG")
        writer[i] = {"image": encoded.getvalue(), "caption": caption}
    writer.done()
    writer.merge(1)
    return folder


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    parser = shapes_parser(__doc__, "data/shapes_litdata")
    parser.add_argument("--per-chunk", type=int, default=500, help="items per chunk")
    args = parser.parse_args(argv)
    out = Path(args.out)
    train_set, val_set = shapes_splits(args)
    train = write_split(train_set, out / "train", args.per_chunk)
    val = write_split(val_set, out / "val", args.per_chunk)
    print(f"wrote {args.train} training pairs in {train}, {args.val} held-out pairs in {val}")
    return train, val


if __name__ == "__main__":
    main()
