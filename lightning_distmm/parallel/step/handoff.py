"""The transfers of a consuming tower's step (docs/vlm.md): a producer's rows to the consumer
replica that owns them, the per-token loss on the consumer, the rows' gradients back.

The step engine (:mod:`lightning_distmm.parallel.step.engine`) runs the lists of
:func:`lightning_distmm.core.handoff_schedule.handoff_schedule` and hands the five handoff instructions to
:meth:`TokenHandoff.run`. Received rows become leaves of the consumer's forward (the consumer's
backward fills their gradients, which go back); a rank that holds both towers hands its own rows
over in memory, through the same leaves, so the two paths compute the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_distmm.core.assignment import RowAssignment
from lightning_distmm.core.handoff_schedule import (
    RecvTokenGrads,
    RecvTokens,
    Route,
    SendTokenGrads,
    SendTokens,
    TokenLoss,
    check_handoff_plan,
    handoff_links,
    handoff_schedule,
)
from lightning_distmm.core.plan import Plan
from lightning_distmm.parallel.pipeline import PendingSend, connect_in_order, post_tensor, receive_tensor
from lightning_distmm.parallel.step.state import ScheduleRun
from lightning_distmm.tower import Tower, TowerModule, tower_order

_TAG = 7000  # tags of the handoff's headers on the host group (the data go over each pair's own group)
_KINDS = ("tokens", "grads")


class TokenHandoff:
    """This rank's side of every route of a step; :meth:`reset` between steps."""

    def __init__(
        self,
        plan: Plan,
        towers: Mapping[str, Tower],
        trains: Mapping[str, bool],
        groups: Mapping[str, Any],
        device: torch.device,
        host_group: dist.ProcessGroup | None,
    ) -> None:
        self.plan = plan
        self.order = tower_order(towers)
        self.consumes = {n: list(t.consumes) for n, t in towers.items() if t.consumes}
        check_handoff_plan(plan, self.consumes)
        self.keywords = {n: dict(t.consumes) for n, t in towers.items()}
        self.fields = {n: t.fields for n, t in towers.items()}
        self.trains = dict(trains)
        self.groups = groups
        self.device = device
        self.host_group = host_group
        self.rank = dist.get_rank()
        # a process group per (kind, sender, receiver), as the pipeline links have: built collectively,
        # in the same order on every rank (NCCL runs one communicator's operations in order), and
        # opened in that order (a communicator created at a first send would hold its rank)
        self.links = {key: dist.new_group([key[1], key[2]]) for key in handoff_links(plan, self.consumes)}
        connect_in_order(self.links, device)
        self.reset()

    @staticmethod
    def needed(towers: Mapping[str, Tower]) -> bool:
        return any(t.consumes for t in towers.values())

    def reset(self) -> None:
        self.received: dict[tuple[str, str], list[tuple[Route, Tensor]]] = {}
        self.local: dict[Route, Tensor] = {}  # rows a rank hands itself
        self.local_grads: dict[Route, Tensor] = {}
        self.counts: dict[str, Tensor] = {}  # a consumer's global target count of this step

    def schedule(self, assignment: RowAssignment) -> list:
        return handoff_schedule(
            self.plan, self.consumes, self.order, self.trains, self.rank, assignment.n, assignment=assignment
        )

    def needs_backward(self, tower: str) -> bool:
        """A consumer runs its backward when it or any producer it reads trains (a frozen LLM still
        carries the gradient of the image tokens)."""
        return self.trains[tower] or any(self.trains[p] for p in self.consumes.get(tower, ()))

    # ------------------------------------------------------------------ what the consumer's forward reads
    def consumed(self, tower: str, mb: int) -> dict[str, Tensor]:
        """The consumed outputs of microbatch ``mb`` of ``tower``, by keyword: the received pieces in row order."""
        out = {}
        for producer, keyword in self.keywords[tower].items():
            pieces = [p for p in self.received.get((producer, tower), []) if p[0].dst_mb == mb]
            pieces.sort(key=lambda p: p[0].start)
            out[keyword] = torch.cat([t for _, t in pieces]) if len(pieces) > 1 else pieces[0][1]
        return out

    # ------------------------------------------------------------------ the instructions
    def run(self, ins: Any, run: ScheduleRun, module: TowerModule, batch: Mapping[str, Any], training: bool) -> None:
        if isinstance(ins, SendTokens):
            r = ins.route
            x = run.outputs[0, r.producer][r.src_mb][r.start - r.src_offset : r.stop - r.src_offset]
            if r.dst == self.rank:
                self.local[r] = x.detach()
            else:
                run.sends.append(self._send(x, r.dst, 0))
        elif isinstance(ins, RecvTokens):
            r = ins.route
            x = self.local.pop(r) if r.src == self.rank else self._recv(r.src, 0)
            leaf = x.detach().requires_grad_(training and self.trains[r.producer])
            self.received.setdefault((r.producer, r.consumer), []).append((r, leaf))
        elif isinstance(ins, TokenLoss):
            self._token_loss(ins, run, module, batch, training)
        elif isinstance(ins, SendTokenGrads):
            r = ins.route
            leaf = next(t for route, t in self.received[r.producer, r.consumer] if route == r)
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if ins.peer == self.rank:
                self.local_grads[r] = g
            else:
                run.sends.append(self._send(g, ins.peer, 1))
        elif isinstance(ins, RecvTokenGrads):
            r = ins.route
            g = self.local_grads.pop(r) if r.dst == self.rank else self._recv(r.dst, 1)
            key = (r.producer, r.src_mb)
            if key not in run.feature_grads:
                run.feature_grads[key] = torch.zeros_like(run.outputs[0, r.producer][r.src_mb])
            run.feature_grads[key][r.start - r.src_offset : r.stop - r.src_offset] = g

    def _token_loss(
        self, ins: TokenLoss, run: ScheduleRun, module: TowerModule, batch: Mapping[str, Any], training: bool
    ) -> None:
        """The consumer's loss on its rows: its sum over the global target count (one all-reduce over
        the tower's data-parallel group), forward and backward to the output gradient."""
        outputs = run.outputs[0, ins.tower]
        needs = training and self.needs_backward(ins.tower)
        leaf = outputs[ins.mb].detach().requires_grad_(needs)
        total, _ = module.token_loss(leaf, self._rows(batch, run, ins.tower, ins.mb))
        if ins.tower not in self.counts:  # the step's first: every microbatch's count, summed over the replicas
            local = sum(
                torch.as_tensor(module.token_loss(out.detach(), self._rows(batch, run, ins.tower, mb))[1])
                .reshape(())
                .to(torch.float64)
                for mb, out in enumerate(outputs)
            )
            count = torch.as_tensor(local, device=self.device).reshape(1)
            if self.plan.towers[ins.tower].dp > 1:
                dist.all_reduce(count, group=self.groups[ins.tower].dp_group)
            self.counts[ins.tower] = count[0].clamp(min=1)
        loss = total / self.counts[ins.tower].to(total.dtype)
        t = self.plan.towers[ins.tower]
        if t.ranks.index(self.rank) % t.tp == 0:  # tensor-parallel ranks compute the same loss: count it once
            run.loss = run.loss + loss.detach().to(run.loss.device)
        if needs:
            if not loss.requires_grad:
                raise RuntimeError("token_loss returned a loss that does not depend on the consuming tower's outputs")
            loss.backward()
            run.feature_grads[ins.tower, ins.mb] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)

    def _rows(self, batch: Mapping[str, Any], run: ScheduleRun, tower: str, mb: int) -> dict[str, Any]:
        rows = run.rows[tower, mb]
        return {f: batch[f][rows] for f in self.fields[tower]}

    # ------------------------------------------------------------------ point to point
    def _send(self, t: Tensor, dst: int, kind: int) -> PendingSend:
        return post_tensor(t, dst, self.links[_KINDS[kind], self.rank, dst], self.host_group, _TAG + 2 * kind)

    def _recv(self, src: int, kind: int) -> Tensor:
        group = self.links[_KINDS[kind], src, self.rank]
        return receive_tensor(src, group, self.host_group, _TAG + 2 * kind, self.device)


HANDOFF_INSTRUCTIONS = (SendTokens, RecvTokens, TokenLoss, SendTokenGrads, RecvTokenGrads)


def tower_trains(towers: Mapping[str, Tower]) -> dict[str, bool]:
    """Whether each tower has a parameter that trains, read before any rank releases what it does not
    hold (so every rank gives the same answer)."""
    return {n: not t.frozen and any(p.requires_grad for p in t.module.parameters()) for n, t in towers.items()}
