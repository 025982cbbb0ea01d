"""One "node" of an elastic job: TinyCLIP under strategy="distmm" with a plan per world size, a
checkpoint every 2 steps and ``ckpt_path=ldm.last_checkpoint(...)``, 6 steps of a global batch of 8.

The second node (torchrun's GROUP_RANK 1) kills its agent and ranks when step 4 starts (the last
checkpoint is step 2's): the first node's agent restarts its ranks on the membership that is left,
they take the plan for 2 ranks, resume from step 2 and finish. Rank 0 of the finishing run writes
the consolidated weights and what it saw to OUT.

Usage (each "node", under torchrun --nnodes 1:2 ...): python elastic_train.py OUT
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from distmm_testing import TinyCLIP, loader, trainer_kwargs  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lightning_distmm as ldm  # noqa: E402
from lightning_distmm.checkpoint import consolidated_state_dict  # noqa: E402

PLANS = {
    4: ldm.Plan(4, {"image": {"ranks": [0, 1, 2]}, "text": {"ranks": [3]}}),
    2: ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}}),
}


def kill_node() -> None:
    """SIGKILL this node's agent and every rank it started (each rank runs in a session of its own),
    this one last: what a lost machine does to the job."""
    agent = os.getppid()
    ranks = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == agent and int(entry.name) != os.getpid():
                ranks.append(int(entry.name))
    os.kill(agent, signal.SIGKILL)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class LoseNodeOne(L.Callback):
    """Node 1 dies (every process of it) when step 4 starts; each run notes its first step."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.first = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if self.first and trainer.global_rank == 0:
            self.first = False
            note = self.out / f"first-step-restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.json"
            note.write_text(json.dumps({"time": time.time(), "step": trainer.global_step}))
        if trainer.global_step == 3 and os.environ.get("GROUP_RANK") == "1" and os.environ.get("LOCAL_RANK") == "0":
            (self.out / "killed.json").write_text(json.dumps({"time": time.time()}))
            kill_node()


class Consolidate(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        state = consolidated_state_dict(trainer)
        if trainer.global_rank == 0:
            torch.save(state, self.out / "weights.pt")
            (self.out / "final.json").write_text(json.dumps({"world_size": trainer.world_size}))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    L.seed_everything(0)
    saves = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1)
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(
        num_nodes=world // 2,
        devices=2,
        max_steps=6,
        strategy=ldm.DistMMStrategy(plan=PLANS),
        callbacks=[saves, LoseNodeOne(out), Consolidate(out)],
        **trainer_kwargs(enable_checkpointing=True),
    )
    trainer.fit(TinyCLIP("sgd", lr=0.05), loader(8), ckpt_path=ldm.last_checkpoint(out / "ckpt"))


if __name__ == "__main__":
    main()
