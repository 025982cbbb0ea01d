"""``plan="auto"``: plan the live job from its live towers, measured on the live device.

:func:`auto_plan` times each tower (:mod:`.measure.tower_timing`), measures the machine
(:func:`lightning_distmm.planner.measure.local.local_cluster`) and runs :func:`make_plan` for the live
world size. Measured profiles price a tower only at ``tp = pp = 1``, so without a tower's model
config the plan is data parallel per tower; a :class:`TowerInfo` with its ``config`` adds the
analytic profile and with it tensor and pipeline parallelism, which the runtime runs too.

Sharding: the plan :func:`make_plan` returns carries each tower's priced shard choice
(``none``, or ``full``: FSDP2) as :attr:`TowerPlan.shard`; the planner's options accept only what
the runtime runs and the cost model prices (:data:`lightning_distmm.planner.cost.PLANNABLE_SHARDS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_distmm.core.plan import Plan
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.machine.config import to_plain
from lightning_distmm.planner.measure.local import local_cluster
from lightning_distmm.planner.measure.tower_timing import first_tensor, measure_tower
from lightning_distmm.planner.options import PlannerOptions
from lightning_distmm.planner.profiles.profile import TowerProfile, measured_profile, tower_profile
from lightning_distmm.planner.search.search import make_plan


@dataclass
class TowerInfo:
    """What ``auto_plan`` needs to know about a live tower.

    ``module``: the encoder; ``make_inputs(b)``: its positional inputs for a microbatch of ``b``
    samples (any device; moved to the measuring device); ``frozen``: runs without gradients;
    ``config``: optionally the tower's model-config entry (``conf/model`` schema), which enables
    the analytic profile and with it tp/pp > 1 plans; ``embed_dim``: the feature width (inferred
    from one forward pass when omitted).
    """

    module: Any
    make_inputs: Callable[[int], Sequence[Any]]
    frozen: bool = False
    config: Mapping[str, Any] | None = None
    embed_dim: int | None = None


def tower_info_from_batch(
    tower: Any,
    batch: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    produced: Mapping[str, Any] | None = None,
) -> TowerInfo:
    """A :class:`TowerInfo` for a ``lightning_distmm.Tower`` whose inputs are cut from a sample batch
    (rows repeated when the batch is smaller than the microbatch). A tower that consumes another's
    output (``Tower(consumes=...)``) is measured on ``produced[producer]``, that tower's output for
    the same batch, cut the same way and passed as the keyword the tower names."""
    import torch

    fields = tower.fields
    consumes = dict(getattr(tower, "consumes", {}) or {})
    missing = [p for p in consumes if produced is None or p not in produced]
    if missing:
        raise ValueError(f"tower consumes {missing}: measure it with those towers' outputs (produced=)")
    extra = [produced[p] for p in consumes] if produced is not None else []

    def make_inputs(b: int) -> list[Any]:
        out = []
        for x in [*(batch[f] for f in fields), *extra]:
            idx = torch.arange(b) % len(x)
            out.append(x[idx] if isinstance(x, torch.Tensor) else [x[i] for i in idx.tolist()])
        return out

    module = consuming_module(tower.module, len(fields), list(consumes.values())) if consumes else tower.module
    return TowerInfo(module, make_inputs, bool(getattr(tower, "frozen", False)), config)


def _consuming_class() -> type:
    import torch

    class Consuming(torch.nn.Module):
        """A consuming tower called positionally: its fields, then each consumed output, which it
        passes on as the keyword the tower names (what the runtime does)."""

        def __init__(self, module: Any, n_fields: int, keywords: Sequence[str]) -> None:
            super().__init__()
            self.module, self.n_fields, self.keywords = module, n_fields, list(keywords)

        def forward(self, *args: Any) -> Any:
            consumed = dict(zip(self.keywords, args[self.n_fields :]))
            return self.module(*args[: self.n_fields], **consumed)

    return Consuming


def consuming_module(module: Any, n_fields: int, keywords: Sequence[str]) -> Any:
    """``module`` called as ``forward(*fields, *consumed)``: how the planner's measuring calls a tower."""
    return _consuming_class()(module, n_fields, keywords)


