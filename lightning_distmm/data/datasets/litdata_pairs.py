"""Image-caption pairs in LitData's format, read as a stream and decoded per rank and per tower.

A LitData folder (written by ``litdata.optimize``, or ``recipes/make_litdata.py``) whose items are
``{"image": encoded image bytes, "caption": str}``. :class:`LitDataPairs` reads it as one process
reads it (:class:`~lightning_distmm.data.streams.litdata_stream.LitDataStream`: LitData's seed, chunk
permutation and in-chunk shuffle of the epoch, on every rank) and decodes only what a rank asks for:
its rows, by index, and of those only its towers' fields (an image rank opens the image and runs the
transform, a text rank tokenizes the caption). LitData's own deserialization gives bytes and a
string, so reading an item costs little; the decoding is ours.

Fields: ``image`` (the transform's tensor), ``caption`` (str), ``input_ids`` / ``attention_mask``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from io import BytesIO
from typing import Any

from lightning_distmm.data.datasets.datamodule import StreamPairsDataModule
from lightning_distmm.data.datasets.pair_options import stream_seed
from lightning_distmm.data.datasets.pairs import PairDecoding
from lightning_distmm.data.samples.fields import FieldDataset
from lightning_distmm.data.streams.litdata_stream import LitDataStream, LitIndex
from lightning_distmm.data.streams.streaming import FieldStream


class LitDataPairs(PairDecoding, FieldStream):
    """Pairs in a LitData folder, a stream decoded per field.

    Args:
        input_dir: the folder ``litdata.optimize`` wrote (its ``index.json`` and chunks).
        shuffle, seed: LitData's (``StreamingDataset(input_dir, shuffle=..., seed=...)``).
        image_key, caption_key: the item's fields holding the encoded image and the caption.
        transform, tokenizer, context_length, decode_log: see :class:`~lightning_distmm.data.datasets.pairs.PairDecoding`.
        skip_bad_samples: a bad item is replaced by the next row of its global batch that decodes
            (:mod:`lightning_distmm.data.samples.skipping`; one process: ``collate_fn=SkipBadRows(dataset)``).
    """

    def __init__(
        self,
        input_dir: str | os.PathLike,
        shuffle: bool = True,
        seed: int = 42,
        image_key: str = "image",
        caption_key: str = "caption",
        transform: Any = None,
        tokenizer: Any = None,
        context_length: int = 77,
        decode_log: str | os.PathLike | None = None,
        skip_bad_samples: bool = False,
    ):
        import litdata

        self.skip_bad_samples, self.skipped = bool(skip_bad_samples), 0

        PairDecoding.__init__(self, transform, tokenizer, context_length, decode_log)
        self.image_key, self.caption_key = image_key, caption_key
        self.input_dir = os.fspath(input_dir)
        self.stream = LitDataStream(litdata.StreamingDataset(os.fspath(input_dir), shuffle=shuffle, seed=seed))

    def samples(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        return self.stream.samples(epoch, skip)

    def epoch_length(self) -> int | None:
        return self.stream.epoch_length()

    def sample_key(self, sample: Any) -> Any:
        return self.stream.sample_key(sample)

    def decode(self, sample: Any, fields: Iterable[str]) -> dict[str, Any]:
        fields = self.check_fields(fields)
        item = self.stream.item(sample)
        where = f"{self.input_dir} item {int(sample)}" if isinstance(sample, LitIndex) else f"{self.input_dir} item"
        out = self.decode_pair(
            fields, BytesIO(item[self.image_key]), lambda: str(item[self.caption_key]).strip(), where
        )
        self.record(int(sample) if isinstance(sample, LitIndex) else None, fields)
        return out

    def in_memory(self) -> FieldDataset:
        """The items by index, a map-style dataset decoded per field (validation, retrieval)."""
        return _ByIndex(self)


class _ByIndex(FieldDataset):
    def __init__(self, source: LitDataPairs):
        self.source, self.fields = source, source.fields

    def __len__(self) -> int:
        return len(self.source.stream.dataset)

    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        return self.source.decode(LitIndex(int(index)), fields)


class LitDataDataModule(StreamPairsDataModule):
    """Training pairs from a LitData folder (a stream), held-out pairs from another (by index).

    Args:
        train: the training folder; val: the held-out folder (None: no validation).
        shuffle, seed: LitData's order (seed None: ``PL_GLOBAL_SEED``, as ``seed_everything`` set it, else 0).
        image_key, caption_key: see :class:`LitDataPairs`.
        options: :class:`~lightning_distmm.data.datasets.pair_options.PairOptions` (the transform, the
            tokenizer, the global ``batch_size``, ``val_batch_size``, ``num_workers``, ``skip_bad_samples``).
    """

    def __init__(
        self,
        train: str,
        val: str | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        image_key: str = "image",
        caption_key: str = "caption",
        **options: Any,
    ):
        super().__init__()
        own = dict(train=train, val=val, shuffle=shuffle, seed=seed, image_key=image_key, caption_key=caption_key)
        transform = self.take_options(own, options)
        common: dict[str, Any] = dict(
            image_key=image_key, caption_key=caption_key, transform=transform, tokenizer=self.text
        )
        skip = self.options.skip_bad_samples
        train_pairs = LitDataPairs(train, shuffle=shuffle, seed=stream_seed(seed), skip_bad_samples=skip, **common)
        self.hold(
            train_pairs,
            None if val is None else LitDataPairs(val, shuffle=False, **common).in_memory(),
            train_pairs.in_memory,
            f"{val} (the held-out folder)" if val is not None else f"{train} (the training folder)",
        )


__all__ = ["LitDataDataModule", "LitDataPairs"]
