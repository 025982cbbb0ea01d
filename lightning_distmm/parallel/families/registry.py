"""The registry of model families: what a family says about itself (:class:`Family`) and the list a
tower is matched against. Family files import this, never the package's ``__init__``, so the
package can import them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_distmm.parallel.context_parallel import SequenceSplit
from lightning_distmm.parallel.pipeline import Stage

#: whether this rank runs a block / layer (the others belong to another pipeline stage)
Held = Callable[[nn.Module], bool]


def holds_all(block: nn.Module) -> bool:
    """A block is held unless its parameters were released to the meta device."""
    return not any(p.is_meta for p in block.parameters())


@dataclass(frozen=True)
class Family:
    """One model family and how each technique applies to it (None: not supported).

    Args:
        name: short name (``vit``, ``clip_text``, ...).
        what: what the family is, for messages ("timm VisionTransformer").
        matches: whether a tower is (or holds) a model of this family.
        check_tp: ``(tower, tp)``: raise ``ValueError`` if the tower cannot be split ``tp`` ways.
        apply_tp: ``(tower, mesh, held, sp)``: shard the held blocks over the tp ``mesh`` in place.
        check_sp: ``(tower)``: raise ``ValueError`` where ``sp: true`` cannot run.
        apply_sp: ``(tower, mesh, held)``: split the residual stream over the tp ``mesh`` (after ``apply_tp``).
        cp_heads: ``(tower)``: ``(where, heads)`` of every attention, for the cp divisibility rule.
        check_cp: ``(tower)``: raise ``ValueError`` for what else stops context parallelism.
        apply_cp: ``(tower, split)``: split the tower's sequence with ``split`` in place.
        stages: ``(tower, pp, fields)``: the tower's ``pp`` pipeline stages.
    """

    name: str
    what: str
    matches: Callable[[nn.Module], bool]
    check_tp: Callable[[nn.Module, int], None] | None = None
    apply_tp: Callable[[nn.Module, DeviceMesh, Held, bool], None] | None = None
    check_sp: Callable[[nn.Module], None] | None = None
    apply_sp: Callable[[nn.Module, DeviceMesh, Held], None] | None = None
    cp_heads: Callable[[nn.Module], list[tuple[str, int]]] | None = None
    check_cp: Callable[[nn.Module], None] | None = None
    apply_cp: Callable[[nn.Module, SequenceSplit], None] | None = None
    stages: Callable[[nn.Module, int, tuple[str, ...]], list[Stage]] | None = None


#: the registered families, in the order a tower is matched against them
FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    """Add ``family`` (a family file calls this once, at import)."""
    if any(f.name == family.name for f in FAMILIES):
        raise ValueError(f"a model family named {family.name!r} is registered already")
    FAMILIES.append(family)
    return family


__all__ = ["FAMILIES", "Family", "Held", "holds_all", "register"]
