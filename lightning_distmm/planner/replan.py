"""Re-planning a running job from what it measured (``DistMMStrategy(replan="drift")``).

The plan a job starts with is priced from counts or from profiles taken before its first step.
The data can change what the towers cost while the job runs (a resolution schedule, longer
captions, a tower that starts training): the plan stays what it was. Here the towers' measured
forward and backward times become their profiles, and the cost model prices the running plan
and the default's candidates (:func:`~lightning_distmm.planner.default.candidate_plans`, the
split proportional to the *measured* forward times among them) on them, as the default plan is
priced.

What a window measures (:class:`MeasuredTower`): the device-seconds each tower's instructions took
on all its ranks and the samples the tower processed. Per sample, that is one device's time
whatever the plan's dp (pipeline stages add up to the whole tower; tensor-parallel ranks count
their time each, so a tp tower's figure includes what tp costs). The profile splits it into a
fixed part per call (the counted operators' dispatch, as :func:`~lightning_distmm.planner.default.counted_profile`
prices it) and a part per sample. On a host whose ranks share cores the times were measured
under that sharing; the cost model applies the host's ``concurrency`` to compute again, so the
profile divides it out.

When (:class:`DriftWatch`): the first window under a plan is its reference. A later window whose
per-sample time of some tower differs from the reference by more than ``margin`` is a drift: the
plans are priced, and the job switches when the cheapest is predicted faster than the running one
by more than ``margin``. Either way the window becomes the new reference, so one drift is acted on
once (hysteresis); after a switch, the first window under the new plan is its reference.

Pure Python, as the rest of the planner.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lightning_distmm.core.plan import Plan
from lightning_distmm.planner.default import (
    CountedTower,
    Host,
    candidate_plans,
    fitted_profile,
    host_cluster,
    plan_layout,
)
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.options import PlannerOptions
from lightning_distmm.planner.price import price_plan
from lightning_distmm.planner.profiles.profile import MeasuredFit, TowerProfile


@dataclass(frozen=True)
class MeasuredTower:
    """A tower's work over a window: forward and backward device-seconds summed over its ranks,
    the samples it processed (each sample counted once however many ranks it crossed) and the
    forward calls its ranks made (microbatches)."""

    forward: float
    backward: float
    samples: int
    calls: int

    @property
    def per_sample(self) -> float:
        """Forward and backward device-seconds per sample."""
        return (self.forward + self.backward) / max(self.samples, 1)


def measured_profile(name: str, tower: MeasuredTower, counted: CountedTower, cluster: Cluster) -> TowerProfile:
    """``tower``'s measurements as the cost model's profile on ``cluster``: ``fixed + rows x
    per-sample`` forward and backward, the fixed part the counted operators' dispatch (never more
    than half of a call), both divided by the host's core sharing."""
    dev = cluster.device
    share = max(dev.concurrency, 1.0)
    calls = max(tower.calls, 1)
    fits = []
    for seconds, ops in ((tower.forward, counted.ops), (tower.backward, 2 * counted.ops)):
        fixed = min(ops * dev.kernel_overhead, 0.5 * seconds / calls)
        slope = max(seconds - fixed * calls, 0.0) / max(tower.samples, 1)
        fits.append((fixed / share, slope / share))
    trainable = counted.params if counted.trainable_params is None else counted.trainable_params
    fit = MeasuredFit(
        device=f"measured on {dev.name}",
        batch_sizes=[],
        fwd=fits[0],
        bwd=fits[1],
        act_bytes=(0.0, 0.0),
        params=int(counted.params),
        trainable_params=0 if counted.frozen else int(trainable),
    )
    return fitted_profile(name, "measured", fit, counted.frozen, counted.embed_dim)


@dataclass
class Pricing:
    """The running plan and every candidate, priced on the measured profiles (seconds per step)."""

    current: float
    candidates: list[tuple[str, Plan, float]]

    @property
    def best(self) -> tuple[str, Plan, float]:
        return min(self.candidates, key=lambda c: c[2])


