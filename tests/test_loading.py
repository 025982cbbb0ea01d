"""Per-rank loading: each rank loads only its rows and its towers' fields, in the sampler's order."""

import json
import multiprocessing as mp
import os
import traceback
from pathlib import Path

import pytest
import torch
from distmm_testing import loader
from ports import free_port
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from lightning_distmm.core import Plan
from lightning_distmm.core.layout import GLOBAL_BATCH_KEY, SAMPLES_KEY, RankLayout
from lightning_distmm.data.loader.loading import DistMMDataLoader
from lightning_distmm.data.samples.fields import FieldDataset
from lightning_distmm.data.samples.sampling import DataPositionError

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
    assert set(batches[0]) == {"image", GLOBAL_BATCH_KEY, SAMPLES_KEY}
    assert int(batches[0][GLOBAL_BATCH_KEY]) == 10 and batches[0]["image"].shape[0] == 3
    assert [b[SAMPLES_KEY] for b in batches] == [(4, 5, 6), (14, 15, 16)]  # messages name these


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
    trained = [0]
    dl = DistMMDataLoader(loader(10, size=40, log=str(log)), RankLayout(PLAN, 0, FIELDS), progress=lambda: trained[0])
    it = iter(dl)
    next(it), next(it), next(it)  # two trained, one prefetched
    trained[0] = 2
    state = dl.state_dict()
    assert (state["epoch"], state["samples"]) == (0, 20)
    log.unlink()
    again = DistMMDataLoader(loader(10, size=40, log=str(log)), RankLayout(PLAN, 0, FIELDS))
    again.load_state_dict(state)
    first = next(iter(again))
    assert torch.equal(first["image"][0], loader(10, size=40).dataset.load(20, ["image"])["image"])
    loaded = [json.loads(line)[0] for line in log.read_text().splitlines()]
    assert loaded[:4] == [20, 21, 22, 23]


# ---------------------------------------------------------------------- the data position
class Indices(FieldDataset):
    """Sample ``i`` is its own index: the batches say which samples were drawn."""

    fields = ("index",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def load(self, index, fields):
        return {"index": torch.tensor(index)}


ONE = Plan(1, {"image": {"ranks": [0]}})


class Trainer:
    """What Lightning does to a loader, by hand: set_epoch, iterate with one batch prefetched, count trained."""

    def __init__(self, dl: DistMMDataLoader) -> None:
        self.dl, self.trained, self.epoch = dl, 0, 0
        dl.rank_sampler.progress = lambda: self.trained

    def run(self, steps: int, epoch_batches: int | None = None, first_epoch: int = 0, resumed_count: int = 0):
        """Train ``steps`` batches; ``resumed_count``: the trainer's count of the epoch restored from a checkpoint."""
        out, self.epoch, self.trained = [], first_epoch, resumed_count
        it = iter(self.dl)
        ahead = next(it, None)  # Lightning draws the first batch while setting up, before set_epoch
        self.dl.batch_sampler.sampler.set_epoch(self.epoch)
        while len(out) < steps:
            if ahead is None or (epoch_batches is not None and self.trained >= epoch_batches):
                self.epoch += 1
                self.dl.batch_sampler.sampler.set_epoch(self.epoch)  # before the epoch loop resets its count
                self.trained = 0
                it = iter(self.dl)
                ahead = next(it, None)
                continue
            batch, ahead = ahead, next(it, None)
            out.append(batch["index"].tolist())
            self.trained += 1
        return out


def _shuffled(batch: int, size: int = 24, **kw) -> DataLoader:
    return DataLoader(Indices(size), batch_size=batch, shuffle=True, drop_last=True, **kw)


def _loader(source: DataLoader) -> DistMMDataLoader:
    return DistMMDataLoader(source, RankLayout(ONE, 0, {"image": ("index",)}))


@pytest.mark.parametrize("sampler", ["global-rng", "generator", "distributed"])
def test_resume_from_a_max_steps_stop_continues_the_epoch(sampler):
    """A run stopped by max_steps mid-epoch, resumed: Lightning's epoch counter then reads one more
    (its fit loop ends the epoch when max_steps stops it), while the data must continue epoch 0."""

    def source():
        if sampler == "global-rng":
            return _shuffled(4)
        if sampler == "generator":
            return _shuffled(4, generator=torch.Generator().manual_seed(7))
        return DataLoader(Indices(24), batch_size=4, sampler=DistributedSampler(Indices(24), 1, 0, seed=3))

    torch.manual_seed(0)
    straight = Trainer(_loader(source())).run(8, epoch_batches=6)
    torch.manual_seed(0)
    first = Trainer(_loader(source()))
    assert first.run(5, epoch_batches=6) == straight[:5]
    state = first.dl.state_dict()
    assert (state["epoch"], state["samples"]) == (0, 20)
    torch.manual_seed(123)  # a resumed process: another RNG state, a freshly seeded generator
    resumed = Trainer(_loader(source()))
    resumed.dl.load_state_dict(state)
    # Lightning resumes that checkpoint at its epoch 1 with 5 batches counted (and stops that epoch after 6)
    assert resumed.run(3, epoch_batches=6, first_epoch=1, resumed_count=5) == straight[5:]


def test_resume_at_an_epoch_end_that_lightning_counts_as_mid_epoch():
    """A checkpoint at the end of epoch 0 with max_steps: Lightning resumes in its epoch 1 but trains
    one batch as the 7th of epoch 0 and then starts epoch 2; the data must still walk epoch 1 whole."""
    ds = Indices(24)
    source = lambda: DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 1, 0, seed=3))  # noqa: E731
    straight = Trainer(_loader(source())).run(9, epoch_batches=6)
    first = Trainer(_loader(source()))
    first.run(6, epoch_batches=6)
    state = first.dl.state_dict()
    assert (state["epoch"], state["samples"]) == (1, 0)
    resumed = Trainer(_loader(source()))
    resumed.dl.load_state_dict(state)
    assert resumed.run(3, epoch_batches=7, first_epoch=1, resumed_count=6) == straight[6:]


