"""WebDataset shards as a stream: every rank reads the same seeded order, decodes only its rows and
fields, trains like one process, and resumes at the next unseen sample (local shards and ``pipe:``)."""

from __future__ import annotations

import copy
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import webdataset as wds
from distmm_testing import (
    SEQ,
    VOCAB,
    TinyCLIP,
    in_subprocess,
    max_param_diff,
    read_losses,
    recipe_stream_datamodule,
    run_distmm,
    run_reference,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset

import lightning_distmm as ldm
from lightning_distmm.core.layout import GLOBAL_BATCH_KEY, RankLayout
from lightning_distmm.data import CaptionTokenizer, WebDatasetPairs, image_transform
from lightning_distmm.data.datasets.tarstream import tar_members
from lightning_distmm.data.datasets.webdataset import shard_urls
from lightning_distmm.data.demo.tokenizer import build_tokenizer
from lightning_distmm.data.loader.checks import check_dataloader
from lightning_distmm.data.loader.loading import DistMMDataLoader
from lightning_distmm.data.samples.sampling import DataPositionError

WORDS = ["red", "green", "blue", "circle", "square", "cross", "big", "small", "a"]
assert len(WORDS) + 4 <= VOCAB  # the tiny text tower's vocabulary
FIELDS = {"image": ("image",), "text": ("input_ids", "attention_mask")}
TEXT = ("attention_mask", "input_ids")


def _caption(i: int) -> str:
    return f"a {['big', 'small'][i % 2]} {WORDS[i % 3]} {WORDS[3 + i % 3]}"  # 4 words + BOS/EOS = SEQ


def _write_shards(folder: Path, sizes: list[int], fmt: str = "png") -> list[Path]:
    """Shards of ``sizes`` samples (keys ``s<i>``, 8x8 noise images, captions), numbered in order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths, i = [], 0
    for shard, size in enumerate(sizes):
        path = folder / f"shard-{shard:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for _ in range(size):
                encoded = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(encoded, format=fmt.upper())
                sink.write({"__key__": f"s{i:04d}", fmt: encoded.getvalue(), "txt": _caption(i), "json": b"{}"})
                i += 1
        paths.append(path)
    return paths


def _tiny(log: Path | None = None) -> dict:
    return dict(
        transform=image_transform(input_size=(3, 8, 8), crop_pct=1.0, interpolation="bilinear"),
        tokenizer=CaptionTokenizer(build_tokenizer(WORDS), context_length=SEQ),
        decode_log=log,
    )


def _keys(ds: WebDatasetPairs, epoch: int = 0, skip: int = 0) -> list[str]:
    return [s.key for s in ds.samples(epoch, skip)]


def _records(log: Path) -> dict[int, list[tuple[str, tuple[str, ...]]]]:
    by_rank: dict[int, list] = {}
    for line in log.read_text().splitlines():
        rank, key, fields = json.loads(line)
        by_rank.setdefault(rank, []).append((key, tuple(fields)))
    return by_rank


# ---------------------------------------------------------------------- one process
def test_shard_urls_folder_braces_lists_and_pipes(tmp_path):
    paths = [str(p) for p in _write_shards(tmp_path / "s", [2, 2, 1])]
    assert shard_urls(tmp_path / "s") == paths
    assert shard_urls(str(tmp_path / "s" / "shard-{000000..000002}.tar")) == paths
    assert shard_urls([paths[2], paths[0]]) == [paths[2], paths[0]]
    assert shard_urls(f"pipe:cat {paths[0]}::{paths[1]}") == [f"pipe:cat {paths[0]}", paths[1]]
    with pytest.raises(FileNotFoundError, match="1 shard"):
        shard_urls([paths[0], str(tmp_path / "nope.tar")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no shards"):
        shard_urls(tmp_path / "empty")


@pytest.mark.parametrize("fmt", ["ustar", "gnu", "pax", "tar-cli"])
def test_tar_members_reads_what_tarfile_reads(tmp_path, fmt):
    """Long names (ustar prefix, GNU long-name header, pax path), a directory, a symlink, a
    non-ASCII name, an empty file and one of exactly a block: the regular members, as tarfile reads them."""
    src = tmp_path / "src"
    deep = src / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    files = {
        "a.txt": b"alpha",
        f"{'d' * 60}/{'e' * 60}/k.png": bytes(range(256)) * 3,
        f"{'d' * 60}/{'e' * 60}/{'n' * 120}.txt": b"long name",
        "caf\u00e9.txt": "caf\u00e9".encode(),
        "empty.txt": b"",
        "block.bin": b"x" * 512,
    }
    for name, data in files.items():
        (src / name).write_bytes(data)
    (src / "link").symlink_to("a.txt")
    path = tmp_path / "t.tar"
    if fmt == "tar-cli":
        if shutil.which("tar") is None:
            pytest.skip("no tar command")
        subprocess.run(["tar", "-cf", str(path), "-C", str(src), "."], check=True)
    else:
        if fmt == "ustar":  # a ustar name is at most 100 characters (155 more in the prefix)
            del files[f"{'d' * 60}/{'e' * 60}/{'n' * 120}.txt"]
            (src / f"{'d' * 60}/{'e' * 60}/{'n' * 120}.txt").unlink()
        formats = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
        with tarfile.open(path, "w", format=formats[fmt]) as tar:
            tar.add(src, arcname=".")
    with tarfile.open(path) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar if m.isreg()]
    with open(path, "rb") as f:
        got = list(tar_members(f, str(path)))
    assert got == expected and len(got) == len(files)
    with open(path, "rb") as f:
        assert [(n, d) for n, d in tar_members(f, str(path), data=False)] == [(n, None) for n, _ in expected]


def test_a_damaged_or_truncated_shard_is_named(tmp_path):
    (path,) = _write_shards(tmp_path / "s", [3])
    data = path.read_bytes()
    damaged = tmp_path / "damaged.tar"
    damaged.write_bytes(data[:2050] + b"garbage!" + data[2058:])  # inside the header at byte 2048
    with pytest.raises(ValueError, match=r"damaged.tar: bad tar header checksum at byte 2048"):
        list(WebDatasetPairs(damaged).samples(0))
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[:2000])
    with pytest.raises(ValueError, match="cut.tar: the tar stream ends inside a member.*truncated shard"):
        list(WebDatasetPairs(f"pipe:cat {cut}").samples(0))
    (tmp_path / "text.tar").write_text("not a tar file at all\n" * 40)
    with pytest.raises(ValueError, match="text.tar: bad"):
        len(WebDatasetPairs(tmp_path / "text.tar"))


def test_reads_pairs_and_decodes_only_the_fields_asked_for(tmp_path, monkeypatch):
    _write_shards(tmp_path / "s", [3, 2])
    log = tmp_path / "decode.log"
    ds = WebDatasetPairs(tmp_path / "s", **_tiny(log))
    assert len(ds) == 5 and ds.shard_sizes() == [3, 2]  # the .json members are no samples of their own
    sample = next(iter(ds))
    assert set(sample) == set(ds.fields) and sample["image"].shape == (3, 8, 8) and sample["caption"] == _caption(0)
    assert sample["input_ids"].shape == (SEQ,) and sample["attention_mask"].tolist() == [1] * SEQ

    raw = list(ds.samples(0))
    opened, tokenized = [], []
    real_open, real_call = Image.open, CaptionTokenizer.__call__
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    monkeypatch.setattr(CaptionTokenizer, "__call__", lambda self, t: tokenized.append(t) or real_call(self, t))
    ds.decoded.clear()
    log.unlink()
    assert set(ds.decode(raw[1], TEXT)) == set(TEXT) and opened == [] and tokenized == [_caption(1)]
    assert set(ds.decode(raw[2], ["image"])) == {"image"} and len(opened) == 1 and len(tokenized) == 1
    assert ds.decode(raw[3], ["caption"]) == {"caption": _caption(3)} and len(opened) == 1 and len(tokenized) == 1
    assert ds.decoded == {"input_ids": 1, "attention_mask": 1, "image": 1, "caption": 1}
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        [0, "s0001", list(TEXT)],
        [0, "s0002", ["image"]],
        [0, "s0003", ["caption"]],
    ]
    with pytest.raises(KeyError, match="no field"):
        ds.decode(raw[0], ["pixels"])


def test_seeded_order_is_the_same_everywhere_and_pipe_reads_it_too(tmp_path):
    paths = _write_shards(tmp_path / "s", [7, 7, 6])
    local = WebDatasetPairs(tmp_path / "s", shuffle=True, shuffle_buffer=5, seed=3)
    again = WebDatasetPairs([str(p) for p in paths], shuffle=True, shuffle_buffer=5, seed=3)
    pipe = WebDatasetPairs([f"pipe:cat {p}" for p in paths], shuffle=True, shuffle_buffer=5, seed=3)
    assert _keys(local, 1) == _keys(again, 1) == _keys(pipe, 1)
    assert sorted(_keys(local, 1)) == [f"s{i:04d}" for i in range(20)]
    assert _keys(local, 0) != _keys(local, 1) != list(sorted(_keys(local, 1)))
    assert _keys(WebDatasetPairs(tmp_path / "s", shuffle=True, seed=4), 1) != _keys(local, 1)
    assert _keys(WebDatasetPairs(tmp_path / "s"), 5) == [f"s{i:04d}" for i in range(20)]  # no shuffle: as written
    assert pipe.epoch_length() is None and local.epoch_length() == 20
    with pytest.raises(TypeError, match="not known"):
        len(pipe)
    # iterated plainly, each iteration is the next epoch
    plain = WebDatasetPairs(tmp_path / "s", shuffle=True, shuffle_buffer=5, seed=3, **_tiny())
    assert [s["caption"] for s in plain] == [_caption(int(k[1:])) for k in _keys(local, 0)]
    assert [s["caption"] for s in plain] == [_caption(int(k[1:])) for k in _keys(local, 1)]


@pytest.mark.parametrize("buffer", [0, 5])
def test_skipping_reads_no_more_than_it_must_and_decodes_nothing(tmp_path, buffer):
    paths = _write_shards(tmp_path / "s", [7, 7, 6])
    for urls in (tmp_path / "s", [f"pipe:cat {p}" for p in paths]):
        ds = WebDatasetPairs(urls, shuffle=True, shuffle_buffer=buffer, seed=1, **_tiny())
        order = _keys(ds, 2)
        ds.read = 0
        assert _keys(ds, 2, 9) == order[9:]
        assert ds.decoded == {}
        if buffer == 0 and isinstance(urls, Path):
            # shards permuted only, local: the first shard (6 or 7 samples, all before sample 9) is not opened
            assert ds.read == 20 - (6 if order[0] >= "s0014" else 7)
        else:
            assert ds.read == 20
        with pytest.raises(DataPositionError, match="written 21 samples.*only 20"):
            _keys(ds, 2, 21)


def _rank_loader(source: DataLoader, rank: int, plan: ldm.Plan, progress=None) -> DistMMDataLoader:
    return DistMMDataLoader(source, RankLayout(plan, rank, FIELDS), progress=progress)


PLAN3 = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_rank_decodes_only_its_rows_and_fields(tmp_path, workers):
    """Rank 1 (image replica 2 of 2) of global batches of 6: samples 3-5 of each, images only."""
    _write_shards(tmp_path / "s", [7, 7, 6])
    log = tmp_path / "decode.log"
    ds = WebDatasetPairs(tmp_path / "s", shuffle=True, shuffle_buffer=5, seed=2, **_tiny(log))
    order = _keys(ds, 0)
    ds.read = 0
    dl = _rank_loader(DataLoader(ds, batch_size=6, drop_last=True, num_workers=workers), 1, PLAN3)
    assert len(dl) == 3
    batches = list(dl)
    assert len(batches) == 3 and set(batches[0]) == {"image", GLOBAL_BATCH_KEY}
    assert int(batches[0][GLOBAL_BATCH_KEY]) == 6 and batches[0]["image"].shape == (3, 3, 8, 8)
    records = _records(log)[0]
    assert [k for k, _ in records] == [order[b * 6 + r] for b in range(3) for r in (3, 4, 5)]
    assert {f for _, f in records} == {("image",)}
    if workers == 0:
        assert ds.decoded == {"image": 9} and ds.read == 20  # every sample read, 9 decoded
    text = _rank_loader(DataLoader(ds, batch_size=6, drop_last=True), 2, PLAN3)
    assert [b["input_ids"].shape for b in text] == [(6, SEQ)] * 3


def test_resume_skips_what_was_trained_without_decoding_it(tmp_path):
    paths = _write_shards(tmp_path / "s", [7, 7, 6])
    trained = [0]

    def loader(urls, log=None, batch=4):
        ds = WebDatasetPairs(urls, shuffle=True, shuffle_buffer=5, seed=2, **_tiny(log))
        return ds, _rank_loader(DataLoader(ds, batch_size=batch, drop_last=True), 2, PLAN3, lambda: trained[0])

    ds, dl = loader(tmp_path / "s")
    order = _keys(ds, 0)
    it = iter(dl)
    next(it), next(it), next(it)  # two trained, one prefetched
    trained[0] = 2
    state = dl.state_dict()
    assert (state["epoch"], state["samples"]) == (0, 8)
    for i, urls in enumerate([tmp_path / "s", [f"pipe:cat {p}" for p in paths]]):
        log = tmp_path / f"resumed{i}.log"
        ds, again = loader(urls, log, batch=3)  # another batch size: the next unseen sample still
        again.load_state_dict(state)
        batches = list(again)
        assert len(batches) == 4 and ds.decoded == {"input_ids": 12, "attention_mask": 12}
        assert [k for k, _ in _records(log)[0]] == order[8:20]


class DictStream(IterableDataset):
    """A plain stream of dict samples (already decoded), in an order set by its epoch."""

    def __init__(self, n: int = 12) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)
        for i in torch.randperm(self.n, generator=g).tolist():
            yield {"image": torch.full((3, 8, 8), float(i)), "input_ids": torch.full((SEQ,), i)}


def test_a_plain_iterable_dataset_is_read_by_every_rank_and_cut_the_same(tmp_path):
    fields = {"image": ("image",), "text": ("input_ids",)}
    dls = [DistMMDataLoader(DataLoader(DictStream(), batch_size=4), RankLayout(PLAN3, r, fields)) for r in range(3)]
    image0, image1, text = (list(dl) for dl in dls)
    assert [len(x) for x in (image0, image1, text)] == [3, 3, 3]
    for a, b, t in zip(image0, image1, text):
        assert set(a) == {"image", GLOBAL_BATCH_KEY} and set(t) == {"input_ids", GLOBAL_BATCH_KEY}
        assert (
            torch.cat([a["image"][:, 0, 0, 0], b["image"][:, 0, 0, 0]]).long().tolist() == t["input_ids"][:, 0].tolist()
        )

    class Tuples(DictStream):
        def __iter__(self):
            yield from ((s["image"], s["input_ids"]) for s in super().__iter__())

    with pytest.raises(TypeError, match="dicts keyed by field name; Tuples yielded tuple"):
        list(DistMMDataLoader(DataLoader(Tuples(), batch_size=4), RankLayout(PLAN3, 0, fields)))


def test_checks_of_streams(tmp_path):
    _write_shards(tmp_path / "s", [5])
    ds = WebDatasetPairs(tmp_path / "s")
    replicas = {"image": 2, "text": 1}
    check_dataloader(DataLoader(ds, batch_size=4, drop_last=True), FIELDS, replicas)
    check_dataloader(DataLoader(ds, batch_size=5, drop_last=False), FIELDS, replicas)
    with pytest.raises(ValueError, match="the last batch of each epoch has 1 samples"):
        check_dataloader(DataLoader(ds, batch_size=2, drop_last=False), FIELDS, replicas)
    with pytest.raises(KeyError, match=r"tower 'audio' reads batch field\(s\) \['wave'\]"):
        check_dataloader(DataLoader(ds, batch_size=4, drop_last=True), {"audio": ("wave",)}, {"audio": 1})
    # a stream of unknown length: a short last batch cannot be ruled out
    pipe = WebDatasetPairs(f"pipe:cat {tmp_path / 's' / 'shard-000000.tar'}")
    check_dataloader(DataLoader(pipe, batch_size=4, drop_last=True), FIELDS, replicas)
    check_dataloader(DataLoader(pipe, batch_size=4, drop_last=False), FIELDS, {"image": 1, "text": 1})
    with pytest.raises(ValueError, match="does not know its length.*drop_last=True"):
        check_dataloader(DataLoader(pipe, batch_size=4, drop_last=False), FIELDS, replicas)
    # a webdataset pipeline reads other shards on each rank: refused, naming what to use
    pipeline = wds.WebDataset(str(tmp_path / "s" / "shard-000000.tar"), shardshuffle=False)
    with pytest.raises(TypeError, match="webdataset pipeline.*WebDatasetPairs"):
        check_dataloader(DataLoader(pipeline, batch_size=4), FIELDS, replicas)


# ---------------------------------------------------------------------- under distmm
@pytest.mark.slow
def test_shards_under_distmm_equal_one_process_and_decode_per_rank(tmp_path):
    """Image on ranks 0, 1 (4 rows each of a batch of 8), text on rank 2, shuffled shards: the same
    weights as one process after 3 steps, each rank decoded only its rows and its tower's fields."""
    _write_shards(tmp_path / "s", [11, 11, 10])

    def data(log: Path | None) -> DataLoader:
        ds = WebDatasetPairs(tmp_path / "s", shuffle=True, shuffle_buffer=6, seed=5, **_tiny(log))
        return DataLoader(ds, batch_size=8, drop_last=True)

    def run() -> None:
        L.seed_everything(0)
        reference = TinyCLIP("sgd", lr=0.05)
        module, initial = copy.deepcopy(reference), copy.deepcopy(reference)
        run_reference(reference, data(None), 3, str(tmp_path / "ref.json"))
        run_distmm(module, PLAN3, 3, data(tmp_path / "decode.log"), 3, str(tmp_path / "dist.json"))
        assert max_param_diff(reference, module) <= 1e-5
        assert max_param_diff(reference, initial) > 1e-3
        assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)

    in_subprocess(run)
    order = _keys(WebDatasetPairs(tmp_path / "s", shuffle=True, shuffle_buffer=6, seed=5), 0)
    records = _records(tmp_path / "decode.log")
    assert {f for _, f in records[0] + records[1]} == {("image",)} and {f for _, f in records[2]} == {TEXT}
    steps = len(records[2]) // 8
    assert steps >= 3  # 3 steps (Lightning may prefetch a batch more)
    assert [k for k, _ in records[0]] == [order[8 * s + r] for s in range(steps) for r in range(4)]
    assert [k for k, _ in records[1]] == [order[8 * s + r] for s in range(steps) for r in range(4, 8)]
    assert [k for k, _ in records[2]] == order[: 8 * steps]


