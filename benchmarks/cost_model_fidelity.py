"""Cost-model fidelity on this machine: predicted vs measured step time of several plans.

A small CLIP (timm ViT image tower, transformers CLIP text tower, 1.2M parameters) trains on 2 CPU
processes (gloo, one torch thread each, global batch 64, synthetic data) under six runtime plans:
both towers on both ranks (colocated) or each tower on its own rank (separate), with whole replica
batches, microbatches of 16 (``gpipe``) or 8 (``cached``), or activation checkpointing. Per plan:

* **predicted**: the project's cost model (``price_plan`` = ``evaluate_plan`` on the plan's
  per-tower choices) on what ``auto_plan`` measures on this machine, measured afresh in every
  round: each tower's forward/backward fit and AdamW step (``measure_tower``), the host
  (``measure_local_cpu``: matmul throughput, gloo latency and bandwidth) and, right before each
  run, ``Device.concurrency`` (how much the two rank processes slow each other down,
  ``ConcurrencyProbe``). ``CostOptions.step_overhead``, the framework's fixed cost per step, is
  measured once with a model of two one-layer towers (not the benchmark's model);
* **measured**: ``Trainer(strategy=DistMMStrategy(plan, start_method="fork"), devices=2)``, timed on
  rank 0 from ``on_train_batch_start`` to ``on_train_batch_end``, warm-up steps skipped.

This machine is shared: other processes come and go. Every measurement first waits (a while) for
the host to be quiet, every timed step records how many cores *other* processes used meanwhile
(``/proc/stat`` minus this job's processes), and the table compares predictions from quiet
calibrations with the median of the quiet steps (others below 0.25 cores); rounds are added (up to
``--max-rounds``) while a plan has too few quiet steps. The medians of all steps are printed too.

The planner's own pick (``make_plan`` with what ``plan="auto"`` allows: tp = pp = 1, ``gpipe`` or
``cached``, no activation checkpointing) is measured as well. Targets: every prediction within 25%
of its measurement, and the planner's pick within 10% of the measured fastest plan. Exits 0 either
way and says whether each target holds. About 10 minutes on a quiet 2-core machine.

    python benchmarks/cost_model_fidelity.py [--rounds 3] [--steps 12] [--warmup 4] [-v]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, whatever is installed

import lightning as L
import torch
from synthetic import TwoTowerCLIP  # noqa: E402 - benchmarks/ is on the path when run as a script
from torch.utils.data import DataLoader

import lightning_distmm as ldm
from lightning_distmm.models.clip import CLIP_TINY, CLIPModel
from lightning_distmm.planner import (
    ConcurrencyProbe,
    Plan,
    host_busy_seconds,
    make_plan,
    measure_local_cpu,
    measure_tower,
    measured_profile,
    price_plan,
    runtime_cost_defaults,
)

# clip_tiny (conf/model/clip_tiny.yaml, --model tiny) steps in 26-55 ms on a 2-core CPU host, much
# of it per-call Python overhead; "small" widens both towers to 128 with 3 layers and gives the image
# tower 65 tokens (170-340 ms steps): still a toy, but one where compute and the plan matter.
SMALL: dict[str, Any] = {
    "name": "clip_small",
    "embed_dim": 64,
    "init_logit_scale": 2.659,
    "towers": {
        "image": {
            "arch": "vit",
            "input": "image",
            "img_size": 32,
            "patch_size": 4,
            "width": 128,
            "layers": 3,
            "heads": 2,
            "mlp_ratio": 4.0,
        },
        "text": {
            "arch": "clip_text",
            "input": ["input_ids", "attention_mask"],
            "vocab_size": 64,
            "context_length": 16,
            "width": 128,
            "layers": 3,
            "heads": 2,
            "mlp_ratio": 4.0,
        },
    },
}
MODELS = {"small": SMALL, "tiny": CLIP_TINY}
OPTIM = {"scheduler": "constant", "warmup_steps": 0, "lr": 1e-4}
# what the runtime executes (the options DistMMStrategy(plan="auto") gives the planner)
PLANNER_OPTIONS = {"max_tp": 1, "max_pp": 1, "schedules": ["gpipe", "cached"], "recompute": False}


def plans(batch: int) -> dict[str, Plan]:
    both, r0, r1 = [0, 1], [0], [1]
    spec = {
        "colocated": {"image": {"ranks": both}, "text": {"ranks": both}},
        "colocated mb16 gpipe": {"image": {"ranks": both, "microbatch": 16}, "text": {"ranks": both, "microbatch": 16}},
        "colocated mb8 cached": {
            "image": {"ranks": both, "microbatch": 8, "schedule": "cached"},
            "text": {"ranks": both, "microbatch": 8, "schedule": "cached"},
        },
        "colocated recompute": {
            "image": {"ranks": both, "recompute": True},
            "text": {"ranks": both, "recompute": True},
        },
        "separate": {"image": {"ranks": r0}, "text": {"ranks": r1}},
        "separate image mb8 cached": {
            "image": {"ranks": r0, "microbatch": 8, "schedule": "cached"},
            "text": {"ranks": r1},
        },
    }
    return {name: Plan(2, towers, global_batch=batch) for name, towers in spec.items()}


def same_plan(a: Plan, b: Plan) -> bool:
    """Equal as executed (a microbatch of the whole replica batch is no microbatching)."""
    if set(a.towers) != set(b.towers) or a.world_size != b.world_size:
        return False
    n = a.global_batch or b.global_batch or 0
    for name in a.towers:
        x, y = a.towers[name], b.towers[name]
        bx, by = x.split(n), y.split(n)
        mx, my = min(x.microbatch or max(bx), max(bx)), min(y.microbatch or max(by), max(by))
        if (x.ranks, bx, mx, x.schedule, x.recompute) != (y.ranks, by, my, y.schedule, y.recompute):
            return False
    return True


def describe(plan: Plan) -> str:
    parts = []
    for name, t in plan.towers.items():
        s = f"{name}@{','.join(map(str, t.ranks))}"
        if t.microbatch:
            s += f" mb{t.microbatch}"
        if t.schedule != "gpipe":
            s += f" {t.schedule}"
        if t.recompute:
            s += " recompute"
        parts.append(s)
    return " | ".join(parts)


# ---------------------------------------------------------------------- data and timing
class Pairs(ldm.FieldDataset):
    """Synthetic image-caption pairs (cheap to load, so loading does not skew the ranks)."""

    fields = ("image", "input_ids", "attention_mask")

    def __init__(self, size: int, img: int, ctx: int) -> None:
        self.size, self.img, self.ctx = size, img, ctx

    def __len__(self) -> int:
        return self.size

    def load(self, index, fields):
        g = torch.Generator().manual_seed(int(index))
        ids = torch.randint(4, 60, (self.ctx,), generator=g)
        ids[-1] = 3  # [EOS]
        out = {
            "image": torch.randn(3, self.img, self.img, generator=g),
            "input_ids": ids,
            "attention_mask": torch.ones(self.ctx, dtype=torch.long),
        }
        return {k: out[k] for k in fields}


def example_inputs(model: dict[str, Any]) -> dict[str, Any]:
    img = model["towers"]["image"]["img_size"]
    ctx = model["towers"]["text"]["context_length"]

    def image(b: int) -> list[torch.Tensor]:
        return [torch.randn(b, 3, img, img)]

    def text(b: int) -> list[torch.Tensor]:
        ids = torch.randint(4, 60, (b, ctx))
        ids[:, -1] = 3
        return [ids, torch.ones(b, ctx, dtype=torch.long)]

    return {"image": image, "text": text}


def _job_seconds(root: int) -> float:
    """CPU seconds of this job: ``root`` and every process below it, finished children included."""
    import psutil

    try:
        procs = [psutil.Process(root)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


class ForeignLoad:
    """Cores that *other* processes of the host kept busy between ``start()`` and ``stop()``: all the
    host's busy time minus this job's (the benchmark process and the ranks it forks)."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.busy = self.job = self.wall = 0.0

    def start(self) -> None:
        self.busy, self.job, self.wall = host_busy_seconds() or 0.0, _job_seconds(self.root), time.perf_counter()

    def stop(self) -> float:
        wall = max(time.perf_counter() - self.wall, 1e-9)
        other = ((host_busy_seconds() or 0.0) - self.busy) - (_job_seconds(self.root) - self.job)
        return max(0.0, other) / wall


