"""Bad training data fails at setup with a message naming the cause; the user's sampler order is kept.

The check-level tests run the checks the strategy calls at setup; the end-to-end ones (skipped
until the strategy calls ``check_dataloader`` and stops swapping the sampler) train under distmm.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from distmm_testing import (
    PairData,
    TinyCLIP,
    in_subprocess,
    loader,
    max_param_diff,
    read_losses,
    run_distmm,
    run_reference,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, IterableDataset

import lightning_distmm as ldm
from lightning_distmm.core.layout import RankLayout
from lightning_distmm.data.loader.checks import check_dataloader, check_dataset
from lightning_distmm.data.loader.loading import DistMMDataLoader

FIELDS = {"image": ("image",), "text": ("input_ids", "attention_mask")}
SEPARATE = {"image": 1, "text": 1}


class Stream(IterableDataset):
    def __iter__(self):
        yield from ()


class Empty(Dataset):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, i):
        raise IndexError(i)


class Tuples(Dataset):
    """Like open_clip's CsvDataset: ``(image, text)`` pairs."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i):
        return torch.zeros(3, 8, 8), torch.ones(6, dtype=torch.long)


class NoMask(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i):
        return {"image": torch.zeros(3, 8, 8), "input_ids": torch.ones(6, dtype=torch.long)}


def test_iterable_dataset_of_unknown_length_needs_drop_last_with_replicas():
    """A stream is read by every rank (tests/test_webdataset.py); its last batch may be short."""
    check_dataset(Stream(), FIELDS, 4, False, SEPARATE)
    check_dataset(Stream(), FIELDS, 4, True, {"image": 2, "text": 1})
    with pytest.raises(ValueError, match="Stream does not know its length.*set drop_last=True"):
        check_dataset(Stream(), FIELDS, 4, False, {"image": 2, "text": 1})
    layout = RankLayout(ldm.Plan(1, {"image": {"ranks": [0]}, "text": {"ranks": [0]}}), 0, FIELDS)
    assert list(DistMMDataLoader(DataLoader(Stream(), batch_size=4), layout)) == []


def test_empty_dataset():
    with pytest.raises(ValueError, match=r"the training dataset Empty is empty \(len 0\)"):
        check_dataset(Empty(), FIELDS, 4, False, SEPARATE)


def test_tuple_samples_say_samples_must_be_dicts():
    message = (
        r"distmm needs samples that are dicts keyed by field name.*Tuples\[0\] is a tuple of 2 .*open_clip's"
        r" CsvDataset.*or subclass lightning_distmm.FieldDataset"
    )
    with pytest.raises(TypeError, match=message):
        check_dataloader(DataLoader(Tuples(), batch_size=4), FIELDS, SEPARATE)


def test_missing_field_names_tower_fields_and_what_samples_have():
    message = (
        r"tower 'text' reads batch field\(s\) \['attention_mask'\] that the samples of NoMask do not have"
        r" \(they have \['image', 'input_ids'\]\)"
    )
    with pytest.raises(KeyError, match=message):
        check_dataloader(DataLoader(NoMask(), batch_size=4), FIELDS, SEPARATE)


def test_field_dataset_declares_its_fields(tmp_path):
    """A FieldDataset declares its fields: the check reads the declaration and decodes no sample
    (a dataset that only says what it has by loading would be loaded here)."""
    log = tmp_path / "loads.jsonl"
    check_dataloader(DataLoader(PairData(16, log=str(log)), batch_size=8), FIELDS, SEPARATE)
    assert not log.exists()
    PairData(16, log=str(log)).load(0, ("image",))  # the log records a load when there is one
    assert log.read_text().count("\n") == 1


def test_last_batch_smaller_than_replicas_is_refused_at_setup():
    data = DataLoader(PairData(10), batch_size=4)  # batches of 4, 4, 2: the image tower has 3 replicas
    message = (
        r"tower 'image' has 3 data-parallel replicas, but the last batch of each epoch has 2 samples \(10 samples"
        r" in batches of 4, drop_last=False\): a replica would get no sample; set drop_last=True"
    )
    with pytest.raises(ValueError, match=message):
        check_dataloader(data, FIELDS, {"image": 3, "text": 1})
    check_dataloader(DataLoader(PairData(10), batch_size=4, drop_last=True), FIELDS, {"image": 3, "text": 1})
    check_dataloader(DataLoader(PairData(11), batch_size=4), FIELDS, {"image": 3, "text": 1})  # last batch 3


def test_last_batch_counts_each_sync_group():
    message = r"each of its 2 sync groups \(\[1, 1\]\) must give each replica a sample; set drop_last=True"
    with pytest.raises(ValueError, match=message):
        check_dataset(PairData(10), FIELDS, 8, False, {"image": 2, "text": 1}, sync_groups=2)
    check_dataset(PairData(12), FIELDS, 8, False, {"image": 2, "text": 1}, sync_groups=2)  # last batch 4 = 2 + 2


def test_no_batch_at_all():
    with pytest.raises(ValueError, match="an epoch has no batch: 3 samples are fewer than one batch of 4"):
        check_dataset(PairData(3), FIELDS, 4, True, SEPARATE)


# ---------------------------------------------------------------------- end to end (needs the strategy)
PLAN = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})


