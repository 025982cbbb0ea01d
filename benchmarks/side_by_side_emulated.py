"""DistMM against DDP, FSDP and a Megatron-style plan, measured side by side on two emulated nodes.

The cluster is ``benchmarks/placement_emulated.py``'s (imported, not copied): two network
namespaces of 2 CPU ranks (gloo) each, joined by a veth pair shaped by ``tc tbf``, one
``torchrun`` per namespace, each namespace's ranks on their own half of the cores. One launch per
round trains four plans of the same model, the order rotating over ``--rounds`` rounds (4: each
plan goes first once; noise on the shared host hits every plan alike; the cores other processes
kept busy are printed):

* **distmm**: the planner's separate-tower plan (``make_plan`` with ``layouts=["separate"]`` and
  what the runtime runs: tp = pp = 1, gpipe), each tower on its own ranks, placed by the planner;
  the plan ``plan="auto"`` would pick (separate or colocated) is printed beside it;
* **ddp**: every rank runs both towers, replicated, gradients all-reduced (``colocated_plan``);
* **fsdp**: the same with ``shard: full`` on both towers (FSDP2 over all 4 ranks);
* **megatron**: the uniform Megatron-style plan: the same tp x pp on both towers (default tp 2,
  pp 1: each tensor-parallel pair inside a node, data parallel across the link), one microbatch
  per pipeline (the whole replica batch). Tensor parallelism across the namespaces is not run.

The model's towers differ in size: a ViT image tower of 1.8M parameters and a text tower of 0.37M
whose 192-token captions take about as long to compute (``placement_emulated``'s ``small`` with 4
image heads instead of 3, so that tp 2 divides both towers' heads).

**The link rate** is chosen so that a step's communication : compute matches two A100 nodes on a
100 Gb/s network. Define rho = (the DDP plan's gradient all-reduce seconds) / (its forward +
backward seconds), both from the cost model (``price_plan``; ``TowerCost.dp_allreduce``, summed
over the towers, over ``forward_phase + backward_phase`` and, on CPU ranks that share a node's
cores, the ``contention`` that stretches them). The A100 reference is ``clip_vit_b32``
(151M parameters, the smallest CLIP preset: the scale of a 2-node job) on ``a100_8x8_eth100`` cut
to 2 nodes x 8 (12.5 GB/s per node), global batch 4096 (256 per GPU), bf16-mixed: 1.21 GB of fp32
gradients cross each NIC per step, 53.3 ms of all-reduce, 68.0 ms of forward + backward, rho =
0.78. (The planner's A100 compute is ~1.7x optimistic against published CLIP throughputs,
docs/planner-results.md, "Published measurements"; with measured-like compute rho would be ~0.46, a faster link.) On the
CPU ranks rho(rate) is the same ratio for this model's DDP plan at global batch 32 on the emulated
spec calibrated here (fp32 gradients, 8.7 MB), and the rate is solved from rho(rate) = rho_A100
by bisection (``matched_rate``); the script prints both sides (the committed run: 261 ms of
all-reduce over 333 ms of compute at 299 Mbit/s). The other plans run on that link.

Each plan is priced with ``price_plan`` on the emulated cluster spec (``placement_emulated``'s
``emulated_cluster``: the tbf rate, TCP framing, gloo's measured latency; this host calibrated,
the towers' measured fits riding on their analytic profiles so tp 2 can be priced) and the
framework's own cost per step (``CostOptions.step_overhead``: Lightning's loop, the strategy's
work outside the towers, the optimizer's calls) measured on the emulated nodes as the step of the
same model with trivial towers less its price (``framework_overhead``). Printed per
plan: rank 0's step time (median of all timed steps), its spread (IQR of the steps, min-max of the
round medians), the measured and predicted speedup over each other plan, and where DistMM loses.
The host is calibrated once and every link rate of ``--rate-mbit`` runs on that calibration (by
default the matched rate and 10x it, the regime where DistMM stops winning), and on one emulation:
each round runs every rate once, the link reshaped between them (``tc qdisc replace``) and the
rates' order turning from round to round, so that the host's drift over the run (a same plan's
step moved 17% between two rates measured one after the other) hits both tables alike and they
differ by the link alone. Results go to ``--results`` (``benchmarks/results/emulated_side_by_side``
``.json`` / ``.md``) for the first rate and ``--results`` + ``_fast`` for the second; each says which
plans' predicted steps lie within 15% of the measured ones and how far each predicted speedup is.

Needs root, ``ip netns`` and ``tc`` (as placement_emulated). About 7 minutes per rate on a quiet
2-core host; ``--dry-run`` calibrates, plans and prices only.

    python benchmarks/side_by_side_emulated.py [--rate-mbit auto,10x] [--rounds 4] [--steps 8] [--dry-run] [-v]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: placement_emulated, cost_model_fidelity
import placement_emulated as pe  # noqa: E402

from lightning_distmm.planner import Cluster, Plan, price_plan  # noqa: E402

PLANS = ("distmm", "ddp", "fsdp", "megatron")
#: plans run only when ``--plans`` names them: ``separate_tp2`` is distmm's separate towers with tp 2
#: in each (the image tower's pair on node 0, the text tower's on node 1): the Megatron-style
#: plan's tp pairs without its data-parallel sums across the link
OPTIONAL_PLANS = ("separate_tp2",)
RESULTS = pe.ROOT / "benchmarks" / "results" / "emulated_side_by_side"
REFERENCE = {"model": "clip_vit_b32", "cluster": "a100_8x8_eth100", "nodes": 2, "global_batch": 4096}

# predicted / measured samples/s of NeMo's ViT-g/14 on DGX A100 (docs/planner-results.md, "Published measurements"): the cost
# model's A100 compute is this much too fast, so the A100 side's rho may be this much too high
NEMO_GAP = 1.43

MODEL: dict[str, Any] = copy.deepcopy(pe.SMALL)
MODEL["name"] = "clip_small_heavy_image_h4"
MODEL["towers"]["image"]["heads"] = 4  # tp 2 divides both towers' heads (text has 2)

#: the same model with towers that cost next to nothing: its measured step less its priced step is
#: the framework's own cost per step on the emulated nodes (``CostOptions.step_overhead``)
TRIVIAL: dict[str, Any] = copy.deepcopy(MODEL)
TRIVIAL["name"] = "clip_trivial"
TRIVIAL["embed_dim"] = 16
TRIVIAL["towers"]["image"].update(img_size=8, patch_size=4, width=16, layers=1, heads=1)
TRIVIAL["towers"]["text"].update(context_length=8, width=16, layers=1, heads=1)


# ---------------------------------------------------------------------- the link rate
def comm_compute(cost: Any) -> tuple[float, float]:
    """A priced step's gradient all-reduce seconds and compute seconds (forward + backward, stretched
    by the node's other ranks on a shared host: ``contention``, 0 on GPUs), summed over towers."""
    comm = sum(t.dp_allreduce for t in cost.towers.values())
    compute = sum(t.forward_phase + t.backward_phase + t.contention for t in cost.towers.values())
    return comm, compute