def test_limit_train_batches_starts_a_new_epoch_each_time():
    """Without a resume, each trainer epoch is a new pass of the sampler, as in one process."""
    ds = Indices(24)
    dl = _loader(DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 1, 0, seed=3)))
    got = Trainer(dl).run(4, epoch_batches=2)
    orders = []
    for epoch in (0, 1):
        s = DistributedSampler(ds, 1, 0, seed=3)
        s.set_epoch(epoch)
        orders.append(list(s))
    assert got == [orders[0][:4], orders[0][4:8], orders[1][:4], orders[1][4:8]]


def test_resume_with_another_batch_size_continues_at_the_next_unseen_sample():
    torch.manual_seed(0)
    straight = Trainer(_loader(_shuffled(8))).run(3)
    order = [i for batch in straight for i in batch]
    torch.manual_seed(0)
    first = Trainer(_loader(_shuffled(8)))
    first.run(2)
    state = first.dl.state_dict()
    assert state["samples"] == 16
    torch.manual_seed(99)
    resumed = Trainer(_loader(_shuffled(4)))
    resumed.dl.load_state_dict(state)
    assert resumed.run(2, resumed_count=2) == [order[16:20], order[20:24]]


class Pairs(BatchSampler):
    """A custom batch sampler (not torch's BatchSampler): it can only be resumed at its own batch boundaries."""

    def __init__(self, size: int, batch: int) -> None:
        super().__init__(SequentialSampler(range(size)), batch, True)

    def __iter__(self):
        yield from super().__iter__()


def test_custom_batch_sampler_refuses_a_position_inside_a_batch():
    dl = _loader(DataLoader(Indices(24), batch_sampler=Pairs(24, 8)))
    Trainer(dl).run(1)
    state = dl.state_dict()
    assert state["samples"] == 8
    whole = _loader(DataLoader(Indices(24), batch_sampler=Pairs(24, 4)))
    whole.load_state_dict(state)
    assert Trainer(whole).run(1, resumed_count=1) == [[8, 9, 10, 11]]
    inside = _loader(DataLoader(Indices(24), batch_sampler=Pairs(24, 6)))
    inside.load_state_dict(state)
    message = r"8 samples into epoch 0, but the batches of this DataLoader's Pairs end at samples 6 and 12"
    with pytest.raises(DataPositionError, match=message):
        Trainer(inside).run(1, resumed_count=1)


def test_a_position_past_the_epoch_is_refused():
    dl = _loader(_shuffled(4, size=24))
    dl.load_state_dict({"epoch": 0, "samples": 40, "rng": None})
    with pytest.raises(DataPositionError, match="40 samples into epoch 0, but this DataLoader's epoch has only 24"):
        next(iter(dl))


def test_a_batch_count_state_is_refused():
    dl = _loader(_shuffled(4))
    with pytest.raises(DataPositionError, match="as 2 batches of an unknown epoch"):
        dl.load_state_dict({"batches_done": 2})


def test_the_users_sampler_is_iterated_as_is():
    """An unseeded shuffle draws from the global RNG exactly as iterating the user's DataLoader does."""
    torch.manual_seed(5)
    reference = [b["index"].tolist() for b in _shuffled(4)]
    torch.manual_seed(5)
    assert [b["index"].tolist() for b in _loader(_shuffled(4))] == reference


# ---------------------------------------------------------------------- several ranks
def _free_port() -> int:
    return free_port()


def _rank_main(rank: int, world: int, port: int, case: str, out: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        torch.manual_seed(100 + rank)  # every rank's RNG differs: only rank 0's may decide the order
        plan = Plan(world, {"image": {"ranks": list(range(world))}})
        source = _shuffled(4, size=24)
        if case == "fails":
            source = DataLoader(Indices(24), batch_sampler=Pairs(24, 6))
        dl = DistMMDataLoader(source, RankLayout(plan, rank, {"image": ("index",)}))
        if case == "fails":
            dl.load_state_dict({"epoch": 0, "samples": 8, "rng": None})
        try:
            result = {"batches": [b["index"].tolist() for b in dl]}
        except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
            result = {"error": f"{type(e).__name__}: {e}"}
        if rank == 0:
            torch.manual_seed(100)
            result["reference"] = [b["index"].tolist() for b in _shuffled(4, size=24)]
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(out, f"rank{rank}.json").write_text(json.dumps({"crash": traceback.format_exc()}))


def _run_ranks(case: str, world: int, tmp_path: Path, timeout: float = 120) -> list[dict]:
    port, ctx = _free_port(), mp.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, case, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after {timeout}s: a hang"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_every_rank_walks_rank_0s_draw_of_the_users_sampler(tmp_path):
    results = _run_ranks("order", 3, tmp_path)
    reference = results[0]["reference"]
    for rank, result in enumerate(results):
        assert "batches" in result, result
        rows = RankLayout(Plan(3, {"image": {"ranks": [0, 1, 2]}}), rank, {"image": ()}).batch(4).rows
        assert result["batches"] == [[batch[r] for r in rows] for batch in reference]


@pytest.mark.slow
def test_rank_0s_refusal_reaches_every_rank(tmp_path):
    """Rank 0 cannot continue the position: every rank raises its message instead of waiting for batches."""
    for result in _run_ranks("fails", 3, tmp_path):
        assert result.get("error", "").startswith("DataPositionError: the checkpoint was written 8 samples"), result
