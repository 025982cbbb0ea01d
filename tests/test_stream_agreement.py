"""Every rank reads the same samples of a stream, or the run stops: LitData read as one process,
a rank-dependent stream stopped at its first batch with the row named, Hugging Face's
``split_dataset_by_node`` and pre-batched streams refused with what to change."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from types import SimpleNamespace

import datasets
import lightning as L
import litdata
import pytest
import torch
from distmm_testing import (
    PairData,
    TinyCLIP,
    in_subprocess,
    max_param_diff,
    read_losses,
    recipe_stream_datamodule,
    run_distmm,
    run_reference,
)
from torch.utils.data import DataLoader, IterableDataset

import lightning_distmm as ldm
from lightning_distmm.core.layout import RankLayout
from lightning_distmm.data import rank_independent
from lightning_distmm.data.loader.checks import check_dataloader
from lightning_distmm.data.loader.loading import DistMMDataLoader
from lightning_distmm.data.streams.agreement import StreamAgreement, UnidentifiableSampleError, key_of
from lightning_distmm.data.streams.litdata_stream import LitIndex
from lightning_distmm.data.streams.stream_sources import as_stream

FIELDS = {"image": ("image",), "text": ("input_ids", "attention_mask")}
ALL = ("image", "input_ids", "attention_mask")
SEPARATE = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})


def _write_litdata(folder: Path, n: int = 64, chunk: int = 8) -> Path:
    """``n`` samples of :class:`PairData` in LitData's format, ``chunk`` per chunk (what
    ``litdata.optimize`` writes, without its worker processes)."""
    from litdata.streaming.writer import BinaryWriter

    folder.mkdir(parents=True, exist_ok=True)
    writer = BinaryWriter(str(folder), chunk_size=chunk)
    data = PairData(n)
    for i in range(n):
        writer[i] = data.load(i, ALL)
    writer.done()
    writer.merge(1)
    return folder


def _ids(samples) -> list[int]:
    """Which PairData index each sample is (its image's first value, unique in 64)."""
    table = {float(PairData(64).load(i, ["image"])["image"][0, 0, 0]): i for i in range(64)}
    return [table[float(s["image"][0, 0, 0])] for s in samples]


class RankSeeded(IterableDataset):
    """PairData's samples in an order seeded by the process's rank: what distmm must not train on."""

    def __iter__(self):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        data = PairData(64)
        for i in torch.randperm(64, generator=torch.Generator().manual_seed(rank)).tolist():
            yield data.load(i, ALL)


class DiffersLater(IterableDataset):
    """The same 16 samples on every rank, then an order seeded by the rank (batch 3 on, of 8)."""

    def __iter__(self):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        data = PairData(64)
        rest = (16 + torch.randperm(48, generator=torch.Generator().manual_seed(rank))).tolist()
        for i in list(range(16)) + rest:
            yield data.load(i, ALL)


class Batches(IterableDataset):
    """Yields whole batches of 8 (as webdataset's .batched(8) does)."""

    def __iter__(self):
        data = PairData(64)
        for b in range(8):
            samples = [data.load(i, ALL) for i in range(8 * b, 8 * b + 8)]
            yield {k: torch.stack([s[k] for s in samples]) for k in ALL}


# ---------------------------------------------------------------------- one process
def test_keys_name_or_fingerprint_a_sample():
    data = PairData(8)
    a, b = data.load(0, ALL), data.load(1, ALL)
    assert key_of(a) == key_of(copy.deepcopy(a)) and key_of(a)[0] != key_of(b)[0]
    assert key_of(a)[1].startswith("fingerprint ")
    big = {"x": torch.arange(100_000.0)}  # large arrays: evenly spaced elements, and their count
    assert key_of(big)[0] != key_of({"x": torch.arange(100_000.0) + 0.5})[0] != key_of({"x": torch.arange(99_999.0)})[0]
    assert key_of({"__key__": "s0007", "image": torch.zeros(3)})[1] == "__key__='s0007'"
    with pytest.raises(UnidentifiableSampleError, match="no field distmm can fingerprint"):
        key_of({"image": object()})


def test_litdata_is_read_as_one_process_reads_it(tmp_path, monkeypatch):
    """Built where LitData sees rank 1 of 2 (its shuffle would give this rank half of the chunks, in
    its own order), the stream is still the whole epoch in one process's order, epoch after epoch."""
    folder = _write_litdata(tmp_path / "lit")
    one = litdata.StreamingDataLoader(litdata.StreamingDataset(str(folder), shuffle=True, seed=3), batch_size=8)
    orders = [_ids(s for b in one for s in _rows(b)) for _ in range(2)]
    assert orders[0] != orders[1] and sorted(orders[0]) == list(range(64))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("GLOBAL_RANK", "1")
    ds = litdata.StreamingDataset(str(folder), shuffle=True, seed=3)
    assert ds.distributed_env.world_size == 2 and len(ds) == 32
    stream = as_stream(ds)
    assert stream.epoch_length() == 64
    assert [list(stream.samples(e)) for e in range(2)] == orders  # the items' indices (written in order)
    assert list(stream.samples(1, skip=40)) == orders[1][40:]
    monkeypatch.setattr(type(stream), "_indices", lambda self: None)  # LitData's lay-out not readable: its items
    assert [_ids(stream.samples(e)) for e in range(2)] == orders
    monkeypatch.undo()
    raw = list(stream.samples(1))[:3]
    assert all(isinstance(r, LitIndex) for r in raw) and [_ids([stream.decode(r, ALL)]) for r in raw] == [
        [r] for r in raw
    ]


def test_a_litdata_chunk_deleted_mid_epoch_is_named_missing(tmp_path, monkeypatch):
    """A chunk of a local folder deleted while the epoch reads it: LitData waits for the file (2 s) and
    reports a hung download ("Timed out after 2s waiting for chunk ..., not a missing object"), which the
    failure relay counted as a consequence, not the cause. The stream names the chunk as missing, with
    what to do, whether it reads items by index or LitData's own iteration."""
    import litdata.streaming.item_loader as item_loader

    from lightning_distmm.data.streams.litdata_stream import MissingChunkError, _chunk_source
    from lightning_distmm.faults import is_consequence

    monkeypatch.setattr(item_loader, "_MAX_WAIT_TIME", 0.2)  # LitData's wait for a local chunk: min(2 s, this)
    folder = _write_litdata(tmp_path / "lit", n=16, chunk=8)
    stream = as_stream(litdata.StreamingDataset(str(folder), shuffle=False))
    samples = list(stream.samples(0))
    stream.decode(samples[3], ALL)  # the first chunk is read; the second goes before it is opened
    (folder / "chunk-0-1.bin").unlink()
    missing = re.escape(str(folder / "chunk-0-1.bin")) + " does not exist: it was deleted or moved"
    with pytest.raises(MissingChunkError, match=f"^LitData chunk {missing} .*item 12 is in it") as raised:
        stream.decode(samples[12], ALL)
    assert str(raised.value).endswith(
        "Put the chunk back, or write the folder again (litdata.optimize) and start the run again"
    )
    assert not is_consequence(raised.value) and raised.value.__suppress_context__  # LitData's timeout is not the cause
    monkeypatch.setattr(type(stream), "_indices", lambda self: None)  # LitData's own iteration
    with pytest.raises(MissingChunkError, match=f"^LitData chunk {missing} .*the epoch reads it"):
        list(stream.samples(0))
    remote = SimpleNamespace(input_dir=SimpleNamespace(path="/cache/x", url="s3://bucket/x"))
    assert _chunk_source(remote, "/cache/x/chunk-0-1.bin") is None  # may still be downloading: LitData's error
    copy = SimpleNamespace(input_dir=SimpleNamespace(path="/cache/x", url="local:/data/x"))
    assert _chunk_source(copy, "/cache/x/chunk-0-1.bin") == os.path.join("/data/x", "chunk-0-1.bin")


class CountingLit(litdata.StreamingDataset):
    """Counts the items it decodes."""

    decoded = 0

    def __getitem__(self, index):
        CountingLit.decoded += 1
        return super().__getitem__(index)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_rank_decodes_only_its_litdata_rows(tmp_path, workers):
    """Rank 1 of three (image replica 2 of 2) decodes rows 4-7 of each batch of 8, and nothing else."""
    folder = _write_litdata(tmp_path / "lit")
    one = litdata.StreamingDataLoader(litdata.StreamingDataset(str(folder), shuffle=True, seed=3), batch_size=8)
    order = _ids(s for b in one for s in _rows(b))
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})
    source = litdata.StreamingDataLoader(
        CountingLit(str(folder), shuffle=True, seed=3), batch_size=8, drop_last=True, num_workers=workers
    )
    CountingLit.decoded = 0
    batches = list(DistMMDataLoader(source, RankLayout(plan, 1, FIELDS)))
    assert [_ids(_rows(b)) for b in batches] == [order[8 * b + 4 : 8 * b + 8] for b in range(8)]
    assert set(batches[0]) == {"image", "__distmm_global_batch__"}
    if workers == 0:
        assert CountingLit.decoded == 32  # in the workers' processes otherwise


