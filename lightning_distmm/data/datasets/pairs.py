"""Image-caption pair datasets in the formats people keep them in, decoded per tower.

- :class:`CsvPairs`: open_clip's CSV/TSV format (one row per pair: an image path column and a
  caption column, ``filepath`` / ``title`` by default, as ``--csv-img-key`` / ``--csv-caption-key``).
- :class:`ImageFolderPairs`: a folder of images with a sidecar ``<stem>.txt`` caption per image,
  or one captions file (JSON ``{relative path: caption}`` or ``path<TAB>caption`` lines).

Both are :class:`~lightning_distmm.data.samples.fields.FieldDataset` s: ``load(index, fields)`` does only
the work of the fields asked for. Under distmm an image rank opens and decodes the image file and
runs the transform, never the tokenizer; a text rank tokenizes, never touching the image file.
Fields: ``image`` (the transform's tensor), ``caption`` (str), ``input_ids`` / ``attention_mask``.

``decoded`` counts, per field, the samples that produced it in this process, and ``decode_log``
(a file path) appends one JSON line ``[rank, index, fields]`` per ``load``, so work done in other
processes (distmm ranks, DataLoader workers) can be checked too.
"""

from __future__ import annotations

import csv
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_distmm.data.datasets.preprocess import CaptionTokenizer
from lightning_distmm.data.samples.fields import FieldDataset, SampleDecodeError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TOKEN_FIELDS = ("input_ids", "attention_mask")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class PairDecoding:
    """What every pair dataset shares: the image transform, a tokenizer built on first use (a rank
    that never tokenizes never loads it), decoding only the fields asked for, and the counters.

    Args:
        transform: a PIL image -> tensor callable (see :func:`~lightning_distmm.data.datasets.preprocess.image_transform`);
            None gives ``torchvision``'s ``ToTensor`` (no resizing).
        tokenizer: a :class:`~lightning_distmm.data.datasets.preprocess.CaptionTokenizer`, or what its
            constructor takes (None: the embedded tokenizer; a local directory; a ``tokenizer.json``).
        context_length: token width when ``tokenizer`` is not already a ``CaptionTokenizer``.
        decode_log: append ``[rank, sample, fields]`` per decoded sample to this file (for checks across processes).
    """

    fields: tuple[str, ...] = ("image", "caption", *TOKEN_FIELDS)

    def __init__(
        self,
        transform: Callable[[Any], Tensor] | None = None,
        tokenizer: Any = None,
        context_length: int = 77,
        decode_log: str | os.PathLike | None = None,
    ):
        if transform is None:
            from torchvision.transforms import ToTensor

            transform = ToTensor()
        self.transform = transform
        self._tokenizer_arg = tokenizer
        self._context_length = int(context_length)
        self._tokenizer: CaptionTokenizer | None = tokenizer if isinstance(tokenizer, CaptionTokenizer) else None
        self.decode_log = str(decode_log) if decode_log is not None else None
        self.decoded: Counter[str] = Counter()

    @property
    def tokenizer(self) -> CaptionTokenizer:
        """Built on first use, so that a rank that never tokenizes never loads the tokenizer."""
        if self._tokenizer is None:
            self._tokenizer = CaptionTokenizer(self._tokenizer_arg, self._context_length)
        return self._tokenizer

    def check_fields(self, fields: Iterable[str]) -> tuple[str, ...]:
        fields = tuple(fields)
        unknown = [f for f in fields if f not in self.fields]
        if unknown:
            raise KeyError(f"{type(self).__name__} has no field(s) {unknown}; fields are {self.fields}")
        return fields

    def decode_pair(
        self, fields: tuple[str, ...], image: Any, caption: Callable[[], str], where: str = "a sample"
    ) -> dict[str, Any]:
        """``fields`` of one pair: ``image`` is what ``PIL.Image.open`` reads (a path, a file object),
        opened only when the image is asked for; ``caption()`` is called only for text fields. An image
        that cannot be read raises :class:`SampleDecodeError` naming ``where`` (the sample)."""
        out: dict[str, Any] = {}
        if "image" in fields:
            from PIL import Image

            try:
                with Image.open(image) as img:
                    out["image"] = self.transform(img.convert("RGB"))
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
                raise SampleDecodeError(f"{where}: cannot read its image: {type(err).__name__}: {err}") from err
        if any(f in fields for f in ("caption", *TOKEN_FIELDS)):
            text = caption()
            out["caption"] = text
            if any(f in fields for f in TOKEN_FIELDS):
                out.update(self.tokenizer(text))
        return {f: out[f] for f in fields}

    def record(self, sample: Any, fields: tuple[str, ...]) -> None:
        """Count a decoded sample's fields (``decoded``) and log them (``decode_log``)."""
        self.decoded.update(fields)
        if self.decode_log is not None:
            with open(self.decode_log, "a") as f:
                f.write(json.dumps([_rank(), sample, sorted(fields)]) + "\n")


