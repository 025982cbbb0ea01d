"""Predicted step time of the DistMM plan against the baselines (Megatron-LM, FSDP, DDP, and the
uniform+batchsync ablation), and solve time.

    python benchmarks/planner.py --paper                      # the DistMM paper's table: 1.1B-26B presets
    python benchmarks/planner.py --regimes                    # where DistMM wins: network x batch x memory map
    python benchmarks/planner.py --sharding-table             # distmm_10b / 26b on 64 A100s, with and without sharding
    python benchmarks/planner.py --published                  # predicted / measured for published CLIP trainings
    python benchmarks/planner.py                              # model presets x GPU cluster presets
    python benchmarks/planner.py --global-batch 1024,32768    # several contrastive batch sizes
    python benchmarks/planner.py --models clip_vit_bigg14 --clusters a100_8x8_eth100

DistMM's towers may be sharded as the runtime runs them (``shards: [none, optimizer, zero2, full,
hybrid]``: ZeRO-1, FSDP2's ZeRO-2, ZeRO-3 and HSDP). ``--sharding-table`` compares DistMM with and
without ZeRO-3.

``--paper`` prints, per preset, DistMM's best separate-tower plan (its own idea: each tower on its
own devices), its best colocated plan, every baseline's plan, and which one the planner picks. The
pick is the fastest of DistMM's plans and the baselines' plans that the runtime runs (DDP's and
FSDP's are colocated plans); when it is a baseline's own plan the row says so (``= fsdp``) and the
speedup over that baseline is 1.00x by construction, not a DistMM win.

All plans are priced by the same cost model (lightning_distmm.planner.cost); the baselines are searched
for their best configuration. "OOM" means no configuration of that baseline fits device memory for
the whole-batch contrastive loss. The last lines time the planner at 64 and at 4,096 devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_distmm.planner import InfeasibleError, load_cluster, make_plan  # noqa: E402
from lightning_distmm.planner.machine.cluster import CONF_DIR  # noqa: E402
from lightning_distmm.planner.search.baselines import BASELINES  # noqa: E402
from lightning_distmm.planner.search.report import Report, describe  # noqa: E402

#: every sharding the runtime runs and the planner prices
ALL_SHARDS = {"shards": ["none", "optimizer", "zero2", "full", "hybrid"]}
PAPER_MODELS = ["distmm_1b", "clip_vit_g14", "clip_vit_bigg14", "distmm_4b", "distmm_10b", "distmm_26b"]
PAPER_CLUSTERS = ["a100_8x8", "h100_8x8", "h200_8x8"]
SUMMARY = ("megatron", "megatron-tp-pp", "fsdp")  # the baselines the --paper summary lines compare with
PAPER_RANGE = (1.32, 3.27)  # DistMM (NSDI'24) speedups over Megatron-LM, 1.1B-26B CLIP models, 64 A100s

DEFAULT_MODELS = [
    "clip_vit_b32",
    "clip_vit_l14",
    "clip_vit_h14",
    "clip_vit_g14",
    "clip_vit_bigg14",
    "lit_l16_bert_large",
    "coca_vit_l14",
    "distmm_1b",
    "distmm_4b",
    "distmm_10b",
    "distmm_26b",
]
DEFAULT_CLUSTERS = ["a100_8x8", "a100_8x8_eth100", "h100_8x8", "h200_8x8"]


def fmt_time(t: float | None) -> str:
    if t is None:
        return "OOM"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def why(rep: Report) -> str:
    """One line on why DistMM wins or not against Megatron-LM, read off the two plans."""
    meg = rep.baselines.get("megatron")
    chosen = rep.chosen
    if meg is None:
        fits = [k for k, b in rep.baselines.items() if b is not None]
        return (
            "Megatron-LM: no uniform split fits the whole replica batch as one microbatch;"
            f" DistMM {chosen.cost.layout} (baselines that fit: {', '.join(fits) or 'none'})"
        )
    if chosen is meg or chosen.step_time >= meg.step_time * (1 - 1e-3):
        c = next(iter(meg.choices.values()))
        lacks = sorted(
            {"ZeRO-1" for ch in meg.choices.values() if ch.shard == "optimizer"}
            | {"block recompute" for ch in meg.choices.values() if ch.recompute_layers is not None}
            | {"sequence parallelism" for ch in meg.choices.values() if ch.tp > 1}
        )
        if chosen.step_time > meg.step_time * (1 + 1e-3):
            return f"Megatron-LM is faster: {', '.join(lacks) or 'its plan'}, which the runtime does not run"
        if c.tp * c.pp == 1:
            return "both pure data parallel: no pipeline for the contrastive batch to hurt"
        return "DistMM's best plan is Megatron-LM's"
    mt = sum(t.compute for t in meg.cost.towers.values())
    c = next(iter(meg.choices.values()))
    if chosen.cost.layout == "separate":
        return (
            f"towers on their own devices, each its own degrees; Megatron-LM at tp{c.tp} pp{c.pp}"
            f" (bubble {sum(t.bubble for t in meg.cost.towers.values()) * 1e3:.0f} ms of {meg.step_time * 1e3:.0f} ms)"
        )
    if c.pp > 1:
        return f"Megatron-LM's one-microbatch pipeline (pp{c.pp}) idles {c.pp - 1} of {c.pp} stages"
    ours = sum(t.compute for t in chosen.cost.towers.values())
    return f"per-tower degrees / sharding: compute {ours * 1e3:.0f} ms vs {mt * 1e3:.0f} ms, less communication"


def paper(global_batch: int, clusters: list[str]) -> None:
    """The DistMM paper's table: 1.1B-26B presets, DistMM against every baseline, with each plan."""
    print(
        f"DistMM vs baselines, global batch {global_batch}; every plan priced by one cost model (bf16-mixed);"
        " DistMM may shard its towers as the runtime does (ZeRO-3 / FSDP2)"
    )
    speedups = []
    tp_pp: list[float] = []
    solve: list[float] = []
    solve_cpu: list[float] = []
    summary: dict[str, dict[str, list[float]]] = {}
    rows: list[tuple[str, ...]] = []
    for c in clusters:
        for m in PAPER_MODELS:
            cfg = yaml.safe_load((CONF_DIR / "model" / f"{m}.yaml").read_text())
            cpu = time.process_time()
            try:
                _, rep = make_plan(cfg, c, global_batch, ALL_SHARDS)
            except InfeasibleError as err:
                print(f"\n{m} on {c}: infeasible ({str(err)[:100]})")
                continue
            cpu = time.process_time() - cpu
            solve.append(rep.solve_time)
            solve_cpu.append(cpu)
            params = sum(p.params for p in rep.profiles.values())
            print(
                f"\n{m} ({params / 1e9:.2f}B) on {c}: DistMM {fmt_time(rep.step_time)} [{rep.chosen.cost.layout}],"
                f" MFU {rep.mfu:.1%}, {rep.memory_per_rank() / 1e9:.1f} GB per rank,"
                f" solved in {rep.solve_time:.2f} s ({cpu:.2f} s CPU)"
            )
            print(f"  picked            {rep.pick_label()}")
            for label, ev in (
                ("DistMM separate", rep.candidates.get("separate")),
                ("DistMM colocated", rep.candidates.get("colocated")),
            ):
                best = rep.best_baseline()
                vs = f"{best.step_time / ev.step_time:.2f}x vs best baseline" if ev is not None and best else "-"
                t = fmt_time(ev.step_time if ev else None)
                print(f"  {label:<17} {t:>9}  {vs:>24}  " + (describe(ev) if ev else "no plan fits"))
            for k in BASELINES:
                b = rep.baselines.get(k)
                sp = rep.speedup(k)
                head = f"  {k:<17} {fmt_time(b.step_time if b else None):>9}  {f'picked {sp:.2f}x' if sp else '-':>24}"
                print(head + (f"  {describe(b)}" if b else "  no configuration fits"))
            print(f"  why: {why(rep)}")
            sep, best = rep.candidates.get("separate"), rep.best_baseline()
            rows.append(
                (
                    m,
                    c,
                    rep.picked_baseline() and f"= {rep.picked_baseline()}" or rep.chosen.name,
                    f"{best.step_time / sep.step_time:.2f}x" if sep and best else "-",
                    *(f"{rep.speedup(k):.2f}x" if rep.speedup(k) else "OOM" for k in SUMMARY),
                )
            )
            for k in SUMMARY:
                if params >= 1.05e9:
                    summary.setdefault(c, {}).setdefault(k, []).append(rep.speedup(k))
            if c == "a100_8x8" and rep.speedup("megatron"):
                speedups.append(rep.speedup("megatron"))
            if c == "a100_8x8" and rep.speedup("megatron-tp-pp"):
                tp_pp.append(rep.speedup("megatron-tp-pp"))
    print(
        "\n| model | cluster | picked | separate towers vs best baseline | "
        + " | ".join(f"picked vs {k}" for k in SUMMARY)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(SUMMARY))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    for c, by in summary.items():
        parts = []
        for k, v in by.items():
            fit = [x for x in v if x is not None]
            span = f"{min(fit):.2f}x .. {max(fit):.2f}x" if fit else "-"
            parts.append(f"{k} {span} (fits in {len(fit)} of {len(v)} presets; OOM in {len(v) - len(fit)})")
        print(f"{c}: picked plan vs " + ", ".join(parts))
    if solve:
        print(
            f"solve time at 64 devices: at most {max(solve):.2f} s per preset, {max(solve_cpu):.2f} s of CPU"
            f" (median {sorted(solve)[len(solve) // 2]:.2f} s; wall above CPU means other processes shared the cores)"
        )
    if speedups:
        lo, hi = PAPER_RANGE
        print(
            f"\nvs Megatron-LM on a100_8x8 (where it fits): {min(speedups):.2f}x .. {max(speedups):.2f}x"
            f' (paper: {lo}x .. {hi}x; docs/planner-results.md, "The paper\'s table", says which modelling'
            " differences explain the gap)"
        )
    if tp_pp:
        print(
            f"vs megatron-tp-pp (the family the paper's argument implies: uniform tp x pp >= 2, one microbatch)"
            f" on a100_8x8: {min(tp_pp):.2f}x .. {max(tp_pp):.2f}x"
        )