def _rows(batch: dict) -> list[dict]:
    return [{k: v[i] for k, v in batch.items() if k in ALL} for i in range(len(batch["image"]))]


def test_refused_with_what_to_change(tmp_path):
    replicas = {"image": 1, "text": 1}
    with pytest.raises(ValueError, match=r"DataLoader over Batches has batch_size=None.*batch_size=<the global batch>"):
        check_dataloader(DataLoader(Batches(), batch_size=None), FIELDS, replicas)
    with pytest.raises(ValueError, match="batch_size=None"):
        DistMMDataLoader(DataLoader(Batches(), batch_size=None), RankLayout(SEPARATE, 0, FIELDS))
    from datasets.distributed import split_dataset_by_node

    hf = datasets.Dataset.from_dict({"i": list(range(8))}).to_iterable_dataset(num_shards=2)
    check_dataloader(DataLoader(hf, batch_size=4), {"t": ("i",)}, {"t": 1})
    with pytest.raises(TypeError, match=r"split_dataset_by_node \(this rank reads node 1 of 2\).*before"):
        check_dataloader(DataLoader(split_dataset_by_node(hf, 1, 2), batch_size=4), {"t": ("i",)}, {"t": 1})


# ---------------------------------------------------------------------- under distmm
class LitDataModule(L.LightningDataModule):
    """A LitData stream built where Lightning users build it: in each rank's process, where
    ``StreamingDataset`` reads the rank and world size (and would give each rank its own share)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def train_dataloader(self) -> DataLoader:
        ds = litdata.StreamingDataset(str(self.folder), shuffle=True, seed=7)
        return litdata.StreamingDataLoader(ds, batch_size=8, drop_last=True)


@pytest.mark.slow
def test_litdata_shuffled_stream_under_distmm_equals_one_process(tmp_path):
    """Image on rank 0, text on rank 1, LitData shuffled (the issue's case): the weights and losses
    of one process after 3 steps, with the ranks' check on every batch."""
    folder = _write_litdata(tmp_path / "lit")

    def run() -> None:
        L.seed_everything(0)
        reference = TinyCLIP("sgd", lr=0.05)
        module, initial = copy.deepcopy(reference), copy.deepcopy(reference)
        run_reference(reference, LitDataModule(folder), 3, str(tmp_path / "ref.json"))
        run_distmm(module, SEPARATE, 2, LitDataModule(folder), 3, str(tmp_path / "dist.json"))
        assert max_param_diff(reference, module) <= 1e-5
        assert max_param_diff(reference, initial) > 1e-3
        assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)

    in_subprocess(run)