def reference_ratio(reference: Mapping[str, Any] = REFERENCE) -> dict[str, float]:
    """rho of the DDP plan of ``reference['model']`` on ``reference['nodes']`` nodes of the preset
    cluster (the cost model's defaults: bf16-mixed, fp32 gradients), and the numbers behind it."""
    import yaml

    from lightning_distmm.core.plan import colocated_plan
    from lightning_distmm.planner import load_cluster, model_profiles

    cfg = yaml.safe_load((pe.ROOT / "conf" / "model" / f"{reference['model']}.yaml").read_text())
    base = load_cluster(reference["cluster"])
    cl = base.with_world(int(reference["nodes"]) * base.devices_per_node)
    profiles = model_profiles(cfg)
    G = int(reference["global_batch"])
    cost = price_plan(colocated_plan(list(profiles), cl.world_size, G), profiles, cl)
    comm, compute = comm_compute(cost)
    return {
        "devices": cl.world_size,
        "per_device_batch": G / cl.world_size,
        "link_gbps": cl.inter.bandwidth * 8 / 1e9,
        "bytes_per_nic": sum(t.bytes_inter for t in cost.towers.values()),
        "allreduce_s": comm,
        "compute_s": compute,
        "ratio": comm / compute,
    }


def matched_rate(target: float, ratio_at: Callable[[float], float], lo: float = 1.0, hi: float = 1e5) -> float:
    """The link rate (Mbit/s) at which ``ratio_at(rate)`` (decreasing in the rate) equals ``target``:
    bisection on a log scale; the nearest end of [lo, hi] when the target lies outside."""
    if ratio_at(hi) >= target:
        return hi
    if ratio_at(lo) <= target:
        return lo
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if ratio_at(mid) > target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.001:
            break
    return math.sqrt(lo * hi)


# ---------------------------------------------------------------------- the plans
def baseline_plans(towers: Sequence[str], batch: int, tp: int = 2, pp: int = 1) -> dict[str, Plan]:
    """DDP, FSDP and the uniform Megatron-style plan on the emulated cluster's 4 ranks, all colocated."""
    world = pe.NODES * pe.DEVICES_PER_NODE
    ranks = list(range(world))
    if world % (tp * pp):
        raise ValueError(f"megatron tp {tp} x pp {pp} does not divide {world} ranks")
    if tp > pe.DEVICES_PER_NODE:
        raise ValueError(f"megatron tp {tp}: a tensor-parallel group across the namespaces is not run here")
    return {
        "ddp": Plan(world, {n: {"ranks": ranks} for n in towers}, global_batch=batch),
        "fsdp": Plan(world, {n: {"ranks": ranks, "shard": "full"} for n in towers}, global_batch=batch),
        # microbatch None: each pipeline runs its whole replica batch as one microbatch (Megatron-LM's
        # schedules compute a loss per microbatch and cannot split a contrastive batch)
        "megatron": Plan(world, {n: {"ranks": ranks, "tp": tp, "pp": pp} for n in towers}, global_batch=batch),
    }


