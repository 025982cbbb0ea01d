"""Sequence packing for a language tower: a microbatch's tokens without their padding.

A batch of right-padded rows (or rows with masked slots, such as absent images' tokens) spends the
decoder's work and memory on padding. :func:`pack` lays the kept tokens of each row end to end in
sequences of at most ``budget`` tokens (whole samples, in row order, a new sequence when the next
sample does not fit), with ``position_ids`` restarting at 0 for every sample; :func:`unpack` puts a
result computed on the packed sequences back at the rows' places (zeros where the rows had masked
tokens). Attention must stay inside each sample: transformers builds that block-diagonal causal mask
itself when it is given ``position_ids`` and no ``attention_mask`` (``masking_utils``'s packed
sequences; a varlen kernel where one exists), so a tower passes ``attention_mask=None``.

Each kept token then sees the tokens it saw unpacked, at the same positions: the result equals the
unpacked one wherever the rows had a token (``tests/test_packing.py``). Reading the rows' lengths
is one read of the mask from the device per call: packing decides shapes on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_distmm.core.layout import row_name


@dataclass(frozen=True)
class Packing:
    """Where every kept token went: row ``rows[i]``, column ``cols[i]`` -> sequence ``seqs[i]``,
    place ``places[i]``; ``shape`` is (sequences, longest sequence)."""

    rows: Tensor
    cols: Tensor
    seqs: Tensor
    places: Tensor
    shape: tuple[int, int]
    source: tuple[int, int]  # (rows, columns) of the unpacked layout

    @property
    def tokens(self) -> int:
        return int(self.rows.numel())


def plan_packing(lengths: list[int], budget: int) -> list[list[int]]:
    """The rows of each packed sequence: whole samples in row order, a new sequence when the next
    does not fit in ``budget`` tokens. A sample longer than the budget is refused, naming it."""
    if budget < 1:
        raise ValueError(f"packing budget {budget}: it must be a positive number of tokens")
    sequences: list[list[int]] = []
    used = budget
    for row, n in enumerate(lengths):
        if n > budget:
            raise ValueError(
                f"row {row} of the microbatch has {n} tokens, more than the packing budget of {budget}: raise the budget to at"
                " least the longest sample"
            )
        if used + n > budget:
            sequences.append([])
            used = 0
        sequences[-1].append(row)
        used += n
    return sequences


def check_budget(
    lengths: Tensor,
    budget: int,
    what: str,
    rows: Sequence[int] | None = None,
    samples: Sequence[int] | None = None,
) -> None:
    """Refuse a batch with a sample longer than the packing ``budget``, naming the sample before
    any rank trains on the batch (the packing itself sees only a microbatch's rows). ``lengths``:
    each row's tokens on the CPU (a tensor elsewhere is left to :func:`plan_packing`, so the check
    never waits for a device); ``what``: how the tokens were counted, for the message; ``rows`` and
    ``samples`` as :func:`~lightning_distmm.core.layout.row_name` takes them."""
    if budget < 1:
        raise ValueError(f"pack_tokens={budget}: the packing budget must be a positive number of tokens")
    if lengths.device.type != "cpu" or not lengths.numel():
        return
    over = (lengths > budget).nonzero()
    if over.numel():
        i = int(over[0, 0])
        n = int(lengths[i])
        raise ValueError(
            f"{row_name(i, rows, samples)} has {n} tokens ({what}), more than the packing budget"
            f" pack_tokens={budget}: a sample is never cut across sequences; raise pack_tokens to at least"
            f" {int(lengths.max())} (this batch's longest sample) or shorten the sample"
        )


def pack(x: Tensor, keep: Tensor, budget: int) -> tuple[Tensor, Tensor, Packing]:
    """``x`` ``[B, T, ...]``'s tokens where ``keep`` ``[B, T]`` is set, packed: ``(packed [S, L, ...],
    position_ids [S, L], packing)``. Positions count each sample's kept tokens from 0; a sequence's
    tail after its last sample continues the last sample's positions (it is never attended: the
    mask is causal) and holds zeros."""
    positions, where = packing_of(keep, budget)
    return place(x, where), positions.to(x.device), where


def place(x: Tensor, where: Packing) -> Tensor:
    """``x`` ``[B, T, ...]``'s kept tokens laid out as ``where`` says (:func:`pack` with its packing known)."""
    packed = x.new_zeros((*where.shape, *x.shape[2:]))
    seqs, places, rows, cols = (i.to(x.device) for i in (where.seqs, where.places, where.rows, where.cols))
    packed[seqs, places] = x[rows, cols]
    return packed


def packing_of(keep: Tensor, budget: int) -> tuple[Tensor, Packing]:
    """Where :func:`pack` puts the tokens ``keep`` ``[B, T]`` sets, and their ``position_ids`` ``[S, L]``
    (on the CPU), from the mask alone: what a pipeline stage after the first needs to run packed
    sequences it receives and to unpack its output."""
    b, t = keep.shape
    mask = keep.bool().cpu()  # the host decides the shapes: one read of the mask
    lengths = mask.sum(dim=1).tolist()
    sequences = plan_packing(lengths, budget)
    longest = max((sum(lengths[r] for r in rows) for rows in sequences), default=0)
    rows_of: list[Tensor] = []
    cols_of: list[Tensor] = []
    seqs_of: list[Tensor] = []
    places_of: list[Tensor] = []
    positions = torch.zeros(len(sequences), max(longest, 1), dtype=torch.long)
    for s, rows in enumerate(sequences):
        place = 0
        for r in rows:
            cols = mask[r].nonzero().flatten()
            n = cols.numel()
            rows_of.append(torch.full((n,), r))
            cols_of.append(cols)
            seqs_of.append(torch.full((n,), s))
            places_of.append(torch.arange(place, place + n))
            positions[s, place : place + n] = torch.arange(n)
            place += n
        if place < positions.shape[1]:
            last = int(positions[s, place - 1]) if place else -1
            positions[s, place:] = torch.arange(last + 1, last + 1 + positions.shape[1] - place)
    where = Packing(_cat(rows_of), _cat(cols_of), _cat(seqs_of), _cat(places_of), tuple(positions.shape), (b, t))
    return positions, where


def _cat(parts: list[Tensor]) -> Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def unpack(y: Tensor, where: Packing) -> Tensor:
    """``y`` ``[S, L, ...]`` computed on :func:`pack`'s sequences, back at the rows' places ``[B, T, ...]``
    (zeros where the rows had no kept token)."""
    out = y.new_zeros((*where.source, *y.shape[2:]))
    seqs, places, rows, cols = (i.to(y.device) for i in (where.seqs, where.places, where.rows, where.cols))
    out[rows, cols] = y[seqs, places]
    return out
