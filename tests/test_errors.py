"""Bad input fails at once, on every rank, with a message that names the problem (no hang)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from distmm_testing import TinyCLIP, loader, trainer_kwargs
from torch.utils.data import DataLoader, Dataset
from vlm_testing import MiscountedVLMData

import lightning_distmm as ldm
from lightning_distmm.models.vlm import VLM


class ErrorRecorder(L.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_exception(self, trainer, pl_module, exception) -> None:  # type: ignore[no-untyped-def]
        Path(self.folder, f"rank{trainer.global_rank}.txt").write_text(str(exception))


class NoMask(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i):
        return {"image": torch.zeros(3, 8, 8), "input_ids": torch.ones(6, dtype=torch.long)}


class _TupleOut(torch.nn.Module):
    """Wraps a tower so it returns ``(features, None)``, as many Hugging Face models return tuples."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args), None


class TupleTower(TinyCLIP):
    def __init__(self) -> None:
        super().__init__()
        self.text = _TupleOut(self.text)


class _DropLastRow(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)[:-1]


class ShortTower(TinyCLIP):
    def __init__(self) -> None:
        super().__init__()
        self.visual = _DropLastRow(self.visual)


class _NoGrad(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.no_grad():
            return self.inner(x)


class NoGradTower(TinyCLIP):
    def __init__(self) -> None:
        super().__init__()
        self.visual = _NoGrad(self.visual)


class VectorLoss(TinyCLIP):
    def interaction_loss(self, features):
        return (features["image"] * features["text"]).sum(dim=1)


class DetachedLoss(TinyCLIP):
    def interaction_loss(self, features):
        return super().interaction_loss(features).detach()


SEPARATE = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})

CASES = {
    "world-size": (
        2,
        ldm.Plan(3, {"image": {"ranks": [0]}, "text": {"ranks": [1, 2]}}),
        lambda: loader(8),
        "world_size=3 but the trainer runs 2",
    ),
    "unknown-tower": (
        2,
        ldm.Plan(2, {"image": {"ranks": [0]}, "audio": {"ranks": [1]}}),
        lambda: loader(8),
        r"\['audio'\] that the module does not define",
    ),
    "missing-field": (
        2,
        "colocated",
        lambda: DataLoader(NoMask(), batch_size=4),
        r"tower 'text' reads batch field\(s\) \['attention_mask'\]",
    ),
    "tp-heads": (
        3,
        ldm.Plan(3, {"image": {"ranks": [0, 1, 2], "tp": 3}, "text": {"ranks": [0]}}),
        lambda: loader(6),
        r"tower 'image', tp=3: blocks.0.attn: 2 attention heads do not divide by tp=3",
    ),
    "pp-too-deep": (
        2,
        ldm.Plan(2, {"image": {"ranks": [0, 1], "pp": 2}, "text": {"ranks": [0]}}),
        lambda: loader(4),
        r"tower 'image', pp=2: a ViT with 1 blocks cannot be cut into pp=2 stages",
    ),
    "tower-returns-tuple": (2, SEPARATE, lambda: loader(4), r"tower 'text' returned a tuple, not a tensor", TupleTower),
    "tower-short-rows": (
        2,
        SEPARATE,
        lambda: loader(4),
        r"tower 'image' returned features of shape \[3, 8\] for 4 samples",
        ShortTower,
    ),
    "tower-short-rows-validate": (
        2,
        SEPARATE,
        lambda: loader(4),
        r"tower 'image' returned features of shape \[3, 8\] for 4 samples",
        ShortTower,
        "validate",
    ),
    "tower-under-no-grad": (
        2,
        SEPARATE,
        lambda: loader(4),
        r"tower 'image' has trainable parameters but its features carry no gradient",
        NoGradTower,
    ),
    "loss-vector": (2, SEPARATE, lambda: loader(4), r"must return a scalar tensor .*, got \[4\]", VectorLoss),
    "loss-detached": (2, SEPARATE, lambda: loader(4), r"loss that does not depend on the features", DetachedLoss),
    # only the encoder's rank (1) loads pixel_values and sees that sample 4's second slot is empty;
    # the LLM's rank ends with the same message, relayed
    "vlm-empty-image-slot": (
        2,
        ldm.Plan(2, {"image": {"ranks": [1]}, "llm": {"ranks": [0]}}),
        lambda: DataLoader(MiscountedVLMData(4, 2, size=12), batch_size=6, drop_last=True),
        r"sample 4 of the dataset \(row 4 of the batch\) has n_images=2, but its pixel_values slot 1 is all zeros",
        VLM,
    ),
    "batch-below-replicas": (
        2,
        ldm.Plan(2, {"image": {"ranks": [0, 1]}, "text": {"ranks": [0]}}),
        lambda: loader(1),
        "has 2 data-parallel replicas, but every batch has 1 samples",
    ),
}


