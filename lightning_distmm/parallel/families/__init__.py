"""What makes each model family parallel, one file per family, behind one set of functions.

A tower is a plain timm / transformers module; the parallel code wraps it from outside, as
torchtitan's one ``parallelize`` per model over generic ``apply_tp`` / ``apply_fsdp`` does. What
differs between families (which linears are column- or row-parallel, how the attention is split
over context-parallel ranks, where a pipeline cuts) lives in the family's file:

* :mod:`.vit`: timm ``VisionTransformer`` (TP, SP, CP, PP);
* :mod:`.clip_text`: transformers CLIP-style text encoders (``encoder.layers`` + ``final_layer_norm``:
  TP, SP, CP; the pipeline cut is :func:`.clip_text.clip_text_stages`, which a wrapper calls);
* :mod:`.llama`: transformers Llama / Qwen2-style causal LMs (TP);
* :mod:`.bert`: transformers BERT-style encoders (``encoder.layer``: TP, PP), LiT's text towers.

The mechanisms every family shares stay generic: :mod:`~lightning_distmm.parallel.tensor_parallel`
(the fused-qkv style, the copy into a tp region), :mod:`~lightning_distmm.parallel.context_parallel`
(the sequence split and its all-to-alls), :mod:`~lightning_distmm.parallel.sp_ops` (the gathered
linears and reduce-scatters) and :mod:`~lightning_distmm.parallel.pipeline` (stages and their
links). The functions here find a tower's family and call it, so that adding a family is one new
file and one :func:`register` call.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_distmm.parallel.context_parallel import SequenceSplit
from lightning_distmm.parallel.families.registry import FAMILIES, Family, Held, holds_all, register
from lightning_distmm.parallel.pipeline import Stage


def family_of(module: nn.Module, technique: str, advice: str) -> Family:
    """The family of ``module`` that supports ``technique`` (a :class:`Family` field name: ``apply_tp``,
    ``apply_sp``, ``apply_cp``, ``stages``); raises naming the families that do, and ``advice``."""
    for family in FAMILIES:
        if family.matches(module) and getattr(family, technique) is not None:
            return family
    able = [f.what for f in FAMILIES if getattr(f, technique) is not None]
    raise ValueError(
        f"no {_TECHNIQUES[technique]} for a {type(module).__name__} tower: supported are {', '.join(able)}; {advice}"
    )


_TECHNIQUES = {
    "apply_tp": "tensor-parallel plan",
    "apply_sp": "sequence-parallel plan",
    "apply_cp": "context-parallel plan",
    "stages": "pipeline cut",
}


# ---------------------------------------------------------------------- tensor parallelism
def check_tp(module: nn.Module, tp: int, tower: str) -> None:
    """Raise if ``module`` cannot be sharded ``tp`` ways; needs only the module's structure (meta is
    fine), so every rank can check every tower and a bad plan fails everywhere at once."""
    try:
        family = family_of(module, "apply_tp", "use tp=1 for this tower")
        if family.check_tp is not None:
            family.check_tp(module, tp)
    except ValueError as err:
        raise ValueError(f"tower {tower!r}, tp={tp}: {err}") from None


def apply_tp(module: nn.Module, mesh: DeviceMesh, held: Held = holds_all, sp: bool = False) -> nn.Module:
    """Shard a tower by its family, only the blocks ``held`` says this rank runs (by default those not
    released to the meta device; a tower built on meta to be materialised later says which by its
    pipeline stage). ``sp``: the row-parallel linears reduce-scatter the tokens (:func:`apply_sp`
    follows).

    Idempotent: a second ``Trainer`` call in the same process (fit, then validate) finds the tower
    already sharded over this mesh.
    """
    if getattr(module, "_distmm_tp_mesh", None) is not None:
        if module._distmm_tp_mesh != mesh:  # type: ignore[comparison-overlap]
            raise ValueError("this tower is already sharded over another tensor-parallel mesh")
        return module
    family = family_of(module, "apply_tp", "use tp=1 for this tower")
    if sp and family.apply_sp is None:
        raise ValueError(
            f"sp: true is built for {', '.join(f.what for f in FAMILIES if f.apply_sp is not None)}; a"
            f" {type(module).__name__} tower runs tp without it"
        )
    assert family.apply_tp is not None
    family.apply_tp(module, mesh, held, sp)
    module._distmm_tp_mesh = mesh  # type: ignore[assignment]
    return module


# ---------------------------------------------------------------------- sequence parallelism
def check_sp(module: nn.Module, tower: str, tp: int) -> None:
    """Raise, naming the tower and the rule, where ``sp: true`` cannot run on ``module`` (meta modules
    are fine: only the structure is read)."""
    where = f"tower {tower!r}, tp={tp}, sp: true"
    try:
        family = family_of(
            module, "apply_sp", "set sp: false for this tower (it runs tp without it) or split its sequence with cp"
        )
        if family.check_sp is not None:
            family.check_sp(module)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def apply_sp(module: nn.Module, mesh: DeviceMesh, held: Held = lambda block: True) -> nn.Module:
    """Split a tensor-parallel tower's residual stream along the sequence over the tp ``mesh`` (in place,
    after :func:`apply_tp` with ``sp=True``), in the blocks ``held`` says this rank runs; idempotent."""
    if getattr(module, "_distmm_sp", None) is not None:
        return module
    family = family_of(module, "apply_sp", "set sp: false for this tower")
    assert family.apply_sp is not None
    family.apply_sp(module, mesh, held)
    return module


# ---------------------------------------------------------------------- context parallelism
def check_cp(module: nn.Module, cp: int, tp: int, tower: str, pp: int = 1) -> None:
    """Raise, naming the tower and the rule, if ``module`` cannot be split ``cp`` ways: every attention's
    heads must divide by ``cp * tp`` (Ulysses gives each cp rank whole heads of its tp shard). Needs only
    the structure (meta is fine), so every rank checks every tower. (A pipelined text tower's sequence
    length is checked when it is split: it must divide by ``cp``, ``pp`` being > 1.)"""
    where = f"tower {tower!r}, cp={cp}"
    try:
        family = family_of(module, "apply_cp", "use cp=1 for this tower")
        assert family.cp_heads is not None
        heads = family.cp_heads(module)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    for name, h in heads:
        if h % (cp * tp):
            raise ValueError(
                f"{where}: {name} has {h} attention heads, which do not divide by cp*tp = {cp}*{tp} = {cp * tp}"
                " (Ulysses all-to-all gives each cp rank whole heads): choose cp*tp dividing the head count"
            )
    if family.check_cp is not None:
        try:
            family.check_cp(module)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def apply_cp(module: nn.Module, group: object, cp: int, rank: int, pp: int = 1, tower: str = "") -> nn.Module:
    """Split a tower's sequence over the ``cp`` ranks of ``group`` (this rank is ``rank`` in it), in
    place; idempotent (a second Trainer call finds it split). A text tower cut into ``pp > 1`` stages
    pads as a whole one: its later stages are told the length by the stage
    (:func:`~lightning_distmm.parallel.context_parallel.tell_length`)."""
    if getattr(module, "_distmm_cp", None) is not None:
        return module
    family = family_of(module, "apply_cp", "use cp=1 for this tower")
    split = SequenceSplit(group, cp, rank, tower=tower)  # type: ignore[arg-type]
    assert family.apply_cp is not None
    family.apply_cp(module, split)
    module._distmm_cp = split  # type: ignore[assignment]
    return module


# ---------------------------------------------------------------------- pipeline stages
def tower_stages(module: nn.Module, pp: int, fields: tuple[str, ...]) -> list[Stage]:
    """The ``pp`` stages of a tower: its own ``pipeline_stages(pp)`` or its family's cut."""
    custom = getattr(module, "pipeline_stages", None)
    if callable(custom):
        return custom(pp)
    family = family_of(
        module,
        "stages",
        "or give the tower a pipeline_stages(pp) method returning lightning_distmm.parallel.pipeline.Stage"
        " objects; use pp=1",
    )
    assert family.stages is not None
    return family.stages(module, pp, fields)


# the families this package ships (a tower is matched against them in ``MATCH_ORDER``, then any
# other registered family: a tower holding a ViT is a ViT tower even if it holds text layers too)
from lightning_distmm.parallel.families import bert, clip_text, llama, vit  # noqa: E402, F401

MATCH_ORDER = ("vit", "clip_text", "llama", "bert")
FAMILIES.sort(key=lambda f: MATCH_ORDER.index(f.name) if f.name in MATCH_ORDER else len(MATCH_ORDER))

__all__ = [
    "FAMILIES",
    "Family",
    "apply_cp",
    "apply_sp",
    "apply_tp",
    "check_cp",
    "check_sp",
    "check_tp",
    "family_of",
    "holds_all",
    "register",
    "tower_stages",
]
