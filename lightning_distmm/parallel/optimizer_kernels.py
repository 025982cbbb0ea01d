"""Multi-tensor optimizer kernels for param groups that mix DTensor and plain parameters.

torch's optimizers step a param group with multi-tensor kernels (``foreach``, torch's default on
CUDA) or fused ones (``fused=True``): one operation over the list of the group's parameters. A
DTensor operation accepts only DTensors on one device mesh, so a list that mixes a sharded or
tensor-parallel tower's DTensors with plain parameters (an unsharded tower, ``logit_scale``), or
DTensors on two meshes (towers sharded over different ranks), stops the step with "got mixed
torch.Tensor and DTensor". torchtitan never meets this because it shards the whole model; DistMM
gives each tower its own parallelism, so on a rank that holds two towers the mix is the rule.

Two remedies, both exact (the same update of every parameter):

* :class:`KindSplitStep`, for torch's own optimizers whose update is computed parameter by
  parameter (SGD, Adam, AdamW, ...): for the length of each ``step`` the mixed group is replaced by
  one copy per kind of parameter, each with the group's hyperparameters, so every multi-tensor
  kernel sees one kind; the user's groups are back before the step returns (learning-rate
  schedulers and checkpoints see them unchanged). On an H200, AdamW over ViT-B/16 (sharded) and a
  CLIP text tower (plain) in one group stepped in 14.9 ms split, 99.7 ms one parameter at a time
  (``benchmarks/optimizer_kernels.py``; docs/runtime.md, "Optimizer kernels for mixed param groups").
* ``foreach=False`` and ``fused=False`` on the group, for any other optimizer: splitting a group
  would change an optimizer whose update reads the whole group (LBFGS, Prodigy's ``d``), while one
  parameter at a time gives the same update, at that cost.

The same step hooks give a ZeRO-1 tower's parameters to the optimizer as this rank's pieces of them
(:mod:`lightning_distmm.parallel.optimizer_shards`): a group is then stepped over its parameters
with those substituted, split by kind if the substituted list mixes kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_distmm.parallel.optimizer_shards import OptimizerShards

#: torch optimizers whose update of a parameter reads only that parameter, its gradient and state,
#: element by element (so a piece of a parameter steps as the whole would)
PER_PARAMETER = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


@dataclass(frozen=True)
class MixedGroup:
    """A param group holding more than one kind of parameter, and what steps it."""

    optimizer: int
    group: int
    kinds: tuple[str, ...]
    remedy: str  # "split" (one copy of the group per kind during the step) or "per-parameter"
    asked: str | None = None  # "foreach=True" / "fused=True" when the user asked and per-parameter overrides it

    def describe(self) -> str:
        where = f"optimizer {self.optimizer} param group {self.group}"
        mix = " and ".join(self.kinds)
        if self.remedy == "split":
            return f"{where} mixes {mix}: each step runs the multi-tensor kernels once per kind"
        asked = f"; {self.asked} overridden" if self.asked else ""
        return f"{where} mixes {mix}, which no multi-tensor kernel takes: it steps one parameter at a time{asked}"


def parameter_kind(p: Tensor) -> str:
    """``plain tensors``, or ``DTensor on mesh <ranks> <shape>``: parameters of one kind can share a
    multi-tensor kernel."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        return f"DTensor on mesh {mesh.mesh.flatten().tolist()} {tuple(mesh.mesh.shape)}"
    return "plain tensors"


def params_by_kind(params: Iterable[Tensor]) -> list[list[Tensor]]:
    """``params`` held here, one list per kind (:func:`parameter_kind`), in the order the kinds first appear."""
    by_kind: dict[str, list[Tensor]] = {}
    for p in params:
        if not p.is_meta:
            by_kind.setdefault(parameter_kind(p), []).append(p)
    return list(by_kind.values())


