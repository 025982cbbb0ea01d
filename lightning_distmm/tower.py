"""``Tower``: one encoder of a contrastive model and the batch field(s) it reads; the two small
protocols through which the module and the runtime meet.

The unit every layer above the plan talks about: the user names towers in
:meth:`lightning_distmm.DistMMMixin.towers`, the runtime runs them, the planner prices them.
:class:`TowerModule` is what the runtime needs of the user's module, :class:`TowerRunner` what
the module needs of whatever runs its towers across ranks; both live here, below the runtime
and the mixin, so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn


@dataclass(eq=False)
class Tower:
    """An encoder and the batch field(s) it reads.

    Args:
        module: the encoder, a plain ``nn.Module`` attribute of the LightningModule (timm,
            transformers, anything); parallel code wraps it from outside.
        input: the batch field passed positionally, or several fields passed in order.
        frozen: a frozen tower (LiT) is run without gradients and has no optimizer state.
        consumes: other towers whose output this tower reads, ``{tower: keyword}``: the module is
            called with ``keyword=<that tower's output for the same rows>`` (a language model
            reading a vision tower's image tokens, docs/vlm.md). A model with such a tower has a
            per-token loss on it (``token_loss``) instead of a batch-sync.
        cost: what one row costs this tower, read from the sample before it is loaded: a field name
            (``"n_images"``; an integer counts as itself, a sequence or tensor by its length) or
            ``{field: weight}`` summing several (``{"n_images": 256, "input_ids": 1}``: an LLM's
            image and text tokens). Each step's rows then go to the tower's replicas by their cost
            instead of their count (docs/runtime.md, "Balancing each step"); None: by count. Name
            a cheap field: every rank reads it for every row of the global batch.
    """

    module: nn.Module
    input: str | Sequence[str]
    frozen: bool = False
    consumes: Mapping[str, str] = field(default_factory=dict)
    cost: str | Mapping[str, float] | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.input,) if isinstance(self.input, str) else tuple(self.input)

    def encode(self, batch: Mapping[str, Any]) -> Tensor:
        """The module on ``batch``'s fields (positionally) and, for a consuming tower, the consumed
        outputs (by keyword, found in ``batch`` under their keyword)."""
        missing = [f for f in (*self.fields, *self.consumes.values()) if f not in batch]
        if missing:
            raise KeyError(
                f"the batch has no field(s) {missing} that a tower reads; batch fields are {sorted(map(str, batch))}"
            )
        args = [batch[f] for f in self.fields]
        kwargs = {kw: batch[kw] for kw in self.consumes.values()}
        # a frozen consumer still carries the gradient of consumed outputs that train (a frozen LLM
        # under a trained projector), so only a tower without such inputs runs under no_grad
        carries = any(isinstance(v, Tensor) and v.requires_grad for v in kwargs.values())
        if self.frozen and not carries:
            with torch.no_grad():
                return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)


class TowerModule(Protocol):
    """What the runtime needs of the user's module (:class:`lightning_distmm.DistMMMixin` provides it)."""

    def tower_specs(self) -> dict[str, Tower]:
        """The module's towers by name (checked and cached)."""
        ...

    def interaction_loss(self, features: dict[str, Tensor]) -> Tensor:
        """The loss over the whole batch's features ``{tower: [B, ...]}``."""
        ...

    def token_loss(self, outputs: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        """A consuming tower's per-token loss on some rows: (sum of the token losses, target count)."""
        ...


class TowerRunner(Protocol):
    """What a strategy installs on a :class:`lightning_distmm.DistMMMixin` module to run its towers
    across ranks: the mixin calls these instead of running every tower itself."""

    def step_loss(self, module: TowerModule, batch: Mapping[str, Any]) -> Tensor:
        """This rank's share of the step; returns the whole-batch loss (the same value on every rank)."""
        ...

    def global_batch_size(self, batch: Mapping[str, Any]) -> int:
        """Samples in the global batch this rank's share of ``batch`` belongs to."""
        ...

    def batch_rows(self, batch: Mapping[str, Any]) -> Sequence[int]:
        """The global batch's row of each row of this rank's share ``batch``."""
        ...

    def backward(self, run_backward: Callable[[], None]) -> None:
        """Around the autograd backward of the returned loss: hand the step's gradients back and sum them."""
        ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip every rank's gradients by the norm of the whole model's gradient; return that norm."""
        ...


def tower_order(towers: Mapping[str, Tower]) -> list[str]:
    """The towers in an order where every tower comes after the towers it consumes (checked: the
    consumed towers exist, no tower consumes itself or a chain back to itself, at most one tower
    consumes others: the one whose output the per-token loss reads)."""
    for name, tower in towers.items():
        unknown = [p for p in tower.consumes if p not in towers]
        if unknown:
            raise ValueError(f"tower {name!r} consumes {unknown}, which are not towers (towers: {sorted(towers)})")
    consumers = [n for n, t in towers.items() if t.consumes]
    if len(consumers) > 1:
        raise ValueError(f"towers {consumers} all consume other towers: distmm supports one consuming tower (the LLM)")
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"towers consume each other in a circle through {name!r}")
        visiting.add(name)
        for p in towers[name].consumes:
            visit(p)
        order.append(name)

    for name in towers:
        visit(name)
    return order


def consumer_of(towers: Mapping[str, Tower]) -> str | None:
    """The tower that consumes other towers' outputs (a vision-language model's LLM), or None."""
    tower_order(towers)
    return next((n for n, t in towers.items() if t.consumes), None)
