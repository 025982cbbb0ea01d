"""ZeRO-1 for a tower (``shard: optimizer``): each replica keeps the whole weights and gradients but
steps, and holds the optimizer state of, only its 1/n of them.

Megatron-LM's distributed optimizer, per tower: the tower's trainable parameters are laid end to end
in flat buckets, each bucket cut into ``n`` equal contiguous ranges (``n``: the ranks the tower's
gradients are summed over, its replicas times its cp ranks), and rank ``r`` of them owns range ``r``.
At the end of the optimizer step's backward the gradients are *reduce-scattered* per bucket (one
collective per bucket instead of an all-reduce: half the bytes received), so each rank holds the
summed gradient of its range only; the optimizer steps that range; an all-gather per bucket then
writes every rank's updated range back into the whole weights. Optimizer state is allocated only for
the owned range: 1/n of the state per rank, weights and gradients whole.

The optimizer the user built keeps its param groups of whole parameters. For the length of each
``step`` a group's ZeRO-1 parameters are replaced by this rank's *pieces* of them (each a 1-D tensor:
the part of the parameter inside the owned range; a parameter with no part there is left out), and
the optimizer's state is keyed by those pieces. An update that reads each element alone (SGD, Adam,
AdamW, ...: :data:`~lightning_distmm.parallel.optimizer_kernels.PER_PARAMETER`) is then exactly the
update of the whole parameter; any other optimizer is refused.

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``: it assigns *whole* parameters to ranks
(uneven shards, a rank's state is whatever parameters it drew), all-reduces the gradients and
broadcasts each parameter from its owner, one collective per parameter: twice the gradient bytes
and many small calls. It also wraps the optimizer in its own class, which Lightning's optimizer
hooks, learning-rate schedulers and checkpoints would then see instead of the user's. FSDP2's
``zero2`` is not ZeRO-1 either: it reshards the weights after the backward and gathers them layer
by layer in the next forward, one pair of collectives per layer. Here the weights stay whole and
each step has one reduce-scatter and one all-gather per bucket.

Checkpoints see the state of whole parameters (:meth:`OptimizerShards.whole_state`, gathered over
the tower's ranks when saved, cut back to the owned pieces when loaded): a ZeRO-1 checkpoint has
the layout of a ``shard: none`` one, and resumes under any plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_distmm.parallel.buckets import local
from lightning_distmm.parallel.exchange import all_gather_single, reduce_scatter_single


@dataclass
class Piece:
    """The part of ``param`` inside this rank's range of its bucket: elements ``[start, stop)`` of
    the parameter's local tensor, flattened, at ``offset`` in the rank's range."""

    param: nn.Parameter
    start: int
    stop: int
    offset: int
    #: what the optimizer steps in place of ``param`` (the piece's values, the optimizer state's key)
    main: nn.Parameter


class Bucket:
    """Parameters of one dtype and device laid end to end, padded to a multiple of the group's size."""

    def __init__(self, params: Sequence[nn.Parameter], rank: int, size: int) -> None:
        self.params = list(params)
        self.sizes = [local(p).numel() for p in self.params]
        total = sum(self.sizes)
        self.shard = -(-total // size)  # each rank's range: ceil(total / size) elements
        self.padded = self.shard * size
        first, last = rank * self.shard, (rank + 1) * self.shard
        self.pieces: list[Piece] = []
        start = 0
        for p, n in zip(self.params, self.sizes):
            lo, hi = max(start, first), min(start + n, last)
            if lo < hi:
                values = local(p).detach().reshape(-1)[lo - start : hi - start].clone()
                self.pieces.append(Piece(p, lo - start, hi - start, lo - first, nn.Parameter(values)))
            start += n
        self.dtype = local(self.params[0]).dtype
        self.device = local(self.params[0]).device

    def flat_gradients(self) -> Tensor:
        """Every parameter's local gradient end to end (zeros where there is none), padded."""
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        start = 0
        for p, n in zip(self.params, self.sizes):
            if p.grad is not None:
                flat[start : start + n].copy_(local(p.grad).reshape(-1))
            start += n
        return flat

    def owned_values(self) -> Tensor:
        """This rank's range of the updated weights (its pieces' values), padded."""
        out = torch.zeros(self.shard, dtype=self.dtype, device=self.device)
        for piece in self.pieces:
            out[piece.offset : piece.offset + piece.main.numel()].copy_(piece.main.detach())
        return out

    def write_back(self, flat: Tensor) -> None:
        """Copy the gathered weights ``flat`` into every parameter's local tensor."""
        start = 0
        with torch.no_grad():
            for p, n in zip(self.params, self.sizes):
                local(p).view(-1).copy_(flat[start : start + n])
                start += n


class TowerShards:
    """One tower's ZeRO-1 on this rank: its trainable parameters in buckets of up to ``cap`` bytes
    (DDP's bucket size), each cut over ``group``."""

    def __init__(self, name: str, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, cap: int) -> None:
        self.name = name
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.buckets: list[Bucket] = []
        run: list[nn.Parameter] = []
        run_bytes = 0
        for p in params:
            t = local(p)
            kind_changes = run and (t.dtype, t.device) != (local(run[0]).dtype, local(run[0]).device)
            if run and (kind_changes or run_bytes + t.numel() * t.element_size() > cap):
                self.buckets.append(Bucket(run, self.rank, self.size))
                run, run_bytes = [], 0
            run.append(p)
            run_bytes += t.numel() * t.element_size()
        if run:
            self.buckets.append(Bucket(run, self.rank, self.size))
        self.pieces = {id(piece.param): piece for b in self.buckets for piece in b.pieces}
        #: the gradients were reduce-scattered into the pieces and the step has not written them back
        self.reduced = False

    def reduce_scatter(self) -> None:
        """Sum the tower's gradients over its ranks, each rank receiving its range: the pieces'
        ``.grad``. The pieces take the current weights first (a checkpoint load or any change made to
        the whole weights since the last step reaches the optimizer), and the whole gradients are freed."""
        for bucket in self.buckets:
            flat = bucket.flat_gradients()
            owned = torch.empty(bucket.shard, dtype=flat.dtype, device=flat.device)
            reduce_scatter_single(owned, flat, op=dist.ReduceOp.SUM, group=self.group)
            for piece in bucket.pieces:
                with torch.no_grad():
                    piece.main.copy_(local(piece.param).detach().reshape(-1)[piece.start : piece.stop])
                piece.main.grad = owned[piece.offset : piece.offset + piece.main.numel()]
            for p in bucket.params:
                p.grad = None
        self.reduced = True

    def gather(self) -> None:
        """After the optimizer stepped the pieces: every rank's range into the whole weights."""
        if not self.reduced:
            return
        for bucket in self.buckets:
            flat = torch.empty(bucket.padded, dtype=bucket.dtype, device=bucket.device)
            all_gather_single(flat, bucket.owned_values(), group=self.group)
            bucket.write_back(flat)
            for piece in bucket.pieces:
                piece.main.grad = None
        self.reduced = False

    def gradients(self) -> list[tuple[nn.Parameter, Tensor]]:
        """Each piece's parameter with the piece's summed gradient (while the step's sums are held)."""
        return [(piece.param, piece.main.grad) for piece in self.pieces.values() if piece.main.grad is not None]

    # ------------------------------------------------------------------ whole state for checkpoints
    def gather_state(self, state: Mapping[Tensor, dict]) -> dict[int, dict[str, object]]:
        """The optimizer state of every parameter of the tower as the whole parameter's (its local
        tensor's shape; a DTensor like the parameter for a tensor-parallel one), gathered from the
        pieces over the tower's ranks; values that are not per-element (a step count, a ``None``
        momentum buffer) are the same for every piece and kept as they are. Keyed by ``id`` of the
        parameter. Collective over the tower's ranks."""
        per_element: set[str] = set()
        shared: dict[str, object] = {}
        for piece in self.pieces.values():
            for k, v in state.get(piece.main, {}).items():
                if torch.is_tensor(v) and v.dim() > 0:
                    per_element.add(k)
                else:
                    shared.setdefault(k, v.detach().cpu() if torch.is_tensor(v) else v)
        everyone: list[tuple[set[str], dict[str, object]] | None] = [None] * self.size
        dist.all_gather_object(everyone, (per_element, shared), group=self.group)
        for keys, values in (e for e in everyone if e is not None):
            per_element |= keys
            for k, v in values.items():
                shared.setdefault(k, v)
        out: dict[int, dict[str, object]] = {id(p): {} for b in self.buckets for p in b.params}
        for name in sorted(per_element):
            for bucket in self.buckets:
                owned = torch.zeros(bucket.shard, dtype=bucket.dtype, device=bucket.device)
                for piece in bucket.pieces:
                    value = state.get(piece.main, {}).get(name)
                    if value is not None:
                        owned[piece.offset : piece.offset + piece.main.numel()].copy_(value.reshape(-1))
                flat = torch.empty(bucket.padded, dtype=bucket.dtype, device=bucket.device)
                all_gather_single(flat, owned, group=self.group)
                start = 0
                for p, n in zip(bucket.params, bucket.sizes):
                    out[id(p)][name] = _like(p, flat[start : start + n].clone())
                    start += n
        for values in out.values():
            if values or shared:
                values.update({k: v.clone() if torch.is_tensor(v) else v for k, v in shared.items()})
        return out


def _like(p: nn.Parameter, flat: Tensor) -> Tensor:
    """``flat`` shaped like ``p``'s local tensor, a DTensor with ``p``'s mesh and placements if ``p`` is one."""
    values = flat.view(local(p).shape)
    if isinstance(p, DTensor):
        return DTensor.from_local(values, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return values


class OptimizerShards:
    """This rank's ZeRO-1 towers (:class:`TowerShards`), built on first use (after the weights reached
    their device and dtype)."""

    def __init__(self, towers: Mapping[str, tuple[Sequence[nn.Parameter], dist.ProcessGroup | None]], cap: int):
        self._spec = dict(towers)
        self._cap = cap
        self._towers: dict[str, TowerShards] | None = None
        self._held: dict[int, Piece | None] = {}

    def __bool__(self) -> bool:
        return bool(self._spec)

    def __contains__(self, name: str) -> bool:
        return name in self._spec

    @property
    def towers(self) -> dict[str, TowerShards]:
        if self._towers is None:
            self._towers = {n: TowerShards(n, ps, g, self._cap) for n, (ps, g) in self._spec.items()}
            self._held = {
                id(p): t.pieces.get(id(p)) for t in self._towers.values() for b in t.buckets for p in b.params
            }
        return self._towers

    def holds(self, p: Tensor) -> bool:
        """Whether ``p`` belongs to a ZeRO-1 tower here."""
        self.towers  # noqa: B018  (built on first use)
        return id(p) in self._held

    def _piece(self, p: Tensor) -> tuple[bool, Piece | None]:
        self.towers  # noqa: B018
        return id(p) in self._held, self._held.get(id(p))

    def substitute(self, params: Sequence[Tensor]) -> list[Tensor]:
        """``params`` as the optimizer steps them here: each ZeRO-1 parameter replaced by this rank's
        piece of it (left out when it has none)."""
        out: list[Tensor] = []
        for p in params:
            sharded, piece = self._piece(p)
            if not sharded:
                out.append(p)
            elif piece is not None:
                out.append(piece.main)
        return out

    def before_step(self) -> None:
        """A step whose gradients were not reduce-scattered here (torch's ``_init_optim_state`` gives
        every parameter a zero gradient and steps with lr 0 to create the state a checkpoint load
        fills): the pieces take their part of the whole gradient, so the state is created for them."""
        for tower in self.towers.values():
            if tower.reduced:
                continue
            for piece in tower.pieces.values():
                g = piece.param.grad
                if g is not None and piece.main.grad is None:
                    piece.main.grad = local(g).detach().reshape(-1)[piece.start : piece.stop].clone()

    def after_step(self) -> None:
        for tower in self.towers.values():
            tower.gather()
            for piece in tower.pieces.values():
                piece.main.grad = None

    @contextlib.contextmanager
    def whole_state(self, optimizer: Optimizer) -> Iterator[None]:
        """While the block runs, ``optimizer.state`` holds every ZeRO-1 parameter's whole state under
        the parameter itself (what ``get_optimizer_state_dict`` maps to names), gathered from the pieces;
        state written there in the block (a checkpoint load) is cut back into the pieces after it.
        Collective over every ZeRO-1 tower's ranks."""
        if not self:
            yield
            return
        # a fresh optimizer has no state to gather: torch's own initialisation (the zero-gradient step
        # at lr 0 that get_optimizer_state_dict runs) creates the pieces' state first
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)
        state = optimizer.state
        params = {id(p): p for b in (b for t in self.towers.values() for b in t.buckets) for p in b.params}
        mains = {piece.main: piece for t in self.towers.values() for piece in t.pieces.values()}
        for tower in self.towers.values():
            for pid, whole in tower.gather_state(state).items():
                if whole:
                    state[params[pid]] = whole
        for main in mains:
            state.pop(main, None)
        try:
            yield
        finally:
            state = optimizer.state  # a load (``Optimizer.load_state_dict``) replaces the mapping
            for main, piece in mains.items():
                whole = state.get(piece.param)
                if whole:
                    state[main] = {
                        k: (local(v).detach().reshape(-1)[piece.start : piece.stop].clone() if v.dim() > 0 else v)
                        if torch.is_tensor(v)
                        else v
                        for k, v in whole.items()
                    }
            for p in params.values():
                state.pop(p, None)