class SplitByNode(L.LightningDataModule):
    """What a user of Hugging Face datasets writes for DDP: each rank takes its node's part."""

    def train_dataloader(self) -> DataLoader:
        from datasets.distributed import split_dataset_by_node

        rows = [PairData(64).load(i, ALL) for i in range(64)]
        hf = datasets.Dataset.from_list([{k: v.tolist() for k, v in r.items()} for r in rows])
        stream = hf.to_iterable_dataset(num_shards=4).with_format("torch")
        return DataLoader(
            split_dataset_by_node(stream, self.trainer.global_rank, self.trainer.world_size), batch_size=8
        )


CASES = {
    "rank-seeded": (
        lambda: DataLoader(RankSeeded(), batch_size=8, drop_last=True),
        r"the ranks read different samples of RankSeeded: epoch 0, global batch 1 read \(samples 0 to 7 of the"
        r" epoch\), row 0 differs first: rank 0 read fingerprint [0-9a-f]{16}; rank 1 read fingerprint",
    ),
    "differs-later": (
        lambda: DataLoader(DiffersLater(), batch_size=8, drop_last=True),
        r"the ranks read different samples of DiffersLater: epoch 0, global batch 3 read \(samples 16 to 23",
    ),
    "hf-split-by-node": (SplitByNode, r"IterableDataset split by datasets.distributed.split_dataset_by_node"),
    "pre-batched": (lambda: DataLoader(Batches(), batch_size=None), r"DataLoader over Batches has batch_size=None"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_that_differs_between_ranks_stops_the_run(tmp_path, case):
    """Two ranks (image, text): the run ends on every rank with the message, before any step
    trains; a stream that differs from its third batch on, before the third step ends (its
    comparison is settled when the next batch is read)."""
    make, message = CASES[case]

    def run() -> None:
        module = TinyCLIP()
        before = copy.deepcopy(module)
        data = make()
        with pytest.raises(Exception, match=message):
            run_distmm(module, SEPARATE, 2, data, 5, str(tmp_path / "dist.json"))
        if case == "differs-later":
            assert 0 < len(read_losses(tmp_path / "dist.json")) < 3
            return
        assert not os.path.exists(tmp_path / "dist.json")  # no step ended
        assert max_param_diff(module, before) == 0

    in_subprocess(run)


def test_declared_rank_independent_skips_the_check():
    plain = RankSeeded()
    assert rank_independent(plain) is plain
    dl = DistMMDataLoader(DataLoader(plain, batch_size=8), RankLayout(SEPARATE, 0, FIELDS))
    assert dl.rank_sampler.agreement is None
    assert DistMMDataLoader(
        DataLoader(RankSeeded(), batch_size=8), RankLayout(SEPARATE, 0, FIELDS)
    ).rank_sampler.agreement


def test_the_first_batch_is_compared_at_once_and_later_ones_every_n_in_the_background(monkeypatch):
    """every=3: batch 1 posted and settled before it is yielded; batches 2-3 and 4-6 posted when
    read and settled at the next comparison; the rest, with the end of the epoch, when it ends."""
    agreement = StreamAgreement("S", key_of, every=3)
    events: list[tuple] = []

    def post(pending, ended):
        events.append(("post", [n for n, _, _ in pending], ended))
        return len(events)

    monkeypatch.setattr(agreement, "_post", post)
    monkeypatch.setattr(agreement, "_settle", lambda posted, epoch: events.append(("settle", posted)))
    batches = [[{"i": 10 * b + r} for r in range(2)] for b in range(7)]
    for n, _ in enumerate(agreement.batches(iter(batches), 0, 0), 1):
        events.append(("yield", n))
    assert events == [
        ("post", [1], False), ("settle", 1), ("yield", 1),
        ("yield", 2),
        ("post", [2, 3], False), ("yield", 3),
        ("yield", 4), ("yield", 5),
        ("settle", 5), ("post", [4, 5, 6], False), ("yield", 6),
        ("yield", 7),
        ("settle", 10), ("post", [7], True), ("settle", 14),
    ]  # fmt: skip
    assert agreement._keys([{"a": 1}, {"a": 1}]) == "all 2 samples of the batch have the same fingerprint " + (
        f"{key_of({'a': 1})[0] & (2**64 - 1):016x}"
    )


def test_the_interval_is_a_strategy_option():
    assert ldm.DistMMStrategy(stream_check_every=8)._loaders.check_every == 8
    with pytest.raises(ValueError, match="every N >= 1 global batches.*rank_independent"):
        ldm.DistMMStrategy(stream_check_every=0)


def test_a_hugging_face_iterable_dataset_is_cut_the_same_on_every_rank():
    """Shuffled by its seed and the epoch distmm sets: the image rank's and the text rank's rows of
    every batch are the same samples, and epoch 1 is another order."""
    rows = [{"image": float(i), "input_ids": i, "attention_mask": 1} for i in range(16)]
    hf = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=4).shuffle(seed=3, buffer_size=8)
    image, text = (DistMMDataLoader(DataLoader(hf, batch_size=4), RankLayout(SEPARATE, r, FIELDS)) for r in (0, 1))
    epochs = []
    for epoch in range(2):
        image.rank_sampler.set_epoch(epoch), text.rank_sampler.set_epoch(epoch)
        got = [(a["image"].long().tolist(), t["input_ids"].tolist()) for a, t in zip(image, text)]
        assert all(a == t for a, t in got) and len(got) == 4
        epochs.append([i for a, _ in got for i in a])
    assert sorted(epochs[0]) == list(range(16)) and epochs[0] != epochs[1]


# ---------------------------------------------------------------------- the recipe
def test_make_litdata_and_the_clip_litdata_experiment(tmp_path):
    """make_litdata.py writes the make_csv samples in LitData's format; experiment=clip_litdata
    builds a DataModule over them; a rank decodes only its rows' fields of them."""
    import sys

    from lightning_distmm.data.datasets.litdata_pairs import LitDataPairs

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "recipes"))
    import make_csv
    import make_litdata

    train_dir, val_dir = make_litdata.main(["--out", str(tmp_path), "--train", "10", "--val", "4", "--per-chunk", "4"])
    csv_path, _ = make_csv.main(["--out", str(tmp_path / "csv"), "--train", "10", "--val", "4"])
    csv_captions = [line.split(",", 1)[1] for line in csv_path.read_text().splitlines()[1:]]
    assert [s["caption"] for s in LitDataPairs(train_dir, shuffle=False)] == csv_captions
    shuffled = LitDataPairs(train_dir, shuffle=True, seed=1)
    order = list(shuffled.samples(0))
    assert sorted(order) == list(range(10)) and order != list(range(10))
    text = DistMMDataLoader(DataLoader(shuffled, batch_size=4, drop_last=True), RankLayout(SEPARATE, 1, FIELDS))
    batches = list(text)
    assert len(batches) == 2 and shuffled.decoded == {"input_ids": 8, "attention_mask": 8}  # no image opened
    assert "image" not in batches[0]

    _, dm = recipe_stream_datamodule("clip_litdata", train_dir, val_dir)
    assert set(dm.val_dataset.load(2, ["caption"])) == {"caption"}


def test_every_stream_datamodule_refuses_captions_its_tokenizer_cannot_read(tmp_path):
    """LitData folders get the caption check the CSV and WebDataset DataModules have (the stream
    DataModules share it), and a broken image in one names its folder and item."""
    import io

    from litdata.streaming.writer import BinaryWriter
    from PIL import Image

    from lightning_distmm.data.datasets.litdata_pairs import LitDataDataModule, LitDataPairs
    from lightning_distmm.data.datasets.pairs import SampleDecodeError

    folder = tmp_path / "digits"
    folder.mkdir()
    writer = BinaryWriter(str(folder), chunk_size=4)
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    for i in range(8):
        image = png.getvalue() if i != 5 else png.getvalue()[:40]
        writer[i] = {"image": image, "caption": f"a photo of the digit {i}"}
    writer.done()
    writer.merge(1)
    with pytest.raises(ValueError, match=r"digits \(the training folder\): .* unknown to the embedded tokenizer"):
        LitDataDataModule(str(folder), image_size=8)
    with pytest.raises(SampleDecodeError, match=r"digits item 5: cannot read its image"):
        LitDataPairs(folder, shuffle=False).in_memory().load(5, ("image",))