@pytest.mark.slow
@pytest.mark.parametrize("pipe", [False, True], ids=["local", "pipe"])
def test_resume_continues_the_same_sample_order(tmp_path, pipe):
    """Saved after 2 steps of 8, resumed to 5: the losses and weights of one 5-step run, and the
    resumed run decodes the samples after the first 16 of the epoch's order, never one before."""
    paths = _write_shards(tmp_path / "s", [13, 13, 14])
    urls = [f"pipe:cat {p}" for p in paths] if pipe else tmp_path / "s"
    plan = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})

    def data(log: Path | None = None) -> DataLoader:
        ds = WebDatasetPairs(urls, shuffle=True, shuffle_buffer=10, seed=1, **_tiny(log))
        return DataLoader(ds, batch_size=8, drop_last=True)

    def run() -> None:
        def build() -> TinyCLIP:  # each run is the same script: seed, build, fit
            L.seed_everything(0)
            return TinyCLIP("adamw", lr=0.01)

        straight = build()
        run_distmm(straight, plan, 2, data(tmp_path / "straight.log"), 5, str(tmp_path / "straight.json"))
        first = build()
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        run_distmm(
            first, plan, 2, data(), 2, str(tmp_path / "first.json"), callbacks=[saver], enable_checkpointing=True
        )
        resumed = build()
        folder = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
        run_distmm(resumed, plan, 2, data(tmp_path / "resumed.log"), 5, str(tmp_path / "r.json"), ckpt_path=str(folder))
        losses = read_losses(tmp_path / "straight.json")
        assert read_losses(tmp_path / "r.json") == pytest.approx(losses[2:], abs=1e-6)
        assert max_param_diff(straight, resumed) <= 1e-6

    in_subprocess(run)
    order = _keys(WebDatasetPairs(urls, shuffle=True, shuffle_buffer=10, seed=1), 0)
    straight, resumed = _records(tmp_path / "straight.log"), _records(tmp_path / "resumed.log")
    for rank in (0, 1):  # one epoch of 40 samples: 5 steps of 8
        assert [k for k, _ in straight[rank]] == order
        assert [k for k, _ in resumed[rank]] == order[16:]