def wait_quiet(threshold: float, max_wait: float, window: float = 1.0) -> float:
    """Wait (at most ``max_wait`` seconds) until other processes use fewer than ``threshold`` cores
    over a ``window``; returns the last reading. Measuring on a busy shared host measures its load."""
    deadline = time.monotonic() + max_wait
    while True:
        load = ForeignLoad()
        load.start()
        time.sleep(window)
        cores = load.stop()
        if cores < threshold or time.monotonic() >= deadline:
            return cores


class StepTimer(L.Callback):
    """Rank 0: wall time of each step (``on_train_batch_start`` -> ``on_train_batch_end``) and the
    cores other processes of the host used meanwhile."""

    def __init__(self, path: str) -> None:
        self.path, self.rows, self.t0 = path, [], 0.0
        self.load = ForeignLoad()  # created in the launching process: the ranks are forked below it

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.is_global_zero:
            self.load.start()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        wall = time.perf_counter() - self.t0
        if trainer.is_global_zero:
            self.rows.append([wall, self.load.stop()])
            Path(self.path).write_text(json.dumps(self.rows))


def measure(plan: Plan, model: dict[str, Any], args: argparse.Namespace, out: str) -> list[tuple[float, float]]:
    """(wall seconds, other processes' cores) of each timed step of ``plan``."""
    L.seed_everything(0, verbose=False)
    module = CLIPModel(model, OPTIM)
    img, ctx = model["towers"]["image"]["img_size"], model["towers"]["text"]["context_length"]
    data = DataLoader(Pairs(args.batch * args.steps, img, ctx), batch_size=args.batch, shuffle=False, drop_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ldm.DistMMStrategy(plan=plan, start_method="fork"),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer(out)],
    )
    trainer.fit(module, data)
    return [tuple(r) for r in json.loads(Path(out).read_text())[args.warmup :]]


