"""Evaluation while training: zero-shot classification and retrieval, as Lightning callbacks.

Both run at the end of every ``every_n_epochs``-th validation epoch (not during the sanity check)
and log their metrics with ``pl_module.log`` (every rank logs the same numbers), so they reach the
progress bar, loggers, ``ModelCheckpoint(monitor=...)`` and ``trainer.callback_metrics``.

Under distmm a rank holds only its towers (the others are released to the meta device), so each
tower's inputs are encoded on the first rank that holds the whole tower, which loads only that
tower's fields (``dataset.load(index, fields)`` when the dataset has it), and the features are
broadcast to every rank: the same per-tower split as training, with the exchange made explicit.
A tower cut into pipeline stages or sharded by tensor parallelism is held whole by no rank: the
callbacks then say so (evaluate a consolidated model instead). In one process they just run.

What to evaluate on comes from the arguments or, when left out, from the datamodule: its
``retrieval_dataset`` (else ``val_dataset``) for :class:`Retrieval`; ``zero_shot_dataset`` (else
``val_dataset``), ``classnames`` and ``tokenize`` for :class:`ZeroShotClassification`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import default_collate

from lightning_distmm.models.metrics import retrieval_from_features, row_keys

Batches = Callable[[], Iterator[Mapping[str, Any]]]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _holds(module: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    params = list(module.parameters()) + list(module.buffers())
    return all(not p.is_meta and not isinstance(p, DTensor) for p in params)


def dataset_batches(dataset: Any, fields: Sequence[str], batch_size: int, limit: int | None = None) -> Batches:
    """Batches of ``fields`` over ``dataset`` in order, loading only those fields when it can."""
    n = len(dataset) if limit is None else min(limit, len(dataset))
    load = getattr(dataset, "load", None)

    def sample(i: int) -> dict[str, Any]:
        if callable(load):
            return load(i, fields)
        item = dataset[i]
        return {f: item[f] for f in fields}

    def batches() -> Iterator[Mapping[str, Any]]:
        for start in range(0, n, batch_size):
            yield default_collate([sample(i) for i in range(start, min(n, start + batch_size))])

    return batches


class TowerEvaluation(L.Callback):
    """Encodes a tower's inputs wherever the tower lives and gives every rank the features."""

    def __init__(self, every_n_epochs: int = 1, batch_size: int = 256, prefix: str = "val"):
        self.every_n_epochs = int(every_n_epochs)
        self.batch_size = int(batch_size)
        self.prefix = prefix
        self.metrics: dict[str, float] = {}

    #: the towers whose features the evaluation compares (set by the subclasses)
    towers: tuple[str, ...] = ()

    def _due(self, trainer: L.Trainer) -> bool:
        return not trainer.sanity_checking and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        """Refuse a plan this callback cannot evaluate before the first step, not at the first validation."""
        for tower in self.towers:
            self._source(type(self).__name__, tower, pl_module.tower_specs()[tower].module)

    def on_validation_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.state.fn != "fit":  # a standalone validate: fit's check did not run
            self.on_fit_start(trainer, pl_module)

    @staticmethod
    def _source(who: str, tower: str, module: torch.nn.Module) -> int:
        """The first rank holding ``tower`` whole (collective under distmm: every rank calls it)."""
        if not _distributed():
            return 0
        holders: list[bool] = [False] * dist.get_world_size()
        dist.all_gather_object(holders, _holds(module))
        if not any(holders):
            raise NotImplementedError(
                f"{who}: no rank holds the whole {tower!r} tower (pipeline stages, tensor-parallel or FSDP shards), so"
                " its features cannot be computed in one place: drop the callback for this plan (recipes: callbacks=none)"
                " and evaluate a consolidated model (lightning_distmm.consolidated_state_dict) after training"
            )
        return holders.index(True)

    @torch.no_grad()
    def encode(self, pl_module: Any, tower: str, batches: Batches) -> Tensor:
        """``[N, D]`` embeddings of ``tower`` over ``batches`` (``pl_module.embedding`` of its features when the
        module has it); collective under distmm: every rank calls it."""
        spec = pl_module.tower_specs()[tower]
        source = self._source(type(self).__name__, tower, spec.module)
        features = None
        if not _distributed() or dist.get_rank() == source:
            device = pl_module.device
            was_training = spec.module.training
            spec.module.eval()
            try:
                embed = getattr(pl_module, "embedding", None) or (lambda _, f: f)
                chunks = [
                    embed(
                        tower, spec.encode({k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()})
                    )
                    .float()
                    .cpu()
                    for batch in batches()
                ]
            finally:
                spec.module.train(was_training)
            features = torch.cat(chunks)
        if _distributed():
            box = [features]
            dist.broadcast_object_list(box, src=source)
            features = box[0]
        assert features is not None
        return features

    def log_metrics(self, pl_module: Any, metrics: Mapping[str, float]) -> None:
        self.metrics = dict(metrics)
        for key, value in metrics.items():
            # the same value on every rank: sync_dist averages equal numbers (and keeps Lightning quiet)
            pl_module.log(f"{self.prefix}/{key}", float(value), prog_bar=False, logger=True, sync_dist=True)