def test_ddp_replicas_take_their_rows_of_each_global_batch(tmp_path):
    """Plain iteration under DDP: replica r of 2 with batches of 2 yields rows 2r, 2r+1 of each
    global batch of 4, the incomplete last global batch dropped on both."""
    _write_shards(tmp_path / "s", [5, 5])
    order = _keys(WebDatasetPairs(tmp_path / "s", shuffle=True, shuffle_buffer=3, seed=1), 0)
    got = []
    for rank in (0, 1):
        ds = WebDatasetPairs(tmp_path / "s", shuffle=True, shuffle_buffer=3, seed=1, **_tiny())
        ds.split_replicas(rank, 2, 2)
        assert len(ds) == 4 and len(DataLoader(ds, batch_size=2)) == 2
        got.append([s["caption"] for s in ds])
    captions = [_caption(int(k[1:])) for k in order]
    assert got == [captions[0:2] + captions[4:6], captions[2:4] + captions[6:8]]


def test_the_default_plan_counts_on_an_example_not_recorded(tmp_path):
    _write_shards(tmp_path / "s", [3])
    ds = WebDatasetPairs(f"pipe:cat {tmp_path / 's' / 'shard-000000.tar'}", **_tiny(tmp_path / "log"))
    example = ds.example()
    assert set(example) == set(ds.fields) and example["caption"] == _caption(0)
    assert ds.decoded == {} and not (tmp_path / "log").exists()


