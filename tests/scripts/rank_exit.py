"""Spawned ranks that end well, one parent, the two plans in turn (``colocated``: no DTensors; ``tp``:
the image tower's DTensors hold its mesh). Per plan and rank: the intra-op thread count the rank
trained with (``threads-PLAN-RANK``) and, from an ``atexit`` handler registered during ``fit``, the
names of the threads its process still has then (``exit-PLAN-RANK``: the process groups' gloo
threads and the store's should be gone when the plan holds no DTensors); the parent writes
``parent-PLAN`` once that ``fit`` returned.

Usage: ``rank_exit.py FOLDER`` (run it with ``TMPDIR`` a folder of its own to see what it leaves there).
"""

import atexit
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from distmm_testing import TinyCLIP, loader, trainer_kwargs  # noqa: E402

import lightning_distmm as ldm  # noqa: E402

folder = Path(sys.argv[1])
PLANS = {
    "colocated": "colocated",
    "tp": ldm.Plan(2, {"image": {"ranks": [0, 1], "tp": 2}, "text": {"ranks": [0, 1]}}),
}


def _write_threads(name: str) -> None:
    names = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
    (folder / name).write_text("\n".join(names))


class Record(L.Callback):
    def __init__(self, plan: str) -> None:
        self.plan = plan

    def on_train_start(self, trainer, pl_module):
        (folder / f"threads-{self.plan}-{trainer.global_rank}").write_text(str(torch.get_num_threads()))

    def on_fit_end(self, trainer, pl_module):
        atexit.register(_write_threads, f"exit-{self.plan}-{trainer.global_rank}")


if __name__ == "__main__":  # spawned ranks import this file too
    for name, plan in PLANS.items():
        trainer = L.Trainer(
            devices=2,
            max_steps=2,
            strategy=ldm.DistMMStrategy(plan, start_method="spawn"),
            callbacks=[Record(name)],
            **trainer_kwargs(),
        )
        trainer.fit(TinyCLIP(), loader(4))
        (folder / f"parent-{name}").write_text("fit returned")