#: the cases run under the real subprocess launcher (one per phase: the plan against the world at
#: setup, a tower's output in the first step, a batch seen by one rank before it moves: every rank
#: must end with what a fork would leave to a race); the others fork their ranks from the test process,
#: which has Lightning imported already (a popen case starts a Python process per rank, 9-15 s of
#: imports each on the 2-core machine)
POPEN_CASES = ("world-size", "tower-returns-tuple", "vlm-empty-image-slot")


def _run_case(case: str, folder: str, start_method: str = "popen") -> None:
    """Train (or validate) one case's module on its plan; every rank records what it raised."""
    world, plan, data, _, *extra = CASES[case]
    module = extra[0]() if extra else TinyCLIP()
    validate = extra[1:] == ["validate"]
    trainer = L.Trainer(
        devices=world,
        max_steps=2,
        strategy=ldm.DistMMStrategy(plan, start_method=start_method),
        callbacks=[ErrorRecorder(folder)],
        **trainer_kwargs(limit_val_batches=2 if validate else 0),
    )
    if validate:
        trainer.validate(module, data())
    else:
        trainer.fit(module, data())


def _assert_every_rank_said(case: str, folder: Path, stderr: str) -> None:
    """Every rank went through its exception handling, and each ends with the message (its own
    error, or the relayed root cause of the rank that failed first)."""
    world, _, _, message, *_ = CASES[case]
    assert re.search(message, stderr), stderr[-2000:]
    texts = {p.name: p.read_text() for p in folder.glob("rank*.txt")}
    assert sorted(texts) == [f"rank{r}.txt" for r in range(world)], texts
    for rank in range(world):
        assert re.search(rf"\[rank{rank}\]: .*{message}", stderr), (rank, stderr[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("case", POPEN_CASES)
def test_bad_input_fails_on_every_rank(case, tmp_path):
    """The real subprocess launcher: each rank's own exception handler records what it raised."""
    script = Path(__file__).parent / "scripts" / "fail_fast.py"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), case, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode != 0
    assert time.monotonic() - start < 90
    _assert_every_rank_said(case, tmp_path, proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c not in POPEN_CASES])
def test_bad_input_fails_with_its_message(case, tmp_path, capfd):
    """Every other case with ranks forked from this process: the launch fails in the parent with the
    case's message, and rank 0's handler recorded it. (torch's fork launcher ends the other ranks as
    soon as one fails, so whether they reached their handlers is a race here; the popen cases above
    show every rank's.)"""
    _, _, _, message, *_ = CASES[case]
    start = time.monotonic()
    with pytest.raises(Exception) as raised:
        _run_case(case, str(tmp_path), start_method="fork")
    assert time.monotonic() - start < 90
    said = capfd.readouterr().err + str(raised.value)
    assert re.search(message, said), said[-2000:]
    records = {p.name: p.read_text() for p in tmp_path.glob("rank*.txt")}
    assert "rank0.txt" in records, records
    for name, text in records.items():
        assert re.search(message, text), (name, text[-2000:])


