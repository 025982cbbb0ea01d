"""The VLM planner's table (docs/vlm.md, "The planner"): for each preset, cluster and global batch,
the plan the planner picks (each module's devices and degrees) against FSDP over the whole model
and a uniform Megatron-style plan, all priced by the same cost model and replayed through the
runtime's handoff lists. Predicted, not measured.

    python benchmarks/vlm_planner.py                                   # llava15_7b, internvl_26b x a100_8x8, h100_8x8 x 128, 1024
    python benchmarks/vlm_planner.py --presets llava15_7b --clusters h100_8x8 --global-batch 256
    python benchmarks/vlm_planner.py --yaml picks.yaml                 # every pick as YAML (plans included)

Each row twice: with each step's rows split by count (the plan's even split, whose slowest replica
the straggler term prices) and by cost (the runtime's per-step balance, ``Tower(cost=...)``: the
straggler of the balanced assignment), with the balanced pick's step against the even one's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_distmm.planner import load_cluster  # noqa: E402
from lightning_distmm.planner.vlm.profile import WORKLOADS, vlm_profiles  # noqa: E402
from lightning_distmm.planner.vlm.search import vlm_plan  # noqa: E402


def fmt(t: float | None) -> str:
    return "OOM" if t is None else f"{t:.3f} s"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llava15_7b,internvl_26b")
    ap.add_argument("--clusters", default="a100_8x8,h100_8x8")
    ap.add_argument("--global-batch", default="128,1024")
    ap.add_argument(
        "--balance",
        default="rows,cost",
        help="how each step's rows are assigned: rows (by count, the even split) and/or cost (by images and tokens)",
    )
    ap.add_argument("--yaml", default=None, help="write every pick (with its plan) to this file")
    args = ap.parse_args(argv)
    dump = []
    for name in args.presets.split(","):
        w = WORKLOADS[name]
        profs = vlm_profiles(w)
        print(
            f"\n{name}: vision {profs.vision.params / 1e6:.1f}M ({'frozen' if w.frozen_vision else 'trains'}),"
            f" projector {profs.projector.params / 1e6:.1f}M, LLM {profs.llm.params / 1e9:.3f}B;"
            f" images per sample {w.images} (mean {w.mean_images:.2f}), LLM sequence {profs.llm.seq}"
            f" = {w.text_tokens} text + {profs.tokens_per_row:.0f} image tokens"
        )
        print(
            "| cluster | batch | rows assigned | picked plan (image, llm) | pick | fsdp | megatron | vs fsdp"
            " | vs megatron | solve |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for cl in args.clusters.split(","):
            cluster = load_cluster(cl)
            for B in (int(b) for b in args.global_batch.split(",")):
                even_step = None
                for balance in args.balance.split(","):
                    wb = dataclasses.replace(w, balance=balance)
                    t0 = time.perf_counter()
                    out = vlm_plan(vlm_profiles(wb), cluster, B)
                    solve = time.perf_counter() - t0
                    pick, fsdp, meg = out["distmm"], out["fsdp"], out["megatron"]
                    label = "by count" if balance == "rows" else "by cost"
                    if pick is None:
                        print(f"| {cl} | {B} | {label} | nothing fits | OOM | OOM | OOM | | | {solve:.0f} s |")
                        continue
                    if balance == "rows":
                        even_step = pick.step
                    elif even_step is not None:
                        label += f" ({even_step / pick.step:.2f}x of by count)"
                    ratio = lambda b: f"{b.step / pick.step:.2f}x" if b is not None else "-"  # noqa: E731
                    print(
                        f"| {cl} | {B} | {label} | {pick.describe()} ({pick.kind}) | {fmt(pick.step)}"
                        f" | {fmt(fsdp and fsdp.step)} | {fmt(meg and meg.step)} | {ratio(fsdp)} | {ratio(meg)}"
                        f" | {solve:.0f} s |"
                    )
                    for kind in ("fsdp", "megatron"):
                        b = out[kind]
                        if b is not None:
                            print(f"|  | | | {kind}: {b.describe()} | | | | | | |")
                    dump.append(
                        {
                            "preset": name,
                            "cluster": cl,
                            "global_batch": B,
                            "workload": wb.to_dict(),
                            **{k: (v.to_dict() if v is not None else None) for k, v in out.items()},
                        }
                    )
    if args.yaml:
        Path(args.yaml).write_text(yaml.safe_dump(dump, sort_keys=False))
        print(f"wrote {args.yaml}")


if __name__ == "__main__":
    main()