@pytest.mark.slow
def test_shuffle_draws_the_order_one_process_draws(tmp_path):
    """An unseeded shuffle=True under distmm trains on the batches a one-process Trainer draws."""

    def run() -> None:
        # the same script twice: seed, build the module, fit (the sampler draws after the build)
        L.seed_everything(0)
        reference = TinyCLIP("adamw", lr=0.01)
        run_reference(reference, loader(8, size=48, shuffle=True), 5, str(tmp_path / "ref.json"))
        L.seed_everything(0)
        module = TinyCLIP("adamw", lr=0.01)
        run_distmm(module, PLAN, 3, loader(8, size=48, shuffle=True), 5, str(tmp_path / "dist.json"))
        assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)
        assert max_param_diff(reference, module) <= 1e-5

    in_subprocess(run)


BAD_DATA = {
    "iterable": (lambda: DataLoader(Stream(), batch_size=4), "Stream does not know its length.*drop_last=True"),
    "empty": (lambda: DataLoader(Empty(), batch_size=4), r"the training dataset Empty is empty"),
    "tuples": (lambda: DataLoader(Tuples(), batch_size=4), r"Tuples\[0\] is a tuple of 2"),
    "last-batch": (
        lambda: DataLoader(PairData(9), batch_size=4),  # batches of 4, 4, 1: the image tower has 2 replicas
        r"tower 'image' has 2 data-parallel replicas, but the last batch of each epoch has 1 samples",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_fails_at_setup_before_any_step(case, tmp_path):
    make, message = BAD_DATA[case]
    data = make()

    def run() -> None:
        with pytest.raises(Exception, match=message):
            run_distmm(TinyCLIP(), PLAN, 3, data, 5, str(tmp_path / "l.json"))
        assert not Path(tmp_path / "l.json").exists()  # no step trained

    in_subprocess(run)


# ---------------------------------------------------------------------- resume (runs with today's strategy)
@pytest.mark.slow
def test_resume_after_a_max_steps_stop_continues_the_epoch_sequence(tmp_path):
    """5 steps (6 batches an epoch, seeded shuffle), the checkpoint written when max_steps stopped the run
    (Lightning's default ModelCheckpoint, at the epoch end the stop runs), resumed out to 8 steps:
    the same batches and weights as one 8-step run."""

    def run() -> None:
        # each run is the same script: seed, build the module, fit (the unseeded shuffle draws after
        # the build, as in an ordinary run)
        def build() -> TinyCLIP:
            L.seed_everything(0)
            return TinyCLIP("adamw", lr=0.01)

        # a seeded shuffle: every epoch's order follows from the generator, which the loader's state
        # carries (an unseeded one draws later epochs from the process RNG, which no checkpoint holds)
        def data() -> DataLoader:
            generator = torch.Generator().manual_seed(7)
            return DataLoader(PairData(48), batch_size=8, shuffle=True, drop_last=True, generator=generator)

        straight = build()
        run_distmm(straight, PLAN, 3, data(), 8, str(tmp_path / "straight.json"))
        first = build()
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
        run_distmm(
            first, PLAN, 3, data(), 5, str(tmp_path / "first.json"), callbacks=[saver], enable_checkpointing=True
        )
        folder = tmp_path / "ckpt" / "epoch=0-step=5.ckpt"
        assert folder.is_dir()
        resumed = build()
        run_distmm(resumed, PLAN, 3, data(), 8, str(tmp_path / "resumed.json"), ckpt_path=str(folder))
        losses = read_losses(tmp_path / "straight.json")
        assert read_losses(tmp_path / "resumed.json") == pytest.approx(losses[5:], abs=1e-6)
        assert max_param_diff(straight, resumed) <= 1e-6

    in_subprocess(run)


@pytest.mark.slow
def test_resume_with_a_smaller_batch_trains_the_unseen_samples(tmp_path):
    """Saved after 2 steps of 8 (shuffled), resumed with batches of 4: the image rank loads exactly
    the samples after the first 16 of the epoch's order, in that order."""
    plan = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})

    def run() -> None:
        def build() -> TinyCLIP:  # each run is the same script: seed, build, fit
            L.seed_everything(0)
            return TinyCLIP("sgd", lr=0.05)

        module = build()
        log = tmp_path / "straight.log"
        run_distmm(module, plan, 2, loader(8, size=48, log=str(log), shuffle=True), 6, str(tmp_path / "s.json"))
        order = _image_rank_loads(log)
        first = build()
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        run_distmm(
            first,
            plan,
            2,
            loader(8, size=48, shuffle=True),
            2,
            str(tmp_path / "f.json"),
            callbacks=[saver],
            enable_checkpointing=True,
        )
        log = tmp_path / "resumed.log"
        resumed = build()
        run_distmm(
            resumed,
            plan,
            2,
            loader(4, size=48, log=str(log), shuffle=True),
            5,
            str(tmp_path / "r.json"),
            ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"),
        )
        assert _image_rank_loads(log)[:12] == order[16:28]  # steps 3-5: three batches of 4

    in_subprocess(run)


def _image_rank_loads(log: Path) -> list[int]:
    """The samples the image rank loaded, in order (the one image rank loads every row's image)."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [index for index, fields in records if fields == ["image"]]