class Retrieval(TowerEvaluation):
    """Recall@k both ways (image->text, text->image) on held-out pairs: row ``i`` matches row ``i``
    and every row whose caption (``match_field`` of the second tower's inputs) is the same.

    Args:
        dataset: the held-out pairs (default: the datamodule's ``retrieval_dataset`` or ``val_dataset``).
        ks: the recalls.
        towers: the two towers whose features are matched (``(query side, other side)``).
        limit: evaluate the first ``limit`` pairs only.
        match_field: the field whose equal values make rows interchangeable (the caption's token
            ids; None: row ``i`` matches row ``i`` only, and a duplicate caption counts as a miss).
        every_n_epochs, batch_size, prefix: when, in what chunks, and under which log prefix.
    """

    def __init__(
        self,
        dataset: Any = None,
        ks: Sequence[int] = (1, 5, 10),
        towers: Sequence[str] = ("image", "text"),
        limit: int | None = None,
        every_n_epochs: int = 1,
        batch_size: int = 256,
        prefix: str = "val/retrieval",
        match_field: str | None = "input_ids",
    ):
        super().__init__(every_n_epochs, batch_size, prefix)
        self.dataset, self.ks, self.towers, self.limit = dataset, tuple(int(k) for k in ks), tuple(towers), limit
        self.match_field = match_field

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self._due(trainer):
            self.log_metrics(pl_module, self.evaluate(pl_module, trainer.datamodule if trainer else None))

    def evaluate(self, pl_module: Any, datamodule: Any = None) -> dict[str, float]:
        dataset = self.dataset
        if dataset is None:
            dataset = getattr(datamodule, "retrieval_dataset", None) or getattr(datamodule, "val_dataset", None)
        if dataset is None:
            raise ValueError("Retrieval needs a dataset (or a datamodule with retrieval_dataset / val_dataset)")
        specs = pl_module.tower_specs()
        a, b = self.towers
        fa = self.encode(pl_module, a, dataset_batches(dataset, specs[a].fields, self.batch_size, self.limit))
        fb = self.encode(pl_module, b, dataset_batches(dataset, specs[b].fields, self.batch_size, self.limit))
        keys = None
        if self.match_field is not None and self.match_field in specs[b].fields:
            keys = [
                k
                for batch in dataset_batches(dataset, [self.match_field], self.batch_size, self.limit)()
                for k in row_keys(batch[self.match_field])
            ]
        ab, ba = retrieval_from_features(fa, fb, self.ks, keys), retrieval_from_features(fb, fa, self.ks, keys)
        out = {"n": float(fa.shape[0]), "unique": float(len(set(keys)) if keys is not None else fa.shape[0])}
        for k in self.ks:
            out[f"{a}_to_{b}_R@{k}"] = ab[k]
            out[f"{b}_to_{a}_R@{k}"] = ba[k]
        return out