class PairDataset(PairDecoding, FieldDataset):
    """Image file + caption pairs; subclasses say where sample ``index``'s image and caption are.

    Args:
        transform, tokenizer, context_length, decode_log: see :class:`PairDecoding`.
    """

    # ------------------------------------------------------------------ what subclasses provide
    def image_path(self, index: int) -> Path:
        raise NotImplementedError

    def caption(self, index: int) -> str:
        raise NotImplementedError

    # ------------------------------------------------------------------ decoding
    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        fields = self.check_fields(fields)
        index = self._check_index(index)
        out = self.decode_pair(fields, self.image_path(index), lambda: self.caption(index), self.describe(index))
        self.record(index, fields)
        return out

    def describe(self, index: int) -> str:
        """Sample ``index`` in words, for error messages: where it comes from."""
        return f"{type(self).__name__} sample {index} ({self.image_path(index)})"

    def _check_index(self, index: int) -> int:
        n = len(self)
        index = int(index)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {type(self).__name__} of {n} samples")
        return index

    def __len__(self) -> int:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:  # workers get a fresh counter; the tokenizer object pickles
        state = dict(self.__dict__)
        state["decoded"] = Counter()
        return state


class CsvPairs(PairDataset):
    """open_clip's CSV/TSV image-caption format.

    Args:
        path: the CSV (``.csv``: comma-separated) or TSV (anything else: tab-separated, open_clip's default).
        img_key: the column of image paths (open_clip: ``filepath``).
        caption_key: the column of captions (open_clip: ``title``).
        sep: the separator, overriding the guess from the suffix.
        root: what relative image paths are relative to (default: the CSV's folder).
        transform, tokenizer, context_length, decode_log: see :class:`PairDataset`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        img_key: str = "filepath",
        caption_key: str = "title",
        sep: str | None = None,
        root: str | os.PathLike | None = None,
        transform: Callable[[Any], Tensor] | None = None,
        tokenizer: Any = None,
        context_length: int = 77,
        decode_log: str | os.PathLike | None = None,
    ):
        super().__init__(transform, tokenizer, context_length, decode_log)
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"CsvPairs: no file {str(self.path)!r}")
        sep = _separator(sep) if sep is not None else ("," if self.path.suffix.lower() == ".csv" else "\t")
        if self.path.stat().st_size == 0:
            raise ValueError(f"{self.path} is empty: expected a header line ({img_key}, {caption_key}) and rows")
        self.root = Path(root).expanduser() if root is not None else self.path.parent
        with open(self.path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter=sep)
            columns = reader.fieldnames or []
            missing = [k for k in (img_key, caption_key) if k not in columns]
            if missing:
                raise KeyError(
                    f"{self.path}: no column(s) {missing} (separator {sep!r}); its columns are {columns}:"
                    f" pass img_key= / caption_key= (open_clip's --csv-img-key / --csv-caption-key) or sep="
                )
            rows = [(r[img_key], r[caption_key]) for r in reader]
        if not rows:
            raise ValueError(f"{self.path} has a header but no rows")
        self._images = [p for p, _ in rows]
        self._captions = [c for _, c in rows]

    def __len__(self) -> int:
        return len(self._images)

    def image_path(self, index: int) -> Path:
        path = Path(self._images[index]).expanduser()
        return path if path.is_absolute() else self.root / path

    def caption(self, index: int) -> str:
        return self._captions[index]

    def describe(self, index: int) -> str:
        return f"{self.path} row {index + 2} (image {self._images[index]!r} -> {self.image_path(index)})"

    def __repr__(self) -> str:
        return f"CsvPairs({str(self.path)!r}, {len(self)} pairs)"


class ImageFolderPairs(PairDataset):
    """A folder of images (searched recursively, sorted by path) with their captions.

    Args:
        root: the folder.
        captions: None for a sidecar ``<image stem>.txt`` next to each image; or a captions file:
            ``.json`` (``{path relative to root: caption}``) or lines ``path<TAB>caption``.
            Images without a caption are an error (named), not silently skipped.
        extensions: image file suffixes (lower case).
        transform, tokenizer, context_length, decode_log: see :class:`PairDataset`.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        captions: str | os.PathLike | None = None,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
        transform: Callable[[Any], Tensor] | None = None,
        tokenizer: Any = None,
        context_length: int = 77,
        decode_log: str | os.PathLike | None = None,
    ):
        super().__init__(transform, tokenizer, context_length, decode_log)
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise FileNotFoundError(f"ImageFolderPairs: no folder {str(self.root)!r}")
        exts = tuple(e.lower() for e in extensions)
        self._images = sorted(p for p in self.root.rglob("*") if p.is_file() and p.suffix.lower() in exts)
        if not self._images:
            raise ValueError(f"{self.root} holds no image files (suffixes {list(exts)})")
        self._captions: list[str] | None = None
        if captions is not None:
            table = _read_captions(Path(captions).expanduser())
            keys = [p.relative_to(self.root).as_posix() for p in self._images]
            missing = [k for k in keys if k not in table]
            if missing:
                raise KeyError(f"{captions} has no caption for {len(missing)} image(s), e.g. {missing[:3]}")
            self._captions = [table[k] for k in keys]
        else:
            missing = [p for p in self._images if not p.with_suffix(".txt").is_file()]
            if missing:
                raise FileNotFoundError(
                    f"{len(missing)} image(s) under {self.root} have no sidecar caption file, e.g."
                    f" {[str(p.with_suffix('.txt')) for p in missing[:3]]}; or pass captions= (a JSON or TSV file)"
                )

    def __len__(self) -> int:
        return len(self._images)

    def image_path(self, index: int) -> Path:
        return self._images[index]

    def caption(self, index: int) -> str:
        if self._captions is not None:
            return self._captions[index]
        return self._images[index].with_suffix(".txt").read_text(encoding="utf-8").strip()

    def __repr__(self) -> str:
        return f"ImageFolderPairs({str(self.root)!r}, {len(self)} pairs)"


def _separator(sep: str) -> str:
    """A CSV separator as a user writes it: one character, or ``\\t`` / ``tab`` (a shell or a Hydra
    override gives a tab as the two characters backslash and t)."""
    named = {"\\t": "\t", "tab": "\t", "TAB": "\t", "comma": ","}
    sep = named.get(sep, sep)
    if len(sep) != 1:
        raise ValueError(f"sep={sep!r}: a CSV separator is one character (a tab: sep='\\t' or sep=tab)")
    return sep


def _read_captions(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise FileNotFoundError(f"no captions file {str(path)!r}")
    if path.suffix.lower() == ".json":
        table = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(table, dict):
            raise TypeError(f"{path}: expected a JSON object {{image path: caption}}")
        return {str(k): str(v) for k, v in table.items()}
    table = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise ValueError(f"{path}:{n}: expected 'path<TAB>caption'")
        name, text = line.split("\t", 1)
        table[name] = text
    return table


__all__ = ["CsvPairs", "ImageFolderPairs", "PairDataset", "SampleDecodeError", "IMAGE_EXTENSIONS"]
