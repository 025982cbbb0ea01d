"""Train TinyCLIP under strategy="distmm" on 2 "nodes" x N ranks (N = 2 by default, or 1), launched
by torchrun or by a SLURM-style environment; rank 0 writes the consolidated weights and each rank's
node to OUT.

Usage (each "node"): python multinode_train.py OUT [N]  (under torchrun, or with SLURM_* variables set)
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from distmm_testing import TinyCLIP, loader, trainer_kwargs  # noqa: E402

import lightning_distmm as ldm  # noqa: E402
from lightning_distmm.checkpoint import consolidated_state_dict  # noqa: E402

#: image sharded inside each node and replicated across the two (HSDP), text on one rank per node
#: (the node's last), by ranks per node
PLANS = {
    2: ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "shard": "hybrid"}, "text": {"ranks": [1, 3]}}),
    1: ldm.Plan(2, {"image": {"ranks": [0, 1], "shard": "hybrid"}, "text": {"ranks": [0, 1]}}),
}


class Consolidate(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        state = consolidated_state_dict(trainer)  # collective: every rank
        nodes = [None] * trainer.world_size
        dist.all_gather_object(nodes, trainer.node_rank)
        mesh = trainer.strategy.engine.groups["image"].shard_mesh
        if trainer.global_rank == 0:
            torch.save(state, self.out / "weights.pt")
            (self.out / "nodes.json").write_text(json.dumps({"nodes": nodes, "image_mesh": mesh.mesh.tolist()}))


def main() -> None:
    out = Path(sys.argv[1])
    per_node = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(1)
    L.seed_everything(0)
    module = TinyCLIP("sgd", lr=0.05)
    trainer = L.Trainer(
        num_nodes=2,
        devices=per_node,
        max_steps=3,
        strategy=ldm.DistMMStrategy(plan=PLANS[per_node], timeout=timedelta(seconds=180)),
        callbacks=[Consolidate(out)],
        **trainer_kwargs(),
    )
    trainer.fit(module, loader(8))


if __name__ == "__main__":
    main()