class _RaisesInForward(torch.nn.Module):
    def __init__(self, shapes: bool = False) -> None:
        super().__init__()
        self.proj, self.shapes = torch.nn.Linear(4, 4), shapes

    def forward(self, x):
        if self.shapes:
            return self.proj(x[:, :3])  # torch raises, inside torch
        raise ValueError("boom in the image tower")


def test_a_tower_that_raises_while_rank_0_chooses_the_plan_is_named_with_its_file_and_line():
    """Rank 0 runs the towers' forwards to choose the plan ("default" or "auto") and broadcasts the
    error's text to every rank: the text keeps where it was raised (and, raised inside torch, the
    tower's line that called it); before, every rank showed "ValueError: boom" alone."""
    import contextlib
    import inspect
    from types import SimpleNamespace

    from lightning_distmm.plan_choice import LiveJob, choose_on_rank0, plan_of_run

    source, first = inspect.getsourcelines(_RaisesInForward.forward)
    line = {key: first + next(i for i, text in enumerate(source) if key in text) for key in ("raise ", "self.proj(")}
    here = re.escape(__file__)

    def job(tower: torch.nn.Module) -> LiveJob:
        return LiveJob(
            towers={"image": ldm.Tower(tower, input="image"), "text": ldm.Tower(torch.nn.Linear(4, 4), input="x")},
            sync_groups=1,
            example={"image": torch.zeros(8, 4), "x": torch.zeros(8, 4)},
            global_batch=8,
            world_size=2,
            per_node=2,
            device=torch.device("cpu"),
            precision="32-true",
            forward_context=contextlib.nullcontext,
            random_state_kept=lambda device: contextlib.nullcontext(),
        )

    raised = rf"ValueError: boom in the image tower \(raised at {here}:{line['raise ']} in forward\)$"
    for spec in ("default", "auto"):
        chosen, said, error = choose_on_rank0(spec, job(_RaisesInForward()))
        assert chosen is None and said is None and re.match(raised, error or ""), (spec, error)
        rank1 = SimpleNamespace(_plan_spec=spec, plan=None, global_rank=1, num_processes=2)
        rank1.broadcast = lambda data, src: (None, None, error)  # what rank 0 sent
        with pytest.raises(ldm.PlanError, match=rf"the {spec} plan could not be chosen \(rank 0\): {raised}"):
            plan_of_run(rank1, None, None, [0, 0])
    error = choose_on_rank0("default", job(_RaisesInForward(shapes=True)))[2]
    assert re.match(rf"RuntimeError: .*\(raised at .*torch.*, from {here}:{line['self.proj(']} in forward\)$", error), (
        error
    )
    assert choose_on_rank0("best", job(_RaisesInForward()))[2] == "PlanError: unknown plan 'best'"  # no place