# ---------------------------------------------------------------------- the recipe
def test_make_shards_and_the_clip_wds_experiment(tmp_path):
    """make_shards.py writes the make_csv samples as shards; experiment=clip_wds builds a
    DataModule over them whose epoch length the recipe reads."""
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "recipes"))
    import make_csv
    import make_shards
    import train

    train_shards, val_shards = make_shards.main(
        ["--out", str(tmp_path), "--train", "10", "--val", "4", "--per-shard", "4"]
    )
    assert [p.name for p in train_shards] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert len(val_shards) == 1
    csv_path, _ = make_csv.main(["--out", str(tmp_path / "csv"), "--train", "10", "--val", "4"])
    csv_captions = [line.split(",", 1)[1] for line in csv_path.read_text().splitlines()[1:]]
    assert [s["caption"] for s in WebDatasetPairs(tmp_path / "train")] == csv_captions

    cfg, dm = recipe_stream_datamodule("clip_shapes_wds", tmp_path / "train", tmp_path / "val")
    kwargs = {"max_steps": 5, "max_epochs": None}
    train.settle_max_epochs(kwargs, dm)
    assert kwargs["max_epochs"] == 3  # 2 batches of 4 an epoch
    assert {type(c).__name__ for c in train.instantiate_group(cfg.callbacks)} >= {"Retrieval", "Throughput"}


def test_a_failing_pipe_and_a_missing_caption_are_named(tmp_path):
    import io
    import tarfile

    from lightning_distmm.data.datasets.webdataset import WebDatasetPairs

    url = f"pipe:cat {tmp_path / 'missing-000000.tar'}"
    with pytest.raises(OSError, match=r"WebDatasetPairs: reading shard 'pipe:cat .*missing-000000.tar' failed"):
        list(WebDatasetPairs([url])._read([url]))
    with tarfile.open(tmp_path / "nocap.tar", "w") as tar:
        info = tarfile.TarInfo("x000.png")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"png"))
    shard = str(tmp_path / "nocap.tar")
    with pytest.raises(ValueError, match=r"sample 'x000' has members \['png'\]: no caption \(txt\);"):
        list(WebDatasetPairs([shard])._read([shard]))