def runtime_cost_defaults(options: Mapping[str, Any] | None, device: Any = "cpu") -> dict[str, Any]:
    """``options`` with the cost options of what the runtime does, where the mapping leaves them
    unset: on CPU fp32 and no overlap of the gradient all-reduce with the backward (the runtime
    posts its buckets during the backward, but gloo's reduction competes for the same cores:
    benchmarks/step_time.py measured no gain, docs/runtime.md); on GPUs the overlap is assumed."""
    import torch

    d = dict(to_plain(options) or {})
    cost = dict(d.get("cost") or {})
    given = set(d) | set(cost)
    cpu = torch.device(device).type == "cpu"
    if "overlap_grad_sync" not in given:
        d["overlap_grad_sync"] = not cpu
    if "precision" not in given and cpu:
        d["precision"] = "32"
    return d


def auto_plan(
    towers: Mapping[str, TowerInfo],
    world_size: int,
    global_batch: int,
    device: Any = "cpu",
    options: PlannerOptions | Mapping[str, Any] | None = None,
    devices_per_node: int | None = None,
    batch_sizes: Sequence[int] = (1, 2, 4),
    cluster: Cluster | None = None,
    autocast: Callable[[], Any] | None = None,
) -> Plan:
    """Plan for the live job: measure each tower on ``device`` and plan ``world_size`` ranks.

    Args:
        towers: name -> :class:`TowerInfo` (module, input maker, frozen, optional config).
        world_size: ranks of the job (``trainer.world_size``).
        global_batch: the DataLoader's batch size (the contrastive batch).
        device: where to measure (this rank's device).
        options: planner options; defaults restrict to ``max_tp = max_pp = 1`` (data parallel per
            tower: measured profiles price a tower only unsplit), ``schedules = ("gpipe", "cached")``
            and no activation checkpointing. Unless a mapping sets them, the cost options follow
            :func:`runtime_cost_defaults` (on CPU ``overlap_grad_sync=False`` and ``precision="32"``).
        devices_per_node: ranks per node (default: all ranks on one node for CPU, the visible
            GPUs for CUDA).
        batch_sizes: microbatch sizes timed per tower.
        cluster: skip measuring the machine and use this spec.
        autocast: the run's forward context (Lightning's ``precision_plugin.forward_context``): the
            towers are timed in the precision the run computes in, one at a time on ``device``.

    ``planner.shards`` may list ``none`` and ``full``: a tower the planner shards runs with
    ``shard: full`` (FSDP2), as priced.

    Every rank must call it with the same inputs and get the same plan: call it on rank 0 and
    broadcast the plan's ``to_dict()``, since timings differ from rank to rank.
    """

    if options is None:
        options = {"max_tp": 1, "max_pp": 1, "schedules": ["gpipe", "cached"], "recompute": False}
    if not isinstance(options, PlannerOptions):
        options = runtime_cost_defaults(options, device)
    options = PlannerOptions.from_any(options)
    # the towers first: one whose forward fails does so before the host's probes start processes
    profiles = measure_profiles(towers, device, batch_sizes, autocast)
    cl = cluster or local_cluster(device, world_size, devices_per_node)
    if cl.world_size != world_size:
        cl = cl.with_world(world_size)
    plan, _ = make_plan(None, cl, global_batch, options, profiles=profiles)
    return plan


def measure_profiles(
    towers: Mapping[str, TowerInfo],
    device: Any = "cpu",
    batch_sizes: Sequence[int] = (1, 2, 4),
    autocast: Callable[[], Any] | None = None,
) -> dict[str, TowerProfile]:
    """Each tower timed on ``device`` at ``batch_sizes``, one at a time: its measured profile."""
    import torch

    profiles: dict[str, TowerProfile] = {}
    for name, info in towers.items():
        E = info.embed_dim
        if E is None:
            with torch.no_grad():
                out = info.module(*info.make_inputs(1))  # where the module is: not on the device yet
            E = int(first_tensor(out).shape[-1])
        fit = measure_tower(info.module, info.make_inputs, batch_sizes, device, frozen=info.frozen, autocast=autocast)
        analytic = tower_profile(name, info.config, E) if info.config is not None else None
        profiles[name] = measured_profile(name, fit, info.frozen, E, analytic)
    return profiles


__all__ = ["TowerInfo", "tower_info_from_batch", "runtime_cost_defaults", "auto_plan", "measure_profiles"]