def test_plan_yaml_with_unknown_keys_fails_at_construction(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("world_size: 2\ntowers:\n  image: {ranks: [0], tp_size: 2}\n  text: {ranks: [1]}\n")
    with pytest.raises(ldm.PlanError, match=r"tower 'image': unknown key\(s\) \['tp_size'\]"):
        ldm.DistMMStrategy(plan=str(path))


def test_missing_plan_file():
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        ldm.DistMMStrategy(plan="nope.yaml")


@pytest.mark.slow
def test_module_without_mixin_is_rejected():
    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch["image"].flatten(1)[:, :2]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(devices=2, max_steps=1, strategy=ldm.DistMMStrategy(start_method="fork"), **trainer_kwargs())
    with pytest.raises(Exception, match="mixes in lightning_distmm.DistMMMixin"):
        trainer.fit(Plain(), loader(4))


@pytest.mark.parametrize("strategy", ["distmm", "instance"])
def test_a_loss_scaling_precision_is_refused_when_the_trainer_is_built(strategy):
    """``16-mixed`` runs a GradScaler whose overflow check is per rank: ranks holding different towers
    would skip different steps. Refused at construction, before any rank starts (before: a string
    ``strategy="distmm"`` got past Lightning's ModelParallelStrategy check and trained). On the CPU
    Lightning turns ``precision="16-mixed"`` into ``bf16-mixed``; the plugin is what a GPU run gets."""
    from lightning.pytorch.plugins import MixedPrecision

    chosen = "distmm" if strategy == "distmm" else ldm.DistMMStrategy(start_method="fork")
    with pytest.raises(ValueError, match=r"does not support precision='16-mixed' \(a loss scaler\).*'bf16-mixed'"):
        L.Trainer(devices=2, strategy=chosen, plugins=[MixedPrecision("16-mixed", "cpu")], **trainer_kwargs())
    for precision in ("bf16-mixed", "32-true", "16-true"):
        L.Trainer(devices=2, strategy=ldm.DistMMStrategy(start_method="fork"), precision=precision, **trainer_kwargs())


@pytest.mark.slow
def test_distmm_schedule_needs_the_grouped_loss_asked_for():
    """The distmm schedule's loss has two sync groups: a module that did not ask for it is refused."""
    distmm = {"microbatch": 2, "schedule": "distmm"}
    plan = ldm.Plan(2, {"image": {"ranks": [0, 1], **distmm}, "text": {"ranks": [0, 1], **distmm}})
    trainer = L.Trainer(
        devices=2, max_steps=1, strategy=ldm.DistMMStrategy(plan, start_method="fork"), **trainer_kwargs()
    )
    with pytest.raises(Exception, match="over 2 sync group\\(s\\).*sync_groups is 1; set sync_groups = 2"):
        trainer.fit(TinyCLIP(), loader(4))
    with pytest.raises(ldm.PlanError, match="every tower or on none"):
        ldm.Plan(2, {"image": {"ranks": [0, 1], **distmm}, "text": {"ranks": [0, 1]}})


@pytest.mark.slow
def test_failing_stage_ends_every_rank_with_its_error():
    """Rank 1 (a pipeline stage) raises mid-training; rank 0 (the stage before it and the text tower)
    ends with that error too, well within 60 s."""
    script = Path(__file__).parent / "scripts" / "stage_fails.py"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60, f"took {elapsed:.0f} s"
    out = proc.stdout + proc.stderr
    assert re.search(r"\[rank1\]: RuntimeError: stage 1 exploded in its forward", out), out[-3000:]
    for rank in (0,):
        assert re.search(
            rf"\[rank{rank}\]: .*DistMMRankFailure: distmm: rank 1: RuntimeError: stage 1 exploded", out
        ), out[-3000:]


def _saved_checkpoint(folder: Path) -> Path:
    """A small DCP checkpoint folder written in one process, with a meta.pt as distmm writes it."""
    import torch.distributed.checkpoint as dcp

    folder.mkdir()
    dcp.save({"state_dict": {"w": torch.arange(4096.0), "b": torch.ones(3)}}, checkpoint_id=folder)
    torch.save({"epoch": 0, "global_step": 2}, folder / "meta.pt")
    return folder


def test_a_truncated_shard_is_named(tmp_path):
    from lightning_distmm.checkpoint import check_shards

    folder = _saved_checkpoint(tmp_path / "epoch=0-step=2.ckpt")
    check_shards(folder)  # whole: no complaint
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"shard {shard.name} is truncated \(100 bytes; the index .metadata needs"):
        check_shards(folder)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard {shard.name} is missing"):
        check_shards(folder)


def test_a_damaged_index_or_meta_file_is_named(tmp_path):
    from lightning_distmm.checkpoint import check_shards, read_metadata

    folder = _saved_checkpoint(tmp_path / "ckpt")
    assert read_metadata(folder)["global_step"] == 2
    (folder / "meta.pt").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match=r"meta.pt cannot be read .*damaged"):
        read_metadata(folder)
    (folder / ".metadata").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=r"its DCP index .metadata cannot be read"):
        check_shards(folder)
