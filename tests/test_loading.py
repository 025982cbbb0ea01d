"""Per-rank loading: each rank loads only its rows and its towers' fields, in the sampler's order."""

import json

import torch
from distmm_testing import loader

from lightning_distmm.core import Plan
from lightning_distmm.core.layout import GLOBAL_BATCH_KEY, RankLayout
from lightning_distmm.data.loading import DistMMDataLoader

FIELDS = {"image": ("image",), "text": ("input_ids", "attention_mask")}
PLAN = Plan(4, {"image": {"ranks": [0, 1, 2], "replica_batch": [4, 3, 3]}, "text": {"ranks": [3]}}, 10)


def _loads(rank, tmp_path):
    log = tmp_path / f"rank{rank}.log"
    dl = DistMMDataLoader(loader(10, size=20, log=str(log)), RankLayout(PLAN, rank, FIELDS))
    batches = list(dl)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return batches, records


def test_image_replica_loads_its_rows_and_only_images(tmp_path):
    batches, records = _loads(1, tmp_path)
    assert [r[0] for r in records] == [4, 5, 6, 14, 15, 16]
    assert all(r[1] == ["image"] for r in records)
    assert set(batches[0]) == {"image", GLOBAL_BATCH_KEY}
    assert int(batches[0][GLOBAL_BATCH_KEY]) == 10 and batches[0]["image"].shape[0] == 3


def test_text_rank_loads_all_rows_and_only_tokens(tmp_path):
    batches, records = _loads(3, tmp_path)
    assert [r[0] for r in records] == list(range(20))
    assert all(r[1] == ["attention_mask", "input_ids"] for r in records)
    assert batches[1]["input_ids"].shape == (10, 6)


def test_colocated_partial_batch_split():
    layout = RankLayout(Plan(2, {"image": {"ranks": [0, 1]}, "text": {"ranks": [0, 1]}}), 1, FIELDS)
    rb = layout.batch(7)
    assert rb.rows == (4, 5, 6)
    assert rb.towers["image"].spans[0].local == slice(0, 3) and rb.towers["text"].spans[0].start == 4


def test_distmm_replicas_take_rows_of_each_sync_group():
    """Under distmm the batch is two sync groups, each split over a tower's replicas: replica 1 of
    a 2-replica image tower gets the second half of each group, the one text replica everything."""
    plan = Plan(3, {"image": {"ranks": [0, 1], "schedule": "distmm"}, "text": {"ranks": [2], "schedule": "distmm"}})
    image = RankLayout(plan, 1, FIELDS).batch(10)
    assert [(s.start, s.stop, s.local_start) for s in image.towers["image"].spans] == [(3, 5, 0), (8, 10, 2)]
    assert image.rows == (3, 4, 8, 9)
    text = RankLayout(plan, 2, FIELDS).batch(10)
    assert [(s.start, s.stop) for s in text.towers["text"].spans] == [(0, 5), (5, 10)] and text.rows == tuple(range(10))


def test_resume_skips_without_loading(tmp_path):
    log = tmp_path / "log"
    dl = DistMMDataLoader(loader(10, size=40, log=str(log)), RankLayout(PLAN, 0, FIELDS), progress=lambda: 2)
    state = dl.state_dict()
    assert state == {"batches_done": 2}
    dl.load_state_dict(state)
    first = next(iter(dl))
    assert torch.equal(first["image"][0], loader(10, size=40).dataset.load(20, ["image"])["image"])
    loaded = [json.loads(line)[0] for line in log.read_text().splitlines()]
    assert loaded[:4] == [20, 21, 22, 23]
