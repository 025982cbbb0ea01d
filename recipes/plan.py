"""Plan a multimodal model on a cluster: print the per-tower table, write plan.yaml.

    python recipes/plan.py model=clip_vit_bigg14 cluster=a100_8x8 global_batch=32768
    python recipes/plan.py -m planner.balancer=dp,proportional,even placement=hetero,naive
    python recipes/plan.py planner=data_parallel cluster=local_cpu model=clip_tiny global_batch=64
    python recipes/plan.py model=clip_vit_l14 global_batch=1024 draw=timeline.svg draw_placement=placement.svg

The plan file is what ``DistMMStrategy(plan="plan.yaml")`` loads; ``plan_report.yaml`` beside it
holds the predicted costs, the baselines and the options. Two pictures (SVG), each optional:
``draw=`` one predicted step (every rank's instructions on a time axis in ms, with a legend of the
instruction kinds; plans of up to 64 ranks), ``draw_placement=`` the placement map (nodes and their
devices, which tower, replica, pipeline stage and tensor-parallel shard each device runs, the
tensor-parallel, stage-to-stage and gradient links, inside a node or across nodes, with the bytes
each moves per step). In a multirun every job writes into its own output folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_distmm.planner import InfeasibleError, make_plan  # noqa: E402
from lightning_distmm.planner.machine.config import to_plain  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="plan")
def main(cfg: DictConfig) -> float:
    options = {**to_plain(cfg.planner), "placement": to_plain(cfg.placement)}
    try:
        plan, report = make_plan(cfg.model, cfg.cluster, int(cfg.global_batch), options)
    except InfeasibleError as err:
        print(f"infeasible: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    print(report.table())
    hc = HydraConfig.get()
    base = Path(hc.runtime.output_dir) if hc.mode == RunMode.MULTIRUN else Path(hc.runtime.cwd)
    if cfg.get("out"):
        out = Path(cfg.out) if Path(cfg.out).is_absolute() else base / cfg.out
        plan.to_yaml(out)
        print(f"plan written to {out}")
        if cfg.get("report"):
            rep = out.parent / cfg.report
            rep.write_text(yaml.safe_dump(report.to_dict(), sort_keys=False))
    if cfg.get("draw"):
        from lightning_distmm.planner.pictures.timeline import timeline_svg

        picture = Path(cfg.draw) if Path(cfg.draw).is_absolute() else base / cfg.draw
        try:
            title = f"{cfg.model.name} on {report.cluster.name}, batch {cfg.global_batch}: predicted step {report.step_time * 1e3:.1f} ms"
            note = (
                "not drawn: the gradient sums' exposed part, the optimizer step and the per-step overhead"
                f" (priced in the predicted {report.step_time * 1e3:.1f} ms)"
            )
            picture.write_text(timeline_svg(report.timeline(), title, note=note), encoding="utf-8")
            print(f"timeline drawn to {picture}")
        except ValueError as err:
            print(f"no timeline: {err}", file=sys.stderr)
    if cfg.get("draw_placement"):
        from lightning_distmm.planner.pictures.placement_map import placement_map

        picture = Path(cfg.draw_placement)
        picture = picture if picture.is_absolute() else base / picture
        picture.write_text(placement_map(report), encoding="utf-8")
        print(f"placement map drawn to {picture}")
    if hc.mode == RunMode.MULTIRUN:
        sep = report.candidates.get("separate")
        print(
            f"[{hc.job.override_dirname or 'defaults'}] step {report.step_time * 1e3:.1f} ms ({report.chosen.cost.layout}),"
            f" best separate-towers plan {sep.step_time * 1e3:.1f} ms,"
            if sep
            else " no separate-towers plan,",
            f"speedup vs megatron {report.speedup('megatron') or float('nan'):.2f}x, vs ddp {report.speedup('ddp') or float('nan'):.2f}x",
        )
    return report.step_time


if __name__ == "__main__":
    main()
