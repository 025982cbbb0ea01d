"""Image-caption pairs in WebDataset tar shards, read as a stream and decoded per tower.

A shard is a tar file whose members are grouped into samples by their name up to the first dot
(``000123.jpg`` + ``000123.txt``), as the ``webdataset`` package (and open_clip's ``--dataset-type
webdataset``, img2dataset) writes them. :class:`WebDatasetPairs` reads local shards, ``file:``
and ``pipe:`` URLs (``pipe:cat shard.tar``, ``pipe:curl -s ...``, ``pipe:aws s3 cp ... -``) through
``webdataset``'s ``gopen``, its members grouped into samples by ``webdataset``'s ``group_by_keys``
(read by :func:`~lightning_distmm.data.datasets.tarstream.tar_members`, which every rank runs on every sample).

It is a :class:`~lightning_distmm.data.streams.streaming.FieldStream`: the epoch's order (shards permuted,
then samples through a shuffle buffer) follows from ``(seed, epoch)`` alone, so every distmm rank
reads the same stream and cuts the same global batches, and decodes only its rows' fields: an
image rank decodes the image and runs the transform, a text rank tokenizes the caption, and the
other samples of the batch are read and dropped as bytes. ``decoded`` counts, per field, the
samples decoded in this process, ``read`` the raw samples read; ``decode_log`` (a file path)
appends one JSON line ``[rank, key, fields]`` per decode, for checks across processes.

Fields: ``image`` (the transform's tensor), ``caption`` (str), ``input_ids`` / ``attention_mask``.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from io import BytesIO
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlparse

from torch import Tensor

from lightning_distmm.data.datasets.datamodule import StreamPairsDataModule
from lightning_distmm.data.datasets.pair_options import stream_seed
from lightning_distmm.data.datasets.pairs import PairDecoding
from lightning_distmm.data.datasets.tarstream import tar_members
from lightning_distmm.data.samples.fields import FieldDataset
from lightning_distmm.data.streams.streaming import FieldStream, skip_samples

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


class RawPair(NamedTuple):
    """A sample as read from a shard: its key, its shard, the image member's bytes and the caption's."""

    key: str
    url: str
    image: bytes
    caption: bytes


def shard_urls(urls: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The shards of ``urls``: a brace pattern (``train-{000000..000009}.tar``), ``::``-separated
    URLs, a folder (its ``*.tar``, sorted), or a list of any of these; ``pipe:`` URLs as they are."""
    from webdataset.shardlists import expand_urls

    items = [urls] if isinstance(urls, str | os.PathLike) else list(urls)
    out: list[str] = []
    for item in items:
        item = os.fspath(item)
        if os.path.isdir(item):
            out.extend(str(p) for p in sorted(Path(item).glob("*.tar")))
        else:
            out.extend(expand_urls(item))
    if not out:
        raise ValueError(f"WebDatasetPairs: no shards in {urls!r}")
    missing = [u for u in out if _local_path(u) is not None and not os.path.isfile(_local_path(u))]
    if missing:
        raise FileNotFoundError(f"WebDatasetPairs: {len(missing)} shard(s) not found, e.g. {missing[:3]}")
    return out


def _local_path(url: str) -> str | None:
    """The file of a local shard (a path or ``file:``); None for ``pipe:`` and remote URLs."""
    parsed = urlparse(url)
    if parsed.scheme == "":
        return url
    if parsed.scheme == "file":
        return parsed.path
    return None


def _extension(name: str) -> str | None:
    """What ``webdataset`` groups a member by: the suffix after the first dot of its base name."""
    base = name.rsplit("/", 1)[-1]
    return base.split(".", 1)[1].lower() if "." in base else None