def price_on_measurements(
    measured: Mapping[str, MeasuredTower],
    counted: Mapping[str, CountedTower],
    plan: Plan,
    host: Host,
    global_batch: int,
    precision: str | None = None,
) -> Pricing:
    """Price ``plan`` and the default's candidates on the measured profiles; candidates that do not
    fit the device's memory or give a replica no sample are left out."""
    world = plan.world_size
    cluster = host_cluster(host, world)
    profiles = {n: measured_profile(n, measured[n], counted[n], cluster) for n in plan.towers}
    cpu = host.kind == "cpu"
    options = PlannerOptions.from_any(
        {"precision": "32" if cpu or not precision else precision, "overlap_grad_sync": not cpu}
    )
    current = price_plan(plan, profiles, cluster, options, global_batch).step_time
    weights = {n: measured[n].forward / max(measured[n].samples, 1) or 1e-12 for n in plan.towers}
    candidates = []
    for name, candidate in candidate_plans(weights, world):
        if any(global_batch < len(t.ranks) for t in candidate.towers.values()):
            continue
        cost = price_plan(candidate, profiles, cluster, options, global_batch)
        if cost.fits:
            candidates.append((name, candidate, cost.step_time))
    return Pricing(current, candidates)


def sameplan_layout(a: Plan, b: Plan) -> bool:
    """Whether two plans put every tower on the same ranks with the same parallelism."""
    return a.to_dict()["towers"] == b.to_dict()["towers"]


@dataclass
class DriftCheck:
    """One check's findings, and the line the job logs for it."""

    step: int
    measured: dict[str, float]  # per-sample device-seconds, by tower
    reference: dict[str, float] | None
    measured_step: float
    margin: float
    pricing: Pricing | None = None
    current_layout: str = ""
    switch_to: Plan | None = None

    @property
    def drift(self) -> float:
        """The largest relative change of a tower's per-sample time from the reference (0 without one)."""
        if not self.reference:
            return 0.0
        return max(abs(self.measured[n] / self.reference[n] - 1) if self.reference[n] > 0 else math.inf
                   for n in self.measured)  # fmt: skip

    def line(self) -> str:
        times = []
        for n, m in self.measured.items():
            ref = (self.reference or {}).get(n)
            times.append(f"{n} {m * 1e3:.3f} ms" + (f" (reference {ref * 1e3:.3f}: {m / ref:.2f}x)" if ref else ""))
        head = (
            f"distmm drift check at step {self.step}: fwd+bwd per sample {', '.join(times)};"
            f" step {self.measured_step * 1e3:.0f} ms measured"
        )
        if self.reference is None:
            return head + "; the reference for this plan"
        if self.pricing is None:
            return head + f"; within {self.margin:.0%} of the reference: plan kept"
        name, plan, best = self.pricing.best
        priced = (
            f"; drift {self.drift:.0%}: priced on these measurements, the running plan ({self.current_layout})"
            f" {self.pricing.current * 1e3:.0f} ms, the best candidate {name} ({plan_layout(plan)}) {best * 1e3:.0f} ms"
        )
        if self.switch_to is not None:
            return head + priced + f": switching, {self.pricing.current / best:.2f}x faster predicted"
        return head + priced + f": plan kept (a switch needs {self.margin:.0%} faster)"


@dataclass
class DriftWatch:
    """The decision rule (module docstring): reference, drift, price, switch."""

    margin: float = 0.10
    reference: dict[str, float] | None = None
    checks: list[DriftCheck] = field(default_factory=list)

    def check(
        self,
        step: int,
        measured: Mapping[str, MeasuredTower],
        measured_step: float,
        counted: Mapping[str, CountedTower],
        plan: Plan,
        host: Host,
        global_batch: int,
        precision: str | None = None,
    ) -> DriftCheck:
        per_sample = {n: m.per_sample for n, m in measured.items()}
        found = DriftCheck(
            step, per_sample, self.reference, measured_step, self.margin, current_layout=plan_layout(plan)
        )
        self.checks.append(found)
        self.reference = per_sample
        if found.reference is None or found.drift <= self.margin:
            return found
        found.pricing = price_on_measurements(measured, counted, plan, host, global_batch, precision)
        name, best_plan, best = found.pricing.best
        if best < (1 - self.margin) * found.pricing.current and not sameplan_layout(best_plan, plan):
            found.switch_to = best_plan
            self.reference = None  # the new plan's first window is its reference
        return found


__all__ = ["MeasuredTower", "measured_profile", "Pricing", "price_on_measurements", "DriftCheck", "DriftWatch"]
