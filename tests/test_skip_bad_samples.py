"""Skip-and-count undecodable samples (``data.skip_bad_samples``): the next decodable index replaces a
bad one on every route, counted and logged, and a distmm run whose text rank never sees the bad
image trains on the batches one process trains on."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from distmm_testing import PairData, TinyCLIP, in_subprocess, max_param_diff, read_losses, run_distmm, run_reference
from torch.utils.data import DataLoader

from lightning_distmm.data.datasets.datamodule import PairsDataModule
from lightning_distmm.data.datasets.pairs import SampleDecodeError
from lightning_distmm.data.samples.skipping import MAX_CONSECUTIVE_BAD, SkipBadSamples, SkippedSamples, resolve_rows

BAD = {3, 4, 17, 40}
CAPTIONS = [f"{c} {s}" for c in ("red", "green", "blue") for s in ("circle", "square", "triangle", "cross")]


class DamagedPairs(PairData):
    """PairData whose images at ``BAD`` cannot be decoded (as a truncated file's)."""

    def load(self, index: int, fields: Any) -> dict[str, Any]:
        if "image" in fields and index in BAD:
            raise SampleDecodeError(f"item {index}: cannot read its image: OSError: image file is truncated")
        return super().load(index, fields)


def _csv_with_a_truncated_png(tmp_path: Path, n: int = 12, bad: int = 2) -> Path:
    from PIL import Image

    rows = ["filepath,title"]
    for i in range(n):
        path = tmp_path / f"img{i}.png"
        Image.new("RGB", (8, 8), (20 * i, 0, 0)).save(path)
        rows.append(f"{path},a {CAPTIONS[i]}")
    data = (tmp_path / f"img{bad}.png").read_bytes()
    (tmp_path / f"img{bad}.png").write_bytes(data[: len(data) // 2])  # truncated mid-data
    (tmp_path / "pairs.csv").write_text("\n".join(rows) + "\n")
    return tmp_path / "pairs.csv"


def test_the_csv_route_replaces_a_truncated_image_by_the_next_pair_and_logs_it(tmp_path, caplog):
    csv = _csv_with_a_truncated_png(tmp_path)
    strict = PairsDataModule(str(csv), val_size=2, image_size=8, context_length=8, batch_size=4)
    with pytest.raises(SampleDecodeError, match=r"img2\.png"):
        strict.train_dataset[2]
    dm = PairsDataModule(str(csv), val_size=2, image_size=8, context_length=8, batch_size=4, skip_bad_samples=True)
    assert isinstance(dm.train_dataset, SkipBadSamples)
    with caplog.at_level(logging.WARNING, logger="lightning_distmm.data.samples.skipping"):
        sample = dm.train_dataset[2]
    assert sample["caption"] == f"a {CAPTIONS[3]}" and dm.train_dataset.skipped == 1
    assert "img2.png" in caplog.text and "1 so far" in caplog.text
    assert dm.train_dataset[1]["caption"] == f"a {CAPTIONS[1]}" and dm.train_dataset.skipped == 1


def test_the_rule_is_the_next_index_that_decodes_and_a_wall_of_bad_samples_is_refused():
    data = SkipBadSamples(DamagedPairs(64))
    assert torch.equal(data[3]["image"], PairData(64).load(5, ["image"])["image"])  # 3 and 4 are bad
    assert data.skipped == 2
    # resolve_rows, the distmm path, gives one process's samples (here without a process group)
    rows = [(i, data.try_load(i, ["image"])) for i in (2, 3, 4, 17)]
    got = resolve_rows(rows, data, ["image"])
    for sample, want in zip(got, (2, 5, 5, 18)):
        assert torch.equal(sample["image"], PairData(64).load(want, ["image"])["image"])

    class AllBad(PairData):
        def load(self, index: int, fields: Any) -> dict[str, Any]:
            raise SampleDecodeError(f"item {index}: cannot read its image")

    with pytest.raises(SampleDecodeError, match=f"{MAX_CONSECUTIVE_BAD} samples in a row.*paths and format"):
        SkipBadSamples(AllBad(200))[0]


class SkipCountRecorder(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:  # type: ignore[no-untyped-def]
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(float(trainer.callback_metrics["data/skipped_samples"])))


@pytest.mark.slow
def test_distmm_skips_what_one_process_skips_with_towers_on_separate_ranks(tmp_path):
    """Image on rank 0, text on rank 1: the text rank cannot see that an image is bad, yet both
    move the row to the same sample; weights and losses equal one process's, the counts agree.
    Tolerance 5e-5: this module under this plan differs from one process by 7.6e-6 with no bad
    sample at all (SGD, lr 0.1, momentum 0.9); trained on the undamaged data instead, it differs by > 1e-3."""

    def run() -> None:
        L.seed_everything(0)
        reference = TinyCLIP()
        module, initial, undamaged = copy.deepcopy(reference), copy.deepcopy(reference), copy.deepcopy(reference)
        plan = {"world_size": 2, "towers": {"image": {"ranks": [0]}, "text": {"ranks": [1]}}}

        def data() -> DataLoader:
            return DataLoader(SkipBadSamples(DamagedPairs(64)), batch_size=8, drop_last=True)

        ref_data = data()
        run_reference(reference, ref_data, 6, str(tmp_path / "ref.json"))
        run_reference(undamaged, DataLoader(PairData(64), batch_size=8, drop_last=True), 6, str(tmp_path / "u.json"))
        counts = [SkippedSamples(), SkipCountRecorder(str(tmp_path / "count.json"))]
        run_distmm(module, plan, 2, data(), 6, str(tmp_path / "dist.json"), callbacks=counts)
        assert max_param_diff(reference, module) <= 5e-5
        assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)
        assert max_param_diff(reference, initial) > 1e-3 and max_param_diff(undamaged, module) > 1e-3
        assert ref_data.dataset.skipped == 5  # 3, 4 (row 3), 4 (row 4), 17, 40 in the first 48 samples
        assert json.loads((tmp_path / "count.json").read_text()) == 5.0

    in_subprocess(run)


def test_held_out_data_resolves_eagerly_so_every_tower_reads_the_same_sample():
    """The evaluation callbacks load each tower's fields on its own rank with no exchange: an eager
    dataset maps index 3 (a bad image) to 5 for the caption too, and Retrieval runs over it."""
    from distmm_testing import TinyCLIP

    from lightning_distmm.models.evaluation import Retrieval

    held_out = SkipBadSamples(DamagedPairs(64), eager=True)
    text = held_out.load(3, ["input_ids"])["input_ids"]
    assert torch.equal(text, PairData(64).load(5, ["input_ids"])["input_ids"])  # not sample 3's caption
    assert held_out.skipped == 4  # 3, 4, 17, 40: each met once by the scan
    metrics = Retrieval(held_out, ks=[1]).evaluate(TinyCLIP())
    resolved = [5 if i in (3, 4) else i + 1 if i in (17, 40) else i for i in range(64)]
    captions = {tuple(PairData(64).load(j, ["input_ids"])["input_ids"].tolist()) for j in resolved}
    assert metrics["n"] == 64 and metrics["unique"] == len(captions)


def _shards_with_damaged_images(folder: Path, n: int, bad: set[int]) -> None:
    """One shard of ``n`` samples (8x8 noise PNGs, captions of test_webdataset's words); ``bad`` truncated."""
    import io

    import numpy as np
    import webdataset as wds
    from PIL import Image
    from test_webdataset import _caption

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with wds.TarWriter(str(folder / "shard-000000.tar")) as sink:
        for i in range(n):
            encoded = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(encoded, format="PNG")
            data = encoded.getvalue()
            sink.write(
                {"__key__": f"s{i:04d}", "png": data[: len(data) // 2] if i in bad else data, "txt": _caption(i)}
            )


@pytest.mark.slow
def test_a_stream_skips_the_same_rows_under_distmm_as_in_one_process(tmp_path):
    """WebDataset shards with 3 damaged images, shuffled; image on ranks 0 and 1 (4 rows each of 8),
    text on rank 2: a bad row is replaced by its batch's next good row, which may be another rank's,
    and the weights and losses equal one process's (``SkipBadRows``)."""
    from test_webdataset import PLAN3, _tiny

    from lightning_distmm.data import WebDatasetPairs
    from lightning_distmm.data.samples.skipping import SkipBadRows

    _shards_with_damaged_images(tmp_path / "s", 40, {2, 9, 21})

    def data() -> DataLoader:
        ds = WebDatasetPairs(tmp_path / "s", shuffle=True, shuffle_buffer=6, seed=5, skip_bad_samples=True, **_tiny())
        return DataLoader(ds, batch_size=8, drop_last=True, collate_fn=SkipBadRows(ds))

    def run() -> None:
        L.seed_everything(0)
        reference = TinyCLIP("sgd", lr=0.05)
        module, initial = copy.deepcopy(reference), copy.deepcopy(reference)
        ref_data = data()
        run_reference(reference, ref_data, 5, str(tmp_path / "ref.json"))
        skipped = ref_data.dataset.skipped
        counts = [SkippedSamples(), SkipCountRecorder(str(tmp_path / "count.json"))]
        run_distmm(module, PLAN3, 3, data(), 5, str(tmp_path / "dist.json"), callbacks=counts)
        assert max_param_diff(reference, module) <= 1e-5
        assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)
        assert max_param_diff(reference, initial) > 1e-3
        assert skipped == 3 and json.loads((tmp_path / "count.json").read_text()) == 3.0  # all in 40 samples

    in_subprocess(run)


def test_a_litdata_folder_skips_a_damaged_item_in_one_process(tmp_path):
    """LitDataPairs marks the item it cannot decode and the DataModule's collate gives the row the
    batch's next good one (distmm exchanges failing rows as for WebDataset: the stream code is shared)."""
    pytest.importorskip("litdata")
    import io

    from litdata.streaming.writer import BinaryWriter
    from PIL import Image

    from lightning_distmm.data.datasets.litdata_pairs import LitDataDataModule

    writer = BinaryWriter(str(tmp_path / "lit"), chunk_size=8)
    for i in range(16):
        encoded = io.BytesIO()
        Image.new("RGB", (8, 8), (10 * i, 0, 0)).save(encoded, format="PNG")
        data = encoded.getvalue()
        writer[i] = {"image": data[: len(data) // 2] if i == 5 else data, "caption": f"a {CAPTIONS[i % 12]}"}
    writer.done()
    writer.merge(1)
    dm = LitDataDataModule(str(tmp_path / "lit"), shuffle=False, image_size=8, context_length=8, batch_size=8,
                           skip_bad_samples=True)  # fmt: skip
    first, second = list(dm.train_dataloader())
    assert first["caption"] == [f"a {CAPTIONS[i]}" for i in (0, 1, 2, 3, 4, 6, 6, 7)]  # row 5 took row 6
    assert second["caption"][0] == f"a {CAPTIONS[8]}" and dm.train_dataset.skipped == 1
