"""Pipeline stages of a tower and the point-to-point moves between them.

A tower with ``pp > 1`` is cut into ``pp`` stages, each on its own rank of the replica; a rank
keeps only its stage's parameters. The cut is per tower family (like tensor parallelism), in the
family's file (:mod:`lightning_distmm.parallel.families`: a timm ``VisionTransformer`` is cut
automatically, a CLIP text tower by ``clip_text_stages``, which its wrapper calls); any tower can
define ``pipeline_stages(pp) -> list[Stage]`` itself. Every cut splits the tower's repeated layers
evenly and gives the embeddings to the first stage and the head to the last (:func:`cut_into_stages`).

Activations travel between consecutive stages of the same replica (and the same tensor-parallel
coordinate) point to point (:class:`PipelineLinks`: a header with the shape on the host, then the
tensor on the pair's own group). Sends are posted
without blocking (``isend``; the runtime waits for them before the step ends) and receives block,
so a rank never waits on a peer that waits on it (``core/schedule.py`` orders the lists, and its
tests simulate random plans for deadlocks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_distmm.core.plan import Plan

_HEADER = 8  # ndim, up to 6 dims, dtype


@dataclass
class Stage:
    """One stage: the submodules it owns and how it maps its input to its output.

    ``run(x, rows)``: ``x`` is the previous stage's activation (``None`` on stage 0) and ``rows`` the
    microbatch's batch fields (stage 0 reads its inputs there; later stages may read masks).
    """

    modules: list[nn.Module]
    run: Callable[[Tensor | None, Mapping[str, Any]], Tensor]
    #: loose parameters of the tower module itself that the stage uses (ViT ``cls_token``, ``pos_embed``)
    extra: tuple[str, ...] = ()


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[a, b)`` ranges over ``n`` layers, the first ``n % parts`` one longer."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


class StageCut(NamedTuple):
    """One stage's share of a tower whose repeated layers are cut evenly (:func:`cut_into_stages`)."""

    start: int  #: the stage's first layer
    stop: int  #: one past its last layer
    first: bool  #: stage 0, which embeds the inputs
    last: bool  #: stage ``pp - 1``, which holds the final norm and the head
    modules: list[nn.Module]  #: what the stage owns (:attr:`Stage.modules`)


def cut_into_stages(
    layers: Sequence[nn.Module] | nn.ModuleList,
    pp: int,
    too_few: str,
    on_first: Sequence[nn.Module] = (),
    on_last: Sequence[nn.Module] = (),
    on_every: Sequence[nn.Module] = (),
) -> list[StageCut]:
    """The ``pp`` stages of a tower whose ``layers`` are split evenly (:func:`even_split`), the cut
    every family shares: each stage owns ``on_every`` (what every stage runs, such as a rotary
    table), its layers, then ``on_first`` (the embeddings) on stage 0 and ``on_last`` (the final
    norm, the head) on the last. ``too_few``: the message of the ``ValueError`` raised when there
    are fewer layers than stages (the caller names its tower's layers in it)."""
    if len(layers) < pp:
        raise ValueError(too_few)
    cuts = []
    for s, (a, b) in enumerate(even_split(len(layers), pp)):
        first, last = s == 0, s == pp - 1
        own = [*on_every, *layers[a:b], *(on_first if first else ()), *(on_last if last else ())]
        cuts.append(StageCut(a, b, first, last, own))
    return cuts


def owned_names(tower: nn.Module, stage: Stage) -> set[str]:
    """Fully-qualified names (inside the tower) of everything the stage owns, parameters and buffers.

    Loose tensors of the tower (ViT ``cls_token``, ``pos_embed``) belong to the first stage that
    uses them: stage 0 for a ViT, so they go with the first stage's embedding modules.
    """
    names: set[str] = set(stage.extra)
    owned_modules = {id(m) for top in stage.modules for m in top.modules()}
    for fqn, sub in tower.named_modules():
        if id(sub) in owned_modules:
            names.update(f"{fqn}.{n}" if fqn else n for n, _ in sub.named_parameters(recurse=False))
            names.update(f"{fqn}.{n}" if fqn else n for n, _ in sub.named_buffers(recurse=False))
    return names