class ZeroShotClassification(TowerEvaluation):
    """CLIP's zero-shot classifier: each class's text feature is the mean of its prompts' (normalised)
    features; an image's class is the most similar one. Logs top-k accuracy and the chance level.

    Args:
        dataset: labelled images (default: the datamodule's ``zero_shot_dataset`` or ``val_dataset``).
        classnames: one name per label (default: the datamodule's ``classnames``).
        templates: prompts with one ``{}`` for the class name.
        tokenize: a list of prompts -> the text tower's input fields (default: the datamodule's ``tokenize``).
        label_field: the dataset field holding the integer label.
        ks: the top-k accuracies.
        towers: ``(image tower, text tower)``.
        every_n_epochs, batch_size, prefix, limit: as for :class:`Retrieval`.
    """

    def __init__(
        self,
        dataset: Any = None,
        classnames: Sequence[str] | None = None,
        templates: Sequence[str] = ("a photo of a {}.",),
        tokenize: Callable[[list[str]], Mapping[str, Tensor]] | None = None,
        label_field: str = "label",
        ks: Sequence[int] = (1, 5),
        towers: Sequence[str] = ("image", "text"),
        limit: int | None = None,
        every_n_epochs: int = 1,
        batch_size: int = 256,
        prefix: str = "val/zeroshot",
    ):
        super().__init__(every_n_epochs, batch_size, prefix)
        self.dataset, self.classnames, self.templates = dataset, classnames, tuple(templates)
        self.tokenize, self.label_field, self.ks = tokenize, label_field, tuple(int(k) for k in ks)
        self.towers, self.limit = tuple(towers), limit

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self._due(trainer):
            self.log_metrics(pl_module, self.evaluate(pl_module, trainer.datamodule if trainer else None))

    def _resolve(self, datamodule: Any) -> tuple[Any, Sequence[str], Callable]:
        dataset = self.dataset
        if dataset is None:
            dataset = getattr(datamodule, "zero_shot_dataset", None) or getattr(datamodule, "val_dataset", None)
        classnames = self.classnames if self.classnames is not None else getattr(datamodule, "classnames", None)
        tokenize = self.tokenize if self.tokenize is not None else getattr(datamodule, "tokenize", None)
        if dataset is None or classnames is None or tokenize is None:
            raise ValueError(
                "ZeroShotClassification needs a dataset, classnames and tokenize (arguments, or a datamodule with"
                " zero_shot_dataset / val_dataset, classnames and tokenize)"
            )
        return dataset, list(classnames), tokenize

    def evaluate(self, pl_module: Any, datamodule: Any = None) -> dict[str, float]:
        dataset, classnames, tokenize = self._resolve(datamodule)
        image, text = self.towers
        prompts = [t.format(c) for c in classnames for t in self.templates]

        def prompt_batches() -> Iterator[Mapping[str, Any]]:
            for start in range(0, len(prompts), self.batch_size):
                yield dict(tokenize(prompts[start : start + self.batch_size]))

        text_features = F.normalize(self.encode(pl_module, text, prompt_batches), dim=-1)
        classifier = F.normalize(text_features.view(len(classnames), len(self.templates), -1).mean(1), dim=-1)
        fields = pl_module.tower_specs()[image].fields
        image_features = self.encode(pl_module, image, dataset_batches(dataset, fields, self.batch_size, self.limit))
        labels = torch.cat(
            [b[self.label_field] for b in dataset_batches(dataset, [self.label_field], 4096, self.limit)()]
        )
        logits = F.normalize(image_features, dim=-1) @ classifier.T
        ranked = logits.topk(min(max(self.ks), len(classnames)), dim=-1).indices
        hit = ranked == labels.view(-1, 1)
        out = {"n": float(len(labels))}
        for k in self.ks:
            out[f"top{k}"] = float(hit[:, :k].any(dim=1).float().mean())
            out[f"chance_top{k}"] = min(1.0, k / len(classnames))
        return out


__all__ = ["Retrieval", "TowerEvaluation", "ZeroShotClassification", "dataset_batches"]