class WebDatasetPairs(PairDecoding, FieldStream):
    """Image-caption pairs from WebDataset shards.

    Args:
        urls: the shards (see :func:`shard_urls`): local paths, a folder, a brace pattern, ``pipe:`` URLs.
        image_key: the image member's extension(s), the first present wins (``"jpg;png"`` or a list;
            open_clip reads ``jpg;png;jpeg;webp``).
        caption_key: the caption member's extension (open_clip: ``txt``).
        shuffle: permute the shards every epoch and pass the samples through a shuffle buffer, both
            seeded by ``(seed, epoch)`` (the same on every rank and in one process).
        shuffle_buffer: samples in the buffer (1 or 0: shards permuted only; a resumed epoch then skips
            whole local shards without opening them).
        seed: the order's seed.
        length: samples of an epoch; None counts the members of local shards (headers only) and
            leaves ``pipe:`` streams without a length.
        transform, tokenizer, context_length, decode_log: as for
            :class:`~lightning_distmm.data.datasets.pairs.PairDataset`.
        skip_bad_samples: a sample that cannot be decoded is replaced by the next row of its global
            batch that can (:mod:`lightning_distmm.data.samples.skipping`; iterated in one process, batch it
            with ``collate_fn=SkipBadRows(dataset)``); ``skipped`` counts them.
    """

    def __init__(
        self,
        urls: str | os.PathLike | Sequence[str | os.PathLike],
        image_key: str | Sequence[str] = IMAGE_KEYS,
        caption_key: str = "txt",
        shuffle: bool = False,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        length: int | None = None,
        transform: Callable[[Any], Tensor] | None = None,
        tokenizer: Any = None,
        context_length: int = 77,
        decode_log: str | os.PathLike | None = None,
        skip_bad_samples: bool = False,
    ):
        self.urls = shard_urls(urls)
        self.skip_bad_samples, self.skipped = bool(skip_bad_samples), 0
        keys = image_key.split(";") if isinstance(image_key, str) else list(image_key)
        self.image_keys = tuple(k.lower().lstrip(".") for k in keys)
        self.caption_key = caption_key.lower().lstrip(".")
        self.shuffle, self.shuffle_buffer, self.seed = bool(shuffle), int(shuffle_buffer), int(seed)
        self.length = None if length is None else int(length)
        PairDecoding.__init__(self, transform, tokenizer, context_length, decode_log)
        self.read = 0
        self._sizes: list[int] | None = None

    # ------------------------------------------------------------------ the order
    def samples(self, epoch: int, skip: int = 0) -> Iterator[RawPair]:
        shards = list(self.urls)
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}/shards").shuffle(shards)
        if self.shuffle and self.shuffle_buffer > 1:
            rng = random.Random(f"{self.seed}/{epoch}/samples")
            return skip_samples(_buffer_shuffle(self._read(shards), self.shuffle_buffer, rng), skip, epoch, repr(self))
        sizes = self.shard_sizes() if skip else None
        before = 0
        if sizes is not None:  # whole shards before the position are not opened
            size = dict(zip(self.urls, sizes))
            while shards and before + size[shards[0]] <= skip:
                before += size[shards.pop(0)]
        return skip_samples(self._read(shards), skip - before, epoch, repr(self), before)

    def _read(self, shards: Iterable[str]) -> Iterator[RawPair]:
        from webdataset.gopen import gopen
        from webdataset.tariterators import group_by_keys

        wanted = {*self.image_keys, self.caption_key}
        for url in shards:
            try:
                stream = gopen(url, "rb")
            except OSError as e:
                raise OSError(f"WebDatasetPairs: shard {url!r} cannot be opened: {e}") from e
            closed = False
            try:
                members = tar_members(stream, url)
                files = ({"fname": n, "data": d, "__url__": url} for n, d in members if _extension(n) in wanted)
                for sample in group_by_keys(files):
                    self.read += 1
                    yield self._raw(sample, url)
                closed = True
                stream.close()  # a pipe: command's exit status is checked here
            except OSError as e:
                closed = True
                if url in str(e):
                    raise
                # a failed pipe: command surfaces as webdataset's raw "(args, kwargs): exit N (read)"
                raise OSError(f"WebDatasetPairs: reading shard {url!r} failed: {e}") from e
            finally:
                if not closed:  # the consumer stopped early, or another error
                    stream.close()

    def _raw(self, sample: dict[str, Any], url: str) -> RawPair:
        image = next((sample[k] for k in self.image_keys if k in sample), None)
        caption = sample.get(self.caption_key)
        if image is None or caption is None:
            has = sorted(k for k in sample if not k.startswith("__"))
            missing = [
                f"no image ({'/'.join(self.image_keys)})" if image is None else "",
                f"no caption ({self.caption_key})" if caption is None else "",
            ]
            raise ValueError(
                f"{url}: sample {sample['__key__']!r} has members {has}: {' and '.join(m for m in missing if m)};"
                " pass image_key= / caption_key= if the shards name them otherwise (open_clip's --wds-image-key ...)"
            )
        return RawPair(sample["__key__"], url, image, caption)

    def shard_sizes(self) -> list[int] | None:
        """Samples per shard when every shard is local (tar headers are read, no data); else None."""
        if self._sizes is None:
            paths = [_local_path(u) for u in self.urls]
            if any(p is None for p in paths):
                return None
            wanted = {*self.image_keys, self.caption_key}
            self._sizes = [_count_samples(p, wanted) for p in paths if p is not None]
        return self._sizes

    def epoch_length(self) -> int | None:
        if self.length is not None:
            return self.length
        sizes = self.shard_sizes()
        return None if sizes is None else sum(sizes)

    def sample_key(self, sample: RawPair) -> tuple[str, str]:
        """The shard and the member name a sample was read from (what the ranks compare)."""
        return sample.url, sample.key

    # ------------------------------------------------------------------ decoding
    def decode(self, sample: RawPair, fields: Iterable[str]) -> dict[str, Any]:
        fields = tuple(fields)
        out = self._decode(sample, fields)
        self.record(sample.key, fields)
        return out

    def example(self) -> dict[str, Any] | None:
        """The first sample decoded whole, not counted in ``decoded`` or ``decode_log`` (no training sample)."""
        first = self.first_sample()
        return None if first is None else self._decode(first, self.fields)

    def _decode(self, sample: RawPair, fields: tuple[str, ...]) -> dict[str, Any]:
        fields = self.check_fields(fields)
        return self.decode_pair(
            fields,
            BytesIO(sample.image),
            lambda: sample.caption.decode("utf-8").strip(),
            f"shard {sample.url} sample {sample.key!r}",
        )

    def in_memory(self, limit: int | None = None) -> FieldDataset:
        """The (first ``limit``) samples of epoch 0 held as bytes, a map-style dataset decoded per
        field on ``load``: for held-out pairs (validation, retrieval evaluation)."""
        samples = self.samples(0)
        return _RawPairs(self, list(samples if limit is None else (s for _, s in zip(range(limit), samples))))

    def __getstate__(self) -> dict[str, Any]:  # workers get fresh counters
        state = dict(self.__dict__)
        state["decoded"], state["read"] = Counter(), 0
        return state

    def __repr__(self) -> str:
        first = self.urls[0] if len(self.urls) == 1 else f"{self.urls[0]} ... ({len(self.urls)} shards)"
        return f"WebDatasetPairs({first!r})"


