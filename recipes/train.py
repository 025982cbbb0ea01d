"""Train a CLIP-style model (default: on the shapes dataset), then measure held-out retrieval.

    python recipes/train.py                                  # strategy=distmm, 2 CPU processes
    python recipes/train.py strategy=single                  # one process, the reference
    python recipes/train.py strategy=ddp                     # plain DDP baseline
    python recipes/train.py strategy.plan=plan.yaml trainer.max_steps=200
    python recipes/train.py experiment=clip_digits logger=csv   # zero-shot on real digit scans
    python recipes/train.py experiment=clip_shapes_csv data.path=data/shapes_csv/train.csv   # after recipes/make_csv.py
    python recipes/train.py ckpt_path=path/to/epoch=0-step=100.ckpt                 # resume

The config follows lightning-hydra-template: ``data``, ``logger`` and ``callbacks`` entries with a
``_target_`` are instantiated, ``experiment/`` files override groups, and ``main`` returns
``trainer.callback_metrics[optimized_metric]`` for a sweeper.

Multi-process strategies launched from this script (distmm, ddp) use Lightning's subprocess
launcher: it re-runs this script for ranks > 0 with the same command-line overrides plus
``hydra.run.dir=<this run's dir> hydra.output_subdir=null``, so every rank composes the same
config and shares one output directory. Only global rank 0 prints and writes ``metrics.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from torch.utils.data import DataLoader

# runnable as ``python recipes/train.py`` from a checkout without installing the package
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from lightning_distmm import DistMMStrategy, consolidated_state_dict  # noqa: E402
from lightning_distmm.data.demo.tokenizer import build_caption_tokenizer  # noqa: E402
from lightning_distmm.models.bridges import recipe as weights  # noqa: E402
from lightning_distmm.models.clip import CLIPModel, num_parameters, to_plain  # noqa: E402
from lightning_distmm.models.metrics import format_metrics, retrieval_metrics  # noqa: E402
from lightning_distmm.models.progress import progress_bar  # noqa: E402

SINGLE, DDP = "single", "ddp"


# ---------------------------------------------------------------------- building blocks
def build_strategy(scfg: DictConfig, trainer_kwargs: dict[str, Any]) -> Any:
    """``Trainer(strategy=...)`` from the strategy config; may adjust ``trainer_kwargs`` (devices)."""
    name = scfg.name
    if name == SINGLE:
        set_threads(scfg, trainer_kwargs.get("devices"))
        trainer_kwargs["devices"] = int(scfg.get("devices", 1))
        trainer_kwargs["num_nodes"] = 1
        return "auto"
    if name == DDP:
        return "ddp"
    if name == "distmm":
        plan = scfg.get("plan")
        if isinstance(plan, DictConfig):
            plan = to_plain(plan)
            if all(str(k).isdigit() for k in plan):  # plans by world size: {2: small.yaml, 4: big.yaml}
                plan = {int(k): _plan_path(v) for k, v in plan.items()}
        else:
            plan = _plan_path(plan)
        extra = {k: to_plain(v) for k, v in scfg.items() if k not in ("name", "plan")}
        return DistMMStrategy(plan=plan, **extra)
    return name  # any other strategy Lightning knows by name


def _plan_path(plan: Any) -> Any:
    """A plan file or folder relative to where the command was run; anything else as it is."""
    if isinstance(plan, str) and plan not in ("default", "colocated", "auto"):
        return hydra.utils.to_absolute_path(plan)
    return plan


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


def build_data(cfg: DictConfig, batch_size: int) -> L.LightningDataModule:
    """The datamodule: ``data._target_`` instantiated (lightning-hydra-template style), with the batch size."""
    if "_target_" not in cfg.data:
        raise SystemExit("data needs a _target_ (a LightningDataModule class); see conf/data/*.yaml")
    return hydra.utils.instantiate(cfg.data, batch_size=batch_size)


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Every entry of a config group (``callbacks``, ``logger``) that has a ``_target_``, instantiated."""
    if group is None:
        return []
    if "_target_" in group:
        return [hydra.utils.instantiate(group)]
    return [hydra.utils.instantiate(v) for v in group.values() if isinstance(v, DictConfig) and "_target_" in v]