def release_unowned(tower: nn.Module, stage: Stage) -> None:
    """Move every parameter and buffer of ``tower`` that ``stage`` does not own to the meta device."""
    owned = owned_names(tower, stage)
    for fqn, sub in tower.named_modules():
        # assigning to a registered name replaces the parameter or buffer in place (Module.__setattr__)
        for n, p in list(sub.named_parameters(recurse=False)):
            if p is not None and (f"{fqn}.{n}" if fqn else n) not in owned and not p.is_meta:
                setattr(sub, n, nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))
        for n, b in list(sub.named_buffers(recurse=False)):
            if b is not None and (f"{fqn}.{n}" if fqn else n) not in owned and not b.is_meta:
                setattr(sub, n, b.to("meta"))


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@dataclass
class PendingSend:
    """Posted sends and the tensors they read (kept alive until the sends complete)."""

    works: list[Any]
    tensors: tuple[Tensor, ...]

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def connect_in_order(links: Mapping[tuple[Any, int, int], Any], device: torch.device) -> None:
    """Open every link ``(..., sender, receiver) -> group`` with one message, in ``links``' order.

    NCCL creates a point-to-point communicator at its first ``send``/``recv``, and creating one
    blocks the calling rank until the peer joins: a first step whose sends meet their receivers in
    a cycle of ranks (towers sharing ranks in different stage orders) would hang there, though every
    later step only posts its sends (``planner.cost.simulate.simulate(..., blocking_sends=True)`` counts
    such plans). Here every rank walks the same list and takes part in its own links, so the
    earliest link not yet open always has both ends waiting on it, and every link opens. Collective:
    every rank calls it with links built in the same order."""
    rank = dist.get_rank()
    probe = torch.zeros(1, device=device)
    for (*_, src, dst), group in links.items():
        if rank == src:
            dist.send(probe, dst, group=group)
        elif rank == dst:
            dist.recv(probe, src, group=group)


def stage_pairs(plan: Plan) -> list[tuple[str, int, int]]:
    """Every (tower, rank of stage s, rank of stage s + 1) of the plan's pipelined towers, in the plan's
    order: the same list on every rank (group creation must be)."""
    pairs = []
    for name, tower in plan.towers.items():
        for replica in range(tower.dp if tower.pp > 1 else 0):
            ranks = tower.replica_ranks(replica)
            width = tower.stage_width  # the cp x tp ranks of a stage, each sending to its peer of the next
            for stage in range(tower.pp - 1):
                for t in range(width):
                    pairs.append((name, ranks[stage * width + t], ranks[(stage + 1) * width + t]))
    return pairs


class PipelineLinks:
    """The point-to-point links of a plan's pipelines: one process group per adjacent stage pair and
    direction (activations forward, gradients back), and the shape headers on the host.

    NCCL runs each communicator's operations in order on one stream, and a send there waits for its
    receive: on shared groups one pair's pending send would hold up another pair's traffic (and
    under ``distmm`` a stage posts activations and gradients of different sync groups interleaved), so each
    pair and direction has its own. A tensor's header (ndim, dims, dtype) travels on ``host_group``,
    a group of CPU collectives (None: the default group, gloo's), tagged by tower and direction, so
    the receiver learns the shape from host memory without waiting for its device. Collective to
    build: every rank calls it with the same plan; the links open at once (:func:`connect_in_order`).
    """

    def __init__(self, plan: Plan, host_group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.host_group = host_group
        self.groups: dict[tuple[str, str, int, int], dist.ProcessGroup | None] = {}
        names = list(plan.towers)
        self.tags = {(name, kind): 2 * i + (kind == "grad") for i, name in enumerate(names) for kind in ("act", "grad")}
        for name, a, b in stage_pairs(plan):
            for kind, (src, dst) in (("act", (a, b)), ("grad", (b, a))):
                self.groups[name, kind, src, dst] = dist.new_group([a, b])
        connect_in_order(self.groups, device)

    def send(self, t: Tensor, tower: str, kind: str, dst: int) -> PendingSend:
        """Post the send of an activation (``kind="act"``) or gradient (``"grad"``) of any shape to ``dst``."""
        group = self.groups[tower, kind, dist.get_rank(), dst]
        return post_tensor(t, dst, group, self.host_group, self.tags[tower, kind])

    def recv(self, tower: str, kind: str, src: int, device: torch.device) -> Tensor:
        """Receive the tensor ``src`` sent with :meth:`send` (blocking until its header arrives)."""
        group = self.groups[tower, kind, src, dist.get_rank()]
        return receive_tensor(src, group, self.host_group, self.tags[tower, kind], device)


def post_tensor(t: Tensor, dst: int, group: Any, host_group: Any, tag: int) -> PendingSend:
    """Post ``t`` (any shape) to ``dst``: its header (ndim, dims, dtype) on ``host_group`` with ``tag``,
    the data on ``group``, the link's own. Nothing waits here."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = t.dim()
    header[1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    header[_HEADER - 1] = _DTYPES.index(t.dtype)
    data = t.detach().contiguous()
    works = [dist.isend(header, dst, group=host_group, tag=tag), dist.isend(data, dst, group=group)]
    return PendingSend(works, (header, data))


def receive_tensor(src: int, group: Any, host_group: Any, tag: int, device: torch.device) -> Tensor:
    """Receive what ``src`` posted with :func:`post_tensor`: the header is read from host memory
    (``numpy()`` refuses a device tensor, so the receiver never waits for its device here)."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.recv(header, src, group=host_group, tag=tag)
    fields = header.numpy()
    ndim = int(fields[0])
    shape = tuple(int(d) for d in fields[1 : 1 + ndim])
    out = torch.empty(shape, dtype=_DTYPES[int(fields[-1])], device=device)
    dist.recv(out, src, group=group)
    return out