def separate_tp2_plan(separate: Plan) -> Plan:
    """``separate``'s towers, each on its ranks with tp 2 and one microbatch (the whole replica
    batch, as the Megatron-style plan runs it)."""
    towers = {n: {"ranks": list(t.ranks), "tp": 2} for n, t in separate.towers.items()}
    return Plan(separate.world_size, towers, global_batch=separate.global_batch)


def distmm_plans(profiles: Mapping[str, Any], cluster: Cluster, options: Mapping[str, Any], batch: int) -> dict:
    """The planner's separate-tower plan and what ``plan="auto"`` would pick (both layouts), with
    the options the runtime runs and no baselines in the pool."""
    from lightning_distmm.planner import make_plan

    base = {**options, "baselines": []}
    separate, _ = make_plan(None, cluster, batch, {**base, "layouts": ["separate"]}, profiles=profiles)
    auto, report = make_plan(None, cluster, batch, base, profiles=profiles)
    return {"separate": separate, "auto": auto, "auto_layout": report.chosen.name}


def describe(plan: Plan) -> str:
    parts = []
    for name, t in plan.towers.items():
        extra = [f"tp{t.tp}"] if t.tp > 1 else []
        extra += [f"pp{t.pp}"] if t.pp > 1 else []
        extra += [f"mb{t.microbatch}"] if t.microbatch else []
        extra += [f"shard {t.shard}"] if t.shard != "none" else []
        extra += ["recompute"] if t.recompute else []
        nodes = pe.nodes_of(t.ranks)
        where = f"node{'s' if len(nodes) > 1 else ''} {','.join(map(str, nodes))}"
        parts.append(f"{name}@{','.join(map(str, t.ranks))} ({where}{'; ' + ' '.join(extra) if extra else ''})")
    return " | ".join(parts)


def framework_overhead(args, host, concurrency, cores, rate, options) -> tuple[float, dict[str, float]]:
    """``CostOptions.step_overhead`` measured where the plans run: :data:`TRIVIAL` trained under a
    separate-tower plan and the colocated (DDP) plan on the emulated nodes (one launch, the link at
    ``rate``), each plan's measured step less what the cost model prices for it (its towers timed as
    the calibration times the model's, pinned to a node's cores), the mean of the two. What it holds:
    Lightning's loop, the strategy's work outside the towers' forward and backward, the loss, the
    optimizer's calls, on ranks that share a node's cores."""
    with pe.pinned(cores[0]):
        profiles = pe.tower_profiles(TRIVIAL, args)
    world = pe.NODES * pe.DEVICES_PER_NODE
    half = world // 2
    plans = {
        "separate": Plan(
            world, {"image": {"ranks": list(range(half))}, "text": {"ranks": list(range(half, world))}},
            global_batch=args.batch,
        ),
        "colocated": baseline_plans(list(TRIVIAL["towers"]), args.batch)["ddp"],
    }  # fmt: skip
    cluster = pe.emulated_cluster(host, pe.LinkSettings(rate), concurrency)
    priced = {
        k: price_plan(p, profiles, cluster, {**options, "step_overhead": 0.0}).step_time for k, p in plans.items()
    }
    with (
        tempfile.TemporaryDirectory(prefix="side_by_side_overhead_") as tmp,
        pe.Emulation(pe.LinkSettings(rate, burst_kib=args.burst_kib)) as emu,
    ):
        path = Path(tmp) / "model.json"
        path.write_text(json.dumps(TRIVIAL))
        run_args = argparse.Namespace(**{**vars(args), "model": str(path), "steps": 24, "warmup": 6})
        got = pe.run_round(emu, plans, run_args, Path(tmp), 0, cores)
    measured = {k: statistics.median(row[0] for row in got["rank0"][k]) for k in plans}
    overhead = statistics.mean(max(0.0, measured[k] - priced[k]) for k in plans)
    return overhead, {**{f"{k}_measured_s": measured[k] for k in plans}, **{f"{k}_priced_s": priced[k] for k in plans}}


