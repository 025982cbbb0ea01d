"""One fault case under the real subprocess launcher (2 ranks, a tower each): each rank writes its pid
and its intra-op thread count, then trains.

Usage: ``fault_case.py CASE FOLDER``. The test injects the fault from outside (a signal) or the
case injects it from inside (an exception on one rank); every rank's pid file lets the test check
that no process outlives the job.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datetime import timedelta  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from distmm_testing import TinyCLIP, loader, trainer_kwargs  # noqa: E402

import lightning_distmm as ldm  # noqa: E402

case, folder = sys.argv[1], Path(sys.argv[2])


class Inject(L.Callback):
    def on_train_start(self, trainer, pl_module):
        (folder / f"pid{trainer.global_rank}").write_text(str(os.getpid()))
        (folder / f"threads{trainer.global_rank}").write_text(str(torch.get_num_threads()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= 2:
            (folder / f"step{trainer.global_rank}").write_text(str(batch_idx))
        if case == "rank0-raises" and batch_idx == 3 and trainer.global_rank == 0:
            raise RuntimeError("boom on rank 0")
        if case == "spawn-rank1-raises" and batch_idx == 3 and trainer.global_rank == 1:
            raise RuntimeError("boom on rank 1")
        if case == "rank1-raises-and-lingers" and batch_idx == 3 and trainer.global_rank == 1:
            raise RuntimeError("boom on rank 1")
        if case == "rank1-stalls" and batch_idx == 3 and trainer.global_rank == 1:
            time.sleep(3600)  # a hung rank: the others wait in a collective until the timeout
        time.sleep(0.05)


class Lingering(ldm.DistMMStrategy):
    """Rank 1 records its error, then lives on with its connections open: the others stay in their
    collective, as every NCCL rank does whose peer failed (gloo fails them when a peer's process ends)."""

    def on_exception(self, exception):
        super().on_exception(exception)
        if self.global_rank == 1:
            time.sleep(3600)


if __name__ == "__main__":  # spawned ranks import this file too
    plan = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})
    # long enough that a peer still importing under a loaded CI host does not time out the setup
    timeout = timedelta(seconds=60) if case == "rank1-stalls" else timedelta(minutes=10)
    grace = {"failure_grace": timedelta(seconds=5)} if case == "rank1-raises-and-lingers" else {}
    start_method = "spawn" if case.startswith("spawn-") else "popen"
    trainer = L.Trainer(
        devices=2,
        max_steps=100_000,
        strategy=(Lingering if grace else ldm.DistMMStrategy)(
            plan, timeout=timeout, start_method=start_method, **grace
        ),
        callbacks=[Inject()],
        **trainer_kwargs(),
    )
    trainer.fit(TinyCLIP(), loader(8, size=4096))
