"""Checkpoints of a model whose towers live on different ranks.

Saving uses torch.distributed.checkpoint (DCP) through Lightning's ``ModelParallelStrategy``: a
folder with one shard per rank plus ``meta.pt`` (loops, callbacks, schedulers). What we change:

* a rank saves only the tensors it holds (towers released to the meta device are skipped);
  replicas of a tower save the same keys, which DCP de-duplicates;
* optimizer state is *flattened* to keys per parameter name (``state.<fqn>.exp_avg``,
  ``param_groups.<fqn>.lr``), because ranks hold different parameters: un-flattened, the
  ``param_groups`` entry would have one key with different contents per rank and DCP would keep
  only one of them;
* :func:`consolidated_state_dict` assembles the whole model on rank 0 while training runs, and
  :func:`export_checkpoint` turns a saved folder into a plain ``state_dict`` file offline, with
  no processes at all; both load into the module with no distmm.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

if TYPE_CHECKING:  # pragma: no cover
    from lightning_distmm.strategy import DistMMStrategy

_METADATA = "meta.pt"


def _flat_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def local_state_dict(module: nn.Module) -> dict[str, Any]:
    """The module's state dict without the tensors of towers this rank does not hold."""
    return {k: v for k, v in module.state_dict().items() if not (isinstance(v, torch.Tensor) and v.is_meta)}


def drop_remote_parameters(optimizers: Iterable[Optimizer]) -> None:
    """Remove parameters released to the meta device from the optimizers' groups (no state for them)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if not p.is_meta]


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    return get_optimizer_state_dict(module, optimizer, options=_flat_options())


def load_sharded(
    path: Path, module: nn.Module, optimizers: list[Optimizer], weights_only: Optional[bool] = None
) -> dict[str, Any]:
    """Load this rank's tensors (and optimizer state) from a DCP folder; return the remaining metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not path.is_dir() or not (path / _METADATA).is_file():
        raise FileNotFoundError(
            f"{path} is not a distmm checkpoint folder (expected a directory with {_METADATA} and DCP shards)"
        )
    model_state = local_state_dict(module)
    state: dict[str, Any] = {"state_dict": model_state}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state_dict(module, optimizer)
    dcp.load(state, checkpoint_id=path)
    missing, unexpected = module.load_state_dict(state["state_dict"], strict=False)
    not_meta_missing = [k for k in missing if k in model_state]
    if not_meta_missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the module: missing {not_meta_missing}, unexpected {unexpected}")
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(
            module, getattr(optimizer, "_optimizer", optimizer), state[f"optimizer_{i}"], options=_flat_options()
        )
    return torch.load(path / _METADATA, weights_only=bool(weights_only) if weights_only is not None else False)


def consolidated_state_dict(trainer_or_strategy: Any) -> dict[str, torch.Tensor] | None:
    """The whole model's plain state dict on rank 0 (``None`` elsewhere). Collective: call on every rank.

    Takes the ``Trainer`` or its ``DistMMStrategy``.

    Each tower's tensors come from the first rank of its first replica; rank 0 receives what it
    does not hold itself (it knows the shapes from its meta tensors).
    """
    strategy: "DistMMStrategy" = getattr(trainer_or_strategy, "strategy", trainer_or_strategy)
    module = strategy.lightning_module
    runtime = strategy.runtime
    assert module is not None and runtime is not None
    rank = dist.get_rank()
    full = module.state_dict()
    out: dict[str, torch.Tensor] = {k: v.detach().cpu().clone() for k, v in full.items() if not v.is_meta}
    prefixes = {name: _prefix(module, tower.module) for name, tower in runtime.towers.items()}
    for name in runtime.towers:
        src = runtime.plan.towers[name].ranks[0]
        if src == 0:
            continue
        keys = [k for k in full if k.startswith(prefixes[name])]
        by_dtype: dict[torch.dtype, list[str]] = {}
        for k in keys:
            by_dtype.setdefault(full[k].dtype, []).append(k)
        for dtype, ks in by_dtype.items():
            if rank == src:
                flat = torch.cat([full[k].detach().reshape(-1) for k in ks]).to(strategy.root_device)
                dist.send(flat, dst=0)
            elif rank == 0:
                flat = torch.empty(sum(full[k].numel() for k in ks), dtype=dtype, device=strategy.root_device)
                dist.recv(flat, src=src)
                start = 0
                for k in ks:
                    out[k] = flat[start : start + full[k].numel()].view(full[k].shape).cpu().clone()
                    start += full[k].numel()
    dist.barrier()
    return out if rank == 0 else None


def _prefix(module: nn.Module, sub: nn.Module) -> str:
    for fqn, m in module.named_modules():
        if m is sub:
            return fqn + "."
    raise ValueError("tower module is not a submodule of the LightningModule")


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