# ---------------------------------------------------------------------- prediction
def calibrate(model: dict[str, Any], args: argparse.Namespace) -> tuple[Any, dict[str, Any], float]:
    """What auto_plan measures: the host (fresh, not the cache) and each tower's profile; and the
    cores other processes used meanwhile."""
    load = ForeignLoad()
    load.start()
    cluster = measure_local_cpu(devices=2, cache=False, measure_concurrency=False)  # probed next to each run
    module = CLIPModel(model, OPTIM)
    towers = module.towers()
    inputs = example_inputs(model)
    profiles = {}
    for name, tower in towers.items():
        fit = measure_tower(tower.module, inputs[name], args.profile_batches, "cpu", repeats=args.profile_repeats)
        profiles[name] = measured_profile(name, fit, False, int(model["embed_dim"]))
    return cluster, profiles, load.stop()


def with_concurrency(cluster: Any, concurrency: float) -> Any:
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, concurrency=concurrency))


# ---------------------------------------------------------------------- framework overhead
class Trivial(TwoTowerCLIP):
    """Two one-layer towers: a distmm step of this model is the framework's fixed cost per step."""

    def __init__(self) -> None:
        super().__init__()
        self.visual = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 16))
        self.text = TrivialText()
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.659))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class TrivialText(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.proj((input_ids * attention_mask).float())


def framework_overhead(
    args: argparse.Namespace, options: dict[str, Any], cluster: Any, tmp: str
) -> tuple[float, dict[str, float]]:
    """``CostOptions.step_overhead`` on this machine: the step time of a model with trivial towers
    under the same strategy, minus what the cost model prices for it (towers, loss, collectives,
    optimizer), averaged over the colocated and the separate layout. Not the benchmark's model."""
    inputs = {
        "image": lambda b: [torch.randn(b, 3, 4, 4)],
        "text": lambda b: [torch.randint(4, 60, (b, 8)), torch.ones(b, 8, dtype=torch.long)],
    }
    module = Trivial()
    profiles = {
        n: measured_profile(n, measure_tower(t.module, inputs[n], (8, 32, 64), "cpu", repeats=5), False, 16)
        for n, t in module.towers().items()
    }
    gaps, raw = [], {}
    for name in ("colocated", "separate"):
        plan = plans(args.batch)[name]
        wait_quiet(args.quiet, args.wait_quiet)
        L.seed_everything(0, verbose=False)
        steps = 30
        data = DataLoader(Pairs(args.batch * steps, 4, 8), batch_size=args.batch, shuffle=False, drop_last=True)
        out = os.path.join(tmp, "overhead.json")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ldm.DistMMStrategy(plan=plan, start_method="fork"),
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[StepTimer(out)],
        )
        trainer.fit(Trivial(), data)
        rows = json.loads(Path(out).read_text())[5:]
        quiet = [t for t, f in rows if f < args.quiet]
        measured = statistics.median(quiet if len(quiet) >= len(rows) // 2 else [t for t, _ in rows])
        priced = price_plan(plan, profiles, cluster, {**options, "step_overhead": 0.0}).step_time
        raw[name] = measured
        gaps.append(max(0.0, measured - priced))
    return sum(gaps) / len(gaps), raw


# ---------------------------------------------------------------------- the benchmark
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (warm-up included)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (at least)")
    parser.add_argument("--max-rounds", type=int, default=6, help="more rounds while a plan has too few quiet steps")
    parser.add_argument(
        "--quiet",
        type=float,
        default=0.25,
        metavar="CORES",
        help="a step (or calibration) is quiet when other processes used fewer cores meanwhile",
    )
    parser.add_argument("--quiet-steps", type=int, default=8, help="quiet steps wanted per plan")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="before each measurement, wait up to this long for other processes to go below --quiet",
    )
    parser.add_argument(
        "--profile-batches", type=lambda s: tuple(int(x) for x in s.split(",")), default=(4, 8, 16, 32, 64)
    )
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("-v", "--verbose", action="store_true", help="print every step")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per rank (the forked ranks inherit it)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_distmm"):  # one line per run is plenty
        logging.getLogger(name).setLevel(logging.WARNING)
    model = MODELS[args.model]
    options = runtime_cost_defaults(PLANNER_OPTIONS, "cpu")
    configs = plans(args.batch)
    pred: dict[str, list[tuple[float, float, float]]] = {}  # plan -> (predicted s, concurrency, other cores) per round
    steps: dict[str, list[tuple[float, float]]] = {
        n: [] for n in configs
    }  # plan -> (wall s, other cores) per timed step
    picks: list[tuple[str, float]] = []  # the planner's pick per round, other cores during its calibration

    def quiet(rows: list[tuple[float, float]]) -> list[float]:
        return [t for t, f in rows if f < args.quiet]

    with tempfile.TemporaryDirectory() as tmp, ConcurrencyProbe(2, 1) as probe:
        wait_quiet(args.quiet, args.wait_quiet)
        overhead, raw = framework_overhead(
            args, options, measure_local_cpu(devices=2, cache=False, measure_concurrency=False), tmp
        )
        options["step_overhead"] = overhead
        print(
            f"framework overhead per step (trivial towers: colocated {raw['colocated'] * 1e3:.1f} ms, separate"
            f" {raw['separate'] * 1e3:.1f} ms, minus their priced cost): {overhead * 1e3:.1f} ms",
            flush=True,
        )
        r = 0
        while r < args.rounds or (
            r < args.max_rounds and any(len(quiet(steps[n])) < args.quiet_steps for n in configs)
        ):
            wait_quiet(args.quiet, args.wait_quiet)
            cluster, profiles, foreign = calibrate(model, args)
            c = probe.measure()
            calm = foreign < args.quiet and probe.quiet  # profiles and concurrency measured on a quiet host
            pick, _ = make_plan(None, with_concurrency(cluster, c), args.batch, options, profiles=profiles)
            name = next((n for n, p in configs.items() if same_plan(p, pick)), None)
            if name is None:
                name = f"planner pick {sum(1 for n in configs if n.startswith('planner pick')) + 1}"
                configs[name], steps[name] = pick, []
            picks.append((name, calm))
            line = []
            for n, plan in configs.items():
                wait_quiet(args.quiet, args.wait_quiet)
                c = probe.measure()  # the host right before this run
                p = price_plan(plan, profiles, with_concurrency(cluster, c), options).step_time
                rows = measure(plan, model, args, os.path.join(tmp, f"r{r}.json"))
                pred.setdefault(n, []).append((p, c, calm and probe.quiet))
                steps[n].extend(rows)
                if args.verbose:
                    print(
                        f"  {n}: concurrency {c:.2f}{'' if probe.quiet else ' (busy host)'}, predicted {p * 1e3:.0f} ms;"
                        " steps ms/other cores: " + " ".join(f"{t * 1e3:.0f}/{f:.2f}" for t, f in rows),
                        flush=True,
                    )
                line.append(
                    f"{n} {p * 1e3:.0f}/{statistics.median(t for t, _ in rows) * 1e3:.0f} ({len(quiet(rows))} quiet)"
                )
            r += 1
            print(f"round {r}: planner's pick {name!r}; predicted/measured ms: {'; '.join(line)}", flush=True)
    report(args, model, configs, pred, steps, picks, quiet, overhead)


