"""The batch-sync's feature gather sends each rank's own rows only (before: a slot of every tower
from every rank, mostly zeros). Prints the bytes per gather before and after for a few plans;
exactness of the gathered features is the equivalence tests' (every plan against one process)."""

from __future__ import annotations

import torch

from lightning_distmm.parallel.exchange import FeatureSpec, GatherLayout, GatherSlot, gather_bytes


def _slots(plan: dict[str, tuple[list[int], list[int]]]) -> dict[str, GatherSlot]:
    out = {}
    for name, (owners, rows) in plan.items():
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + r)
        out[name] = GatherSlot(owners, offsets)
    return out


def test_each_rank_sends_only_its_rows():
    spec = {"image": FeatureSpec((512,), torch.float32), "text": FeatureSpec((512,), torch.float32)}
    cases = {
        # name: (slots, world, expected packed/padded)
        "separate 1+1 ranks, batch 64": (_slots({"image": ([0], [64]), "text": ([1], [64])}), 2, 0.5),
        "image on 3 ranks, text on 1, batch 96": (
            _slots({"image": ([0, 1, 2], [32] * 3), "text": ([3], [96])}),
            4,
            96 / 128,
        ),
        "colocated on 2 ranks, batch 64": (_slots({"image": ([0, 1], [32, 32]), "text": ([0, 1], [32, 32])}), 2, 1.0),
    }
    for label, (slots, world, ratio) in cases.items():
        packed, padded = gather_bytes(slots, spec, world)
        print(f"{label}: {padded / 2**10:.0f} KiB received per rank before, {packed / 2**10:.0f} KiB now")
        assert packed == padded * ratio


def test_the_layout_places_every_replica_in_its_owners_chunk():
    slots = _slots({"image": ([0, 1, 2], [3, 3, 2]), "text": ([2], [8])})
    spec = {"image": FeatureSpec((4,), torch.float32), "text": FeatureSpec((2, 3), torch.float32)}
    layout = GatherLayout.of(["image", "text"], slots, spec)
    assert layout.segments[("image", 2)] == (2, 0, 8) and layout.segments[("text", 0)] == (2, 8, 48)
    assert layout.chunk == 56  # rank 2: two image rows and eight text rows of 6
