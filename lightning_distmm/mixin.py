"""The user's side of the contract: name the towers, write the whole-batch loss.

A module that mixes in :class:`DistMMMixin` says which submodule encodes which batch field
(:meth:`DistMMMixin.towers`) and how the towers' features meet (:meth:`DistMMMixin.interaction_loss`,
always written for the *whole* batch). Under an ordinary strategy the mixin runs every tower on
the whole batch in this process: that is the reference. Under ``strategy="distmm"`` the strategy
installs a :class:`~lightning_distmm.tower.TowerRunner` and the same :meth:`contrastive_loss` call
runs this rank's towers on this rank's samples, exchanges features, and computes this rank's
share of the loss; the value it returns is the whole-batch loss on every rank, so logging it
needs no reduction. The module's ``backward`` and ``configure_gradient_clipping`` hooks go
through the runner too: the step's gradients are handed back around the autograd backward, and
clipping by norm uses the norm of the whole model across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_distmm.tower import Tower, TowerRunner, consumer_of, tower_order


def grouped_loss(loss: Callable[[dict[str, Tensor]], Tensor], features: dict[str, Tensor], groups: int) -> Tensor:
    """``loss`` over ``groups`` contiguous groups of rows, weighted by each group's share of the rows."""
    from lightning_distmm.core.plan import split_batch

    n = next(iter(features.values())).shape[0]
    total: Tensor | None = None
    start = 0
    for rows in split_batch(n, None, groups):
        part = loss({k: f[start : start + rows] for k, f in features.items()}) * (rows / n)
        total = part if total is None else total + part
        start += rows
    assert total is not None
    return total


