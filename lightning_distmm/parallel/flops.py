"""What each tower costs, counted on one real sample: forward FLOPs, operators, parameters.

Used by the default plan (``plan=None``, :mod:`lightning_distmm.planner.default`), which prices a
few plans from these counts without timing anything. Counting is analytic
(``torch.utils.flop_counter``, and the operators one forward dispatches), so every rank gets the
same numbers (a tower built on the meta device is counted on meta inputs, or as 2 x its parameters
when its forward reads tensor values).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_distmm.tower import Tower, tower_order


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
    prices (``planner.default.CountedTower``'s fields). A tower that consumes another's output
    (``Tower(consumes=...)``) is counted on that tower's output for the same sample."""
    counted = _count(towers, example)
    out: dict[str, dict[str, Any]] = {}
    for name, tower in towers.items():
        params = list(tower.module.parameters())
        flops, ops, width, tokens = counted[name]
        if width is None:  # the width of the last parameter's leading dimension: a projection's output
            width = int(params[-1].shape[0]) if params and params[-1].dim() else 512
        out[name] = {
            "flops": flops,
            "params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "embed_dim": int(width),
            "ops": int(ops),
            "frozen": bool(tower.frozen),
            "tokens": int(tokens),
        }
    return out


def tower_flops(towers: Mapping[str, Tower], example: Mapping[str, Any] | None) -> dict[str, float]:
    """Forward FLOPs of each tower on ``example`` (one collated sample); 2 x parameters without one."""
    return {name: c[0] for name, c in _count(towers, example).items()}


def output_vectors(output: Any) -> tuple[int, int | None]:
    """``(vectors per row, width)`` of a tower's output (its first tensor, ``[rows, ..., width]``):
    what a consumer of it receives per row (an image's tokens); ``(1, None)`` without a tensor."""
    while isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor) or not output.dim():
        return 1, None
    width = int(output.shape[-1])
    rows = int(output.shape[0]) if output.dim() > 1 else 1
    return max(output.numel() // max(rows * width, 1), 1), width


def consumer_inputs(name: str, tower: Tower, produced: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments a consuming tower is called with: ``{keyword: producer's output}``."""
    return {keyword: produced[producer] for producer, keyword in tower.consumes.items()}


def check_consumer_call(name: str, tower: Tower) -> None:
    """A tower that consumes another's output must take it as the keyword it names, after its
    fields: otherwise the error names the tower, the keyword and the forward's signature."""
    if not tower.consumes:
        return
    try:
        sig = inspect.signature(tower.module.forward)
    except (TypeError, ValueError):  # a builtin or C forward: nothing to check before calling
        return
    args = [object()] * len(tower.fields)
    kwargs = {keyword: object() for keyword in tower.consumes.values()}
    try:
        sig.bind(*args, **kwargs)
    except TypeError as err:
        given = ", ".join([*tower.fields, *(f"{k}=<{p}'s output>" for p, k in tower.consumes.items())])
        raise TypeError(
            f"tower {name!r} consumes {dict(tower.consumes)} but {type(tower.module).__name__}.forward{sig} cannot"
            f" be called as forward({given}): {err}. Its input fields come first, in order, and each consumed"
            f" output as the keyword that Tower(consumes={{producer: keyword}}) names"
        ) from None


def _count(
    towers: Mapping[str, Tower], example: Mapping[str, Any] | None
) -> dict[str, tuple[float, int, int | None, int]]:
    """``(FLOPs, operators, output width, vectors of that width per sample)`` of one forward of each tower on ``example``, producers
    before their consumers (each consumer fed its producers' outputs); ``(2 x parameters, 0, None)``
    for a tower without its fields (or whose producer could not run)."""
    out: dict[str, tuple[float, int, int | None, int]] = {}
    produced: dict[str, Any] = {}
    for name in tower_order(towers):
        tower = towers[name]
        check_consumer_call(name, tower)
        params = sum(p.numel() for p in tower.module.parameters())
        missing = (
            example is None
            or any(f not in example for f in tower.fields)
            or any(p not in produced for p in tower.consumes)
        )
        if missing:
            out[name] = (2.0 * params, 0, None, 1)
            continue
        assert example is not None
        meta = any(p.is_meta for p in tower.module.parameters())
        inputs = [example[f] for f in tower.fields]
        kwargs = consumer_inputs(name, tower, produced)
        if meta:  # built on meta: counted on meta inputs
            inputs = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs]
            kwargs = {k: x.to("meta") if isinstance(x, torch.Tensor) else x for k, x in kwargs.items()}
        was_training = tower.module.training
        tower.module.eval()
        try:
            with torch.no_grad(), FlopCounterMode(display=False) as flops, _OperatorCount() as ops:
                result = tower.module(*inputs, **kwargs)
        except RuntimeError:
            if not meta:
                raise
            out[name] = (2.0 * params, 0, None, 1)  # its forward reads values (a mask), which meta tensors lack
            continue
        finally:
            tower.module.train(was_training)
        produced[name] = result
        tokens, width = output_vectors(result)
        out[name] = (float(flops.get_total_flops()) or 2.0 * params, ops.count, width, tokens)
    return out
