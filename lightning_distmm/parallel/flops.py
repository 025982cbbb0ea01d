"""What each tower costs, counted on one real sample: forward FLOPs, operators, parameters.

Used by the default plan (``plan=None``, :mod:`lightning_distmm.planner.default`), which prices a
few plans from these counts without timing anything. Counting is analytic
(``torch.utils.flop_counter``, and the operators one forward dispatches), so every rank gets the
same numbers (a tower built on the meta device is counted on meta inputs, or as 2 x its parameters
when its forward reads tensor values).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_distmm.tower import Tower


class _OperatorCount(TorchDispatchMode):
    """Counts the operators a forward dispatches (each a kernel call with its fixed cost on a CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def tower_counts(towers: Mapping[str, Tower], example: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per tower: forward FLOPs per sample (:func:`tower_flops`), operators one forward calls, parameters
    (all and trainable), the feature width it outputs and whether it is frozen: what the default plan
    prices (``planner.default.CountedTower``'s fields)."""
    flops = tower_flops(towers, example)
    out: dict[str, dict[str, Any]] = {}
    for name, tower in towers.items():
        params = list(tower.module.parameters())
        ops, width = 0, None
        if example is not None and all(f in example for f in tower.fields):
            ops, width = _forward_ops(tower, example)
        if width is None:  # the width of the last parameter's leading dimension: a projection's output
            width = int(params[-1].shape[0]) if params and params[-1].dim() else 512
        out[name] = {
            "flops": flops[name],
            "params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "embed_dim": int(width),
            "ops": int(ops),
            "frozen": bool(tower.frozen),
        }
    return out


def _forward_ops(tower: Tower, example: Mapping[str, Any]) -> tuple[int, int | None]:
    """Operators one forward of ``tower`` on ``example`` dispatches, and its output's feature width."""
    was_training = tower.module.training
    tower.module.eval()
    inputs = [example[f] for f in tower.fields]
    if any(p.is_meta for p in tower.module.parameters()):
        inputs = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs]
    try:
        with torch.no_grad(), _OperatorCount() as counter:
            out = tower.module(*inputs)
    except RuntimeError:
        return 0, None
    finally:
        tower.module.train(was_training)
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    width = int(out.shape[-1]) if isinstance(out, torch.Tensor) and out.dim() else None
    return counter.count, width


def tower_flops(towers: Mapping[str, Tower], example: Mapping[str, Any] | None) -> dict[str, float]:
    """Forward FLOPs of each tower on ``example`` (one collated sample); 2 x parameters without one."""
    out: dict[str, float] = {}
    for name, tower in towers.items():
        params = sum(p.numel() for p in tower.module.parameters())
        if example is None or any(f not in example for f in tower.fields):
            out[name] = 2.0 * params
            continue
        was_training = tower.module.training
        tower.module.eval()
        inputs = [example[f] for f in tower.fields]
        meta = any(p.is_meta for p in tower.module.parameters())
        if meta:  # built on meta: counted on meta inputs
            inputs = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs]
        try:
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                tower.module(*inputs)
            out[name] = float(counter.get_total_flops()) or 2.0 * params
        except RuntimeError:
            if not meta:
                raise
            out[name] = 2.0 * params  # its forward reads values (a mask), which meta tensors do not have
        finally:
            tower.module.train(was_training)
    return out
