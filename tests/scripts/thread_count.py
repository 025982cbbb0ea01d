"""Record the intra-op thread count each rank trains with (``fit`` for 1 step), per launcher."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from distmm_testing import TinyCLIP, loader, trainer_kwargs  # noqa: E402

import lightning_distmm as ldm  # noqa: E402

start_method, folder = sys.argv[1], Path(sys.argv[2])


class Threads(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        (folder / f"rank{trainer.global_rank}").write_text(str(torch.get_num_threads()))


if __name__ == "__main__":
    trainer = L.Trainer(
        devices=2,
        max_steps=1,
        strategy=ldm.DistMMStrategy("colocated", start_method=start_method),
        callbacks=[Threads()],
        **trainer_kwargs(),
    )
    trainer.fit(TinyCLIP(), loader(4))
