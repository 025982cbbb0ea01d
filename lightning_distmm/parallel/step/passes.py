"""A microbatch's forward and backward through this rank's stage of a tower: the ``Forward`` and
``Backward`` instructions of the step engine's list (:mod:`lightning_distmm.parallel.step.engine`),
with what they receive from and post to the neighbouring stages, the cached schedule's recompute
(the same RNG state as the first forward, so dropout masks match) and the gradient buckets a
tower's last backward of the step fills and posts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import Backward, Forward
from lightning_distmm.parallel.context_parallel import feature_grad_scale, head_copies
from lightning_distmm.parallel.fsdp import set_gradient_reduction
from lightning_distmm.parallel.groups import Topology
from lightning_distmm.parallel.pipeline import Stage
from lightning_distmm.parallel.step.batch_sync import check_features
from lightning_distmm.parallel.step.gradients import RankGradients
from lightning_distmm.parallel.step.state import Microbatch, ScheduleRun
from lightning_distmm.tower import Tower


class StagePasses:
    """This rank's forward and backward passes of its local towers' microbatches.

    Args:
        plan, towers, stages, topology, device, gradients: the engine's.
        runs_backward: whether a tower's backward runs (it trains, or consumes a tower that does).
    """

    def __init__(
        self,
        plan: Plan,
        towers: Mapping[str, Tower],
        stages: Mapping[str, Stage],
        topology: Topology,
        device: torch.device,
        gradients: RankGradients,
        runs_backward: Callable[[str], bool],
    ) -> None:
        self.plan, self.towers, self.stages = plan, towers, stages
        self.topology, self.device, self.gradients = topology, device, gradients
        self.runs_backward = runs_backward

    def run_stage(self, name: str, x: Tensor | None, rows: Mapping[str, Any]) -> Tensor:
        if name in self.stages:
            return self.stages[name].run(x, rows)
        return self.towers[name].encode(rows)  # recomputed blocks are wrapped at preparation (parallel.recompute)

    def forward(self, ins: Forward, rows: Mapping[str, Any], training: bool, run: ScheduleRun) -> None:
        """One microbatch through this rank's stage of a tower (the whole tower without pipeline)."""
        grad = training and self.runs_backward(ins.tower)
        x_in = (
            self.topology.links.recv(ins.tower, "act", ins.recv_from, self.device)
            if ins.recv_from is not None
            else None
        )
        start = run.now()
        if grad and not ins.keep:  # cached: no activations now, recompute from the input in backward
            rng = _rng_state(self.device)
            with torch.no_grad():
                x = self.run_stage(ins.tower, x_in, rows)
            run.records[ins.tower, ins.mb] = Microbatch(x_in, rows, None, rng)
            if x_in is not None:
                run.stash_bytes += x_in.numel() * x_in.element_size()
        else:
            if grad and x_in is not None:
                x_in.requires_grad_(True)
            x = self.run_stage(ins.tower, x_in, rows)
            if grad:
                run.records[ins.tower, ins.mb] = Microbatch(x_in, rows, x, None)
        run.traced(ins, start)
        if ins.send_to is not None:
            run.sends.append(self.topology.links.send(x, ins.tower, "act", ins.send_to))
        else:
            check_features(ins.tower, x, ins.rows, grad and ins.keep)
            run.outputs.setdefault((ins.sync_group, ins.tower), []).append(x)

    def backward(self, ins: Backward, run: ScheduleRun, last: bool, ends_with_sums: bool) -> None:
        """One microbatch backward through this rank's stage; the input gradient goes to the previous stage.

        On the tower's ``last`` backward of a run whose sums are posted during the step, its
        gradients become final during this backward, bucket by bucket, and each bucket's sum is
        posted as soon as it is. A sharded tower reduce-scatters (FSDP) in its ``last`` backward of
        a step whose backward ends with the sums (``ends_with_sums``) and in no other:
        the earlier microbatches' gradients accumulate unsharded inside FSDP and are reduced with it,
        once per step (and not at all while Lightning accumulates).
        """
        if self.gradients.sharded(ins.tower):
            set_gradient_reduction(self.towers[ins.tower].module, ends_with_sums and last)
        micro = run.records.pop((ins.tower, ins.mb))
        feature_grad = run.feature_grads.pop((ins.tower, ins.mb), None)
        buckets = self.gradients.buckets(ins.tower) if last and run.sums is not None else None
        if buckets is not None:
            buckets.arm()
        if ins.recv_from is not None:
            g_out = self.topology.links.recv(ins.tower, "grad", ins.recv_from, self.device)
        else:  # the cp (and sp) ranks all run the head: each backpropagates its share (parallel/context_parallel.py)
            t = self.plan.towers[ins.tower]
            g_out = feature_grad_scale(feature_grad, head_copies(t.cp, t.tp, t.sp))
        start = run.now()
        if micro.output is None:  # cached: recompute the stage from its saved input, same RNG
            x_in = micro.input.requires_grad_(True) if micro.input is not None else None
            with _restored_rng(micro.rng, self.device):  # type: ignore[arg-type]
                out = self.run_stage(ins.tower, x_in, micro.rows)
        else:
            x_in, out = micro.input, micro.output
        torch.autograd.backward(out, g_out)
        run.traced(ins, start)
        if ins.send_to is not None:
            assert x_in is not None
            run.sends.append(
                self.topology.links.send(
                    x_in.grad if x_in.grad is not None else torch.zeros_like(x_in), ins.tower, "grad", ins.send_to
                )
            )
        if buckets is not None:
            assert run.sums is not None
            run.sums.extend(buckets.finish())


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state: tuple[Tensor, Tensor | None], device: torch.device) -> Iterator[None]:
    """Replay a microbatch with the RNG state of its first forward (dropout masks match), then continue."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def take_rows(value: Any, rows: slice) -> Any:
    """``rows`` of a batch field (a tensor or a sequence; anything else is the same for every row)."""
    if isinstance(value, (Tensor, list, tuple)):
        return value[rows]
    return value
