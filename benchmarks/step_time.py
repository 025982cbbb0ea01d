"""Step time, side by side in one run: DDP (open_clip loss) vs distmm colocated, separate towers and the default plan.

Same model, world size and global batch for all four:

* ``ddp``: Lightning's DDPStrategy, each rank runs both towers on batch/world samples and
  computes open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True)``;
* ``distmm-colocated``: ``DistMMStrategy(plan="colocated")``, the same layout through distmm;
* ``distmm-separate``: the image tower on some ranks, the text tower on the others;
* ``distmm-default``: ``DistMMStrategy()`` with no plan: the plan the cost model prices cheapest
  from counted FLOPs (``lightning_distmm.planner.default``); the line it logs is printed below the
  table.

Configurations run in interleaved rounds (so machine noise hits all alike); the step time is
measured on rank 0 from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward,
gradient sync, optimizer step), skipping warm-up steps. Prints medians and ratios to DDP.

``--launcher`` picks how the ranks start, the same for DDP and distmm: ``fork`` (the notebook
launchers, in this process), ``spawn``, or ``popen`` (Lightning's subprocess launcher, as a script
run from a shell: each run is this script started again with ``--only``).

``--stream`` prices the check that every rank reads the same samples of a stream
(:mod:`lightning_distmm.data.streams.agreement`): the separate-towers plan over the same data as a map-style
dataset (``distmm-separate``), as a stream checked every ``--check-every`` global batches
(``distmm-stream``), and as the same stream declared rank-independent, unchecked
(``distmm-stream-declared``); ``check ms`` is the check's own time per global batch on rank 0 (the
samples' keys and the all-gather), timed around it.

    python benchmarks/step_time.py --devices 2 --batch 64 --steps 14 --rounds 3 --launcher popen
    python benchmarks/step_time.py --devices 2 --batch 64 --steps 14 --rounds 3 --stream
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
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from synthetic import SyntheticPairs, SyntheticStream, TwoTowerCLIP
from torch import nn
from torch.utils.data import DataLoader

import lightning_distmm as ldm
from lightning_distmm.models.tiny import TinyText, quiet_trainer_kwargs, tiny_vit

EMBED, VOCAB, SEQ, IMG = 128, 256, 32, 32


class BenchCLIP(TwoTowerCLIP):
    def __init__(self, image_width: int = 192, image_layers: int = 4, text_width: int = 128, text_layers: int = 4):
        super().__init__()
        self.visual = tiny_vit(
            IMG, 4, image_width, image_layers, max(1, image_width // 64), EMBED, mlp_ratio=4.0, qkv_bias=True
        )
        heads = max(1, text_width // 64)
        self.text = TinyText(VOCAB, SEQ, text_width, EMBED, text_layers, heads, 4 * text_width, freeze_key_bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class OpenClipDDP(BenchCLIP):
    """open_clip's ClipLoss(local_loss=True, gather_with_grad=True) under DDP."""

    def training_step(self, batch, batch_idx):
        image = F.normalize(self.visual(batch["image"]), dim=-1)
        text = F.normalize(self.text(batch["input_ids"], batch["attention_mask"]), dim=-1)
        scale = self.logit_scale.exp()
        if dist.is_initialized() and dist.get_world_size() > 1:
            import torch.distributed.nn.functional as dnn

            all_image, all_text = torch.cat(dnn.all_gather(image)), torch.cat(dnn.all_gather(text))
            offset = dist.get_rank() * image.shape[0]
        else:
            all_image, all_text, offset = image, text, 0
        labels = torch.arange(image.shape[0]) + offset
        loss = (
            F.cross_entropy(scale * image @ all_text.T, labels) + F.cross_entropy(scale * text @ all_image.T, labels)
        ) / 2
        self.log("train/loss", loss)
        return loss


def minor_faults() -> int:
    """This process's minor page faults so far (Linux; 0 elsewhere): pages the kernel had to hand it."""
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


