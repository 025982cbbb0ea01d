"""Checkpoints of a model whose towers live on different ranks.

Saving uses torch.distributed.checkpoint (DCP) through Lightning's ``ModelParallelStrategy``: a
folder with one shard per rank plus ``meta.pt`` (loops, callbacks, schedulers). What we change:

* a rank saves only the tensors it holds (towers released to the meta device are skipped);
  replicas of a tower save the same keys, which DCP de-duplicates;
* optimizer state is *flattened* to keys per parameter name (``state.<fqn>.exp_avg``,
  ``param_groups.<fqn>.lr``), because ranks hold different parameters: un-flattened, the
  ``param_groups`` entry would have one key with different contents per rank and DCP would keep
  only one of them;
* the plan the checkpoint was trained under and its global batch are kept in ``meta.pt``
  (:data:`PLAN_KEY`): a checkpoint resumes under *any* plan for the same towers (DCP re-shards
  every tensor by its global name and shape: replicated, tensor-parallel or FSDP-sharded, on any
  number of ranks), and :func:`check_plan_change` refuses the one change that cannot continue the
  same training, a plan fixed to another global batch;
* :func:`consolidated_state_dict` assembles the whole model on rank 0 while training runs, and
  :func:`export_checkpoint` turns a saved folder into a plain ``state_dict`` file offline, with
  no processes at all; both load into the module with no distmm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.optim import Optimizer

from lightning_distmm.core.plan import Plan, PlanError
from lightning_distmm.parallel.optimizer_shards import OptimizerShards
from lightning_distmm.parallel.prepare import tower_prefixes
from lightning_distmm.parallel.step.engine import StepEngine
from lightning_distmm.parallel.tensor_parallel import is_strided

#: the file of a checkpoint folder that holds everything but the tensors (Lightning's name)
META_FILE = "meta.pt"
#: the key of ``meta.pt`` that records the plan a checkpoint was trained under and its global batch
PLAN_KEY = "distmm_plan"


class RuntimeHolder(Protocol):
    """What :func:`consolidated_state_dict` needs of a strategy (``DistMMStrategy`` has it)."""

    @property
    def lightning_module(self) -> nn.Module | None: ...

    @property
    def root_device(self) -> torch.device: ...

    engine: StepEngine | None


def _flat_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def local_state_dict(module: nn.Module) -> dict[str, Any]:
    """The module's state dict without the tensors of towers this rank does not hold."""
    return {k: v for k, v in module.state_dict().items() if not (isinstance(v, torch.Tensor) and v.is_meta)}


def for_dcp(state: dict[str, Any]) -> dict[str, Any]:
    """DCP describes a shard as one contiguous block, so it cannot store the head-aligned strided
    shards of a fused qkv (tensor parallelism): those are saved replicated across their tp group."""
    return {
        k: v.redistribute(v.device_mesh, [Replicate()] * len(v.placements)) if is_strided(v) else v
        for k, v in state.items()
    }


