"""The asynchronous batch-sync of ``distmm`` (a posted gather, the next sync group's forward, the wait)
trains exactly what one process computing the grouped loss trains."""

import copy
import json
from pathlib import Path

import lightning as L
import pytest
from distmm_testing import Comparison, GroupedDeepCLIP, loader, max_param_diff, read_losses, run_distmm, run_reference

import lightning_distmm as ldm


def overlap(plan: ldm.Plan) -> ldm.DistMMStrategy:
    """The strategy with the asynchronous batch-sync on."""
    return ldm.DistMMStrategy(plan=plan, start_method="fork", overlap_batch_sync=True)


class ScheduleKinds(L.Callback):
    """Each rank writes the instruction kinds its step engine ran (every list it built) at the end of fit."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.engine
        kinds = sorted({type(i).__name__ for ins in engine._schedules.values() for i in ins})
        (self.folder / f"kinds{trainer.global_rank}.json").write_text(json.dumps(kinds))


@pytest.mark.slow
def test_async_batch_sync_is_exact(tmp_path):
    """Image pp2 on ranks 0, 1 and text on rank 2, two sync groups, 3 steps: the last stages post
    sync group 0's gather, run a forward of sync group 1 and wait; weights and losses equal one process,
    and the blocking batch-sync's (the default) bit for bit."""
    plan = ldm.Plan(
        3,
        {
            "image": {"ranks": [0, 1], "pp": 2, "microbatch": 2, "schedule": "distmm"},
            "text": {"ranks": [2], "microbatch": 2, "schedule": "distmm"},
        },
    )
    L.seed_everything(0)
    reference = GroupedDeepCLIP("adamw", lr=0.01)
    module, initial, blocking = (copy.deepcopy(reference) for _ in range(3))
    run_reference(reference, loader(10), 3, str(tmp_path / "ref.json"))
    run_distmm(
        module, overlap(plan), 3, loader(10), 3, str(tmp_path / "dist.json"), callbacks=[ScheduleKinds(tmp_path)]
    )
    Comparison(
        reference, module, initial, read_losses(tmp_path / "ref.json"), read_losses(tmp_path / "dist.json")
    ).assert_exact(1e-5)
    kinds = [json.loads((tmp_path / f"kinds{r}.json").read_text()) for r in range(3)]
    assert "SyncPost" not in kinds[0]  # the first stage takes no part in the batch-sync
    assert all({"SyncPost", "SyncWait", "BatchSync"} <= set(k) for k in kinds[1:])
    run_distmm(blocking, plan, 3, loader(10), 3, str(tmp_path / "blocking.json"))
    assert max_param_diff(module, blocking) == 0.0
    assert read_losses(tmp_path / "blocking.json") == read_losses(tmp_path / "dist.json")


@pytest.mark.slow
def test_async_batch_sync_with_a_rank_holding_a_first_stage_and_a_last_stage(tmp_path):
    """Image pp2 on ranks 0, 1 and text on rank 0 (the issue's plan): rank 0 holds image's first stage
    and text's last. Before, rank 0 waited for an image gradient before its asynchronous wait, which
    rank 1 sent only after its own (whose all-reduce needs rank 0): the run hung on gloo (seen: no
    step in 90 s). Now 2 steps finish and equal the blocking batch-sync's bit for bit."""
    from distmm_testing import in_subprocess

    def main() -> None:
        distmm = {"schedule": "distmm"}
        plan = ldm.Plan(2, {"image": {"ranks": [0, 1], "pp": 2, **distmm}, "text": {"ranks": [0], **distmm}})
        L.seed_everything(0)
        overlapped = GroupedDeepCLIP("adamw", lr=0.01)
        blocking = copy.deepcopy(overlapped)
        run_distmm(
            overlapped, overlap(plan), 2, loader(8), 2, str(tmp_path / "o.json"), callbacks=[ScheduleKinds(tmp_path)]
        )
        run_distmm(blocking, plan, 2, loader(8), 2, str(tmp_path / "b.json"))
        assert max_param_diff(overlapped, blocking) == 0.0
        assert read_losses(tmp_path / "o.json") == read_losses(tmp_path / "b.json")
        assert "SyncWait" in json.loads((tmp_path / "kinds0.json").read_text())

    in_subprocess(main, timeout=240)


def test_the_overlap_knob_says_when_a_plan_has_nothing_to_overlap():
    from lightning_distmm.core.schedule import overlaps_batch_sync

    towers = {"image": {"ranks": [0]}, "text": {"ranks": [1]}}
    assert not overlaps_batch_sync(ldm.Plan(2, towers))
    assert overlaps_batch_sync(ldm.Plan(2, {n: {**t, "schedule": "distmm"} for n, t in towers.items()}))
