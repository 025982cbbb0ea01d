"""Activation memory of the pipeline schedules, measured side by side in one run.

Image tower cut into 2 pipeline stages (ranks 0, 1), text tower on rank 2 (3 CPU ranks, gloo).
For each schedule the activation bytes autograd keeps for backward are counted on every rank
(``lightning_distmm.parallel.memory.ActivationMeter``: saved-tensor accounting, weights excluded,
plus the stage inputs that ``cached`` keeps outside autograd for its recompute)
and the step time is timed on rank 0:

1. peak activation bytes per rank at a fixed global batch, ``gpipe``, ``distmm`` and ``cached``;
2. the largest contrastive batch that fits a per-rank activation budget (the budget is gpipe's
   peak at the fixed batch, so gpipe's largest batch is that batch): distmm and cached are run at
   growing batches until a rank exceeds the budget;
3. step time of each schedule against gpipe's at the same batch (cached recomputes each
   microbatch once; distmm has a second batch-sync);
4. the bubble fraction (idle share of the ranks' time in a step), as measured from the executor's
   trace (stage compute and batch-syncs count as busy), and from the schedule IR simulated with
   those measured durations (transfers taken as free).

``distmm`` computes the grouped loss (two sync groups), so its module sets ``sync_groups = 2``.

    python benchmarks/pipeline_memory.py --batch 32 --microbatch 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from contextlib import ExitStack
from pathlib import Path

import lightning as L
import torch
from synthetic import SyntheticPairs, TwoTowerCLIP
from torch import nn
from torch.utils.data import DataLoader

import lightning_distmm as ldm
from lightning_distmm.models.tiny import TinyText, quiet_trainer_kwargs, tiny_vit
from lightning_distmm.parallel.memory import ActivationMeter

EMBED, VOCAB, SEQ, IMG = 64, 128, 16, 32


class BenchCLIP(TwoTowerCLIP):
    def __init__(self, sync_groups: int = 1) -> None:
        super().__init__()
        self.sync_groups = sync_groups
        self.visual = tiny_vit(IMG, 4, width=64, depth=4, heads=2, embed=EMBED, mlp_ratio=4.0, qkv_bias=True)
        self.text = TinyText(VOCAB, SEQ, width=64, embed=EMBED, layers=4, intermediate=256, freeze_key_bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Probe(L.Callback):
    """Per rank: peak activation bytes over the timed steps; rank 0 also times each step."""

    def __init__(self, folder: str, warmup: int) -> None:
        self.folder, self.warmup = folder, warmup
        self.meter, self.stack, self.t0 = ActivationMeter(), ExitStack(), 0.0
        self.peaks: list[int] = []
        self.times: list[float] = []

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.engine.record_trace(True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.meter.reset()
        self.stack.enter_context(self.meter.track())
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.t0)
        self.stack.close()
        # cached keeps each microbatch's stage input outside autograd until its recompute: count it
        step = trainer.strategy.engine.step
        self.peaks.append(self.meter.peak + step.stash_bytes)
        trace = [
            (type(i).__name__, getattr(i, "tower", ""), getattr(i, "mb", getattr(i, "sync_group", 0)), a, b)
            for i, a, b in step.trace
        ]
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(
            json.dumps({"peak": max(self.peaks), "times": self.times[self.warmup :], "trace": trace})
        )


def make_plan(schedule: str, microbatch: int) -> ldm.Plan:
    tower = {"microbatch": microbatch, "schedule": schedule}
    return ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2, **tower}, "text": {"ranks": [2], **tower}})


def bubbles(plan: ldm.Plan, batch: int, traces: list[list]) -> tuple[float, float, list]:
    """(measured, from the IR, the simulated intervals): the idle share of the ranks' compute time
    over the last step, as traced by the executor and as the IR simulated with those durations."""
    from lightning_distmm.core.schedule import Backward, BatchSync, Forward, schedules
    from lightning_distmm.planner.cost.simulate import bubble_fraction, simulate

    start = min(t[3] for trace in traces for t in trace)
    end = max(t[4] for trace in traces for t in trace)
    busy = sum(t[4] - t[3] for trace in traces for t in trace)
    measured = 1 - busy / ((end - start) * len(traces))
    medians = {}
    for rank, trace in enumerate(traces):
        for kind in ("Forward", "Backward", "BatchSync"):
            for tower in {t[1] for t in trace}:
                times = [t[4] - t[3] for t in trace if t[0] == kind and t[1] == tower]
                if times:
                    medians[(rank, kind, tower)] = statistics.median(times)

    def duration(rank, ins):
        if isinstance(ins, (Forward, Backward)):
            return medians.get((rank, type(ins).__name__, ins.tower), 0.0)
        if isinstance(ins, BatchSync):
            return medians.get((rank, "BatchSync", ""), 0.0)
        return 0.0  # the gradient sums are not traced: idle in both

    intervals = simulate(schedules(plan, batch), duration)
    return measured, bubble_fraction(intervals), intervals


def run(
    schedule: str, batch: int, microbatch: int, steps: int, warmup: int
) -> tuple[list[int], float, tuple[float, float]]:
    L.seed_everything(0, verbose=False)
    plan = make_plan(schedule, microbatch)
    with tempfile.TemporaryDirectory() as folder:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=3,
            strategy=ldm.DistMMStrategy(plan, start_method="fork"),
            max_steps=steps,
            callbacks=[Probe(folder, warmup)],
            **quiet_trainer_kwargs(),
        )
        trainer.fit(
            BenchCLIP(plan.sync_groups),
            DataLoader(SyntheticPairs(batch * steps, IMG, VOCAB, SEQ), batch_size=batch, drop_last=True),
        )
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(3)]
    bubble = bubbles(plan, batch, [r["trace"] for r in ranks])
    return [r["peak"] for r in ranks], statistics.median(ranks[0]["times"]), bubble


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="the fixed global batch")
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds for the step times")
    parser.add_argument("--max-batch", type=int, default=1024)
    parser.add_argument("--svg", default=None, help="folder for timeline pictures of the simulated schedules")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")

    names = ("gpipe", "distmm", "cached")
    peaks, times, bubble = {}, {s: [] for s in names}, {}
    for _ in range(args.rounds):
        for schedule in names:
            peaks[schedule], t, bubble[schedule] = run(schedule, args.batch, args.microbatch, args.steps, args.warmup)
            times[schedule].append(t)
    budget = max(peaks["gpipe"])
    largest = {"gpipe": args.batch}
    step = 2 * args.microbatch  # batches searched in multiples of two microbatches (one per sync group)
    for schedule in ("distmm", "cached"):
        fits = lambda b: max(run(schedule, b, args.microbatch, 2, 0)[0]) <= budget  # noqa: E731
        fitted, failed = (args.batch, None) if max(peaks[schedule]) <= budget else (0, args.batch)
        while failed is None and fitted * 2 <= args.max_batch:  # doubling, then bisection
            if fits(fitted * 2):
                fitted *= 2
            else:
                failed = fitted * 2
        while failed is not None and fitted and failed - fitted > step:
            mid = (fitted + failed) // 2 // step * step
            if mid <= fitted:
                break
            fitted, failed = (mid, failed) if fits(mid) else (fitted, mid)
        largest[schedule] = fitted

    mib = 1 / 2**20
    print(
        f"\nactivation memory, image pp=2 (ranks 0,1) + text (rank 2), global batch {args.batch}, microbatch {args.microbatch}"
    )
    print(
        f"{'schedule':<10} {'rank0 MiB':>10} {'rank1 MiB':>10} {'rank2 MiB':>10} {'step ms':>9} {'largest batch':>14}"
        f" {'bubble measured':>16} {'bubble IR':>10}"
    )
    for schedule in names:
        p = peaks[schedule]
        print(
            f"{schedule:<10} {p[0] * mib:>10.2f} {p[1] * mib:>10.2f} {p[2] * mib:>10.2f}"
            f" {statistics.median(times[schedule]) * 1e3:>9.1f} {largest[schedule]:>14}"
            f" {bubble[schedule][0]:>16.2f} {bubble[schedule][1]:>10.2f}"
        )
    if args.svg:
        from lightning_distmm.planner.pictures.timeline import timeline_svg

        Path(args.svg).mkdir(parents=True, exist_ok=True)
        for schedule in names:
            title = (
                f"{schedule}: image pp=2 (ranks 0-1) + text (rank 2), batch {args.batch}, microbatch {args.microbatch}"
            )
            Path(args.svg, f"timeline_{schedule}.svg").write_text(timeline_svg(bubble[schedule][2], title))
        print(f"timelines written to {args.svg}/timeline_{{{','.join(names)}}}.svg")
    print(
        f"\nbudget = gpipe's peak {budget * mib:.2f} MiB per rank (largest batches capped at --max-batch {args.max_batch})"
    )
    for schedule in ("distmm", "cached"):
        ratio_batch = largest[schedule] / largest["gpipe"]
        ratio_time = statistics.median(times[schedule]) / statistics.median(times["gpipe"])
        target = f" (target >= 8x: {'yes' if ratio_batch >= 8 else 'no'})" if schedule == "cached" else ""
        print(f"largest batch, {schedule} / gpipe: {ratio_batch:.1f}x{target}")
        target = f" (target <= 1.5: {'yes' if ratio_time <= 1.5 else 'no'})" if schedule == "cached" else ""
        print(f"step time at batch {args.batch}, {schedule} / gpipe: {ratio_time:.2f}{target}")


if __name__ == "__main__":
    main()