def report(args, model, configs, pred, steps, picks, quiet, overhead) -> None:
    quiet_picks = [n for n, calm in picks if calm] or [n for n, _ in picks]
    pick = max(dict.fromkeys(quiet_picks), key=quiet_picks.count)  # the most frequent, the earliest on ties
    predicted, measured, note, conc = {}, {}, {}, {}
    for n in configs:
        rows = [x for x in pred[n] if x[2]] or pred[n]
        predicted[n] = statistics.median(p for p, _, _ in rows)
        conc[n] = statistics.median(c for _, c, _ in rows)
        q = quiet(steps[n])
        enough = len(q) >= max(3, args.quiet_steps // 2) or len(q) == len(steps[n])
        measured[n] = statistics.median(q if enough else [t for t, _ in steps[n]])
        note[n] = "" if enough else " (few quiet steps: median of all)"
    fastest = min(measured, key=measured.get)
    params = sum(p.numel() for p in CLIPModel(model, OPTIM).parameters())
    rounds = len(picks)
    print(
        f"\ncost-model fidelity: {model['name']} ({params / 1e6:.2f}M parameters), 2 CPU ranks (gloo, 1 thread each),"
        f" global batch {args.batch}; {rounds} interleaved rounds x {args.steps - args.warmup} timed steps per plan"
    )
    print(
        f"predicted: cost model on profiles measured in each round, concurrency probed right before each run, step overhead"
        f" {overhead * 1e3:.1f} ms (median over quiet rounds); measured: median of the quiet steps (other processes of the"
        f" host below {args.quiet} cores)"
    )
    head = (
        f"{'plan':<26} {'towers':<44} {'predicted ms':>12} {'measured ms':>11} {'error':>7} {'concurrency':>11}"
        f" {'quiet steps':>11} {'all steps ms':>12}"
    )
    print(head)
    print("-" * len(head))
    errors = {}
    for n, plan in configs.items():
        p, m = predicted[n] * 1e3, measured[n] * 1e3
        errors[n] = (p - m) / m
        mark = (" <- planner's pick" if n == pick else "") + (" (fastest)" if n == fastest else "")
        allm = statistics.median(t for t, _ in steps[n]) * 1e3
        q = f"{len(quiet(steps[n]))}/{len(steps[n])}"
        print(
            f"{n:<26} {describe(plan):<44} {p:>12.1f} {m:>11.1f} {errors[n] * 100:>+6.1f}% {conc[n]:>11.2f} {q:>11}"
            f" {allm:>12.1f}{note[n]}{mark}"
        )
    worst = max(errors, key=lambda n: abs(errors[n]))
    gap = measured[pick] / measured[fastest] - 1
    print(
        f"\nplanner's pick per round: {', '.join(n + ('' if calm else ' (busy host: not counted)') for n, calm in picks)}"
    )
    print(
        f"target 1, every prediction within 25% of the measurement: {'HOLDS' if all(abs(e) <= 0.25 for e in errors.values()) else 'MISSED'}"
        f" (largest error {errors[worst] * 100:+.1f}%, {worst!r})"
    )
    print(
        f"target 2, the planner's pick within 10% of the measured fastest: {'HOLDS' if gap <= 0.10 else 'MISSED'}"
        f" ({pick!r} {measured[pick] * 1e3:.1f} ms, fastest {fastest!r} {measured[fastest] * 1e3:.1f} ms: {gap * 100:+.1f}%)"
    )


if __name__ == "__main__":
    main()
