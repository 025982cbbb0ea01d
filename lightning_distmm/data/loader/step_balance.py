"""Each step's rows assigned to the towers' replicas by what they cost (docs/runtime.md, "Balancing
each step").

A tower says what one of its rows costs (``Tower(cost=...)``): a field of the sample, or several
with weights. Every rank reads those fields of every row of the global batch (only those fields:
they should be cheap, a count or a length), computes the same
:func:`~lightning_distmm.core.assignment.balance_rows` from them, and loads only its own rows; the
assignment rides in the batch to the runtime. No rank asks another.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_distmm.core.assignment import RowAssignment, balance_rows
from lightning_distmm.core.plan import Plan

#: what a tower's row costs: a field name, or field names with weights
CostSpec = str | Mapping[str, float]


def cost_fields(spec: CostSpec) -> tuple[str, ...]:
    return (spec,) if isinstance(spec, str) else tuple(spec)


def check_cost_spec(tower: str, spec: Any) -> None:
    """A tower's ``cost`` must be a field name or ``{field: weight}`` with non-negative weights."""
    if isinstance(spec, str) and spec:
        return
    if isinstance(spec, Mapping) and spec:
        bad = {k: w for k, w in spec.items() if not isinstance(k, str) or not _number(w) or w < 0}
        if not bad:
            return
        raise ValueError(
            f"tower {tower!r}: cost={dict(spec)!r} has entries {bad} that are not a field name with a non-negative"
            f" weight; give cost='n_images' or cost={{'n_images': 256, 'input_ids': 1}}"
        )
    raise ValueError(
        f"tower {tower!r}: cost={spec!r} is not a batch field name or a mapping of field name to weight;"
        f" give cost='n_images' or cost={{'n_images': 256, 'input_ids': 1}}, or leave it out (rows split by count)"
    )


def field_cost(tower: str, field: str, value: Any, where: str) -> float:
    """What a sample's ``field`` counts: an integer as itself, a sequence or tensor by its length
    (a caption's tokens). Anything else stops the run naming the sample and the field."""
    if hasattr(value, "dim") and value.dim() == 0:
        value = value.item()
    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
        kind = type(value).__name__
        raise ValueError(
            f"{where} has {field}={value!r}, which tower {tower!r} counts as the cost of the row: a cost field"
            f" must be a count (a non-negative integer) or a sequence whose length is counted, not a {kind}"
        )
    if _number(value):
        if value < 0 or not math.isfinite(value):
            raise ValueError(
                f"{where} has {field}={value!r}, which tower {tower!r} counts as the cost of the row: a count"
                f" must be a non-negative integer"
            )
        return float(value)
    if hasattr(value, "__len__"):
        return float(len(value))
    raise ValueError(
        f"{where} has {field} of type {type(value).__name__}, which tower {tower!r} counts as the cost of"
        f" the row: a cost field must be a count (an integer) or a sequence whose length is counted"
    )


def row_cost(tower: str, spec: CostSpec, sample: Mapping[str, Any], where: str) -> float:
    if isinstance(spec, str):
        return field_cost(tower, spec, sample[spec], where)
    return sum(w * field_cost(tower, f, sample[f], where) for f, w in spec.items())


class CostBalancer:
    """Computes a global batch's row assignment from its rows' costs (the same on every rank).

    Args:
        plan: the run's plan.
        costs: tower -> what its row costs (towers without one keep the plan's split).
        load: ``(index, fields) -> sample`` reading only ``fields`` of dataset sample ``index``.
        dataset_name: for messages.
    """

    def __init__(
        self,
        plan: Plan,
        costs: Mapping[str, CostSpec],
        load: Callable[[int, Sequence[str]], Mapping[str, Any]],
        dataset_name: str,
    ):
        for tower, spec in costs.items():
            check_cost_spec(tower, spec)
        self.plan = plan
        self.costs = {t: s for t, s in costs.items() if t in plan.towers}
        self.load = load
        self.dataset_name = dataset_name
        self.fields = tuple(dict.fromkeys(f for s in self.costs.values() for f in cost_fields(s)))

    def __call__(self, indices: Sequence[int]) -> RowAssignment:
        per_tower: dict[str, list[float]] = {t: [] for t in self.costs}
        for row, index in enumerate(indices):
            sample = self.load(index, self.fields)
            where = f"sample {index} of {self.dataset_name} (row {row} of the batch)"
            missing = [f for f in self.fields if f not in sample]
            if missing:
                towers = [t for t, s in self.costs.items() if set(cost_fields(s)) & set(missing)]
                raise KeyError(
                    f"{where} has no field(s) {missing}, which tower(s) {towers} count as the cost of a row"
                    f" (Tower(cost=...)); give every sample those fields, or leave cost out"
                )
            for tower, spec in self.costs.items():
                per_tower[tower].append(row_cost(tower, spec, sample, where))
        return balance_rows(self.plan, len(indices), per_tower)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
