"""A sharded tower through ``validate``, ``fit``, ``validate``, ``test``, ``predict`` and ``fit`` again, in the same
processes (the script launcher), with Lightning's loops made to see a non-gloo backend: off gloo
(NCCL) Lightning runs its standalone evaluation loops under ``torch.inference_mode``, which it skips
on gloo; FSDP2's all-gather buffers made under it break the evaluation or the training after it.

Usage: python eval_modes.py OUT PLAN [PLAN ...]   (PLAN: a key of PLANS)

The two ranks run the whole sequence for each plan in turn, on a fresh module built from the same
seed (one launch: the ranks' start, ``import lightning`` included, is most of a run's time). For
each plan, rank 0 writes OUT/PLAN/result.json (the validation, test and prediction losses, whether
the loops ran under inference mode) and OUT/PLAN/weights.pt (the whole model after the second fit).
``run_sequence(None, out)`` is the one-process reference (``tests/test_eval_modes.py`` calls it in
a forked child of the test process).
"""

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from distmm_testing import TinyCLIP, loader, trainer_kwargs  # noqa: E402
from gpu_first_run import look_like_nccl  # noqa: E402  (Lightning's loops see a non-gloo backend)

import lightning_distmm as ldm  # noqa: E402
from lightning_distmm.checkpoint import consolidated_state_dict  # noqa: E402

PLANS = {
    # the image tower sharded over a one-rank mesh, text on the other rank
    "mesh1": ldm.Plan(2, {"image": {"ranks": [0], "shard": "full"}, "text": {"ranks": [1]}}),
    # the image tower sharded over two ranks, text beside it on rank 1
    "mesh2": ldm.Plan(2, {"image": {"ranks": [0, 1], "shard": "full"}, "text": {"ranks": [1]}}),
}


class EvalCLIP(TinyCLIP):
    """TinyCLIP with test and predict steps that compute the contrastive loss, recording the grad mode."""

    inference: list[bool]

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.inference.append(torch.is_inference_mode_enabled())
        loss = self.contrastive_loss(batch)
        self.log("test/loss", loss, sync_dist=True, batch_size=self.global_batch_size(batch))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.inference.append(torch.is_inference_mode_enabled())
        return super().validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.inference.append(torch.is_inference_mode_enabled())
        return self.contrastive_loss(batch)


def run_sequence(plan: str | None, out: Path) -> None:
    """The sequence on a fresh module (seed 0) under ``PLANS[plan]`` on 2 ranks, or in one process
    (``plan=None``: the reference); rank 0 writes ``out/result.json`` and ``out/weights.pt``."""
    torch.set_num_threads(1)
    look_like_nccl()
    L.seed_everything(0, verbose=False)
    module = EvalCLIP("adamw", lr=0.01)
    module.inference = []

    def trainer(steps: int) -> L.Trainer:
        kw: dict[str, Any] = (
            {"devices": 1} if plan is None else {"devices": 2, "strategy": ldm.DistMMStrategy(PLANS[plan])}
        )
        return L.Trainer(
            max_steps=steps,
            **kw,
            **trainer_kwargs(val_check_interval=1, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2),
        )

    first = trainer(2)
    before = first.validate(module, loader(8, size=16), verbose=False)[0]["val/loss"]
    first.fit(module, loader(8), loader(8, size=16))  # validating after every step, under no_grad
    val = first.validate(module, loader(8, size=16), verbose=False)[0]["val/loss"]
    test = first.test(module, loader(8, size=24), verbose=False)[0]["test/loss"]
    predicted = [float(p) for p in first.predict(module, loader(8, size=16))]
    again = trainer(2)
    again.fit(module, loader(8, size=32))
    state = module.state_dict() if plan is None else consolidated_state_dict(again)
    if again.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "weights.pt")
        result = {"before": before, "val": val, "test": test, "predict": predicted, "inference": module.inference}
        (out / "result.json").write_text(json.dumps(result))


def main() -> None:
    out, plans = Path(sys.argv[1]), sys.argv[2:]
    unknown = [p for p in plans if p not in PLANS]
    if unknown or not plans:
        sys.exit(f"eval_modes.py: plans {unknown or plans} not among {sorted(PLANS)}")
    for plan in plans:
        run_sequence(plan, out / plan)


if __name__ == "__main__":
    main()