def trainer_arguments(cfg: DictConfig) -> dict[str, Any]:
    """``cfg.trainer`` as keyword arguments; values with a ``_target_`` (``+trainer.logger={_target_: ...}``) instantiated."""
    kwargs: dict[str, Any] = {}
    for key, value in cfg.trainer.items():
        if isinstance(value, DictConfig) and "_target_" in value:
            kwargs[key] = hydra.utils.instantiate(value)
        elif isinstance(value, ListConfig) and any(isinstance(v, DictConfig) and "_target_" in v for v in value):
            kwargs[key] = [hydra.utils.instantiate(v) if isinstance(v, DictConfig) else v for v in value]
        else:
            kwargs[key] = to_plain(value)
    return kwargs


def settle_max_epochs(trainer_kwargs: dict[str, Any], datamodule: L.LightningDataModule) -> None:
    """With ``max_steps`` and no ``max_epochs``, the epochs those steps take (the progress bar shows
    ``Epoch 0/1``, not Lightning's ``Epoch 0/-2`` for "unbounded"); training still stops at ``max_steps``."""
    steps = trainer_kwargs.get("max_steps")
    if trainer_kwargs.get("max_epochs") is not None or not steps or steps < 0:
        return
    try:
        batches = len(datamodule.train_dataloader())
    except TypeError:  # no length: leave Lightning's default
        return
    accumulate = int(trainer_kwargs.get("accumulate_grad_batches") or 1)
    limit = trainer_kwargs.get("limit_train_batches")
    if isinstance(limit, int) and limit > 0:
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = max(1, int(batches * limit))
    per_epoch = max(1, batches // accumulate)
    trainer_kwargs["max_epochs"] = -(-int(steps) // per_epoch)


def check_text_vocab(cfg: DictConfig, datamodule: L.LightningDataModule) -> None:
    """The tokenizer's ids must fit every text tower's embedding table (any DataModule: its ``text``
    tokenizer, or the embedded one); otherwise the first batch fails deep in an embedding lookup."""
    text = getattr(datamodule, "text", None)
    vocab = int(text.vocab_size) if text is not None else build_caption_tokenizer().get_vocab_size()
    for name, tower in cfg.model.towers.items():
        if "vocab_size" in tower and int(tower.vocab_size) < vocab:
            raise SystemExit(
                f"model.towers.{name}.vocab_size={tower.vocab_size} < the caption tokenizer's {vocab} tokens"
                f" (data.tokenizer={cfg.data.get('tokenizer')}): token ids past the embedding table would fail"
                f" at the first batch; set model.towers.{name}.vocab_size={vocab} (or more), or use a tokenizer"
                " of that size"
            )


#: what the recipe prints, also written to Hydra's job log file (train.log), not printed twice
_REPORT = logging.getLogger("recipes.train.report")


def log_to_hydra_files() -> None:
    """Hydra's job log (``<run dir>/train.log``) stayed empty: Lightning's logger does not propagate
    to the root logger Hydra's file handler sits on. Hand that handler to Lightning's logger and to
    the recipe's report too (the console keeps Lightning's own handler)."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    _REPORT.setLevel(logging.INFO)
    _REPORT.propagate = False
    for logger in (logging.getLogger("lightning.pytorch"), _REPORT):
        for handler in list(logger.handlers):  # a sweep's earlier job's file: not this job's
            if isinstance(handler, logging.FileHandler) and handler not in files:
                logger.removeHandler(handler)
        for handler in files:
            if handler not in logger.handlers:
                logger.addHandler(handler)


def report(text: str) -> None:
    """Print ``text`` (global rank 0 calls it) and write it to the job log."""
    print(text, flush=True)
    _REPORT.info(text)


def parameter_line(cfg: DictConfig, model: CLIPModel, trainer_kwargs: dict[str, Any], out_dir: Path) -> str:
    """What is trained, where: parameters per tower (and CoCa's decoder), strategy, devices, threads."""
    parts = [f"{name} {num_parameters(getattr(model, attr)):,}" for name, attr in model._tower_attrs.items()]
    if getattr(model, "decoder", None) is not None:
        parts.append(f"decoder {num_parameters(model.decoder):,}")
    return (
        f"model {cfg.model.name}: {num_parameters(model):,} parameters ({', '.join(parts)});"
        f" strategy {cfg.strategy.name}, devices {trainer_kwargs.get('devices')}, global batch {cfg.data.batch_size}"
        + (f", {torch.get_num_threads()} torch threads" if cfg.strategy.name == SINGLE else "")
        + f"; output {out_dir}"
    )


def set_threads(scfg: DictConfig, configured_devices: Any) -> None:
    """One process (``strategy=single``): torch threads as Lightning's DDP sets them per process, for the
    processes this config's multi-process run starts (``trainer.devices``), unless ``OMP_NUM_THREADS``
    or ``strategy.threads`` says otherwise: a one-process run then computes with what each rank of
    the run it is compared with has (on a loaded CPU, more OpenMP threads than free cores spin and wait)."""
    threads = scfg.get("threads")
    if threads is None:
        if "OMP_NUM_THREADS" in os.environ:
            return
        processes = configured_devices if isinstance(configured_devices, int) and configured_devices > 0 else 1
        threads = max(
            1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) // processes
        )
    torch.set_num_threads(int(threads))
    os.environ["OMP_NUM_THREADS"] = str(int(threads))


def command_line_overrides() -> list[str]:
    """This job's command-line overrides (Hydra's task overrides; empty outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def initial_model(cfg: DictConfig) -> CLIPModel:
    """The module to train: ``cfg.model`` built afresh, or with ``init=`` the weights it names.

    With ``init`` the model config becomes the weights' own (so the data's image size and context
    length, the vocabulary check and the evaluation module follow it) and the optimiser takes
    ``optim.finetune``'s values for the keys the command line does not set. Every rank loads them.
    """
    optim = to_plain(cfg.optim)
    if not cfg.get("init"):
        return CLIPModel(cfg.model, {k: v for k, v in optim.items() if k != "finetune"})
    try:
        spec = weights.parse_init(str(cfg.init))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e)) from None
    optim, changed = weights.finetune_optim(optim, command_line_overrides())
    model = weights.load_init(spec, optim)
    with open_dict(cfg):
        cfg.model = OmegaConf.create(model.model_cfg)
        cfg.optim = OmegaConf.create(optim)
    fine = ", ".join(f"optim.{k}={v}" for k, v in changed.items()) or "the optimiser as configured"
    rank_zero_info(f"init: {spec.describe()}; model {cfg.model.name}; fine-tuning with {fine}")
    return model


def export_folders(cfg: DictConfig) -> dict[str, str]:
    """``export.<format>`` entries that are set, as absolute paths (relative to where the command ran)."""
    folders = {k: v for k, v in to_plain(cfg.get("export") or {}).items() if v}
    return {k: hydra.utils.to_absolute_path(str(v)) for k, v in folders.items()}


def check_exportable(model: CLIPModel, folders: dict[str, str]) -> None:
    """Refuse, before training, a model that ``export.<format>`` could not write at the end."""
    problems = weights.export_problems(model, list(folders))
    if problems:
        raise SystemExit("cannot export after training, so not training: " + " | ".join(problems))


def zero_shot_callback(cfg: DictConfig, datamodule: L.LightningDataModule) -> L.Callback | None:
    """With ``zeroshot.folder``: ``ZeroShotClassification`` over that class folder, its images read with
    the datamodule's eval transform (or one from ``data``'s size and CLIP's statistics) and its
    prompts tokenized as the captions are."""
    zcfg = cfg.get("zeroshot") or {}
    if not zcfg.get("folder"):
        return None
    from lightning_distmm.data.datasets.class_folder import ClassFolder, templates
    from lightning_distmm.data.datasets.preprocess import CaptionTokenizer, pair_preprocessing
    from lightning_distmm.models.evaluation import ZeroShotClassification

    transform = getattr(datamodule, "image_transform", None)
    if transform is None:
        data = cfg.data
        keys = {k: to_plain(data[k]) for k in ("mean", "std", "interpolation") if data.get(k) is not None}
        transform, _ = pair_preprocessing(int(cfg.model.towers.image.img_size), **keys)
    tokenize = getattr(datamodule, "tokenize", None)
    if tokenize is None:
        text = cfg.model.towers.get("text", {})
        tokenize = CaptionTokenizer(cfg.data.get("tokenizer"), int(text.get("context_length", 77))).batch
    classnames = zcfg.get("classnames")
    classnames = to_plain(classnames) if isinstance(classnames, ListConfig) else classnames
    if isinstance(classnames, str):
        classnames = hydra.utils.to_absolute_path(classnames)
    folder = ClassFolder(hydra.utils.to_absolute_path(str(zcfg.folder)), classnames, transform)
    prompts = templates(to_plain(zcfg.get("templates", "simple")))
    rank_zero_info(f"zero-shot: {folder}, {len(prompts)} templates (e.g. {prompts[0].format(folder.classnames[0])!r})")
    return ZeroShotClassification(
        dataset=folder,
        classnames=folder.classnames,
        templates=prompts,
        tokenize=tokenize,
        ks=[int(k) for k in zcfg.get("ks", [1, 5])],
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
    log_to_hydra_files()
    L.seed_everything(int(cfg.seed), workers=True)
    if cfg.model.get("kind") == "vlm":  # a vision encoder feeding a language model (experiment=vlm_shapes)
        return vlm_job(cfg, out_dir, launched_here)
    if cfg.model.get("kind") == "llava":  # transformers' LLaVA as two towers (experiment=llava_shapes)
        return llava_job(cfg, out_dir, launched_here)

    model = initial_model(cfg)  # before the data: with init= the model config is the weights'
    exports = export_folders(cfg)
    check_exportable(model, exports)
    trainer_kwargs = trainer_arguments(cfg)
    strategy = build_strategy(cfg.strategy, trainer_kwargs)
    datamodule = build_data(cfg, per_process_batch(cfg, trainer_kwargs))
    check_text_vocab(cfg, datamodule)
    settle_max_epochs(trainer_kwargs, datamodule)

    callbacks = [*(trainer_kwargs.pop("callbacks", None) or []), *instantiate_group(cfg.get("callbacks"))]
    zero_shot = zero_shot_callback(cfg, datamodule)
    if zero_shot is not None:
        callbacks.append(zero_shot)
    loggers = instantiate_group(cfg.get("logger"))
    # logger: null means none (Lightning would otherwise write lightning_logs/ with its default one)
    trainer_kwargs["logger"] = loggers or trainer_kwargs.get("logger") or False
    if trainer_kwargs["logger"] is False:  # the callbacks log for loggers; none is configured on purpose
        warnings.filterwarnings("ignore", message=r".*but have no logger configured.*")
    if trainer_kwargs.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(progress_bar())  # right for max_steps and streams, no v_num
    trainer = L.Trainer(**trainer_kwargs, strategy=strategy, callbacks=callbacks, default_root_dir=str(out_dir))
    rank_zero_info(parameter_line(cfg, model, trainer_kwargs, out_dir))
    start = time.time()
    ckpt_path = cfg.get("ckpt_path")
    trainer.fit(model, datamodule=datamodule, ckpt_path=hydra.utils.to_absolute_path(ckpt_path) if ckpt_path else None)
    fit_seconds = time.time() - start

    train_loss = trainer.callback_metrics.get("train/loss")  # validate() below starts callback_metrics anew
    if trainer.limit_val_batches:
        # the last validation (if any) ran at an epoch end or a val_check_interval, not necessarily at
        # the last step: validate the trained weights, so the callbacks' figures are theirs
        trainer.validate(model, datamodule=datamodule, verbose=False)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and v.numel() == 1}
    if logged:
        rank_zero_info(
            f"validation after step {trainer.global_step}: "
            + ", ".join(f"{k} = {v:.4f}" for k, v in sorted(logged.items()))
        )
    if "val/zeroshot/top1" in logged:
        chance = logged.get("val/zeroshot/chance_top1")
        rank_zero_info(f"zero-shot top1 = {logged['val/zeroshot/top1']:.3f} (chance {chance:.3f})")
    if logged.get("val/retrieval/n"):
        rank_zero_info(retrieval_line(logged, "val/retrieval/"))
    # the trained weights in one module on global rank 0 (collective under distmm: every rank calls)
    eval_model = evaluation_module(trainer, model, cfg) if cfg.eval.enabled or exports else None
    if cfg.eval.enabled:
        evaluate(trainer, eval_model, datamodule, cfg, out_dir, fit_seconds, train_loss)
    if exports and eval_model is not None:
        for fmt, folder in weights.export(eval_model, exports).items():
            report(f"exported {fmt}: {folder}")
    release_process_group(launched_here)
    return optimized_metric(trainer, cfg.get("optimized_metric"))


def vlm_job(cfg: DictConfig, out_dir: Path, launched_here: bool) -> dict[str, float] | None:
    """Train ``conf/model/vlm_*.yaml`` on the captioning data (``conf/data/vlm_shapes.yaml``) with the
    configured strategy, then, on global rank 0 with the whole trained model, caption held-out images
    next to the true captions with the accuracy vs chance (recipes/vlm_shapes.py's parts)."""
    from vlm_shapes import Losses, build_from_config, caption_report, loss_line  # recipes/vlm_shapes.py

    model = build_from_config(to_plain(cfg.model), float(cfg.optim.lr))
    use_model_plan(cfg)
    trainer_kwargs = trainer_arguments(cfg)
    strategy = build_strategy(cfg.strategy, trainer_kwargs)
    datamodule = build_data(cfg, per_process_batch(cfg, trainer_kwargs))
    settle_max_epochs(trainer_kwargs, datamodule)
    out_dir.mkdir(parents=True, exist_ok=True)
    losses = Losses(str(out_dir / "losses.json"))
    parts = f"vision {num_parameters(model.vision):,}, llm {num_parameters(model.language):,}"
    trainer, seconds, train_loss = fit_towers(
        cfg, model, datamodule, strategy, trainer_kwargs, out_dir, [losses], f"({parts})", f"; output {out_dir}"
    )
    if cfg.strategy.name not in (SINGLE, DDP) and trainer.world_size > 1:
        state = consolidated_state_dict(trainer)  # collective: every rank calls it; rank 0 gets the whole model
        if trainer.global_rank == 0:
            model = build_from_config(to_plain(cfg.model), float(cfg.optim.lr))
            model.load_state_dict(state)
    if trainer.global_rank == 0:
        recorded = json.loads((out_dir / "losses.json").read_text()) if (out_dir / "losses.json").exists() else []
        if recorded:
            report(loss_line(recorded, seconds))
        for line in caption_report(model, datamodule.test):
            report(line)
    release_process_group(launched_here)
    return {"train/loss": float(train_loss)} if train_loss is not None else None


def fit_towers(
    cfg: DictConfig,
    model: Any,
    datamodule: Any,
    strategy: Any,
    trainer_kwargs: dict[str, Any],
    out_dir: Path,
    callbacks: list[Any],
    parts: str,
    tail: str = "",
) -> tuple[L.Trainer, float, Any]:
    """The VLM jobs' training: the Trainer with the configured callbacks and logger, one line
    naming the model (``parts``: its towers' parameters) and the run, ``fit``; returns the trainer,
    the seconds ``fit`` took and the last ``train/loss``."""
    callbacks = [*(trainer_kwargs.pop("callbacks", None) or []), *instantiate_group(cfg.get("callbacks")), *callbacks]
    trainer_kwargs["logger"] = instantiate_group(cfg.get("logger")) or False
    warnings.filterwarnings("ignore", message=r".*but have no logger configured.*")
    trainer = L.Trainer(**trainer_kwargs, strategy=strategy, callbacks=callbacks, default_root_dir=str(out_dir))
    rank_zero_info(
        f"model {cfg.model.name}: {num_parameters(model):,} parameters {parts}; strategy {cfg.strategy.name},"
        f" devices {trainer_kwargs.get('devices')}, global batch {cfg.data.batch_size}{tail}"
    )
    start = time.time()
    trainer.fit(model, datamodule=datamodule)
    return trainer, time.time() - start, trainer.callback_metrics.get("train/loss")


def use_model_plan(cfg: DictConfig) -> None:
    """train.yaml's plan names CLIP's towers: under distmm a model with its own towers trains with the
    model config's plan, unless the command line gives one."""
    if cfg.strategy.name == "distmm" and not any(o.startswith("strategy.plan") for o in command_line_overrides()):
        with open_dict(cfg):
            cfg.strategy.plan = cfg.model.get("plan")


def llava_job(cfg: DictConfig, out_dir: Path, launched_here: bool) -> dict[str, float] | None:
    """Train ``conf/model/llava_*.yaml`` (``init=hf_llava:<folder>``: from that saved model) on the
    shapes conversations, then on global rank 0 with the whole trained model ask held-out images both
    questions and, with ``export.hf=<folder>``, save it as a folder transformers loads."""
    from llava_shapes import build_module  # recipes/llava_shapes.py
    from llava_shapes import report as llava_report

    from lightning_distmm.models.llava import save_llava

    init = cfg.get("init")
    if init and not str(init).startswith("hf_llava:"):
        raise SystemExit(
            f"init={init}: a LLaVA starts from init=hf_llava:<folder> (a saved LlavaForConditionalGeneration)"
        )
    folder = str(init).split(":", 1)[1] if init else None
    export = (cfg.get("export") or {}).get("hf")
    use_model_plan(cfg)
    trainer_kwargs = trainer_arguments(cfg)
    strategy = build_strategy(cfg.strategy, trainer_kwargs)
    datamodule = build_data(cfg, per_process_batch(cfg, trainer_kwargs))
    if folder is None and not hasattr(datamodule, "held_out"):
        raise SystemExit(
            "your conversations need your model: init=hf_llava:<folder> (a saved LlavaForConditionalGeneration whose"
            " vocabulary is the tokenizer's and whose image_seq_length is data.image_tokens)"
        )
    model = build_module(cfg.model, float(cfg.optim.lr), datamodule.tokenizer, folder)
    settle_max_epochs(trainer_kwargs, datamodule)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = f"(vision {num_parameters(model.vision):,}, language {num_parameters(model.language):,})"
    trainer, seconds, train_loss = fit_towers(
        cfg, model, datamodule, strategy, trainer_kwargs, out_dir, [], parts + (f" from {folder}" if folder else "")
    )
    distributed = cfg.strategy.name not in (SINGLE, DDP) and trainer.world_size > 1
    # collective: every rank calls it; rank 0 gets the whole model
    state = consolidated_state_dict(trainer) if distributed else model.state_dict()
    if trainer.global_rank == 0:
        loss = f", last loss {float(train_loss):.3f}" if train_loss is not None else ""
        report(f"trained {cfg.trainer.max_steps} steps in {seconds:.0f} s{loss}")
        if export:
            save_llava(state, model.config, str(export))
            report(f"exported hf: {export}")
        if distributed:  # this rank held only its towers
            model = build_module(cfg.model, float(cfg.optim.lr), datamodule.tokenizer, folder)
            model.load_state_dict(state)
        if hasattr(datamodule, "held_out"):  # the shapes conversations: ask about held-out images
            for line in llava_report(model.to_llava(), datamodule.tokenizer, datamodule.held_out):
                report(line)
    release_process_group(launched_here)
    return {"train/loss": float(train_loss)} if train_loss is not None else None


def retrieval_line(logged: dict[str, float], prefix: str) -> str:
    """The Retrieval callback's last recall@1 both ways next to chance (1 / held-out pairs)."""
    n = logged[prefix + "n"]
    recalls = {k[len(prefix) :]: v for k, v in logged.items() if k.startswith(prefix) and k.endswith("_R@1")}
    shown = ", ".join(
        f"{name.removesuffix('_R@1').replace('_to_', '->')} R@1 = {v:.3f}" for name, v in sorted(recalls.items())
    )
    return f"retrieval (callback, {int(n)} held-out pairs): {shown} (chance {1 / n:.3f})"


def optimized_metric(trainer: L.Trainer, name: str | None) -> float | None:
    """The value a Hydra sweeper optimises: ``trainer.callback_metrics[name]`` after fit."""
    if not name:
        return None
    value = trainer.callback_metrics.get(name)
    if value is None:
        rank_zero_info(f"optimized_metric {name!r} was not logged; logged: {sorted(trainer.callback_metrics)}")
        return None
    return float(value)


def evaluate(
    trainer: L.Trainer,
    eval_model: CLIPModel | None,
    datamodule: L.LightningDataModule,
    cfg: DictConfig,
    out_dir: Path,
    fit_seconds: float,
    train_loss: Any = None,
) -> dict[str, float] | None:
    """Held-out retrieval on global rank 0 with ``eval_model`` (:func:`evaluation_module`'s); prints it
    and writes ``metrics.json``."""
    if trainer.global_rank != 0 or eval_model is None:
        return None
    held_out = getattr(datamodule, "retrieval_dataset", None) or datamodule.val_dataset
    metrics = retrieval_metrics(eval_model, DataLoader(held_out, batch_size=int(cfg.eval.batch_size)))
    report(format_metrics(metrics))
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
    report(f"wrote {out_dir / 'metrics.json'}")
    return metrics


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