def from_dcp(loaded: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`for_dcp` after a load: re-shard what was saved replicated like the live tensors."""
    return {
        k: distribute_tensor(v.to_local(), like[k].device_mesh, like[k].placements) if is_strided(like.get(k)) else v
        for k, v in loaded.items()
    }


def drop_remote_parameters(optimizers: Iterable[Optimizer]) -> None:
    """Remove parameters released to the meta device from the optimizers' groups (no state for them)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if not p.is_meta]


def _unwrapped(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer itself when ``optimizer`` wraps one (Lightning's ``LightningOptimizer.optimizer``)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, Optimizer) else optimizer


def optimizer_state_dict(
    module: nn.Module, optimizer: Optimizer, shards: OptimizerShards | None = None
) -> dict[str, Any]:
    """The optimizer's state by parameter name; a ZeRO-1 tower's (``shards``) as its whole parameters'."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    inner = _unwrapped(optimizer)
    with shards.whole_state(inner) if shards else contextlib.nullcontext():
        return get_optimizer_state_dict(module, inner, options=_flat_options())


def _load_optimizer_state(
    module: nn.Module,
    optimizer: Optimizer,
    loaded: dict[str, Any],
    like: dict[str, Any],
    shards: OptimizerShards | None = None,
) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    inner = _unwrapped(optimizer)
    with shards.whole_state(inner) if shards else contextlib.nullcontext():
        set_optimizer_state_dict(module, inner, from_dcp(loaded, like), options=_flat_options())


def plan_record(plan: Plan, global_batch: int | None) -> dict[str, Any]:
    """What a checkpoint records of its run: the plan (plain data) and the global batch it trained at."""
    return {"plan": plan.to_dict(), "global_batch": global_batch if global_batch is not None else plan.global_batch}


def check_plan_change(path: Path, plan: Plan) -> None:
    """Refuse to resume the checkpoint at ``path`` under ``plan`` when the change cannot continue the
    same training: ``plan`` is made for another global batch than the one the checkpoint trained at.

    Anything else may change (ranks, replica batches, tp, pp, sharding, schedule, world size): the
    weights and optimizer state are re-sharded by name, and the data loader continues at the next
    unseen sample of the epoch's order. A plan without ``global_batch`` resumes at whatever batch
    the DataLoader gives (the loader's position is a count of samples).
    """
    meta = path / META_FILE
    if not meta.is_file():
        return
    record = read_metadata(path).get(PLAN_KEY)
    if not record:
        return
    saved = record.get("global_batch")
    if plan.global_batch is not None and saved is not None and plan.global_batch != saved:
        before = Plan.from_dict(record["plan"])
        raise PlanError(
            f"checkpoint {path} was trained at a global batch of {saved} under\n{before.table()}\nand cannot resume"
            f" under a plan made for a global batch of {plan.global_batch}:\n{plan.table()}\nA plan change keeps the"
            f" global batch (the contrastive loss, its negatives and the optimizer's steps depend on it): make the"
            f" new plan for global_batch: {saved}, or leave global_batch unset to resume at the DataLoader's batch"
        )


def split_for_dcp(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict split as ``ModelParallelStrategy`` saves it: the tensors DCP writes
    (``state_dict``, ``optimizer_<i>``: the keys :func:`load_sharded` reads) and the rest (``meta.pt``)."""
    rest = dict(checkpoint)
    tensors = {"state_dict": rest.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(rest.pop("optimizer_states", []))})
    return tensors, rest


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    weights_only: bool | None = None,
    shards: OptimizerShards | None = None,
) -> dict[str, Any]:
    """Load this rank's tensors (and optimizer state; a ZeRO-1 tower's, ``shards``, cut into this
    rank's pieces) from a DCP folder; return the remaining metadata."""
    import torch.distributed.checkpoint as dcp

    if not path.is_dir() or not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a distmm checkpoint folder (expected a directory with {META_FILE} and DCP shards)"
        )
    metadata = check_shards(path)  # every rank, before the collective load: a damaged file fails everywhere, by name
    model_state = local_state_dict(module)
    live = {"state_dict": model_state}
    for i, optimizer in enumerate(optimizers):
        live[f"optimizer_{i}"] = optimizer_state_dict(module, optimizer, shards)
    state = {key: for_dcp(value) for key, value in live.items()}
    check_keys(path, state, set(metadata.state_dict_metadata))  # a different model is named, before the load
    dcp.load(state, checkpoint_id=path)
    missing, unexpected = module.load_state_dict(from_dcp(state["state_dict"], model_state), strict=False)
    not_meta_missing = [k for k in missing if k in model_state]
    if not_meta_missing or unexpected:
        raise RuntimeError(
            f"checkpoint {path} does not match the module: missing {not_meta_missing}, unexpected {unexpected}"
        )
    for i, optimizer in enumerate(optimizers):
        _load_optimizer_state(module, optimizer, state[f"optimizer_{i}"], live[f"optimizer_{i}"], shards)
    return read_metadata(path, weights_only=bool(weights_only) if weights_only is not None else False)


def read_metadata(path: Path, weights_only: bool = False) -> dict[str, Any]:
    """``meta.pt`` of the checkpoint folder ``path`` (loops, callbacks, the plan), naming the file when
    it cannot be read."""
    meta = Path(path) / META_FILE
    try:
        return torch.load(meta, weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - torch.load raises many kinds for a damaged file
        raise ValueError(
            f"checkpoint {path}: {meta.name} cannot be read ({type(err).__name__}: {err}); the file is damaged or"
            f" was not written by a finished save: resume from another checkpoint"
        ) from err


def check_keys(path: Path, state: dict[str, dict[str, Any]], have: set[str]) -> None:
    """Every tensor this rank loads (``state``: ``{"state_dict": ..., "optimizer_0": ...}``) is among
    the checkpoint's keys ``have`` (its DCP metadata's); otherwise say which, by tower, and what the
    checkpoint holds instead (torch's ``CheckpointException`` named an optimizer step counter and no
    folder)."""
    wanted = {f"{top}.{key}" for top, flat in state.items() for key, v in flat.items() if isinstance(v, torch.Tensor)}
    message = describe_missing(wanted, have)
    if message is not None:
        raise ValueError(f"checkpoint {path}: {message}")


def describe_missing(wanted: set[str], have: set[str]) -> str | None:
    """What of ``wanted`` (DCP keys such as ``state_dict.visual.blocks.1.norm1.weight``) ``have`` lacks,
    grouped by the module's first-level names (its towers), or None when nothing is missing."""
    missing = sorted(wanted - have)
    if not missing:
        return None

    def towers(keys: Iterable[str]) -> list[str]:
        return sorted({k.split(".")[1] for k in keys if k.startswith("state_dict.") and k.count(".") > 1})

    weights = [k for k in missing if k.startswith("state_dict.")]
    lacking = towers(weights)
    saved = towers(have)
    head = f"it lacks {len(missing)} of this rank's {len(wanted)} tensors"
    if weights:
        head += f", weights of {lacking} (e.g. {weights[0].removeprefix('state_dict.')})"
    else:
        head += f" (optimizer state, e.g. {missing[0]}): the optimizer differs from the one saved"
    return (
        f"{head}; it holds weights of {saved}. It was saved from another model or other towers: resume"
        " from a checkpoint of this model, or load only matching weights (ldm.export_checkpoint, then"
        " load_state_dict(strict=False))"
    )


def check_shards(path: Path) -> Any:
    """Every shard file the checkpoint's DCP metadata refers to exists and is long enough; returns
    that metadata (read once, for :func:`check_keys` too).

    A save cut short leaves a truncated ``__N_0.distcp``; torch would fail deep in the load with
    ``EOFError`` or an unpickling error that names no file.
    """
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - a damaged .metadata fails in many ways
        raise ValueError(
            f"checkpoint {path}: its DCP index .metadata cannot be read ({type(err).__name__}: {err}): the save"
            f" did not finish or the file is damaged; resume from another checkpoint"
        ) from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(needed.items()):
        shard = path / rel
        if not shard.is_file():
            raise FileNotFoundError(f"checkpoint {path}: shard {rel} is missing (the index .metadata refers to it)")
        have = shard.stat().st_size
        if have < size:
            raise ValueError(
                f"checkpoint {path}: shard {rel} is truncated ({have} bytes; the index .metadata needs {size}):"
                f" the save did not finish; resume from another checkpoint"
            )
    return metadata


def consolidated_state_dict(trainer_or_strategy: Any) -> dict[str, torch.Tensor] | None:
    """The whole model's plain state dict on rank 0 (``None`` elsewhere). Collective: call on every rank.

    Takes the ``Trainer`` or its ``DistMMStrategy``.

    Each tensor comes from the first rank of its tower's first replica that holds it (pipeline
    stages hold different tensors; tensor-parallel shards are assembled there first; a sharded
    tower's FSDP shards are assembled by all its ranks); rank 0 receives what it does not hold
    itself (it knows the shapes from its meta tensors).
    """
    strategy: RuntimeHolder = getattr(trainer_or_strategy, "strategy", trainer_or_strategy)
    module = strategy.lightning_module
    engine = strategy.engine
    assert module is not None and engine is not None
    rank = dist.get_rank()
    full = module.state_dict()
    out: dict[str, torch.Tensor] = {
        k: v.detach().cpu().clone() for k, v in full.items() if not v.is_meta and not isinstance(v, DTensor)
    }
    prefixes = {name: fqn + "." for name, fqn in tower_prefixes(module, engine.towers).items()}
    held = {k for k, v in full.items() if not v.is_meta}
    everyone: list[set[str]] = [set()] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    for name in engine.towers:
        tower = engine.plan.towers[name]
        keys_of_tower = [k for k in full if k.startswith(prefixes[name])]
        replica = tower.replica_ranks(0)
        by_source: dict[int, list[str]] = {}
        for k in keys_of_tower:
            # the first rank of the first replica that holds it (pipeline stages hold different keys)
            by_source.setdefault(next(r for r in replica if k in everyone[r]), []).append(k)
        for src, keys in by_source.items():
            # the ranks that assemble the keys (a collective over their mesh): a sharded tower's
            # FSDP shards span the stage's ranks in every replica, a replicated tower's TP shards
            # the source's tensor-parallel group
            peers = [r for r in (tower.ranks if tower.sharded else replica) if set(keys) <= everyone[r]]
            if rank in peers:
                # sharded tensors are assembled among the peers (a collective there)
                tensors = {
                    k: (full[k].full_tensor() if isinstance(full[k], DTensor) else full[k]).detach() for k in keys
                }
            if src == 0:
                if rank == 0:
                    out.update({k: v.cpu().clone() for k, v in tensors.items()})
                continue
            _send_to_zero(keys, full, tensors if rank == src else None, src, rank, strategy.root_device, out)
    dist.barrier()
    return out if rank == 0 else None


def _send_to_zero(
    keys: list[str],
    full: dict[str, Any],
    tensors: dict[str, torch.Tensor] | None,
    src: int,
    rank: int,
    device: torch.device,
    out: dict[str, torch.Tensor],
) -> None:
    """Move ``keys`` from ``src`` to rank 0, one flat message per dtype (rank 0 knows the shapes)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for k in keys:
        by_dtype.setdefault(full[k].dtype, []).append(k)
    for dtype, ks in by_dtype.items():
        if rank == src:
            assert tensors is not None
            dist.send(torch.cat([tensors[k].reshape(-1) for k in ks]).to(device), dst=0)
        elif rank == 0:
            flat = torch.empty(sum(full[k].numel() for k in ks), dtype=dtype, device=device)
            dist.recv(flat, src=src)
            start = 0
            for k in ks:
                out[k] = flat[start : start + full[k].numel()].view(full[k].shape).cpu().clone()
                start += full[k].numel()


def export_checkpoint(checkpoint_dir: str | Path, output: str | Path | None = None) -> dict[str, torch.Tensor]:
    """Turn a distmm checkpoint folder into the plain ``state_dict`` of the whole model, in one process.

    Uses ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``; the result loads with
    ``module.load_state_dict(...)`` and no distmm. Written to ``output`` when given.
    """
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint_dir = Path(checkpoint_dir)
    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp) / "full.pt"
        dcp_to_torch_save(checkpoint_dir, flat)
        state = torch.load(flat, weights_only=False)
    model = state["state_dict"]
    if output is not None:
        torch.save(model, output)
    return model