class CheckTimer:
    """The stream check's own time on this rank: the samples' keys and the comparisons, per global batch."""

    seconds = {"keys": 0.0, "gather": 0.0}
    batches = 0

    @classmethod
    def install(cls) -> None:
        from lightning_distmm.data.streams import agreement

        original = agreement.StreamAgreement.batches

        def batches(self, source, epoch, skip):  # type: ignore[no-untyped-def]
            keys, post, settle = self._keys, self._post, self._settle

            def timed(fn, part):  # type: ignore[no-untyped-def]
                def call(*args, **kwargs):  # type: ignore[no-untyped-def]
                    t0 = time.perf_counter()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        cls.seconds[part] += time.perf_counter() - t0

                return call

            self._keys, self._post, self._settle = timed(keys, "keys"), timed(post, "gather"), timed(settle, "gather")

            def counted():  # type: ignore[no-untyped-def]
                for batch in source:
                    cls.batches += 1
                    yield batch

            try:
                yield from original(self, counted(), epoch, skip)
            finally:
                self._keys, self._post, self._settle = keys, post, settle

        agreement.StreamAgreement.batches = batches  # type: ignore[method-assign]

    @classmethod
    def per_batch(cls) -> dict[str, float]:
        """Seconds per global batch: computing the samples' keys, and comparing (posting the
        all-gather and waiting for it: the first batch's waits for the other ranks to reach it)."""
        return {part: t / cls.batches if cls.batches else 0.0 for part, t in cls.seconds.items()}


class StepTimer(L.Callback):
    """Each step's time and minor page faults on rank 0 (memory the allocator had to take back from the kernel)."""

    def __init__(self, path: str) -> None:
        self.path, self.times, self.faults, self.t0, self.f0 = path, [], [], 0.0, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.f0 = minor_faults()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.t0)
        self.faults.append(minor_faults() - self.f0)
        if trainer.is_global_zero:
            record = {"times": self.times, "faults": self.faults, "check": CheckTimer.per_batch()}
            Path(self.path).write_text(json.dumps(record))


DDP_STRATEGY = {"fork": "ddp_notebook", "spawn": "ddp_spawn", "popen": "ddp"}
CONFIGS = ["ddp", "distmm-colocated", "distmm-separate", "distmm-default"]


