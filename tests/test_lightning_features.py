"""Lightning features under distmm, each against the single-process reference."""

import copy

import lightning as L
import pytest
import torch
from distmm_testing import (
    TinyCLIP,
    compare_with_reference,
    loader,
    max_param_diff,
    read_losses,
    run_distmm,
    run_reference,
)
from lightning.pytorch.callbacks import LearningRateMonitor

import lightning_distmm as ldm

PLAN = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})


class ScheduledCLIP(TinyCLIP):
    """AdamW with a step LR schedule, plus a validation metric logged with sync_dist."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def validation_step(self, batch, batch_idx):
        loss = self.contrastive_loss(batch)
        self.log("val/loss", loss, sync_dist=True, batch_size=self.global_batch_size(batch))
        return loss


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {"accumulate_grad_batches": 2},
        {"gradient_clip_val": 0.05},
        {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    ],
    ids=["accumulate", "clip-norm", "clip-value"],
)
def test_trainer_options_match_reference(extra, tmp_path):
    L.seed_everything(0)
    reference = ScheduledCLIP("adamw", lr=0.01)
    module = copy.deepcopy(reference)
    run_reference(reference, loader(8), 3, str(tmp_path / "r.json"), **extra)
    run_distmm(module, PLAN, 3, loader(8), 3, str(tmp_path / "d.json"), **extra)
    assert max_param_diff(reference, module) <= 1e-5
    assert read_losses(tmp_path / "d.json") == pytest.approx(read_losses(tmp_path / "r.json"), abs=1e-5)
    assert len(read_losses(tmp_path / "d.json")) == 3 * extra.get("accumulate_grad_batches", 1)


@pytest.mark.slow
def test_clipping_really_clips(tmp_path):
    """The clip threshold is far below the gradient norm: clipped weights differ from unclipped ones,
    in one process and under distmm, and distmm's clipping (by the norm of the whole model across
    ranks) matches one process's."""
    L.seed_everything(0)
    a = TinyCLIP("sgd", lr=0.1)
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    run_reference(a, loader(8), 2, str(tmp_path / "a.json"), gradient_clip_val=0.05)
    run_reference(b, loader(8), 2, str(tmp_path / "b.json"))
    assert max_param_diff(a, b) > 1e-3
    run_distmm(c, PLAN, 3, loader(8), 2, str(tmp_path / "c.json"), gradient_clip_val=0.05)
    assert max_param_diff(c, b) > 1e-3
    assert max_param_diff(c, a) <= 1e-5


@pytest.mark.slow
def test_validation_and_lr_schedule(tmp_path):
    L.seed_everything(0)
    reference = ScheduledCLIP("adamw", lr=0.01)
    module = copy.deepcopy(reference)
    kw = dict(limit_val_batches=2, val_check_interval=3, callbacks=[LearningRateMonitor("step")])
    ref = L.Trainer(devices=1, max_steps=3, **{**_kwargs(), **kw})
    ref.fit(reference, loader(8), loader(8, size=16))
    dist = L.Trainer(
        devices=3, max_steps=3, strategy=ldm.DistMMStrategy(PLAN, start_method="fork"), **{**_kwargs(), **kw}
    )
    dist.fit(module, loader(8), loader(8, size=16))
    assert float(dist.callback_metrics["val/loss"]) == pytest.approx(float(ref.callback_metrics["val/loss"]), abs=1e-5)
    assert max_param_diff(reference, module) <= 1e-5
    assert ref.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(0.01 * 0.5**3)


def _kwargs():
    from distmm_testing import trainer_kwargs

    kw = trainer_kwargs()
    kw.pop("limit_val_batches")
    kw["logger"] = L.pytorch.loggers.CSVLogger("/tmp/distmm_test_logs")
    return kw


class TransformedLossCLIP(TinyCLIP):
    """The training_step returns a function of the contrastive loss plus a term of its own."""

    def training_step(self, batch, batch_idx):
        loss = self.contrastive_loss(batch)
        self.log("train/loss", loss, batch_size=self.global_batch_size(batch))
        return 0.5 * loss + loss**2 + 0.1 * self.logit_scale**2


