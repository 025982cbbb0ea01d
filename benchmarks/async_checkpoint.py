"""What a checkpoint every K steps costs, side by side in one run: no saves, synchronous saves,
``DistMMStrategy(async_save=True)``.

Two models on the main job's plan (2 CPU ranks over gloo, the image tower on rank 0, the text tower
on rank 1), each trained with ``ModelCheckpoint(every_n_train_steps=K, save_top_k=-1)``:

* ``main``: the README's main job, ``conf/model/clip_tiny.yaml`` on the embedded shapes data;
* ``50m``: the same CLIP with a 50M-parameter image tower (a ViT of width 512, 16 layers).

For each, three configurations run in interleaved rounds (machine noise hits all alike):
``none`` (no checkpoint), ``sync`` (Lightning's save: the step waits until DCP has written every
shard) and ``async`` (the step waits for the copy to CPU memory; a thread writes the shards). Rank 0
records every step's time (from one ``on_train_batch_start`` to the next, so a save in the
callback's ``on_train_batch_end`` counts) and the time each ``trainer.save_checkpoint`` held the
step. Prints, per model and configuration, the median step, the mean step (the saves are in the
mean, not the median), the mean over a save interval relative to ``none``, the median blocking time
per save, and the wait at the end of fit for the last save.

    python benchmarks/async_checkpoint.py --rounds 3 --every 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_distmm as ldm
from lightning_distmm.data.demo.shapes import ShapesDataModule
from lightning_distmm.models.clip import CLIPModel
from lightning_distmm.models.tiny import quiet_trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]
PLAN = {"world_size": 2, "towers": {"image": {"ranks": [0]}, "text": {"ranks": [1]}}}
CONFIGS = ["none", "sync", "async"]


def model_config(name: str) -> dict:
    """``clip_tiny`` as the main job trains it, or with the 50M-parameter image tower."""
    cfg = yaml.safe_load((ROOT / "conf/model/clip_tiny.yaml").read_text())
    if name == "50m":
        cfg["towers"]["image"].update(width=512, layers=16, heads=8)
    return cfg


class Timer(L.Callback):
    """Rank 0: every step's time (start to next start) and each save's blocking time, written to ``path``."""

    def __init__(self, path: str) -> None:
        self.path, self.starts, self.saves, self.final = path, [], [], 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        save = trainer.save_checkpoint

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return save(*args, **kwargs)
            finally:
                self.saves.append(time.perf_counter() - t0)

        trainer.save_checkpoint = timed  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.starts.append(time.perf_counter())  # the last step's end
        t0 = time.perf_counter()
        trainer.strategy.wait_for_saves()  # what the end of fit waits for the last save
        self.final = time.perf_counter() - t0
        if trainer.is_global_zero:
            steps = [b - a for a, b in zip(self.starts, self.starts[1:])]
            Path(self.path).write_text(json.dumps({"steps": steps, "saves": self.saves, "final": self.final}))


def run(model: str, config: str, args: argparse.Namespace, out: str, saves: Path) -> dict:
    L.seed_everything(0, verbose=False)
    module = CLIPModel(model_config(model), {"lr": 1e-4})
    strategy = ldm.DistMMStrategy(plan=PLAN, start_method="fork", async_save=config == "async")
    callbacks: list[L.Callback] = [Timer(out)]
    if config != "none":
        callbacks.append(ModelCheckpoint(dirpath=saves, every_n_train_steps=args.every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        **{**quiet_trainer_kwargs(), "enable_checkpointing": config != "none"},
    )
    trainer.fit(module, ShapesDataModule(batch_size=args.batch, train_size=args.batch * args.steps))
    shutil.rmtree(saves, ignore_errors=True)
    return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="main,50m")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=21, help="steps per fit (the first --warmup not timed)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--every", type=int, default=5, help="ModelCheckpoint(every_n_train_steps=...)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    models = [m for m in args.models.split(",") if m]
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for model in models:
                for config in CONFIGS:
                    out = os.path.join(tmp, f"{model}-{config}-{r}.json")
                    record = run(model, config, args, out, Path(tmp) / "saves")
                    acc = results.setdefault((model, config), {"steps": [], "saves": [], "final": []})
                    acc["steps"] += record["steps"][args.warmup :]
                    acc["saves"] += record["saves"]
                    acc["final"].append(record["final"])
    print(
        f"\ncheckpoint every {args.every} steps, 2 CPU ranks (gloo, fork), main job's plan (image rank 0, text"
        f" rank 1), global batch {args.batch}, {args.rounds} rounds x {args.steps - args.warmup} timed steps"
    )
    head = f"{'model':<6} {'params':>8} {'saves':<6} {'median step ms':>15} {'mean step ms':>13} {'vs none':>8}"
    print(head + f" {'blocks per save ms':>19} {'end-of-fit wait ms':>19}")
    for model in models:
        params = sum(p.numel() for p in CLIPModel(model_config(model)).parameters())
        base = statistics.mean(results[(model, "none")]["steps"])
        for config in CONFIGS:
            acc = results[(model, config)]
            mean = statistics.mean(acc["steps"])
            block = f"{statistics.median(acc['saves']) * 1e3:.1f}" if acc["saves"] else "-"
            final = f"{statistics.median(acc['final']) * 1e3:.1f}" if config != "none" else "-"
            print(
                f"{model:<6} {params / 1e6:>7.2f}M {config:<6} {statistics.median(acc['steps']) * 1e3:>15.1f}"
                f" {mean * 1e3:>13.1f} {mean / base:>8.3f} {block:>19} {final:>19}"
            )


if __name__ == "__main__":
    main()
