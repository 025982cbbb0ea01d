"""Forward FLOPs per sample of each tower, counted on one real sample.

Used by the default plan (ranks in proportion to FLOPs) when no planner is asked for. Counting
is analytic (``torch.utils.flop_counter``), so every rank gets the same numbers and the same plan
(a tower built on the meta device is counted on meta inputs, or as 2 x its parameters when its
forward reads tensor values).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_distmm.tower import Tower


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