@pytest.mark.slow
def test_loss_transformed_in_training_step_is_exact(tmp_path):
    """The schedule runs its backward inside training_step; the gradient reaching the returned loss
    (here 0.5 + 2L, plus a regulariser outside the schedule) still scales it exactly. Image pp=2 so
    the scaled gradients include a pipeline stage's."""
    from distmm_testing import DeepCLIP

    class Deep(TransformedLossCLIP, DeepCLIP):
        pass

    plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 2}, "text": {"ranks": [2]}})
    compare_with_reference(lambda: Deep("sgd", lr=0.05), plan, 3, 8, 2, tmp_path).assert_exact()


@pytest.mark.slow
def test_standalone_validate_matches_reference():
    """trainer.validate (no fit, no optimizer) under a pipelined distmm plan: the reference's loss."""
    from distmm_testing import DeepCLIP

    L.seed_everything(0)
    module = DeepCLIP()
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 3}, "text": {"ranks": [2]}})
    kw = {**_kwargs(), "limit_val_batches": 2}
    ref = L.Trainer(devices=1, **kw).validate(copy.deepcopy(module), loader(8, size=16), verbose=False)
    dist = L.Trainer(devices=3, strategy=ldm.DistMMStrategy(plan, start_method="fork"), **kw).validate(
        module, loader(8, size=16), verbose=False
    )
    assert dist[0]["val/loss"] == pytest.approx(ref[0]["val/loss"], abs=1e-5)


@pytest.mark.slow
def test_distmm_with_accumulation_and_clipping(tmp_path):
    """DistMM-Pipe (image pp=2, two sync groups) with gradient accumulation and global-norm clipping."""
    from distmm_testing import GroupedDeepCLIP

    distmm = {"microbatch": 2, "schedule": "distmm"}
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2, **distmm}, "text": {"ranks": [2], **distmm}})
    compare_with_reference(
        lambda: GroupedDeepCLIP("sgd", lr=0.05),
        plan,
        3,
        8,
        2,
        tmp_path,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
    ).assert_exact()


@pytest.mark.slow
def test_bf16_mixed_runs_and_stays_near_the_reference(tmp_path):
    """bf16-mixed under a pipelined distmm plan: it runs (features and gradients in bf16 cross the
    stages and the batch-sync) and lands within bf16 rounding of one process (docs/runtime.md:
    ~0.02 after 3 SGD steps; a sign or scale error would be far off)."""
    from distmm_testing import GroupedDeepCLIP

    distmm = {"microbatch": 2, "schedule": "distmm"}
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2, **distmm}, "text": {"ranks": [2], **distmm}})
    L.seed_everything(0)
    reference = GroupedDeepCLIP("sgd", lr=0.05)
    module, initial = copy.deepcopy(reference), copy.deepcopy(reference)
    run_reference(reference, loader(8), 3, str(tmp_path / "r.json"), precision="bf16-mixed")
    run_distmm(module, plan, 3, loader(8), 3, str(tmp_path / "d.json"), precision="bf16-mixed")
    assert max_param_diff(reference, module) < 0.1 < 10 * max_param_diff(initial, module)
    assert read_losses(tmp_path / "d.json") == pytest.approx(read_losses(tmp_path / "r.json"), abs=0.05)


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in folder.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_logger_records_what_one_process_records(tmp_path):
    """Lightning's TensorBoardLogger (``logger=tensorboard`` in the recipe) under distmm: one event
    file, written by rank 0, with the same per-step losses as a single process's."""
    from lightning.pytorch.loggers import TensorBoardLogger

    def kwargs(name: str) -> dict:
        from distmm_testing import trainer_kwargs

        return trainer_kwargs(logger=TensorBoardLogger(str(tmp_path), name=name), log_every_n_steps=1)

    L.seed_everything(0)
    module = TinyCLIP("sgd", lr=0.05)
    reference = copy.deepcopy(module)
    L.Trainer(devices=1, max_steps=3, **kwargs("ref")).fit(reference, loader(8))
    L.Trainer(devices=3, max_steps=3, strategy=ldm.DistMMStrategy(PLAN, start_method="fork"), **kwargs("distmm")).fit(
        module, loader(8)
    )
    ref, got = _tensorboard_scalars(tmp_path / "ref"), _tensorboard_scalars(tmp_path / "distmm")
    assert [s for s, _ in got["train/loss"]] == [0, 1, 2]
    assert [v for _, v in got["train/loss"]] == pytest.approx([v for _, v in ref["train/loss"]], abs=1e-5)