class KindSplitStep:
    """Runs an optimizer's ``step`` with param groups rewritten: each group's parameters substituted
    (``substitute``: a ZeRO-1 tower's parameters by this rank's pieces; identity otherwise) and each
    group in ``mixed`` replaced by one copy per kind of parameter (the kinds found once, here: a
    group's parameters do not change after setup; the copies are made each step, so they carry the
    hyperparameters a scheduler set). Installed as the optimizer's step pre- and post-hooks, with
    ``before`` and ``after`` run first and last (the ZeRO-1 gradients handed over, the updated
    pieces gathered)."""

    def __init__(
        self,
        optimizer: Optimizer,
        mixed: Sequence[int],
        substitute: Callable[[Sequence[Tensor]], list[Tensor]] | None = None,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.optimizer = optimizer
        swap = substitute or list
        self.params = [swap(g["params"]) if substitute else None for g in optimizer.param_groups]
        self.parts = {i: params_by_kind(swap(optimizer.param_groups[i]["params"])) for i in mixed}
        self.before, self.after = before, after
        self._kept: list[dict[str, Any]] | None = None
        self._split: list[tuple[int, list[dict[str, Any]]]] = []
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def _before(self, *_: Any) -> None:
        if self._kept is not None:
            return
        if self.before is not None:
            self.before()
        self._kept = self.optimizer.param_groups
        groups: list[dict[str, Any]] = []
        self._split = []
        for i, group in enumerate(self._kept):
            if i in self.parts:
                copies = [{**group, "params": params} for params in self.parts[i]]
            elif self.params[i] is not None:
                copies = [{**group, "params": self.params[i]}]
            else:
                groups.append(group)
                continue
            self._split.append((i, copies))
            groups.extend(copies)
        self.optimizer.param_groups = groups

    def _after(self, *_: Any) -> None:
        if self._kept is None:
            return
        for i, parts in self._split:  # a value the step wrote into its group copy goes back
            original = self._kept[i]
            for key, value in parts[0].items():
                if key != "params" and original.get(key) is not value:
                    original[key] = value
        self.optimizer.param_groups, self._kept, self._split = self._kept, None, []
        if self.after is not None:
            self.after()


def _kinds(params: Iterable[Tensor]) -> tuple[str, ...]:
    return tuple(sorted({parameter_kind(p) for p in params if not p.is_meta}))


def prepare_mixed_groups(optimizers: Iterable[Optimizer], shards: OptimizerShards | None = None) -> list[MixedGroup]:
    """For every param group whose parameters held here are not all of one kind: a
    :class:`KindSplitStep` on a :data:`PER_PARAMETER` optimizer, else ``foreach=False`` and
    ``fused=False``. An optimizer that holds a ZeRO-1 tower's parameters (``shards``) steps this
    rank's pieces of them through the same hooks; one that is not :data:`PER_PARAMETER` is refused
    there (its update of a piece would not be its update of the whole). Returns what was done, to be
    logged."""
    done: list[MixedGroup] = []
    holders: list[int] = []
    for i, optimizer in enumerate(optimizers):
        inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps one
        swap = shards.substitute if shards else list
        holds = bool(shards) and any(shards.holds(p) for g in inner.param_groups for p in g["params"])
        mixed = {j: kinds for j, g in enumerate(inner.param_groups) if len(kinds := _kinds(swap(g["params"]))) > 1}
        if holds:
            if type(inner) not in PER_PARAMETER:
                raise ValueError(
                    f"shard: optimizer (ZeRO-1) steps each replica's 1/n of every parameter, which is the update of the"
                    f" whole only for an optimizer that updates each element on its own"
                    f" ({', '.join(o.__name__ for o in PER_PARAMETER)}); optimizer {i} is a {type(inner).__name__}:"
                    f" use shard: none or shard: full for its towers"
                )
            holders.append(i)
            if len(holders) > 1:
                raise ValueError(
                    f"shard: optimizer (ZeRO-1): optimizers {holders[0]} and {i} both hold parameters of ZeRO-1 towers;"
                    " one optimizer must hold them all (its step gathers the updated weights)"
                )
            assert shards is not None
            KindSplitStep(inner, list(mixed), shards.substitute, shards.before_step, shards.after_step)
            done += [MixedGroup(i, j, kinds, "split") for j, kinds in mixed.items()]
            continue
        if not mixed:
            continue
        if type(inner) in PER_PARAMETER:
            KindSplitStep(inner, list(mixed))
            done += [MixedGroup(i, j, kinds, "split") for j, kinds in mixed.items()]
            continue
        for j, kinds in mixed.items():
            group = inner.param_groups[j]
            asked = next((f"{key}=True" for key in ("fused", "foreach") if group.get(key)), None)
            for key in ("foreach", "fused"):
                if key in group:
                    group[key] = False
            done.append(MixedGroup(i, j, kinds, "per-parameter", asked))
    return done
