"""Write the embedded shapes data as WebDataset tar shards: ``<out>/train/shard-*.tar``, ``<out>/val/shard-*.tar``.

    python recipes/make_shards.py --out data/shapes_wds --train 4000 --val 256 --per-shard 1000
    python recipes/train.py experiment=clip_shapes_wds data.train=data/shapes_wds/train data.val=data/shapes_wds/val

Each sample is two members, ``<key>.png`` (the shapes render in ``[0, 1]`` saved as an 8-bit PNG,
or ``.jpg`` with ``--format jpg``) and ``<key>.txt`` (the caption), written with ``webdataset``'s
``ShardWriter``: the layout open_clip's ``--dataset-type webdataset`` and img2dataset use. The
samples are those of ``recipes/make_csv.py`` (the same renders and captions, in the same order).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from PIL import Image

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from shapes_files import shapes_parser, shapes_splits  # noqa: E402

from lightning_distmm.data.demo.shapes import ShapesDataset  # noqa: E402


def write_split(dataset: ShapesDataset, out: Path, name: str, per_shard: int, fmt: str = "png") -> list[Path]:
    """``out/<name>/shard-%06d.tar``, ``per_shard`` samples each, keys ``<name>_<i>``."""
    import webdataset as wds

    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("shard-*.tar"):
        old.unlink()
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(len(dataset)):
            pixels, caption = dataset.for_file(i)
            encoded = io.BytesIO()
            Image.fromarray(pixels).save(encoded, format="PNG" if fmt == "png" else "JPEG", quality=95)
            sink.write({"__key__": f"{name}_{i:06d}", fmt: encoded.getvalue(), "txt": caption})
    return sorted(folder.glob("shard-*.tar"))


def main(argv: list[str] | None = None) -> tuple[list[Path], list[Path]]:
    parser = shapes_parser(__doc__, "data/shapes_wds")
    parser.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    parser.add_argument("--format", choices=["png", "jpg"], default="png", help="the image members' encoding")
    args = parser.parse_args(argv)
    out = Path(args.out)
    train_set, val_set = shapes_splits(args)
    train = write_split(train_set, out, "train", args.per_shard, args.format)
    val = write_split(val_set, out, "val", args.per_shard, args.format)
    print(f"wrote {len(train)} training shard(s) ({args.train} pairs) in {out / 'train'}")
    print(f"wrote {len(val)} held-out shard(s) ({args.val} pairs) in {out / 'val'}")
    return train, val


if __name__ == "__main__":
    main()
