"""Train a CLIP-style model on the shapes dataset, then measure held-out retrieval.

    python recipes/train.py                                  # strategy=distmm, 2 CPU processes
    python recipes/train.py strategy=single                  # one process, the reference
    python recipes/train.py strategy=ddp                     # plain DDP baseline
    python recipes/train.py strategy.plan=plan.yaml trainer.max_steps=200

Multi-process strategies launched from this script (distmm, ddp) use Lightning's subprocess
launcher: it re-runs this script for ranks > 0 with the same command-line overrides plus
``hydra.run.dir=<this run's dir> hydra.output_subdir=null``, so every rank composes the same
config and shares one output directory. Only global rank 0 prints and writes ``metrics.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

# runnable as ``python recipes/train.py`` from a checkout without installing the package
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from lightning_distmm import DistMMStrategy, consolidated_state_dict  # noqa: E402
from lightning_distmm.data.shapes import ShapesDataModule  # noqa: E402
from lightning_distmm.data.tokenizer import build_caption_tokenizer  # noqa: E402
from lightning_distmm.models.clip import CLIPModel, num_parameters, to_plain  # noqa: E402
from lightning_distmm.models.metrics import format_metrics, retrieval_metrics  # noqa: E402

SINGLE, DDP = "single", "ddp"


# ---------------------------------------------------------------------- building blocks
def build_strategy(scfg: DictConfig, trainer_kwargs: dict[str, Any]) -> Any:
    """``Trainer(strategy=...)`` from the strategy config; may adjust ``trainer_kwargs`` (devices)."""
    name = scfg.name
    if name == SINGLE:
        trainer_kwargs["devices"] = int(scfg.get("devices", 1))
        trainer_kwargs["num_nodes"] = 1
        return "auto"
    if name == DDP:
        return "ddp"
    if name == "distmm":
        plan = scfg.get("plan")
        if isinstance(plan, DictConfig):
            plan = to_plain(plan)
        elif isinstance(plan, str) and plan not in ("default", "colocated", "auto"):
            plan = hydra.utils.to_absolute_path(plan)  # relative to where the command was run
        extra = {k: to_plain(v) for k, v in scfg.items() if k not in ("name", "plan")}
        return DistMMStrategy(plan=plan, **extra)
    return name  # any other strategy Lightning knows by name


def per_process_batch(cfg: DictConfig, trainer_kwargs: dict[str, Any]) -> int:
    """The DataLoader batch size: the global batch, except for DDP with ``split_batch``."""
    batch = int(cfg.data.batch_size)
    if cfg.strategy.name == DDP and cfg.strategy.get("split_batch", True):
        devices, nodes = trainer_kwargs.get("devices", 1), int(trainer_kwargs.get("num_nodes", 1))
        if isinstance(devices, int) and devices * nodes > 1:
            world = devices * nodes
            if batch % world:
                raise SystemExit(f"data.batch_size={batch} does not split over {world} DDP processes")
            return batch // world
    return batch


def build_data(cfg: DictConfig, batch_size: int) -> ShapesDataModule:
    kwargs = to_plain(cfg.data)
    name = kwargs.pop("name", "shapes")
    if name != "shapes":
        raise SystemExit(f"data.name={name!r}: this recipe knows only 'shapes'")
    kwargs["batch_size"] = batch_size
    return ShapesDataModule(**kwargs)


def check_text_vocab(cfg: DictConfig) -> None:
    """The tokenizer's ids must fit every text tower's embedding table."""
    vocab = build_caption_tokenizer().get_vocab_size()
    for name, tower in cfg.model.towers.items():
        if "vocab_size" in tower and int(tower.vocab_size) < vocab:
            raise SystemExit(
                f"model.towers.{name}.vocab_size={tower.vocab_size} < the caption tokenizer's {vocab} tokens"
            )


def evaluation_module(trainer: L.Trainer, model: CLIPModel, cfg: DictConfig) -> CLIPModel | None:
    """A module with every tower's trained weights on global rank 0 (None on other ranks).

    Collective under distmm: every rank must call it.
    """
    if cfg.strategy.name == SINGLE or trainer.world_size == 1:
        return model if trainer.global_rank == 0 else None
    if cfg.strategy.name == DDP:  # every replica holds the same full weights
        return model if trainer.global_rank == 0 else None
    state = consolidated_state_dict(trainer)  # towers live on different ranks: assemble them on rank 0
    if trainer.global_rank != 0:
        return None
    fresh = CLIPModel(cfg.model, cfg.optim)
    fresh.load_state_dict(state)
    return fresh


def prepare_hydra_relaunch() -> None:
    """Make Lightning's re-launch of this script for ranks > 0 right under ``--multirun`` too.

    Lightning re-runs ``sys.argv`` plus ``hydra.run.dir=<HydraConfig.run.dir>``. In a sweep that
    would start the whole sweep again in every child, in the wrong directory; so for a sweep job
    the command line becomes this job's own overrides and ``run.dir`` this job's output dir.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    sys.argv = [sys.argv[0], *hc.overrides.task]
    with open_dict(hc):
        readonly = OmegaConf.is_readonly(hc)
        OmegaConf.set_readonly(hc, False)
        hc.run.dir = hc.runtime.output_dir
        OmegaConf.set_readonly(hc, readonly)


