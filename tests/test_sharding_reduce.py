"""A sharded tower reduce-scatters once per optimizer step, whatever its microbatches, and accumulation
with clipping stays exact.

FSDP's gradient sync is turned on by the executor for a sharded tower's last backward of a step
that ends with the sums, and off for every other backward (earlier microbatches, and every backward
while Lightning accumulates): the gradients accumulate unsharded inside FSDP and are reduced once.
"""

import json
from pathlib import Path

import lightning as L
import pytest
import torch.distributed as dist
from distmm_testing import TinyCLIP, compare_accumulating_and_clipping, loader, run_distmm

import lightning_distmm as ldm

# both towers sharded and in microbatches: 8 rows, 4 per replica, 2 microbatches of 2
PLAN = ldm.Plan(
    3,
    {
        "image": {"ranks": [0, 1], "shard": "full", "microbatch": 2},
        "text": {"ranks": [1, 2], "shard": "full", "microbatch": 2},
    },
)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_accumulation_and_clipping_with_sharded_microbatches(optimizer, tmp_path):
    """Microbatches and accumulated batches all reduce in the last backward of the optimizer step;
    clipping is active (the whole model's gradient norm is above 0.05)."""
    result = compare_accumulating_and_clipping(PLAN, optimizer, tmp_path)
    result.assert_exact()
    assert len(result.distributed_losses) == 6


class ReduceScatterCounter(L.Callback):
    """Counts this rank's reduce-scatters per training batch (the collective FSDP2 reduces with) and
    its FSDP units; each rank writes them to ``folder/rank{r}.json`` at the end."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.per_batch: list[int] = []
        self.count = 0
        self._original = None

    def _counting(self, *args, **kwargs):
        self.count += 1
        return self._original(*args, **kwargs)

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self._original = dist.reduce_scatter_single
        dist.reduce_scatter_single = self._counting  # FSDP2 calls it through the module at each reduce

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.count = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.per_batch.append(self.count)

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        from lightning_distmm.parallel.fsdp import fsdp_modules

        dist.reduce_scatter_single = self._original
        engine = trainer.strategy.engine
        units = sum(len(list(fsdp_modules(engine.towers[n].module))) for n in engine.layout.local_towers)
        path = Path(self.folder) / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"per_batch": self.per_batch, "units": units}))


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_reduce_scatter_per_step_for_microbatched_sharded_towers(accumulate, tmp_path):
    """Each FSDP unit (a block, the tower root) of a rank's sharded towers reduce-scatters once per
    optimizer step though the step runs 2 microbatches of each tower (and, accumulating, 2 batches):
    3 ranks, image on 0-1 and text on 1-2, one block each, so 2 units per tower."""
    L.seed_everything(0)
    counter = ReduceScatterCounter(str(tmp_path))
    steps = 3
    run_distmm(
        TinyCLIP("sgd", lr=0.05),
        PLAN,
        3,
        loader(8),
        steps,
        str(tmp_path / "losses.json"),
        callbacks=[counter],
        accumulate_grad_batches=accumulate,
    )
    seen = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)}
    assert [seen[r]["units"] for r in range(3)] == [2, 4, 2]  # rank 1 holds both towers
    for r in range(3):
        units = seen[r]["units"]
        # the optimizer step's last batch reduces every unit once; an accumulating batch reduces nothing
        expected = ([0] * (accumulate - 1) + [units]) * steps
        assert seen[r]["per_batch"] == expected, (r, seen[r])