def sharding_table(clusters: list[str], global_batch: int, models: list[str]) -> None:
    """What sharding buys DistMM on the largest presets. For each model, DistMM with unsharded towers
    only (``shards: [none]``, the planner's default) and with every sharding the runtime runs allowed
    (ZeRO-1, ZeRO-2, ZeRO-3, HSDP): the plan, its memory on the fullest rank, its step
    and the speedup over every baseline (the baselines are the same in every row: each shards by its
    own rules)."""
    print(f"DistMM with and without sharding, global batch {global_batch} (bf16-mixed, 18 B per parameter unsharded)")
    for c in clusters:
        for m in models:
            cfg = yaml.safe_load((CONF_DIR / "model" / f"{m}.yaml").read_text())
            params = sum(p.params for p in make_plan(cfg, c, global_batch, ALL_SHARDS)[1].profiles.values())
            print(f"\n{m} ({params / 1e9:.2f}B) on {c}:")
            for label, opts in (
                ("unsharded towers", {"shards": ["none"]}),
                ("ZeRO-3/HSDP allowed", ALL_SHARDS),  # what the runtime runs (FSDP2)
            ):
                try:
                    _, rep = make_plan(cfg, c, global_batch, opts)
                except InfeasibleError as err:
                    print(f"  {label:<17} infeasible: {str(err)[:160]}")
                    continue
                limit = rep.cluster.device.memory * rep.options.cost.memory_margin
                print(
                    f"  {label:<17} {fmt_time(rep.step_time):>9}  {rep.memory_per_rank() / 1e9:5.1f} GB per rank"
                    f" (limit {limit / 1e9:.0f} GB)  {describe(rep.chosen)}"
                )
                sp = ", ".join(
                    f"{k} {rep.speedup(k):.2f}x" if rep.speedup(k) else f"{k} OOM"
                    for k in BASELINES
                    if k in rep.baselines
                )
                print(f"  {'':<17} vs {sp}")


