"""One "node" of a two-node job (SLURM-style variables, one task per node) that trains TinyCLIP and,
at its second step, writes OUT/ready<rank> and stays in that step (as a rank blocked in an NCCL
collective whose peer vanished stays: nothing fails it). The test kills the other node; this rank
must end by itself, naming the lost node.

Usage: python node_loss.py OUT GRACE_SECONDS
"""

import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from distmm_testing import TinyCLIP, loader, trainer_kwargs  # noqa: E402

import lightning_distmm as ldm  # noqa: E402


class StuckAtStepTwo(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if batch_idx == 1:
            (self.out / f"ready{trainer.global_rank}").write_text(str(time.time()))
            time.sleep(300)


def main() -> None:
    out, grace = Path(sys.argv[1]), float(sys.argv[2])
    strategy = ldm.DistMMStrategy(plan="colocated", failure_grace=timedelta(seconds=grace))
    trainer = L.Trainer(
        num_nodes=2, devices=1, max_steps=3, strategy=strategy, callbacks=[StuckAtStepTwo(out)], **trainer_kwargs()
    )
    trainer.fit(TinyCLIP("sgd", lr=0.05), loader(8))


if __name__ == "__main__":
    main()
