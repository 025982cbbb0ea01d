"""Predicted step time of the DistMM plan against the Megatron-style and DDP baselines, and solve time.

    python benchmarks/planner.py                              # model presets x GPU cluster presets
    python benchmarks/planner.py --global-batch 1024,32768    # several contrastive batch sizes
    python benchmarks/planner.py --models clip_vit_bigg14 --clusters a100_8x8_eth100

All plans are priced by the same cost model (lightning_distmm.planner.cost); the baselines are searched
for their best configuration. "OOM" means no configuration of that baseline fits device memory for
the whole-batch contrastive loss. The last lines time the planner at 4,096 devices.
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
from lightning_distmm.planner.cluster import CONF_DIR  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--clusters", default=",".join(DEFAULT_CLUSTERS))
    ap.add_argument("--global-batch", default="4096", help="comma-separated contrastive batch sizes")
    ap.add_argument(
        "--scale-devices", type=int, default=4096, help="also time the planner at this many devices (0: skip)"
    )
    args = ap.parse_args()

    head = (
        "model",
        "params",
        "cluster",
        "batch",
        "DistMM",
        "layout",
        "Megatron",
        "DDP",
        "vs Megatron",
        "vs DDP",
        "solve",
    )
    rows = []
    large: list[float] = []
    worst_solve = 0.0
    for G in [int(x) for x in args.global_batch.split(",")]:
        for m in args.models.split(","):
            cfg = yaml.safe_load((CONF_DIR / "model" / f"{m}.yaml").read_text())
            for c in args.clusters.split(","):
                try:
                    _, rep = make_plan(cfg, c, G)
                except InfeasibleError as err:
                    rows.append((m, "", c, str(G), "infeasible", "", "", "", "", "", str(err)[:60]))
                    continue
                worst_solve = max(worst_solve, rep.solve_time)
                params = sum(p.params for p in rep.profiles.values())
                meg, ddp = rep.baselines["megatron"], rep.baselines["ddp"]
                for b in (meg, ddp):
                    assert b is None or rep.step_time <= b.step_time * (1 + 1e-9), (
                        "DistMM predicted slower than a baseline"
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
            f"speedup over Megatron-style for presets >= 1.1B parameters: {min(large):.2f}x .. {max(large):.2f}x"
            f" (paper: 1.32x .. 3.27x; docs/planner.md explains the difference)"
        )
    print(f"slowest solve at 64 devices: {worst_solve * 1e3:.0f} ms")
    if args.scale_devices:
        base = load_cluster("a100_8x8")
        nodes = max(1, args.scale_devices // base.devices_per_node)
        big = dataclasses.replace(base, nodes=nodes)
        for m in ("clip_vit_bigg14", "coca_vit_l14", "distmm_26b"):
            cfg = yaml.safe_load((CONF_DIR / "model" / f"{m}.yaml").read_text())
            t0 = time.perf_counter()
            _, rep = make_plan(cfg, big, 16 * big.world_size)
            print(
                f"solve at {big.world_size} devices ({m}, batch {16 * big.world_size}): {time.perf_counter() - t0:.2f} s,"
                f" layout {rep.chosen.cost.layout}, vs Megatron {rep.speedup('megatron') or float('nan'):.2f}x"
            )


if __name__ == "__main__":
    main()