# ---------------------------------------------------------------------- statistics and tables
def spread(steps: Sequence[float], round_medians: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles and min-max of the timed steps, and the per-round medians."""
    q = statistics.quantiles(steps, n=4, method="inclusive") if len(steps) > 1 else [steps[0]] * 3
    return {
        "median": statistics.median(steps),
        "q1": q[0],
        "q3": q[2],
        "min": min(steps),
        "max": max(steps),
        "rounds": list(round_medians),
        "steps": len(steps),
    }


def speedups(times: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``out[a][b]``: how many times faster ``a`` is than ``b`` (``times[b] / times[a]``)."""
    return {a: {b: times[b] / times[a] for b in times if b != a} for a in times}


#: how far a predicted speedup may be from the measured one and still count as the model agreeing
RATIO_TOLERANCE = 0.10


def verdicts(measured: Mapping[str, float], predicted: Mapping[str, float], who: str = "distmm") -> list[str]:
    """Plain sentences: where ``who`` wins or loses, measured, with the prediction beside and how far
    it is: the model agrees when it names the same winner *and* its speedup is within
    :data:`RATIO_TOLERANCE` of the measured one (a measured tie, within 2%, has no winner to name);
    the right winner with a speedup further off says by how much."""
    out = []
    m, p = speedups(measured)[who], speedups(predicted)[who]
    for other in m:
        verb = "wins against" if m[other] > 1.02 else "loses to" if m[other] < 0.98 else "ties with"
        off = p[other] / m[other] - 1
        tie = 0.98 <= m[other] <= 1.02  # no winner measured: only how far the prediction is counts
        if not tie and (m[other] > 1) != (p[other] > 1):
            agree = "the model predicted the opposite"
        elif abs(off) <= RATIO_TOLERANCE:
            agree = f"the model agrees: {off:+.0%}"
        elif tie:
            agree = f"the predicted speedup is {off:+.0%} off"
        else:
            agree = f"the right winner, but the predicted speedup is {off:+.0%} off"
        out.append(f"{who} {verb} {other}: {m[other]:.2f}x measured, {p[other]:.2f}x predicted ({agree})")
    return out


#: how far a plan's predicted step may be from its measured one and still count as priced right
TIME_TOLERANCE = 0.15


def time_verdict(measured: Mapping[str, float], predicted: Mapping[str, float]) -> str:
    """One sentence: which plans' predicted steps lie within :data:`TIME_TOLERANCE` of the measured."""
    errors = {k: predicted[k] / measured[k] - 1 for k in measured}
    off = [f"{k} {e:+.0%}" for k, e in errors.items() if abs(e) > TIME_TOLERANCE]
    within = [f"{k} {e:+.0%}" for k, e in errors.items() if abs(e) <= TIME_TOLERANCE]
    head = f"predicted step within {TIME_TOLERANCE:.0%} of the measured: "
    return head + (", ".join(within) or "none") + ("; outside it: " + ", ".join(off) if off else "")


def markdown(result: Mapping[str, Any]) -> str:
    """The short table of a result (what docs/planner-results.md quotes)."""
    plans = result["plans"]
    names = list(plans)
    rows = [
        "| plan | towers | predicted ms | measured ms (IQR; round medians) | error | distmm's speedup measured |"
        " predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in names:
        p = plans[k]
        s = p["measured"]
        rounds = " / ".join(f"{t * 1e3:.0f}" for t in s["rounds"])
        if k == "distmm":
            ms = mp = "-"
        else:
            ms = f"{result['speedup']['measured']['distmm'][k]:.2f}x"
            mp = f"{result['speedup']['predicted']['distmm'][k]:.2f}x"
        rows.append(
            f"| {k} | {p['towers'].replace('|', chr(92) + '|')} | {p['predicted_s'] * 1e3:.0f} | {s['median'] * 1e3:.0f}"
            f" ({s['q1'] * 1e3:.0f}-{s['q3'] * 1e3:.0f}; {rounds}) | {p['predicted_s'] / s['median'] - 1:+.0%} | {ms} | {mp} |"
        )
    head = ["| measured (predicted) speedup of row over column |", "|---" * (len(names) + 1) + "|"]
    head[0] = "| row over column | " + " | ".join(names) + " |"
    for a in names:
        cells = [
            "-" if a == b else f"{result['speedup']['measured'][a][b]:.2f} ({result['speedup']['predicted'][a][b]:.2f})"
            for b in names
        ]
        head.append(f"| {a} | " + " | ".join(cells) + " |")
    link, ref = result["link"], result["reference"]
    lines = [
        f"Emulated cluster: 2 namespaces x 2 CPU ranks (gloo), tbf {link['rate_mbit']:.0f} Mbit/s per node and"
        f" direction ({link['measured_mbit']:.0f} measured), {result['model']['name']} (image"
        f" {result['model']['params']['image'] / 1e6:.2f}M, text {result['model']['params']['text'] / 1e6:.2f}M"
        f" parameters), global batch {result['batch']}, {result['rounds']} rounds x {result['timed_steps']} timed"
        f" steps; other processes kept {result['foreign_cores']:.1f} cores busy (median over rounds).",
        f"Link rate: comm/compute of the DDP plan {link['ratio']:.2f} here vs {ref['ratio']:.2f} for"
        f" {ref['model']} on 2 A100 nodes at {ref['link_gbps']:.0f} Gb/s"
        + (
            f" (this host calibrated while other processes kept {result['calibration']['foreign_cores']:.1f} cores busy)."
            if "calibration" in result
            else "."
        ),
        "",
        *rows,
        "",
        "Measured (predicted) speedup, row over column:",
        "",
        *head,
        "",
        *[f"- {v}" for v in result["verdicts"]],
        "",
        *parts_lines(result),
    ]
    if result.get("notes"):
        lines += ["", *[f"- {n.splitlines()[0][:300]}" for n in result["notes"]]]  # the JSON keeps them whole
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- the run
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rate-mbit",
        default="auto,10x",
        help="link rates, each run on the same calibration: 'auto' (matched to 2 A100 nodes at 100 Gb/s), Mbit/s,"
        " or Nx (N times the first); the first writes --results, the second --results + '_fast', others '_<i>'",
    )
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=8, help="steps per plan and round, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each plan goes first in one of every 4")
    parser.add_argument("--plans", default=",".join(PLANS), help="a subset of " + ",".join(PLANS))
    parser.add_argument("--megatron-tp", type=int, default=2)
    parser.add_argument("--megatron-pp", type=int, default=1)
    parser.add_argument(
        "--step-overhead-ms",
        type=float,
        default=None,
        help="CostOptions.step_overhead to price with; by default measured on the emulated nodes with trivial"
        " towers (0 in a dry run)",
    )
    parser.add_argument("--burst-kib", type=float, default=None, help="tbf's bucket (default: placement_emulated's)")
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds one launch may take")
    pe.add_profile_args(parser)
    parser.add_argument("--cached-host", action="store_true", help="as placement_emulated's")
    parser.add_argument("--results", default=str(RESULTS), help="path prefix of the .json and .md written")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--quiet-cores", type=float, default=0.5, help="calibrate once others use fewer cores")
    parser.add_argument("--quiet-wait", type=float, default=120.0, help="at most this many seconds of waiting")
    parser.add_argument("--dry-run", action="store_true", help="calibrate, plan and price; run nothing")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    args.rates = [r.strip() for r in str(args.rate_mbit).split(",")]
    for r in args.rates:
        try:
            if r != "auto" and float(r.removesuffix("x")) <= 0:
                raise ValueError
        except ValueError:
            parser.error(f"--rate-mbit {args.rate_mbit}: each rate is 'auto', Mbit/s or Nx (N times the first)")
    if args.rates[0].endswith("x"):
        parser.error("--rate-mbit: the first rate is 'auto' or Mbit/s; later ones may be Nx of it")
    args.plans = tuple(k.strip() for k in args.plans.split(","))
    if "distmm" not in args.plans or any(k not in PLANS + OPTIONAL_PLANS for k in args.plans):
        parser.error(f"--plans {','.join(args.plans)}: distmm and any of {', '.join(PLANS[1:] + OPTIONAL_PLANS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    import signal
    import warnings

    from cost_model_fidelity import ForeignLoad, wait_quiet

    args = parse_args(argv)
    why = pe.preflight()
    if why:
        sys.exit(f"side_by_side_emulated: {why}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, pe._exit_on_signal)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    cores = pe.node_cores(args.pin)
    waited = wait_quiet(args.quiet_cores, args.quiet_wait)  # a busy host's calibration sets a slow link
    load = ForeignLoad()
    load.start()
    host, concurrency, profiles = pe.calibrate(MODEL, args, cores[0], analytic=True)
    calib_load = load.stop()
    options = pe.planner_options((args.step_overhead_ms or 0.0) * 1e-3)
    ref = {**REFERENCE, **reference_ratio()}
    towers = list(MODEL["towers"])
    ddp_probe = baseline_plans(towers, args.batch)["ddp"]

    def ratio_at(mbit: float) -> float:
        comm, compute = comm_compute(
            price_plan(ddp_probe, profiles, pe.emulated_cluster(host, pe.LinkSettings(mbit), concurrency), options)
        )
        return comm / compute

    rates: list[tuple[str, float]] = []
    for spec in args.rates:
        if spec == "auto":
            rate = float(round(matched_rate(ref["ratio"], ratio_at)))
        elif spec.endswith("x"):
            rate = float(round(float(spec[:-1]) * rates[0][1]))
        else:
            rate = float(spec)
        rates.append((spec, rate))
    calib = {"foreign_cores_before": waited, "foreign_cores": calib_load, "concurrency": concurrency}
    if args.step_overhead_ms is None and not args.dry_run:
        overhead, raw = framework_overhead(args, host, concurrency, cores, rates[0][1], options)
        options["step_overhead"] = overhead
        calib["step_overhead_s"], calib["step_overhead_runs"] = overhead, raw
        print(
            f"framework overhead per step {overhead * 1e3:.1f} ms (trivial towers on the emulated nodes: "
            + ", ".join(f"{k} {raw[k + '_measured_s'] * 1e3:.1f} ms measured, {raw[k + '_priced_s'] * 1e3:.1f} priced"
                        for k in ("separate", "colocated"))
            + ")",
            flush=True,
        )  # fmt: skip
    else:
        calib["step_overhead_s"] = options["step_overhead"]
    print(
        f"calibrated in {time.perf_counter() - t0:.0f} s (other processes kept {waited:.1f} cores busy before,"
        f" {calib_load:.1f} during): concurrency {concurrency:.2f}; link rate: the DDP plan's"
        f" all-reduce / forward+backward is {ref['ratio']:.3f} for {ref['model']} on {ref['devices']} A100s"
        f" ({ref['per_device_batch']:.0f} per GPU; {ref['bytes_per_nic'] / 1e9:.2f} GB per NIC at"
        f" {ref['link_gbps']:.0f} Gb/s: {ref['allreduce_s'] * 1e3:.1f} ms over {ref['compute_s'] * 1e3:.1f} ms)",
        flush=True,
    )
    priced = [
        price_rate(args, spec, rate, host, concurrency, profiles, options, ref, towers, ratio_at)
        for spec, rate in rates
    ]
    if args.dry_run:
        return
    measured = measure_rates(args, priced, cores, t0)
    for i, (p, m) in enumerate(zip(priced, measured, strict=True)):
        suffix = "" if i == 0 else "_fast" if i == 1 else f"_{i}"
        if not m["foreign"]:
            print(f"side_by_side_emulated: every round at {p['rate']:g} Mbit/s failed:\n" + "\n".join(m["failed"]))
            continue
        result = build_result(
            args, p["rate"], m["mbit"], p["ratio"], ref, p["plans"], p["predicted"], p["waits"], m["steps"], m["per_round"],
            m["parts"], m["foreign"],
        )  # fmt: skip
        result["notes"] = p["notes"] + m["failed"]
        result["calibration"] = calib
        report(result, Path(args.results + suffix))


def price_rate(args, spec, rate, host, concurrency, profiles, options, ref, towers, ratio_at) -> dict[str, Any]:
    """The four plans on a link of ``rate`` Mbit/s, priced, with the notes the table carries
    (what ``plan="auto"`` would pick, the plans not run, the predicted speedups at other rates)."""
    ddp_probe = baseline_plans(towers, args.batch)["ddp"]
    link = pe.LinkSettings(rate, burst_kib=args.burst_kib)
    cluster = pe.emulated_cluster(host, link, concurrency)
    comm, compute = comm_compute(price_plan(ddp_probe, profiles, cluster, options))
    print(
        f"{rate:g} Mbit/s: the DDP plan's all-reduce / forward+backward here is {comm * 1e3:.0f} ms over"
        f" {compute * 1e3:.0f} ms = {comm / compute:.3f} (the A100 reference: {ref['ratio']:.3f})",
        flush=True,
    )
    dm = distmm_plans(profiles, cluster, options, args.batch)
    plans = {"distmm": dm["separate"], **baseline_plans(towers, args.batch, args.megatron_tp, args.megatron_pp)}
    if "separate_tp2" in args.plans:
        plans["separate_tp2"] = separate_tp2_plan(dm["separate"])
    plans = {k: plans[k] for k in args.plans}
    predicted = {k: price_plan(p, profiles, cluster, options) for k, p in plans.items()}
    notes = [
        f"plan='auto' would run {dm['auto_layout']}: {describe(dm['auto'])}"
        f" (predicted {price_plan(dm['auto'], profiles, cluster, options).step_time * 1e3:.0f} ms)",
        "tensor parallelism across the namespaces (the link) is not run: megatron's tp pairs stay inside a node",
    ]
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        if (tp, pp) != (args.megatron_tp, args.megatron_pp):
            alt = baseline_plans(towers, args.batch, tp, pp)["megatron"]
            notes.append(
                f"megatron tp{tp} pp{pp} (not run) predicted {price_plan(alt, profiles, cluster, options).step_time * 1e3:.0f} ms"
            )
    if spec == "auto":  # the A100 side's compute as NeMo measured it: a faster link, priced only
        slow = round(matched_rate(ref["ratio"] / NEMO_GAP, ratio_at))
        cl_slow = pe.emulated_cluster(host, pe.LinkSettings(slow), concurrency)
        t = {k: price_plan(p, profiles, cl_slow, options).step_time for k, p in plans.items()}
        notes.append(
            f"with A100 compute {NEMO_GAP}x the cost model's (its gap to NeMo's published ViT-g/14 rate), rho ="
            f" {ref['ratio'] / NEMO_GAP:.2f} and the link {slow} Mbit/s; there distmm's predicted speedup is "
            + ", ".join(f"{t[k] / t['distmm']:.2f}x over {k}" for k in t if k != "distmm")
            + " (not measured)"
        )
    for factor in (0.5, 2.0, 10.0):  # where the model says the comparison turns (priced, not measured)
        cl_f = pe.emulated_cluster(host, pe.LinkSettings(rate * factor), concurrency)
        t = {k: price_plan(p, profiles, cl_f, options).step_time for k, p in plans.items()}
        notes.append(
            f"at {rate * factor:g} Mbit/s ({factor:g}x the link) distmm's predicted speedup is "
            + ", ".join(f"{t[k] / t['distmm']:.2f}x over {k}" for k in t if k != "distmm")
            + " (same plans, not measured)"
        )
    for k, p in plans.items():
        fwd, bwd = rank0_compute(p, predicted[k])
        print(
            f"  {k:<9} {describe(p)}: predicted {predicted[k].step_time * 1e3:.0f} ms (rank 0: forward"
            f" {fwd * 1e3:.0f}, backward {bwd * 1e3:.0f})",
            flush=True,
        )
    for n in notes:
        print(f"  {n}", flush=True)
    waits = {k: rank0_waits(p, predicted[k], profiles, cluster, options) for k, p in plans.items()}
    return {
        "rate": rate,
        "link": link,
        "ratio": comm / compute,
        "plans": plans,
        "predicted": predicted,
        "waits": waits,
        "notes": notes,
    }


def measure_rates(args, priced: Sequence[Mapping[str, Any]], cores, t0: float) -> list[dict[str, Any]]:
    """Every rate's plans trained on one emulation, ``--rounds`` rounds; within each round every rate
    runs once, the link reshaped between them and the rates' order turning from round to round, so
    that the host's drift over the run hits each rate's table alike."""
    from cost_model_fidelity import ForeignLoad

    out = [
        {
            "steps": {k: [] for k in p["plans"]},
            "per_round": {k: [] for k in p["plans"]},
            "parts": {k: [] for k in p["plans"]},
            "foreign": [],
            "failed": [],
        }
        for p in priced
    ]
    with tempfile.TemporaryDirectory(prefix="side_by_side_") as tmp, pe.Emulation(priced[0]["link"]) as emu:
        model_path = Path(tmp) / "model.json"
        model_path.write_text(json.dumps(MODEL))
        run_args = argparse.Namespace(**{**vars(args), "model": str(model_path)})
        for p, m in zip(priced, out, strict=True):
            emu.set_link(p["link"])
            m["mbit"] = pe.probe_link(emu)
            print(f"link: tbf {p['rate']:g} Mbit/s, one TCP stream measured {m['mbit']:.0f} Mbit/s", flush=True)
        launch = 0
        for r in range(args.rounds):
            for i in [(j + r) % len(priced) for j in range(len(priced))]:  # each rate first in turn
                p, m = priced[i], out[i]
                emu.set_link(p["link"])
                names = list(p["plans"])
                order = names[r % len(names) :] + names[: r % len(names)]  # each plan first in turn
                load = ForeignLoad()
                load.start()
                try:
                    got = pe.run_round(emu, {k: p["plans"][k] for k in order}, run_args, Path(tmp), launch, cores)
                except RuntimeError as err:  # a failed launch costs its round, not the run: said in the result
                    m["failed"].append(f"round {r + 1} failed and is not counted: {str(err)[-1500:]}")
                    print(m["failed"][-1], flush=True)
                    continue
                finally:
                    launch += 1
                m["foreign"].append(load.stop())
                for k in order:
                    m["steps"][k] += [row[0] for row in got["rank0"][k]]
                    m["per_round"][k].append(statistics.median(row[0] for row in got["rank0"][k]))
                    m["parts"][k].append(got["parts"][k][0])
                line = pe.round_line(r, order, got["nodes"], m["per_round"], p["plans"], m["foreign"][-1], t0)
                print(f"{p['rate']:g} Mbit/s {line}", flush=True)
                if args.verbose:
                    for k in order:
                        print(
                            f"  {k}: rank medians s (wall/CPU/fwd/bwd/sync/coll in fwd/in bwd/elsewhere) {got['parts'][k]}",
                            flush=True,
                        )
        if args.verbose:
            print(emu.qdisc_stats())
    return out


def rank0_compute(plan: Plan, cost: Any) -> tuple[float, float]:
    """Rank 0's predicted forward and backward seconds in ``cost``: the phases of the towers it
    runs, each stretched by its share of the node's contention (what the worker times as rank 0's
    Forward and Backward instructions)."""
    fwd = bwd = 0.0
    for name, t in cost.towers.items():
        if 0 in plan.towers[name].ranks:
            busy = t.forward_phase + t.backward_phase
            stretch = 1 + t.contention / busy if busy > 0 else 1.0
            fwd, bwd = fwd + t.forward_phase * stretch, bwd + t.backward_phase * stretch
    return fwd, bwd


def rank0_waits(plan: Plan, cost: Any, profiles: Mapping[str, Any], cluster: Cluster, options: Mapping) -> dict:
    """Rank 0's predicted seconds per step inside collectives, where the worker's collective clock
    sees them: FSDP's per-layer gathers in the forward and gathers and reduce-scatters in the
    backward (per microbatch), the tensor-parallel all-reduces (half in each) and the exposed
    gradient sums (``other``). The batch-sync has its own column."""
    from lightning_distmm.planner import PlannerOptions
    from lightning_distmm.planner.cost import LAYER_SHARDS, plan_choices, shard_comm

    opts = PlannerOptions.from_any(options).cost
    cl = cluster.with_world(plan.world_size) if cluster.world_size != plan.world_size else cluster
    choices, ranks = plan_choices(plan)
    out = {"forward": 0.0, "backward": 0.0, "other": 0.0}
    for name, tc in cost.towers.items():
        if 0 not in ranks[name]:
            continue
        c = choices[name]
        if c.shard in LAYER_SHARDS:
            ag, agrs = shard_comm(profiles[name], cl, opts, c.dp * c.cp, c.tp, c.pp, c.shard)
            k = cost.extra["details"][name]["K"]
            out["forward"] += k * float(ag)
            out["backward"] += k * float(agrs)
        out["forward"] += tc.tp_comm / 2
        out["backward"] += tc.tp_comm / 2
        out["other"] += tc.dp_exposed
    return out


def parts_lines(result: Mapping[str, Any]) -> list[str]:
    """Rank 0's step in parts, predicted beside measured: where a plan's error lies."""
    rows = [
        "| plan | forward predicted / measured ms | backward | the rest of the step (sums, optimizer, framework) |",
        "|---|---|---|---|",
    ]
    for k, p in result["plans"].items():
        if "rank0_predicted_s" not in p or not p["rank0_parts_s"]:
            continue
        fp, bp = p["rank0_predicted_s"]["forward"], p["rank0_predicted_s"]["backward"]
        fm = statistics.median(r[2] for r in p["rank0_parts_s"])
        bm = statistics.median(r[3] for r in p["rank0_parts_s"])
        rest_p, rest_m = p["predicted_s"] - fp - bp, p["measured"]["median"] - fm - bm
        rows.append(
            f"| {k} | {fp * 1e3:.0f} / {fm * 1e3:.0f} | {bp * 1e3:.0f} / {bm * 1e3:.0f} |"
            f" {rest_p * 1e3:.0f} / {rest_m * 1e3:.0f} |"
        )
    waits = [
        "| plan | in the forward, predicted / measured ms | in the backward | elsewhere (gradient sums) |",
        "|---|---|---|---|",
    ]
    for k, p in result["plans"].items():
        if "rank0_waits_s" not in p or not p["rank0_parts_s"] or len(p["rank0_parts_s"][0]) < 8:
            continue
        cells = [
            f"{p['rank0_waits_s'][part] * 1e3:.0f} / {statistics.median(r[i] for r in p['rank0_parts_s']) * 1e3:.0f}"
            for part, i in (("forward", 5), ("backward", 6), ("other", 7))
        ]
        waits.append(f"| {k} | " + " | ".join(cells) + " |")
    return [
        "Rank 0's step in parts (measured: medians of its timed instructions over the rounds):",
        "",
        *rows,
        "",
        "Rank 0's seconds inside collectives (measured: the worker's collective clock; the batch-sync not counted):",
        "",
        *waits,
    ]


def build_result(args, rate, mbit, ratio, ref, plans, predicted, waits, steps, per_round, parts, foreign) -> dict:
    from lightning_distmm.models.clip import CLIPModel

    params = {n: sum(p.numel() for p in t.module.parameters()) for n, t in CLIPModel(MODEL, pe.OPTIM).towers().items()}
    measured = {k: statistics.median(steps[k]) for k in plans}
    pred = {k: predicted[k].step_time for k in plans}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": {"name": MODEL["name"], "params": params, "config": MODEL},
        "batch": args.batch,
        "rounds": len(foreign),
        "timed_steps": args.steps - args.warmup,
        "link": {"rate_mbit": rate, "measured_mbit": mbit, "ratio": ratio},
        "reference": ref,
        "foreign_cores": statistics.median(foreign),
        "foreign_cores_per_round": foreign,
        "plans": {
            k: {
                "towers": describe(plans[k]),
                "plan": plans[k].to_dict(),
                "predicted_s": pred[k],
                "measured": spread(steps[k], per_round[k]),
                "rank0_parts_s": parts[
                    k
                ],  # per round, medians: wall, CPU, forward, backward, batch-sync, collectives (3)
                "rank0_predicted_s": dict(zip(("forward", "backward"), rank0_compute(plans[k], predicted[k]))),
                "rank0_waits_s": waits[k],
            }
            for k in plans
        },
        "speedup": {"measured": speedups(measured), "predicted": speedups(pred)},
        "verdicts": [time_verdict(measured, pred), *verdicts(measured, pred)],
    }


def report(result: dict[str, Any], prefix: Path) -> None:
    text = markdown(result)
    print("\n" + text)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(f"# Side by side on two emulated nodes ({result['date']})\n\n{text}")
    print(f"wrote {prefix.with_suffix('.json')} and {prefix.with_suffix('.md')}")


if __name__ == "__main__":
    main()
