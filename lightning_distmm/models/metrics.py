"""Zero-shot retrieval on held-out image-caption pairs, in one process.

Row ``i`` of the held-out set matches row ``i``, and every row whose caption is the same as row
``i``'s (a data set of real captions repeats some: "a photo of a dog"; the shapes ``val`` split
has none, see :mod:`lightning_distmm.data.demo.shapes`). Top-k accuracy is the fraction of queries for
which a match ranks among the k most similar candidates; chance is ``k / N``. Without the captions
to compare, a duplicate caption counts against the query, which caps image->text recall@1 at the
share of unique captions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def _to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


@torch.no_grad()
def encode_dataset(
    module: Any, dataloader: Iterable[Mapping[str, Any]], max_samples: int | None = None
) -> dict[str, Tensor]:
    """``module.encode(batch)`` over the loader, concatenated per tower (on the CPU); each tower's
    ``module.embedding(tower, features)`` when the module has it (a CoCa tower's row holds more)."""
    was_training = module.training
    module.eval()
    try:
        device = next(module.parameters()).device
        chunks: dict[str, list[Tensor]] = {}
        seen = 0
        for batch in dataloader:
            features = module.encode(_to_device(batch, device))
            embed = getattr(module, "embedding", None) or (lambda _, f: f)
            for name, f in features.items():
                chunks.setdefault(name, []).append(embed(name, f).float().cpu())
            seen += len(next(iter(features.values())))
            if max_samples is not None and seen >= max_samples:
                break
    finally:
        module.train(was_training)
    out = {name: torch.cat(fs) for name, fs in chunks.items()}
    if max_samples is not None:
        out = {name: f[:max_samples] for name, f in out.items()}
    return out


def retrieval_from_features(
    query: Tensor, target: Tensor, ks: Sequence[int] = (1, 5), keys: Sequence[Any] | None = None
) -> dict[int, float]:
    """Top-k accuracy of retrieving ``target[i]`` for ``query[i]`` by cosine similarity.

    ``keys`` (one per row, e.g. the caption's token ids): rows with equal keys are interchangeable,
    so any of them is a correct match. A query's rank is the number of non-matching candidates at
    least as similar as its best match: ties count against the query, so a collapsed model that gives
    every sample the same feature scores 0, not 1.
    """
    n = query.shape[0]
    if n != target.shape[0]:
        raise ValueError(f"need as many queries as targets, got {n} and {target.shape[0]}")
    sim = F.normalize(query, dim=-1) @ F.normalize(target, dim=-1).T
    if keys is None:
        same = torch.eye(n, dtype=torch.bool, device=sim.device)
    else:
        if len(keys) != n:
            raise ValueError(f"need one key per row, got {len(keys)} for {n} rows")
        ids: dict[Any, int] = {}
        group = torch.tensor([ids.setdefault(k, len(ids)) for k in keys], device=sim.device)
        same = group.unsqueeze(0) == group.unsqueeze(1)
    best = sim.masked_fill(~same, float("-inf")).max(dim=1, keepdim=True).values
    rank = ((sim >= best) & ~same).sum(dim=1)
    return {k: float((rank < k).float().mean()) for k in ks}


def row_keys(values: Any) -> list[Any]:
    """One hashable key per row of a batch field (a tensor's rows as tuples, strings as they are)."""
    if isinstance(values, Tensor):
        return [tuple(r) for r in values.reshape(values.shape[0], -1).tolist()]
    return [v if isinstance(v, str | int | float | tuple) else repr(v) for v in values]


def retrieval_metrics(
    module: Any,
    dataloader: Iterable[Mapping[str, Any]],
    ks: Sequence[int] = (1, 5),
    image: str = "image",
    text: str = "text",
    max_samples: int | None = None,
    match_field: str | None = "input_ids",
) -> dict[str, float]:
    """Image->text and text->image top-k retrieval accuracy over the held-out pairs of ``dataloader``.

    Runs in one process with every tower (``module.encode(batch)``); under a distributed strategy
    evaluate a module holding all weights (e.g. rebuilt from a consolidated state dict). Rows whose
    ``match_field`` (the caption's token ids) is equal all match each other (None: row ``i`` only).

    Returns ``{"n": N, "image->text/top1": ..., "text->image/top1": ..., "chance/top1": 1/N, ...}``.
    """
    keys: list[Any] = []
    if match_field is not None:

        def keyed(loader: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
            for batch in loader:
                if match_field in batch:
                    keys.extend(row_keys(batch[match_field]))
                yield batch

        dataloader = keyed(dataloader)
    features = encode_dataset(module, dataloader, max_samples=max_samples)
    for name in (image, text):
        if name not in features:
            raise KeyError(f"module.encode gave towers {sorted(features)}, no {name!r}")
    n = int(features[image].shape[0])
    out: dict[str, float] = {"n": n}
    match = keys[:n] if len(keys) >= n else None
    i2t = retrieval_from_features(features[image], features[text], ks, match)
    t2i = retrieval_from_features(features[text], features[image], ks, match)
    for k in ks:
        out[f"{image}->{text}/top{k}"] = i2t[k]
        out[f"{text}->{image}/top{k}"] = t2i[k]
        out[f"chance/top{k}"] = min(1.0, k / n)
    return out


def format_metrics(metrics: Mapping[str, float], ks: Sequence[int] = (1, 5)) -> str:
    """Readable lines: ``image->text top1 = 0.830 (chance 0.004)``."""
    lines = [f"retrieval on {int(metrics['n'])} held-out pairs:"]
    for key, value in metrics.items():
        if "/" not in key or key.startswith("chance/"):
            continue
        direction, k = key.split("/")
        chance = metrics.get(f"chance/{k}")
        lines.append(f"  {direction} {k} = {value:.3f}" + (f" (chance {chance:.3f})" if chance is not None else ""))
    return "\n".join(lines)


__all__ = ["retrieval_metrics", "retrieval_from_features", "row_keys", "encode_dataset", "format_metrics"]
