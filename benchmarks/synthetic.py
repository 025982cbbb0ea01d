"""What the benchmarks share: synthetic image / caption pairs (deterministic per index, no
download) and the two-tower CLIP contract their models implement."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning as L
import torch
from torch.utils.data import IterableDataset

import lightning_distmm as ldm


class SyntheticPairs(ldm.FieldDataset):
    """``size`` random images ``[3, image_size, image_size]`` with token ids ending in ``[EOS]`` (the last id)."""

    fields = ("image", "input_ids", "attention_mask")

    def __init__(self, size: int, image_size: int, vocab: int, seq: int) -> None:
        self.size, self.image_size, self.vocab, self.seq = size, image_size, vocab, seq

    def __len__(self) -> int:
        return self.size

    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        g = torch.Generator().manual_seed(index)
        out = {"image": torch.randn(3, self.image_size, self.image_size, generator=g)}
        out["input_ids"] = torch.randint(1, self.vocab - 2, (self.seq,), generator=g)
        out["input_ids"][-1] = self.vocab - 1
        out["attention_mask"] = torch.ones(self.seq, dtype=torch.long)
        return {k: out[k] for k in fields}


class SyntheticStream(IterableDataset):
    """:class:`SyntheticPairs` as a stream (an ``IterableDataset`` of dict samples, in index order):
    under distmm every rank reads it whole, and the ranks check that they read the same samples."""

    def __init__(self, size: int, image_size: int, vocab: int, seq: int) -> None:
        self.pairs = SyntheticPairs(size, image_size, vocab, seq)

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self):
        for i in range(len(self.pairs)):
            yield self.pairs.load(i, self.pairs.fields)


class TwoTowerCLIP(ldm.DistMMMixin, L.LightningModule):
    """``self.visual`` reads ``image``, ``self.text`` reads ``input_ids`` and ``attention_mask``,
    and they meet in the CLIP loss with ``self.logit_scale``; subclasses build the three and pick
    the optimizer."""

    def towers(self):
        return {"image": ldm.Tower(self.visual, "image"), "text": ldm.Tower(self.text, ["input_ids", "attention_mask"])}

    def interaction_loss(self, features):
        return ldm.losses.clip_loss(features["image"], features["text"], self.logit_scale)