def published() -> None:
    """Every published CLIP training throughput of ``conf/published/clip_training.yaml`` priced as its
    source ran it, beside the measurement (benchmarks/published.py)."""
    from published import TOLERANCE, load_published, predict_all, table  # benchmarks/ is on the path as a script

    data = load_published()
    preds = predict_all(data)
    print("Published CLIP training throughputs (samples/s) and the cost model's prediction of each run as its")
    print("source ran it (data parallel, the source's per-GPU batch, precision and its O2/autocast form, attention")
    print("kernel and softmax path, recompute, the gradient all-reduce overlapped or not, bias kernels)\n")
    print(table(preds, data.reasons))
    inside = sum(p.within for p in preds)
    print(
        f"\n{inside} of {len(preds)} entries within +-{TOLERANCE:.0%}; ratio predicted/measured"
        f" {min(p.ratio for p in preds):.2f} .. {max(p.ratio for p in preds):.2f}"
    )
    print("sources:")
    for k, v in data.sources.items():
        print(f"  {k}: {v}")


def solve_at_scale(devices: int) -> None:
    """Time the planner at ``devices`` devices (nodes of a100_8x8), 16 samples per device."""
    base = load_cluster("a100_8x8")
    nodes = max(1, devices // base.devices_per_node)
    big = dataclasses.replace(base, nodes=nodes)
    for m in ("clip_vit_bigg14", "coca_vit_l14", "distmm_26b"):
        cfg = yaml.safe_load((CONF_DIR / "model" / f"{m}.yaml").read_text())
        t0, cpu = time.perf_counter(), time.process_time()
        _, rep = make_plan(cfg, big, 16 * big.world_size, ALL_SHARDS)
        print(
            f"solve at {big.world_size} devices ({m}, batch {16 * big.world_size}): {time.perf_counter() - t0:.2f} s"
            f" ({time.process_time() - cpu:.2f} s CPU),"
            f" layout {rep.chosen.cost.layout}, vs Megatron {rep.speedup('megatron') or float('nan'):.2f}x"
        )


REGIME_MODELS = {"CLIP": "clip_vit_bigg14", "LiT": "lit_l16_bert_large", "CoCa": "coca_vit_l14"}
REGIME_NETWORKS_GBIT = (100, 400, 800, 3200)
REGIME_BATCHES = (1024, 4096, 16384, 32768)
REGIME_MEMORY_GB = (40, 80, 141)


def regimes(base: str = "a100_8x8", svg: Path | None = None) -> list[dict[str, object]]:
    """Where DistMM's own idea wins: for CLIP, LiT and CoCa presets on 64 GPUs of ``base``'s kind,
    the best separate-tower plan and the picked plan against the best baseline, across network
    bandwidth per node, global batch and device memory (the device's compute kept: a 40 or 141 GB
    row is an A100 with that much memory, a what-if, not a product)."""
    from dataclasses import replace

    base_cl = load_cluster(base)
    cells: list[dict[str, object]] = []
    print(
        f"Regime map on {base_cl.world_size} x {base_cl.device.name} (compute of {base}); cell: separate / picked vs best baseline"
    )
    for family, m in REGIME_MODELS.items():
        cfg = yaml.safe_load((CONF_DIR / "model" / f"{m}.yaml").read_text())
        print(f"\n{family} ({m})")
        print("| memory | network per node | " + " | ".join(f"batch {g}" for g in REGIME_BATCHES) + " |")
        print("|---|---|" + "---|" * len(REGIME_BATCHES))
        for mem in REGIME_MEMORY_GB:
            for gbit in REGIME_NETWORKS_GBIT:
                cl = replace(
                    base_cl,
                    name=f"{base}-{mem}GB-{gbit}Gb",
                    device=replace(base_cl.device, memory=mem * 1e9),
                    inter=replace(base_cl.inter, bandwidth=gbit * 1e9 / 8),
                )
                row = []
                for g in REGIME_BATCHES:
                    cell: dict[str, object] = {
                        "family": family,
                        "model": m,
                        "memory_gb": mem,
                        "network_gbit": gbit,
                        "batch": g,
                    }
                    try:
                        _, rep = make_plan(cfg, cl, g, ALL_SHARDS)
                    except InfeasibleError:
                        cell.update(separate=None, picked=None, pick="OOM")
                        row.append("OOM")
                        cells.append(cell)
                        continue
                    best, sep = rep.best_baseline(), rep.candidates.get("separate")
                    cell["separate"] = best.step_time / sep.step_time if best and sep else None
                    cell["picked"] = best.step_time / rep.step_time if best else None
                    cell["pick"] = f"= {rep.picked_baseline()}" if rep.picked_baseline() else rep.chosen.name
                    cell["best_baseline"] = best.name if best else None
                    cells.append(cell)
                    sep_s = f"{cell['separate']:.2f}x" if cell["separate"] else "-"
                    pick_s = f"{cell['picked']:.2f}x" if cell["picked"] else "only DistMM fits"
                    row.append(f"{sep_s} / {pick_s} ({cell['pick']})")
                print(f"| {mem} GB | {gbit} Gb/s | " + " | ".join(row) + " |", flush=True)
    if svg is not None:
        svg.write_text(_regime_svg(cells))
        print(f"\nwrote {svg}")
    return cells


def _regime_svg(cells: list[dict[str, object]]) -> str:
    """A heat map per family: rows memory x network, columns global batch; colour by the separate-tower
    plan's speedup over the best baseline (red below 1, white at 1, green above), the figure in each cell."""
    fams = list(REGIME_MODELS)
    rows = [(m, n) for m in REGIME_MEMORY_GB for n in REGIME_NETWORKS_GBIT]
    cw, ch, left, top, gap = 64, 20, 120, 52, 30
    width = left + len(fams) * (len(REGIME_BATCHES) * cw + gap)
    height = top + len(rows) * ch + 40

    def colour(x: object) -> str:
        if not isinstance(x, float):
            return "#dddddd"
        t = max(-1.0, min(1.0, (x - 1.0) / 0.3))
        if t >= 0:
            return f"rgb({int(255 * (1 - t))},{int(255 - 80 * t)},{int(255 * (1 - t))})"
        return f"rgb(255,{int(255 * (1 + t))},{int(255 * (1 + t))})"

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="10">',
        '<text x="4" y="14" font-size="12">Separate-tower plan vs best baseline (predicted), 64 GPUs; rows: memory, network per node</text>',
    ]
    for r, (mem, gbit) in enumerate(rows):
        out.append(f'<text x="4" y="{top + r * ch + 14}">{mem} GB, {gbit} Gb/s</text>')
    for f, fam in enumerate(fams):
        x0 = left + f * (len(REGIME_BATCHES) * cw + gap)
        out.append(f'<text x="{x0}" y="{top - 16}" font-weight="bold">{fam} ({REGIME_MODELS[fam]})</text>')
        for b, g in enumerate(REGIME_BATCHES):
            out.append(f'<text x="{x0 + b * cw + 4}" y="{top - 4}">B={g}</text>')
        for cell in cells:
            if cell["family"] != fam:
                continue
            r = rows.index((cell["memory_gb"], cell["network_gbit"]))
            b = REGIME_BATCHES.index(cell["batch"])
            x, y = x0 + b * cw, top + r * ch
            v = cell["separate"]
            label = f"{v:.2f}" if isinstance(v, float) else ("OOM" if cell["pick"] == "OOM" else "-")
            out.append(f'<rect x="{x}" y="{y}" width="{cw - 2}" height="{ch - 2}" fill="{colour(v)}"/>')
            out.append(f'<text x="{x + 14}" y="{y + 13}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--clusters", default=",".join(DEFAULT_CLUSTERS))
    ap.add_argument("--global-batch", default="4096", help="comma-separated contrastive batch sizes")
    ap.add_argument(
        "--scale-devices", type=int, default=4096, help="also time the planner at this many devices (0: skip)"
    )
    ap.add_argument("--paper", action="store_true", help="the DistMM paper's 1.1B-26B table (a100_8x8, h100, h200)")
    ap.add_argument(
        "--sharding-table",
        action="store_true",
        help="distmm_10b and distmm_26b with and without sharding (a100_8x8 unless --clusters; --models to change)",
    )
    ap.add_argument(
        "--published",
        action="store_true",
        help="the cost model against published CLIP training throughputs (conf/published/clip_training.yaml)",
    )
    ap.add_argument(
        "--regimes",
        action="store_true",
        help="where DistMM wins: CLIP, LiT, CoCa across network, global batch and memory (writes docs/img/regimes.svg)",
    )
    args = ap.parse_args()
    if args.published:
        published()
        return
    if args.regimes:
        t0 = time.perf_counter()
        regimes(svg=Path(__file__).resolve().parents[1] / "docs" / "img" / "regimes.svg")
        print(f"map priced in {time.perf_counter() - t0:.1f} s")
        return
    if args.sharding_table:
        clusters = args.clusters.split(",") if args.clusters != ",".join(DEFAULT_CLUSTERS) else ["a100_8x8"]
        models = args.models.split(",") if args.models != ",".join(DEFAULT_MODELS) else ["distmm_10b", "distmm_26b"]
        for G in [int(x) for x in args.global_batch.split(",")]:
            sharding_table(clusters, G, models)
        return
    if args.paper:
        t0 = time.perf_counter()
        clusters = args.clusters.split(",") if args.clusters != ",".join(DEFAULT_CLUSTERS) else PAPER_CLUSTERS
        for G in [int(x) for x in args.global_batch.split(",")]:
            paper(G, clusters)
        print(f"table priced in {time.perf_counter() - t0:.1f} s")
        if args.scale_devices:
            solve_at_scale(args.scale_devices)
        return

    head = (
        "model",
        "params",
        "cluster",
        "batch",
        "DistMM",
        "layout",
        "Megatron-LM",
        "DDP",
        "vs Megatron",
        "vs DDP",
        "solve",
    )
    rows = []
    large: list[float] = []
    losses: list[str] = []  # where a baseline's plan is predicted faster than DistMM's
    partial = 0  # of those, rows where the baseline recomputes part of a tower's blocks
    worst_solve = 0.0
    for G in [int(x) for x in args.global_batch.split(",")]:
        for m in args.models.split(","):
            cfg = yaml.safe_load((CONF_DIR / "model" / f"{m}.yaml").read_text())
            for c in args.clusters.split(","):
                try:
                    _, rep = make_plan(cfg, c, G, ALL_SHARDS)
                except InfeasibleError as err:
                    rows.append((m, "", c, str(G), "infeasible", "", "", "", "", "", str(err)[:60]))
                    continue
                worst_solve = max(worst_solve, rep.solve_time)
                params = sum(p.params for p in rep.profiles.values())
                meg, ddp = rep.baselines["megatron"], rep.baselines["ddp"]
                for name, b in rep.baselines.items():
                    if b is not None and b.step_time < rep.step_time * (1 - 1e-9):
                        sp = "; sp" if any(ch.sp for ch in b.choices.values()) else ""
                        partial += any(ch.recompute_layers is not None for ch in b.choices.values())
                        losses.append(
                            f"{m} on {c} at batch {G}: {name} {fmt_time(b.step_time)} < DistMM {fmt_time(rep.step_time)}"
                            f" ({describe(b)}{sp} against {describe(rep.chosen)})"
                        )
                sm, sd = rep.speedup("megatron"), rep.speedup("ddp")
                if params >= 1.05e9 and sm is not None:
                    large.append(sm)
                rows.append(
                    (
                        m,
                        f"{params / 1e9:.2f}B",
                        c,
                        str(G),
                        fmt_time(rep.step_time),
                        rep.chosen.cost.layout,
                        fmt_time(meg.step_time if meg else None),
                        fmt_time(ddp.step_time if ddp else None),
                        f"{sm:.2f}x" if sm else "-",
                        f"{sd:.2f}x" if sd else "-",
                        f"{rep.solve_time * 1e3:.0f} ms",
                    )
                )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line.format(*r))
    print()
    if large:
        print(
            f"speedup over Megatron-LM for presets >= 1.1B parameters: {min(large):.2f}x .. {max(large):.2f}x"
            f' (paper: 1.32x .. 3.27x; docs/planner-results.md, "The paper\'s table", explains the difference)'
        )
    # a baseline can price a configuration the search may not choose (sequence parallelism with
    # uniform degrees): where it wins, DistMM loses, and the rows say so
    print(
        f"predicted slower than a baseline: {len(losses)} rows (shardings allowed: {', '.join(ALL_SHARDS['shards'])})"
    )
    for line in losses:
        print(f"  {line}")
    if losses:
        print(f"  {partial} of the {len(losses)}: the baseline recomputes part of a tower's blocks (n/stage)")
    print(f"slowest solve at 64 devices: {worst_solve * 1e3:.0f} ms")
    if args.scale_devices:
        solve_at_scale(args.scale_devices)


if __name__ == "__main__":
    main()
