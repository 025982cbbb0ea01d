"""Which optimizer kernels a param group may use when a rank holds DTensor and plain parameters.

torch's optimizers step a param group with multi-tensor kernels (``foreach``, torch's default on
CUDA) or fused ones (``fused=True``): one operation over the list of the group's parameters. A
DTensor operation accepts only DTensors on one device mesh, so a list that mixes a sharded or
tensor-parallel tower's DTensors with plain parameters (an unsharded tower, ``logit_scale``), or
DTensors on two meshes (towers sharded over different ranks), stops the step with "got mixed
torch.Tensor and DTensor". torchtitan never meets this because it shards the whole model; DistMM
gives each tower its own parallelism, so on a rank that holds two towers the mix is the rule.

Such a group steps one parameter at a time (``foreach=False``, ``fused=False``): the same update,
with one kernel launch per parameter and operation instead of one per list. Groups of one kind
keep torch's choice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


@dataclass(frozen=True)
class PerParameterGroup:
    """A param group switched to per-parameter kernels: which one, its kinds, what the user had asked."""

    optimizer: int
    group: int
    kinds: tuple[str, ...]
    asked: str | None  # "foreach=True" or "fused=True" when the user had asked for it, else None

    def describe(self) -> str:
        where = f"optimizer {self.optimizer} param group {self.group}"
        mix = " and ".join(self.kinds)
        asked = f"; {self.asked} overridden" if self.asked else ""
        return f"{where} mixes {mix}, which no multi-tensor kernel takes: it steps one parameter at a time{asked}"


def parameter_kind(p: Tensor) -> str:
    """``plain``, or ``DTensor on mesh <ranks>``: parameters of one kind can share a multi-tensor kernel."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        return f"DTensor on mesh {mesh.mesh.flatten().tolist()} {tuple(mesh.mesh.shape)}"
    return "plain tensors"


def step_mixed_groups_per_parameter(optimizers: Iterable[Optimizer]) -> list[PerParameterGroup]:
    """Set ``foreach=False`` and ``fused=False`` on every param group whose parameters held here are
    not all of one kind (:func:`parameter_kind`); return what was switched, to be logged."""
    switched: list[PerParameterGroup] = []
    for i, optimizer in enumerate(optimizers):
        inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps one
        for j, group in enumerate(inner.param_groups):
            kinds = sorted({parameter_kind(p) for p in group["params"] if not p.is_meta})
            if len(kinds) < 2:
                continue
            asked = next((f"{key}=True" for key in ("fused", "foreach") if group.get(key)), None)
            if "foreach" in group:
                group["foreach"] = False
            if "fused" in group:
                group["fused"] = False
            switched.append(PerParameterGroup(i, j, tuple(kinds), asked))
    return switched