def run(config: str, args: argparse.Namespace, out: str) -> tuple[list[float], list[int]]:
    """One fit of ``config``; its timed steps' times and page faults. ``popen`` runs it as this script started again."""
    if args.launcher == "popen" and not args.only:
        import subprocess
        import sys

        cmd = [sys.executable, __file__, "--only", config, "--out", out, "--launcher", "popen"]
        cmd += ["--devices", str(args.devices), "--batch", str(args.batch), "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup)] + (["--threads", str(args.threads)] if args.threads else [])
        cmd += ["--check-every", str(args.check_every)]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return _timed(out, args.warmup)
    L.seed_everything(0, verbose=False)
    CheckTimer.install()
    world = args.devices
    if config == "ddp":
        module: L.LightningModule = OpenClipDDP()
        strategy: object = DDP_STRATEGY[args.launcher]
        per_rank = args.batch // world
    else:
        module = BenchCLIP()
        if config == "distmm-colocated":
            plan: object = "colocated"
        elif config == "distmm-default":
            plan = None
        else:
            image = max(1, world - max(1, world // 4))
            plan = ldm.Plan(
                world, {"image": {"ranks": list(range(image))}, "text": {"ranks": list(range(image, world))}}
            )
        strategy = ldm.DistMMStrategy(plan=plan, start_method=args.launcher, stream_check_every=args.check_every)
        per_rank = args.batch
    size = args.batch * args.steps
    dataset: object = SyntheticPairs(size, IMG, VOCAB, SEQ)
    if config.startswith("distmm-stream"):
        dataset = SyntheticStream(size, IMG, VOCAB, SEQ)
        if config == "distmm-stream-declared":
            ldm.data.rank_independent(dataset)
    data = DataLoader(dataset, batch_size=per_rank, shuffle=False, drop_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=[StepTimer(out)],
        use_distributed_sampler=config == "ddp",
        **quiet_trainer_kwargs(),
    )
    trainer.fit(module, data)
    return _timed(out, args.warmup)


CHECKS: dict[str, dict[str, float]] = {}  # the output file of a run: its stream check's seconds per global batch


def _timed(out: str, warmup: int) -> tuple[list[float], list[int]]:
    record = json.loads(Path(out).read_text())
    CHECKS[out] = record.get("check", {})
    return record["times"][warmup:], record["faults"][warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per rank (default: what the launcher sets)"
    )
    parser.add_argument("--launcher", choices=["fork", "spawn", "popen"], default="fork")
    parser.add_argument(
        "--stream", action="store_true", help="price the stream check: map-style vs checked vs declared stream"
    )
    parser.add_argument("--check-every", type=int, default=1, help="the stream check's interval in global batches")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of {','.join(CONFIGS)} (ratios to the first)",
    )
    parser.add_argument("--only", help=argparse.SUPPRESS)  # popen: one configuration, run as a script
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.only:
        run(args.only, args, args.out)
        return
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    configs = [c for c in args.configs.split(",") if c]
    if args.stream:
        configs = ["distmm-separate", "distmm-stream", "distmm-stream-declared"]
    unknown = sorted(set(configs) - set(CONFIGS) - {"distmm-stream", "distmm-stream-declared"})
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {CONFIGS}")
    samples: dict[str, list[float]] = {c: [] for c in configs}
    faults: dict[str, list[int]] = {c: [] for c in configs}
    rounds: dict[str, list[float]] = {c: [] for c in configs}  # each round's median: the host's drift
    checks: dict[str, dict[str, list[float]]] = {c: {"keys": [], "gather": []} for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for c in configs:
                out = os.path.join(tmp, f"{c}-{r}.json")
                times, step_faults = run(c, args, out)
                samples[c] += times
                faults[c] += step_faults
                for part in ("keys", "gather"):
                    checks[c][part].append(CHECKS.get(out, {}).get(part, 0.0))
                rounds[c].append(statistics.median(times))
    first = configs[0]
    base = statistics.median(samples[first])
    params = sum(p.numel() for p in BenchCLIP().parameters())
    print(
        f"\nstep time, {args.devices} CPU ranks (gloo, {args.launcher} launcher), global batch {args.batch},"
        f" {params / 1e6:.2f}M parameters, {args.rounds} rounds x {args.steps - args.warmup} timed steps"
        + (f", stream check every {args.check_every} global batch(es)" if args.stream else "")
    )
    w = max(8, len(first) + 3)
    head = f"{'configuration':<24} {'median ms':>10} {'vs ' + first:>{w}} {'page faults/step':>17}"
    print(
        head
        + (f" {'keys ms':>8} {'gather ms':>10} {'check/step':>11}" if args.stream else "")
        + "  per-round medians ms"
    )
    for c in configs:
        med = statistics.median(samples[c])
        line = f"{c:<24} {med * 1e3:>10.1f} {med / base:>{w}.3f} {statistics.median(faults[c]):>17.0f}"
        if args.stream:
            keys, gather = (statistics.median(checks[c][part]) for part in ("keys", "gather"))
            line += f" {keys * 1e3:>8.3f} {gather * 1e3:>10.3f} {100 * (keys + gather) / med:>10.2f}%"
        print(line + "  " + " ".join(f"{x * 1e3:.0f}" for x in rounds[c]))
    if {"distmm-colocated", "distmm-separate", "distmm-default"} <= set(configs):
        best = min(statistics.median(samples[c]) for c in ("distmm-colocated", "distmm-separate"))
        mine = statistics.median(samples["distmm-default"])
        print(f"distmm-default / faster of distmm-colocated and distmm-separate: {mine / best:.3f}")
    if "distmm-default" in configs:
        print(default_line(args.devices, args.batch))


def default_line(world: int, batch: int) -> str:
    """The line ``DistMMStrategy()`` logs for this model on ``world`` ranks of this host (priced
    here, as rank 0 of the run does: the counts and the host's description, nothing timed)."""
    from torch.utils.data import default_collate

    from lightning_distmm.parallel.flops import tower_counts
    from lightning_distmm.planner.default import CountedTower, default_plan, describe_cpu

    example = default_collate([SyntheticPairs(1, IMG, VOCAB, SEQ)[0]])
    counts = tower_counts(BenchCLIP().tower_specs(), example)
    threads = max(1, (os.cpu_count() or 1) // world)  # what Lightning's launchers give each rank
    host = describe_cpu(world, threads)
    return default_plan({n: CountedTower(**c) for n, c in counts.items()}, world, batch, host).line()


if __name__ == "__main__":
    main()
