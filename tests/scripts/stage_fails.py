"""One pipeline stage raises in its forward at step 2; every rank must end, none may hang."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from distmm_testing import DeepCLIP, loader, trainer_kwargs  # noqa: E402

import lightning_distmm as ldm  # noqa: E402

torch.set_num_threads(1)


class Boom(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1 and trainer.global_rank == 1:  # the image tower's second stage
            pl_module.visual.blocks[1].register_forward_hook(self._explode)

    @staticmethod
    def _explode(*_):
        raise RuntimeError("stage 1 exploded in its forward")


# rank 0 holds the first stage and the text tower: it waits on stage 1 both in the pipeline and at the batch-sync
plan = ldm.Plan(2, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 2}, "text": {"ranks": [0]}})
trainer = L.Trainer(devices=2, max_steps=4, strategy=ldm.DistMMStrategy(plan), callbacks=[Boom()], **trainer_kwargs())
trainer.fit(DeepCLIP(), loader(8))