class _RawPairs(FieldDataset):
    def __init__(self, source: WebDatasetPairs, samples: list[RawPair]):
        self.source, self.samples = source, samples
        self.fields = source.fields

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        return self.source.decode(self.samples[index], fields)


def _count_samples(path: str, wanted: set[str]) -> int:
    """Samples of a local shard as ``webdataset`` groups them (consecutive members of one key)."""
    from webdataset.tariterators import base_plus_ext

    count, last = 0, None
    with open(path, "rb") as f:
        for name, _ in tar_members(f, path, data=False):  # the headers only: seeks over the contents
            if _extension(name) not in wanted:
                continue
            key, _ = base_plus_ext(name)
            if key is not None and key != last:
                count, last = count + 1, key
    return count


def _buffer_shuffle(samples: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """A shuffle buffer of ``size`` samples: each incoming sample takes the place of a random one,
    which leaves. Ours, not ``webdataset``'s, so that the order a checkpoint resumes stays the same
    across ``webdataset`` versions."""
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        i = rng.randrange(size)
        yield buffer[i]
        buffer[i] = sample
    rng.shuffle(buffer)
    yield from buffer


class WebDatasetDataModule(StreamPairsDataModule):
    """Training pairs from WebDataset shards (a stream), held-out pairs from other shards (in memory).

    Args:
        train: the training shards (see :func:`shard_urls`).
        val: the held-out shards, read into memory for validation and retrieval (None: no validation).
        length: samples of a training epoch (needed for ``pipe:`` URLs to know an epoch's length).
        image_key, caption_key, shuffle, shuffle_buffer: see :class:`WebDatasetPairs`.
        seed: the order's seed (None: ``PL_GLOBAL_SEED``, as ``seed_everything`` set it, else 0).
        options: :class:`~lightning_distmm.data.datasets.pair_options.PairOptions` (the transform, the
            tokenizer, the global ``batch_size``, ``val_batch_size``, ``num_workers``, ``skip_bad_samples``).
    """

    def __init__(
        self,
        train: str | Sequence[str],
        val: str | Sequence[str] | None = None,
        length: int | None = None,
        image_key: str | Sequence[str] = IMAGE_KEYS,
        caption_key: str = "txt",
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        seed: int | None = None,
        **options: Any,
    ):
        super().__init__()
        own = dict(train=train, val=val, length=length, image_key=image_key, caption_key=caption_key)
        own.update(shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed)
        transform = self.take_options(own, options)
        common: dict[str, Any] = dict(image_key=image_key, caption_key=caption_key, transform=transform)
        train_pairs = WebDatasetPairs(
            train,
            shuffle=shuffle,
            shuffle_buffer=shuffle_buffer,
            seed=stream_seed(seed),
            length=length,
            tokenizer=self.text,
            skip_bad_samples=self.options.skip_bad_samples,
            **common,
        )
        self.hold(
            train_pairs,
            None if val is None else WebDatasetPairs(val, tokenizer=self.text, **common).in_memory(),
            lambda: train_pairs.in_memory(limit=64),
            f"{train if isinstance(train, str) else train[0]} (the training shards)"
            if val is None
            else f"{val if isinstance(val, str) else val[0]} (the held-out shards)",
        )


__all__ = ["RawPair", "WebDatasetDataModule", "WebDatasetPairs", "shard_urls"]
