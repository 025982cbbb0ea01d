"""The default plan (``DistMMStrategy(plan=None)``): the cheaper of a few runnable plans, priced.

Why: giving each tower ranks in proportion to its forward FLOPs
(:func:`proportional_plan`) puts one tower per rank on 2 ranks however
unequal their work, and the rank of the lighter tower idles (measured: 1.44x of DDP's step where the
same ranks colocated ran at 1.03x; docs/runtime.md, "The default plan, measured against colocated
and separate"). Colocating every tower on every rank loses where towers balance and the all-reduce
of every parameter over every rank costs more than the split saves. So the default prices both,
and where cheap every other contiguous split of the ranks, with the cost model that prices every
plan (:func:`lightning_distmm.planner.price.price_plan`), and runs the cheapest.

Nothing is measured (``plan="auto"`` is the measured version): a tower is what the strategy counted
on one sample (:class:`CountedTower`: forward FLOPs, operators, parameters, feature width) and the
machine is what its description says (:class:`Host`: CPU cores, SIMD width and clock, threads per
rank; a GPU by its name). :func:`host_cluster` turns the description into the cost model's
:class:`~lightning_distmm.planner.machine.cluster.Cluster` with the nominal constants below, and
:func:`counted_profile` a tower into a :class:`~lightning_distmm.planner.profiles.profile.TowerProfile`
whose time is ``operators x per-operator cost + samples x FLOPs / rate``.

Pure Python: :func:`describe_cpu` reads ``/proc/cpuinfo`` and the process's CPU affinity; the
strategy passes what only torch knows (threads per rank, a GPU's name and memory).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_distmm.core.plan import Plan, TowerPlan, colocated_plan
from lightning_distmm.planner.machine.cluster import GB, Cluster, Device, Link
from lightning_distmm.planner.machine.presets import read_cluster
from lightning_distmm.planner.options import PlannerOptions
from lightning_distmm.planner.price import price_plan
from lightning_distmm.planner.profiles.profile import Block, MeasuredFit, TowerProfile

# ---------------------------------------------------------------------- nominal constants (CPU)
CPU_FLOPS_PER_CYCLE = {"avx512f": 64.0, "avx2": 32.0, "sse": 8.0}
"""fp32 FLOPs one core issues per cycle at peak: two FMA pipes x lanes x 2 (AVX-512: 16 lanes,
AVX2 with FMA: 8, SSE: 4 and one pipe). Intel's optimization manual (port 0/1 FMA on Skylake-SP and
later; parts with one AVX-512 FMA unit reach half). A 2.6 GHz AVX-512 core (166 GFLOP/s by this table) measured 181-185 GFLOP/s for a 512^3
fp32 ``torch.mm`` on one thread (``measure_local_cpu``)."""
CPU_NOMINAL_GHZ = 2.5
"""The clock when ``/proc/cpuinfo`` gives none."""
CPU_TOWER_EFFICIENCY = 0.5
"""Fraction of that peak a tower's counted FLOPs run at, forward and backward alike. A nominal
figure, not fitted: fp32 GEMMs of transformer sizes reach 0.6-1.0 of the peak in a measured matmul
table (sizes 64-512, one AVX-512 core), attention's per-head products and the elementwise work (norms,
activations, softmax: no FLOPs in the count, but time) less. It scales every candidate's compute
alike: it does not change which of two compute-bound plans is cheaper, only how much compute weighs
against the gradient all-reduce and the per-call cost (so it can move a near-tie)."""
CPU_OP_SECONDS = 5e-6
"""Seconds of one operator call under autograd (dispatch and graph bookkeeping), per operator of a
forward; a backward is priced at twice the forward's operators, as the cost model does. 5.1-5.5 us
measured on an AVX-512 host (``measure_local_cpu``'s small-op probe). It is why small towers on their own
ranks win: their per-call cost does not shrink with the batch."""
GLOO_BANDWIDTH = 1.0 * GB
"""Bytes per second a gloo ring all-reduce moves between processes of one host over loopback TCP:
0.76-1.21 GB/s measured on a 2-core host (``measure_local_cpu``), 1.2 GB/s in docs/planner.md, "CPU ranks"."""
GLOO_LATENCY = 200e-6
"""Seconds per ring step of a gloo collective on one host: 0.24 ms (2 processes) to 1.5 ms (4
processes on 2 cores) measured on a 2-core host; the lower figure, for a host not oversubscribed."""
CPU_STREAM_BANDWIDTH = 10.0 * GB
"""Bytes per second one CPU process streams (the optimizer step's traffic): 23-27 GB/s for a 32 MiB
copy measured on one host, taken lower for a process sharing the socket's memory bandwidth."""
GPU_TOWER_EFFICIENCY = 0.4
"""Fraction of a GPU preset's peak a tower's counted FLOPs run at: NVIDIA NeMo's published ViT-g/14
CLIP training on DGX A100 is ~39% MFU by the planner's FLOP count (docs/planner-results.md, "Published measurements"), open_clip's runs lower;
a counted tower has no GEMM shapes to price more closely. Not checked on a GPU."""
DEFAULT_BATCH = 64
"""The global batch priced when the DataLoader has no ``batch_size`` (an iterable of batches)."""
MAX_SPLITS = 64
"""Contiguous splits of the ranks priced besides the FLOP-proportional one, when there are at most
this many (2 towers on up to 65 ranks; 3 towers on up to 12)."""


@dataclass(frozen=True)
class CountedTower:
    """What the strategy counted on one tower by running it on one sample (no timing).

    ``flops``: forward FLOPs per sample (``torch.utils.flop_counter``); ``ops``: operators one
    forward calls, whatever its batch; ``params`` / ``trainable_params``: elements; ``embed_dim``:
    the feature width exchanged at the batch-sync (or handed to a consuming tower); ``tokens``:
    the vectors of that width its output holds per sample (a vision tower's image tokens);
    ``frozen``: run without gradients."""

    flops: float
    params: int
    trainable_params: int | None = None
    embed_dim: int = 512
    ops: int = 0
    frozen: bool = False
    tokens: int = 1


@dataclass(frozen=True)
class Host:
    """The machine one rank runs on, as the system describes it (nothing measured).

    ``kind``: ``cpu`` or ``cuda``; ``ranks_per_node``: ranks sharing one host; CPU: ``cores`` this
    process may run on, ``threads`` torch threads per rank, ``flops_per_cycle`` and ``ghz`` of a core
    (:func:`describe_cpu`); ``memory``: bytes per rank (a CPU rank's share of RAM, a GPU's memory);
    ``name``: the GPU's name (a preset whose name it contains prices it)."""

    kind: str = "cpu"
    ranks_per_node: int = 1
    cores: int = 1
    threads: int = 1
    flops_per_cycle: float = CPU_FLOPS_PER_CYCLE["avx2"]
    ghz: float = CPU_NOMINAL_GHZ
    memory: float = 16 * GB
    name: str = ""


def describe_cpu(ranks_per_node: int, threads: int, memory: float | None = None) -> Host:
    """This host's CPU as a :class:`Host`: usable cores (the process's affinity), the widest SIMD
    its flags name and its clock (``/proc/cpuinfo``, the top clock from cpufreq where the kernel
    gives it; Linux, nominal elsewhere), RAM per rank."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    flags, ghz = "", CPU_NOMINAL_GHZ
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and not flags:
                flags = value
            elif key.strip() == "cpu MHz" and ghz == CPU_NOMINAL_GHZ:
                ghz = float(value) / 1000 or CPU_NOMINAL_GHZ
    except (OSError, ValueError):
        pass
    try:  # the top clock where the kernel gives it: "cpu MHz" is the current one, low on an idle laptop
        ghz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e6 or ghz
    except (OSError, ValueError):
        pass
    words = set(flags.split())
    simd = "avx512f" if "avx512f" in words else "avx2" if {"avx2", "fma"} <= words else "sse"
    if memory is None:
        try:
            memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(ranks_per_node, 1)
        except (AttributeError, ValueError, OSError):  # pragma: no cover
            memory = 16 * GB
    return Host("cpu", ranks_per_node, cores, max(1, threads), CPU_FLOPS_PER_CYCLE[simd], ghz, memory)


def host_cluster(host: Host, world_size: int) -> Cluster:
    """The cost model's cluster for ``world_size`` ranks on hosts like ``host``.

    CPU: one device per rank with ``threads x flops_per_cycle x ghz`` FLOP/s, the nominal gloo
    links above, and ``concurrency`` = threads asked for per core (ranks x threads / cores, at least
    1): ranks that together want more threads than the host has cores share them, so each one's
    compute stretches by that factor while all compute. GPU: the preset whose name the device's
    contains (A100, H100, H200), else the A100 preset, with the device's memory."""
    per_node = max(1, min(host.ranks_per_node, world_size))
    nodes = max(1, math.ceil(world_size / per_node))
    if world_size % per_node:
        per_node, nodes = world_size, 1
    if host.kind == "cpu":
        peak = host.threads * host.flops_per_cycle * host.ghz * 1e9
        device = Device(
            name=f"cpu/{host.threads}t (described)",
            memory=host.memory,
            peak_flops=peak,
            memory_bandwidth=CPU_STREAM_BANDWIDTH,
            gemm_efficiency=CPU_TOWER_EFFICIENCY,
            kernel_overhead=CPU_OP_SECONDS,
            concurrency=max(1.0, per_node * host.threads / max(host.cores, 1)),
        )
        link = Link(GLOO_BANDWIDTH, GLOO_LATENCY)
        return Cluster(
            "described_cpu", nodes, per_node, device, link, dataclasses.replace(link), notes="described, not measured"
        )
    preset = "a100_8x8"
    for key, name in (("H200", "h200_8x8"), ("H100", "h100_8x8"), ("A100", "a100_8x8")):
        if key in host.name.upper():
            preset = name
            break
    base = read_cluster(preset)
    device = dataclasses.replace(
        base.device,
        memory=host.memory or base.device.memory,
        gemm_efficiency=GPU_TOWER_EFFICIENCY,
        gemm_class_efficiency=None,
    )
    return dataclasses.replace(base, nodes=nodes, devices_per_node=per_node, device=device)


def counted_profile(name: str, tower: CountedTower, cluster: Cluster) -> TowerProfile:
    """A profile priced from counts: a microbatch of ``b`` samples takes ``ops x op cost + b x flops
    / rate`` forward and twice that backward (two GEMMs per forward GEMM), ``rate`` the device's peak
    times its efficiency. Activations are not counted (the plans compared differ little in them);
    the static bytes of its parameters are."""
    dev = cluster.device
    rate = dev.peak_flops * dev.gemm_efficiency
    per_sample = float(tower.flops) / rate
    fixed = tower.ops * dev.kernel_overhead
    trainable = tower.params if tower.trainable_params is None else tower.trainable_params
    fit = MeasuredFit(
        device=f"counted on {dev.name}",
        batch_sizes=[],
        fwd=(fixed, per_sample),
        bwd=(2 * fixed, 2 * per_sample),
        act_bytes=(0.0, 0.0),
        params=int(tower.params),
        trainable_params=0 if tower.frozen else int(trainable),
    )
    return fitted_profile(name, "counted", fit, tower.frozen, tower.embed_dim)


def fitted_profile(name: str, kind: str, fit: MeasuredFit, frozen: bool, embed_dim: int) -> TowerProfile:
    """A profile priced only by its ``fit`` (no blocks: tp = pp = 1), as the default plan and the
    re-planner build them; ``kind`` names where the fit came from (``counted``, ``measured``)."""
    blank = Block()
    return TowerProfile(
        name, kind, frozen, 1, 1, 0, 1, int(embed_dim), blank, blank, blank, measured=fit, analytic=False
    )


def candidate_plans(flops: Mapping[str, float], world_size: int) -> list[tuple[str, Plan]]:
    """The plans the default chooses from, each with its name: the FLOP-proportional split
    (``proportional``), every tower on every rank (``colocated``) and, when there are at most
    :data:`MAX_SPLITS` of them, every other split of the ranks into contiguous blocks, one per tower
    in the towers' order (``separate``)."""
    names = list(flops)
    out: list[tuple[str, Plan]] = [("proportional", proportional_plan(flops, world_size))]
    if len(names) > 1:
        out.append(("colocated", colocated_plan(names, world_size)))
    if 1 < len(names) <= world_size and math.comb(world_size - 1, len(names) - 1) <= MAX_SPLITS + 1:
        seen = {_counts(out[0][1], names)}
        for cuts in itertools.combinations(range(1, world_size), len(names) - 1):
            bounds = (0, *cuts, world_size)
            counts = tuple(bounds[i + 1] - bounds[i] for i in range(len(names)))
            if counts in seen:
                continue
            towers = {n: TowerPlan(ranks=list(range(bounds[i], bounds[i + 1]))) for i, n in enumerate(names)}
            out.append(("separate", Plan(world_size, towers)))
    return out


def _counts(plan: Plan, names: Sequence[str]) -> tuple[int, ...]:
    return tuple(len(plan.towers[n].ranks) for n in names)


@dataclass
class DefaultChoice:
    """The default's answer: the plan it runs, its name, and every candidate's predicted step."""

    plan: Plan
    name: str
    predicted: list[tuple[str, Plan, float]]
    host: Host
    global_batch: int

    def seconds(self, name: str) -> float | None:
        """The predicted step of the best candidate called ``name`` (None when not priced)."""
        found = [s for n, _, s in self.predicted if n == name]
        return min(found) if found else None

    def line(self) -> str:
        """One line for the log: what was chosen and its predicted ratio to the FLOP-proportional
        split and to colocated (whichever it is not), with what it was priced on."""
        mine = self.seconds(self.name)
        assert mine is not None
        others = []
        for other in ("proportional", "colocated"):
            t = self.seconds(other)
            if other != self.name and t is not None:
                label = "the FLOP-proportional split" if other == "proportional" else "colocated"
                others.append(
                    f"{t / mine:.2f}x faster than {label} ({plan_layout(self._plan_of(other))}: {t * 1e3:.0f} ms)"
                )
        where = (
            f"{self.host.cores} CPU cores, {self.host.threads} thread(s) per rank"
            if self.host.kind == "cpu"
            else self.host.name or self.host.kind
        )
        return (
            f"distmm default plan: {self.name} ({plan_layout(self.plan)}, {mine * 1e3:.0f} ms per step), predicted"
            f" {' and '.join(others) or 'the only candidate'}; priced from counted FLOPs on {where}, global batch"
            f" {self.global_batch} (plan='auto' measures instead)"
        )

    def _plan_of(self, name: str) -> Plan:
        return min((x for x in self.predicted if x[0] == name), key=lambda x: x[2])[1]


def plan_layout(plan: Plan) -> str:
    """A plan in a few words: `image@0-1, text@2`, or every tower on which ranks."""
    if plan.colocated:
        return f"every tower on ranks 0-{plan.world_size - 1}" if plan.world_size > 1 else "every tower on rank 0"
    parts = []
    for name, t in plan.towers.items():
        r = t.ranks
        span = f"{r[0]}-{r[-1]}" if len(r) > 1 and r == list(range(r[0], r[-1] + 1)) else ",".join(map(str, r))
        parts.append(f"{name}@{span}")
    return ", ".join(parts)


def default_plan(
    towers: Mapping[str, CountedTower],
    world_size: int,
    global_batch: int | None,
    host: Host,
    precision: str | None = None,
) -> DefaultChoice:
    """Price :func:`candidate_plans` for ``towers`` on ``world_size`` ranks of ``host`` and return
    the cheapest (ties go to the earlier candidate: the proportional split, then colocated).

    ``precision``: Lightning's precision of the run (CPU ranks compute in fp32, as the runtime does;
    the gradient all-reduce overlaps the backward only on GPUs: :func:`~lightning_distmm.planner.auto.runtime_cost_defaults`).
    A candidate whose static bytes do not fit the device loses to one that does."""
    G = int(global_batch) if global_batch else max(DEFAULT_BATCH, world_size)
    cluster = host_cluster(host, world_size)
    profiles = {n: counted_profile(n, t, cluster) for n, t in towers.items()}
    cpu = host.kind == "cpu"
    options = PlannerOptions.from_any(
        {"precision": "32" if cpu or not precision else precision, "overlap_grad_sync": not cpu}
    )
    names = list(towers)
    priced: list[tuple[str, Plan, float, bool]] = []
    for name, plan in candidate_plans({n: towers[n].flops for n in names}, world_size):
        if any(G < len(t.ranks) for t in plan.towers.values()):
            continue  # a replica without a sample
        cost = price_plan(plan, profiles, cluster, options, G)
        priced.append((name, plan, cost.step_time, cost.fits))
    if not priced:  # fewer samples than ranks: the runtime's own check names the problem
        plan = proportional_plan({n: towers[n].flops for n in names}, world_size)
        return DefaultChoice(plan, "proportional", [("proportional", plan, math.nan)], host, G)
    best = min(priced, key=lambda x: (not x[3], x[2]))
    return DefaultChoice(best[1], best[0], [(n, p, s) for n, p, s, _ in priced], host, G)


def proportional_plan(tower_flops: Mapping[str, float], world_size: int, global_batch: int | None = None) -> Plan:
    """Ranks in proportion to each tower's forward FLOPs: one candidate of the default plan
    (this module prices it against colocated and the other splits).

    Every tower gets at least one rank; with fewer ranks than towers the plan is colocated.
    Ranks are given out contiguously in the towers' order.
    """
    names = list(tower_flops)
    if world_size < len(names):
        return colocated_plan(names, world_size, global_batch)
    total = sum(max(float(f), 0.0) for f in tower_flops.values()) or 1.0
    spare = world_size - len(names)
    exact = [spare * max(float(tower_flops[n]), 0.0) / total for n in names]
    counts = [1 + int(x) for x in exact]
    order = sorted(range(len(names)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in order[: world_size - sum(counts)]:
        counts[i] += 1
    towers, start = {}, 0
    for name, count in zip(names, counts):
        towers[name] = TowerPlan(ranks=list(range(start, start + count)))
        start += count
    return Plan(world_size, towers, global_batch)


__all__ = [
    "CountedTower",
    "Host",
    "DefaultChoice",
    "describe_cpu",
    "host_cluster",
    "counted_profile",
    "fitted_profile",
    "candidate_plans",
    "default_plan",
    "proportional_plan",
    "plan_layout",
]