class DistMMMixin:
    """Mix into a ``LightningModule`` before it: ``class CLIP(DistMMMixin, L.LightningModule)``.

    ``sync_groups``: how many groups the batch's loss is split into (default 1: one loss over the
    whole batch). With ``g`` groups the batch is cut into ``g`` contiguous groups of rows (the first
    ones a row larger when ``g`` does not divide it); each group's features meet only each other
    (their own negatives) and the loss is the groups' losses weighted by their share of the rows.
    The ``distmm`` schedule computes exactly this loss with 2 groups (one per sync group), so a module
    trained with it sets ``sync_groups = 2``; the single-process reference then computes the same.
    """

    #: installed by the distmm strategy for the run (None: every tower runs here, on the whole batch)
    _distmm_runner: TowerRunner | None = None
    sync_groups: int = 1

    # ------------------------------------------------------------------ user hooks
    def towers(self) -> dict[str, Tower]:
        """Which submodule encodes which batch field, keyed by tower name."""
        raise NotImplementedError(f"{type(self).__name__} must define towers() -> dict[str, Tower]")

    def interaction_loss(self, features: dict[str, Tensor]) -> Tensor:
        """The loss over the whole batch's features ``{tower: [B, ...]}``; use :mod:`lightning_distmm.losses`.

        Under distmm each rank computes only its rows of a row-local loss (it asks
        :func:`lightning_distmm.interaction.local_rows`); a term that is not a sum over rows (a
        regulariser of the logit scale) belongs in ``training_step``, added to the returned loss,
        where its gradient is averaged over ranks as under DDP.
        """
        raise NotImplementedError(f"{type(self).__name__} must define interaction_loss(features) -> Tensor")

    def token_loss(self, outputs: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        """For a model whose tower consumes others (a vision encoder feeding a language model): the
        consuming tower's ``outputs`` for some rows and those rows of the batch give ``(sum of the
        per-token losses, number of target tokens)``. The step's loss is the whole batch's sum over
        its count (a token mean); under distmm each replica divides its sum by the global count."""
        raise NotImplementedError(
            f"{type(self).__name__} has a tower that consumes other towers and must define"
            f" token_loss(outputs, batch) -> (loss sum, target count)"
        )

    def embedding(self, tower: str, features: Tensor) -> Tensor:
        """The per-sample embedding that retrieval and zero-shot evaluation compare, from ``tower``'s
        features: the features themselves, unless a tower's row carries more than its embedding
        (CoCa's towers also hand the interaction their token sequences)."""
        return features

    # ------------------------------------------------------------------ machinery
    def tower_specs(self) -> dict[str, Tower]:
        """``towers()``, checked and cached; frozen towers have ``requires_grad`` turned off here."""
        specs = self.__dict__.get("_distmm_tower_specs")
        if specs is None:
            specs = dict(self.towers())
            if not specs:
                raise ValueError(f"{type(self).__name__}.towers() returned no towers")
            for name, tower in specs.items():
                if not isinstance(tower, Tower):
                    raise TypeError(f"towers()[{name!r}] must be a lightning_distmm.Tower, got {type(tower).__name__}")
                if tower.frozen:
                    tower.module.requires_grad_(False)
            tower_order(specs)
            self.__dict__["_distmm_tower_specs"] = specs
        return specs

    def encode(self, batch: Mapping[str, Any]) -> dict[str, Tensor]:
        """Every tower on the whole batch, in this process (the single-process path)."""
        return {name: tower.encode(batch) for name, tower in self.tower_specs().items()}

    def contrastive_loss(self, batch: Mapping[str, Any]) -> Tensor:
        """The whole-batch interaction loss for ``batch``, however the towers are placed.

        Under distmm the returned tensor's value is the whole-batch loss and its gradient is this
        rank's contribution; the module's :meth:`backward` hook hands the step's gradients back.
        """
        runner = self._distmm_runner
        if runner is not None:
            return runner.step_loss(self, batch)
        consumer = consumer_of(self.tower_specs())
        if consumer is not None:
            return self._token_mean(consumer, batch)
        features = self.encode(batch)
        if self.sync_groups == 1:
            return self.interaction_loss(features)
        return grouped_loss(self.interaction_loss, features, self.sync_groups)

    def _token_mean(self, consumer: str, batch: Mapping[str, Any]) -> Tensor:
        """The single-process reference of a VLM: every tower on the whole batch in
        consumption order, the consumer's per-token loss summed over the batch over its target count."""
        specs = self.tower_specs()
        outputs: dict[str, Tensor] = {}
        for name in tower_order(specs):
            tower = specs[name]
            inputs = dict(batch)
            inputs.update({kw: outputs[p] for p, kw in tower.consumes.items()})
            outputs[name] = tower.encode(inputs)
        total, count = self.token_loss(outputs[consumer], batch)
        return total / torch.as_tensor(count, device=total.device).clamp(min=1).to(total.dtype)

    def global_batch_size(self, batch: Mapping[str, Any]) -> int:
        """Samples in the global batch (a rank under distmm only holds its share of them)."""
        runner = self._distmm_runner
        if runner is not None:
            return runner.global_batch_size(batch)
        first = self.tower_specs()[next(iter(self.tower_specs()))].fields[0]
        return len(batch[first])

    def batch_rows(self, batch: Mapping[str, Any]) -> Sequence[int]:
        """The row of the global batch (the DataLoader's batch) of each row of ``batch``: under distmm a
        rank holds some rows of it, in one process every row. For messages that name a sample."""
        runner = self._distmm_runner
        if runner is not None:
            return runner.batch_rows(batch)
        return range(self.global_batch_size(batch))

    # ------------------------------------------------------------------ Lightning hooks
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward hook: under distmm the runner wraps the autograd backward of ``loss``
        (it hands back the gradients the step's schedule produced, scaled by the gradient that
        reaches ``loss``, and sums them). A module overriding this hook calls ``super().backward``."""
        parent = super().backward  # type: ignore[misc]
        runner = self._distmm_runner
        if runner is None:
            parent(loss, *args, **kwargs)
        else:
            runner.backward(lambda: parent(loss, *args, **kwargs))

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Lightning's clipping hook: under distmm, clipping by norm uses the norm of the whole model's
        gradient across towers and ranks (each rank's own norm would differ). Clipping by value is
        per element and stays Lightning's. A module overriding this hook calls
        ``super().configure_gradient_clipping`` for the global norm (``self.clip_gradients`` clips by
        the norm of this rank's gradients only)."""
        runner = self._distmm_runner
        algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)  # Lightning passes an enum
        by_norm = algorithm is None or str(algorithm).lower() == "norm"
        if runner is not None and gradient_clip_val and by_norm:
            runner.clip_grad_norm_(float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[misc]

    # ------------------------------------------------------------------ default Lightning steps
    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        loss = self.contrastive_loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=self.global_batch_size(batch))  # type: ignore[attr-defined]
        return loss

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        loss = self.contrastive_loss(batch)
        # the value is already the whole-batch loss on every rank; sync_dist only averages equal
        # numbers (and keeps Lightning from warning about epoch-level logging)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=self.global_batch_size(batch))  # type: ignore[attr-defined]
        return loss
