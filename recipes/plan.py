"""Plan a multimodal model on a cluster: print the per-tower table, write plan.yaml.

    python recipes/plan.py model=clip_vit_bigg14 cluster=a100_8x8 global_batch=32768
    python recipes/plan.py -m planner.balancer=dp,proportional,even placement=hetero,naive
    python recipes/plan.py planner=data_parallel cluster=local_cpu model=clip_tiny global_batch=64
    python recipes/plan.py model=clip_vit_l14 cluster=a100_8x8 global_batch=1024 draw=timeline.svg

The plan file is what ``DistMMStrategy(plan="plan.yaml")`` loads; ``plan_report.yaml`` beside it
holds the predicted costs, the baselines and the options; ``draw=`` writes a picture of one
predicted step (every rank's instructions, plans of up to 64 ranks). In a multirun every job
writes into its own output folder.
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
from lightning_distmm.planner.config import to_plain  # noqa: E402


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
        from lightning_distmm.core.schedule import timeline_svg

        picture = Path(cfg.draw) if Path(cfg.draw).is_absolute() else base / cfg.draw
        try:
            title = f"{cfg.model.name} on {report.cluster.name}, batch {cfg.global_batch}: predicted step {report.step_time * 1e3:.1f} ms"
            picture.write_text(timeline_svg(report.timeline(), title))
            print(f"timeline drawn to {picture}")
        except ValueError as err:
            print(f"no timeline: {err}", file=sys.stderr)
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
