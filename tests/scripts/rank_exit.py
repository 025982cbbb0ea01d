"""How a spawned rank ends: an ``atexit`` handler registered during ``fit`` writes the names of the
threads its process still has then (the process groups' gloo threads and the store's should be gone
when the plan holds no DTensors), per rank; the parent writes ``parent`` once ``fit`` returned."""

import atexit
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from distmm_testing import TinyCLIP, loader, trainer_kwargs  # noqa: E402

import lightning_distmm as ldm  # noqa: E402

plan_name, folder = sys.argv[1], Path(sys.argv[2])
PLANS = {
    "colocated": "colocated",
    "tp": ldm.Plan(2, {"image": {"ranks": [0, 1], "tp": 2}, "text": {"ranks": [0, 1]}}),
}


def _write_threads(rank: int) -> None:
    names = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
    (folder / f"rank{rank}").write_text("\n".join(names))


class ThreadsAtExit(L.Callback):
    def on_fit_end(self, trainer, pl_module):
        atexit.register(_write_threads, trainer.global_rank)


if __name__ == "__main__":
    trainer = L.Trainer(
        devices=2,
        max_steps=1,
        strategy=ldm.DistMMStrategy(PLANS[plan_name], start_method="spawn"),
        callbacks=[ThreadsAtExit()],
        **trainer_kwargs(),
    )
    trainer.fit(TinyCLIP(), loader(4))
    (folder / "parent").write_text("fit returned")
