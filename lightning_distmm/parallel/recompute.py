"""Activation recomputation per block (a plan's ``recompute``), applied from outside like TP and FSDP.

Each recomputed transformer block keeps only its input through the forward and runs its forward
again in the backward, one block at a time (``torch.utils.checkpoint``, non-reentrant: Megatron-LM's
``--recompute-granularity full``, open_clip's ``--grad-checkpointing``, torchtitan's full activation
checkpointing). ``recompute: true`` recomputes every block this rank runs; ``recompute: N`` the first
``N`` blocks of the rank's stage (Megatron-LM's ``--recompute-method block --recompute-num-layers
N``): the blocks after them keep their activations, so a tower pays for recomputation only in the
blocks memory requires. A tower without repeated blocks recomputes its whole forward (``true``).

The forward is wrapped where it is called, as :mod:`lightning_distmm.parallel.compile` wraps it: the
modules' hooks (FSDP2's gathers) stay outside, so a sharded block's weights are gathered for its
recomputation by FSDP's pre-backward hook, as torchtitan's order (checkpointing before FSDP2) has it.
A block both recomputed and compiled is wrapped here first and compiled around the checkpoint
(torchtitan's order again; a compiled forward called inside the recomputation, where torch disables
dynamo, failed). Random operations (dropout) replay the
forward's draws (``preserve_rng_state``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_distmm.parallel.fsdp import transformer_blocks


class _Recomputed:
    """A module's forward run under ``checkpoint`` (the module's own ``forward`` kept to restore)."""

    def __init__(self, module: nn.Module) -> None:
        self.inner = module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation, a frozen tower: nothing to keep or recompute
            return self.inner(*args, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # a copy of the module runs without recomputation: its forward is the inner one, bound to the copy
        return copy.deepcopy(self.inner, memo)


def recompute_blocks(
    module: nn.Module,
    count: bool | int,
    held: Callable[[nn.Module], bool] = lambda block: True,
    pipelined: bool = False,
) -> list[nn.Module]:
    """Recompute ``count`` of the blocks this rank runs (``held``), the first ones (``True``: all);
    a tower without blocks recomputes its root ``forward`` (not when ``pipelined``). Returns the
    modules whose forward is recomputed; a tower prepared already (a second ``Trainer`` call in
    this process) is left as it is."""
    blocks = [b for b in transformer_blocks(module) if held(b)]
    if count is True:
        chosen = blocks or ([] if pipelined else [module])
    else:
        if count > len(blocks):
            raise ValueError(
                f"recompute: {count} asks for more blocks than this rank's stage of the tower has ({len(blocks)})"
            )
        chosen = blocks[: int(count)]
    for m in chosen:
        if isinstance(m.__dict__.get("forward"), _Recomputed):
            return chosen
    for m in chosen:
        m.forward = _Recomputed(m)
    return chosen


__all__ = ["recompute_blocks"]
