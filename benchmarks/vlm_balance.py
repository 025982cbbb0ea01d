"""Each step's rows split by count against by cost, measured side by side on CPU ranks.

An encoder feeding a language model (``lightning_distmm.models.vlm.VLM``: a timm ViT that runs only
the images a row carries, a projector, a Llama LM reading every image slot's tokens, so that its
rows cost the same whatever their images) on two CPU
ranks, both towers on both (``plan="colocated"``: encoder dp 2, LLM dp 2). Images per sample are
drawn from the planner's workloads (InternVL-like ``{1: .2, 3: .3, 5: .3, 7: .2}``, LLaVA-like
``{0: .1, 1: .9}``), the same samples for both modes. The modes alternate run by run:

* ``rows``: ``DistMMStrategy(balance="rows")``, the plan's even split in sample order;
* ``cost``: ``DistMMStrategy(balance="cost")`` with ``VLM(cost={"image": "n_images"})``: each
  step's rows to the encoder's replicas by their images (the LLM's keep their counts);
* ``packed`` (``--model vlm``): balanced by cost, and the LLM computes only each row's present
  tokens packed into sequences (``VLM(pack_tokens=...)``: no absent image slot, no padding), its
  rows balanced by those tokens (``cost={"llm": {"n_images": tokens per image, "n_tokens": 1}}``).

``--model clip``: a CLIP-style model (``step_time.BenchCLIP``: ViT and text transformer, colocated
on the same ranks) whose captions have lengths of 4..32 tokens, the text tower balanced by them
(``cost={"n_tokens": 1}``). Its text tower pads every caption to the same length, so balancing
cannot make it faster: the run measures what balancing costs (reading the cost field, the
assignment, the reordered batch-sync), which must be nothing within the noise.

Per step: rank 0's step time (``on_train_batch_start`` to ``on_train_batch_end``; the gradient sums
make every rank wait for the slowest), and each rank's encoder forward time (hooks around the
vision tower's forward), whose slowest over mean is the straggler the balance removes. The first
``--warmup`` steps are left out. Prints medians and the ratio of the two modes.

    python benchmarks/vlm_balance.py --rows 1,2,4 --steps 12 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaForCausalLM  # noqa: E402

import lightning_distmm as ldm  # noqa: E402
from lightning_distmm.models.tiny import quiet_trainer_kwargs  # noqa: E402
from lightning_distmm.models.vlm import VLM, tiny_llama_config, tiny_vit  # noqa: E402

WORKLOADS = {"internvl": {1: 0.2, 3: 0.3, 5: 0.3, 7: 0.2}, "llava": {0: 0.1, 1: 0.9}}
IMG, PATCH, WIDTH, SEQ, VOCAB = 32, 8, 192, 24, 64


class Samples(ldm.FieldDataset):
    """Samples with their drawn images (up to the workload's most) and a caption of 8..SEQ tokens."""

    fields = ("pixel_values", "n_images", "input_ids", "attention_mask", "labels", "n_tokens")

    def __init__(self, size: int, images: dict[int, float], seed: int = 0) -> None:
        rng = random.Random(seed)
        self.max_images = max(images)
        self.counts = rng.choices(list(images), list(images.values()), k=size)
        self.lengths = [rng.randint(8, SEQ) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.counts)

    def load(self, index: int, fields: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        k, length = self.counts[index], self.lengths[index]
        if "pixel_values" in fields:
            g = torch.Generator().manual_seed(index)
            pixels = torch.randn(max(self.max_images, 1), 3, IMG, IMG, generator=g)
            pixels[k:] = 0
            out["pixel_values"] = pixels
        if "n_images" in fields:
            out["n_images"] = k
        mask = (torch.arange(SEQ) < length).long()
        ids = (torch.arange(SEQ) * 7 + index) % (VOCAB - 1) + 1
        if "input_ids" in fields:
            out["input_ids"] = ids * mask
        if "attention_mask" in fields:
            out["attention_mask"] = mask
        if "labels" in fields:
            out["labels"] = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        if "n_tokens" in fields:
            out["n_tokens"] = length
        return out


class Timer(L.Callback):
    """Rank 0's step times and each rank's encoder forward seconds per step, written per rank."""

    def __init__(self, out: str, encoder: bool = True) -> None:
        self.out, self.steps, self.encoder, self.t0, self.enc = out, [], [], 0.0, 0.0
        self.hooked = encoder

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.hooked:
            return
        vision = pl_module.vision  # type: ignore[attr-defined]
        start: list[float] = [0.0]

        def pre(*_: Any) -> None:
            start[0] = time.perf_counter()

        def post(*_: Any) -> None:
            self.enc += time.perf_counter() - start[0]

        vision.register_forward_pre_hook(pre)
        vision.register_forward_hook(post)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.t0, self.enc = time.perf_counter(), 0.0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(time.perf_counter() - self.t0)
        self.encoder.append(self.enc)
        Path(f"{self.out}.{trainer.global_rank}").write_text(json.dumps({"steps": self.steps, "encoder": self.encoder}))


def clip_module_and_data(rows: int, args: argparse.Namespace) -> tuple[L.LightningModule, DataLoader]:
    """The CLIP-style model with its text tower costed by caption length, and its data."""
    from step_time import IMG as CLIP_IMG
    from step_time import SEQ as CLIP_SEQ
    from step_time import VOCAB as CLIP_VOCAB
    from step_time import BenchCLIP
    from synthetic import SyntheticPairs

    class Captions(SyntheticPairs):
        fields = (*SyntheticPairs.fields, "n_tokens")

        def load(self, index: int, fields: Any) -> dict[str, Any]:
            out = super().load(index, [f for f in fields if f != "n_tokens"])
            if "n_tokens" in fields:
                out["n_tokens"] = 4 + (index * 7919) % (CLIP_SEQ - 3)
            return out

    class CostedCLIP(BenchCLIP):
        def towers(self) -> dict[str, ldm.Tower]:
            t = super().towers()
            t["text"].cost = {"n_tokens": 1}
            return t

    torch.manual_seed(0)
    batch = rows * args.devices
    data = DataLoader(Captions(batch * args.steps, CLIP_IMG, CLIP_VOCAB, CLIP_SEQ), batch_size=batch, drop_last=True)
    return CostedCLIP(), data


def run(mode: str, rows: int, args: argparse.Namespace, folder: str) -> dict[str, list[float]]:
    if args.model == "clip":
        module, data = clip_module_and_data(rows, args)
        return fit(module, data, mode, rows, args, folder, None)
    images = WORKLOADS[args.workload]
    max_images = max(images)
    torch.manual_seed(0)
    vit = tiny_vit(img_size=IMG, patch_size=PATCH, width=WIDTH, depth=args.vit_depth, heads=4)
    lm = LlamaForCausalLM(tiny_llama_config(vocab=VOCAB, width=32, layers=1, heads=4))
    cost: dict[str, Any] = {"image": "n_images"}  # (this LLM reads every image slot: its rows cost alike)
    pack_tokens = None
    if mode == "packed":  # the LLM computes present tokens only: its rows cost their images and caption
        per_image = (IMG // PATCH) ** 2 + 1
        cost["llm"] = {"n_images": per_image, "n_tokens": 1}
        pack_tokens = max_images * per_image + SEQ  # the longest sample fits
    module = VLM(
        vit=vit,
        lm=lm,
        vit_width=WIDTH,
        max_images=max_images,
        optimizer="adamw",
        lr=1e-3,
        cost=cost,
        pack_tokens=pack_tokens,
    )
    batch = rows * args.devices
    data = DataLoader(Samples(batch * args.steps, images), batch_size=batch, drop_last=True)
    return fit(module, data, mode, rows, args, folder, module.vision)


def fit(
    module: L.LightningModule,
    data: DataLoader,
    mode: str,
    rows: int,
    args: argparse.Namespace,
    folder: str,
    encoder: torch.nn.Module | None,
) -> dict[str, list[float]]:
    """One run of ``mode``: rank 0's step times and, with ``encoder``, its forward's straggler."""
    out = str(Path(folder) / f"{mode}-{rows}")
    strategy = ldm.DistMMStrategy(plan="colocated", start_method="fork", balance="rows" if mode == "rows" else "cost")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=[Timer(out, encoder is not None)],
        **quiet_trainer_kwargs(),
    )
    trainer.fit(module, data)
    per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(args.devices)]
    w = args.warmup
    enc = list(zip(*(p["encoder"][w:] for p in per_rank)))
    return {
        "step": per_rank[0]["steps"][w:],
        "straggler": [max(e) / (sum(e) / len(e)) for e in enc if sum(e) > 0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["vlm", "clip"], default="vlm")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="internvl")
    parser.add_argument("--rows", default="1,2,4", help="rows per encoder replica")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--vit-depth", type=int, default=8)
    args = parser.parse_args()
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    modes = ("rows", "cost", "packed") if args.model == "vlm" else ("rows", "cost")
    with tempfile.TemporaryDirectory() as folder:
        for rows in (int(r) for r in args.rows.split(",")):
            for _ in range(args.rounds):
                for mode in modes:
                    got = run(mode, rows, args, folder)
                    slot = results.setdefault((mode, rows), {"step": [], "straggler": []})
                    for k, v in got.items():
                        slot[k] += v
    what = (
        f"{args.workload}-like images per sample {WORKLOADS[args.workload]}; VLM colocated on {args.devices} CPU"
        f" ranks (encoder dp {args.devices}, LLM dp {args.devices})"
        if args.model == "vlm"
        else f"CLIP-style, captions of 4..32 tokens padded to 32, text tower balanced by length; colocated on"
        f" {args.devices} CPU ranks"
    )
    print(f"\n{what}; medians over {args.rounds} runs x {args.steps - args.warmup} steps, modes alternating")
    print("| rows / replica | split | step ms | encoder fwd slowest / mean | step: by count / this |")
    print("|---|---|---|---|---|")
    labels = {"rows": "by count", "cost": "by cost", "packed": "by cost + packed LLM"}
    for rows in (int(r) for r in args.rows.split(",")):
        med = {m: statistics.median(results[(m, rows)]["step"]) for m in modes}
        for mode in modes:
            r = results[(mode, rows)]
            strag = f"{statistics.median(r['straggler']):.2f}" if r["straggler"] else "-"
            ratio = f"{med['rows'] / med[mode]:.2f}x" if mode != "rows" else ""
            print(f"| {rows} | {labels[mode]} | {med[mode] * 1e3:.0f} | {strag} | {ratio} |")


if __name__ == "__main__":
    main()