_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def release_process_group(launched_here: bool) -> None:
    """End this job's process group, so that the next job of a sweep can start a fresh one.

    Lightning's launcher leaves ``LOCAL_RANK`` & co. in the launching process's environment, which
    would make the next job believe its processes were created externally (and wait forever for
    ranks nobody starts); the process that launched this job's ranks removes them again.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if launched_here:
        for key in _LAUNCH_ENV:
            os.environ.pop(key, None)


# ---------------------------------------------------------------------- the app
@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, float] | None:
    out_dir = Path(cfg.out_dir)
    launched_here = "LOCAL_RANK" not in os.environ  # this process will start the other ranks (if any)
    prepare_hydra_relaunch()
    L.seed_everything(int(cfg.seed), workers=True)

    trainer_kwargs = to_plain(cfg.trainer)
    strategy = build_strategy(cfg.strategy, trainer_kwargs)
    check_text_vocab(cfg)
    datamodule = build_data(cfg, per_process_batch(cfg, trainer_kwargs))
    model = CLIPModel(cfg.model, cfg.optim)

    trainer = L.Trainer(**trainer_kwargs, strategy=strategy, default_root_dir=str(out_dir))
    rank_zero_info(
        f"model {cfg.model.name}: {num_parameters(model):,} parameters"
        f" (image {num_parameters(model.visual):,}, text {num_parameters(model.text):,});"
        f" strategy {cfg.strategy.name}, devices {trainer_kwargs.get('devices')}, global batch {cfg.data.batch_size};"
        f" output {out_dir}"
    )
    start = time.time()
    trainer.fit(model, datamodule=datamodule)
    fit_seconds = time.time() - start

    metrics = evaluate(trainer, model, datamodule, cfg, out_dir, fit_seconds) if cfg.eval.enabled else None
    release_process_group(launched_here)
    return metrics


def evaluate(
    trainer: L.Trainer,
    model: CLIPModel,
    datamodule: ShapesDataModule,
    cfg: DictConfig,
    out_dir: Path,
    fit_seconds: float,
) -> dict[str, float] | None:
    """Held-out retrieval on global rank 0; prints it and writes ``metrics.json`` (collective: all ranks call)."""
    eval_model = evaluation_module(trainer, model, cfg)
    if trainer.global_rank != 0 or eval_model is None:
        return None
    metrics = retrieval_metrics(eval_model, datamodule.eval_dataloader(int(cfg.eval.batch_size)))
    print(format_metrics(metrics), flush=True)
    train_loss = trainer.callback_metrics.get("train/loss")
    record = {
        **metrics,
        "train/loss": float(train_loss) if train_loss is not None else None,
        "steps": int(trainer.global_step),
        "fit_seconds": round(fit_seconds, 1),
        "strategy": str(cfg.strategy.name),
        "world_size": int(trainer.world_size),
        "parameters": num_parameters(eval_model),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out_dir / 'metrics.json'}", flush=True)
    return metrics


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
