"""Caption the embedded shapes images with a tiny vision encoder + projector + LLM under distmm
(docs/vlm.md): the encoder on its own rank(s), the LLM on another, image tokens handed over
point to point. Prints the loss, then generated captions of held-out images next to the true ones
and the share of captions that name the right colour and shape, next to chance (1/32).

    python recipes/vlm_shapes.py                       # encoder rank 0, LLM rank 1 (2 CPU processes)
    python recipes/vlm_shapes.py --image-dp 2 --steps 3000
    python recipes/vlm_shapes.py --single              # the same module under an ordinary Trainer

Nothing is downloaded: the images are rendered, the tokenizer is the embedded caption vocabulary,
the models are built at random.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import LlamaForCausalLM

import lightning_distmm as ldm
from lightning_distmm.data.demo.captions import COLORS, SHAPES
from lightning_distmm.data.demo.shapes import PIXEL_MEAN, PIXEL_STD, ShapesDataset, describe, render
from lightning_distmm.data.demo.tokenizer import BOS_ID, EOS_ID, build_caption_tokenizer, decode
from lightning_distmm.data.samples.fields import FieldDataset
from lightning_distmm.models.vlm import VLM, tiny_llama_config, tiny_vit

CONTEXT = 16


class ShapesCaptions(FieldDataset):
    """Shapes samples as a VLM reads them: ``max_images`` image slots, the caption as text whose words
    (not ``[BOS]``, not padding) are the targets. With ``max_images`` 2 a sample carries two views of
    its shape (the second rendered with its own noise, jitter and tint) or, every ``no_image_every``-th
    sample, none: a caption without its image, from which only the language is learnt."""

    fields = ("pixel_values", "n_images", "input_ids", "attention_mask", "labels", "label")

    def __init__(self, split: str, size: int, max_images: int = 1, no_image_every: int = 0) -> None:
        self.shapes = ShapesDataset(split, size=size, context_length=CONTEXT)
        self.max_images, self.no_image_every = int(max_images), int(no_image_every)

    def __len__(self) -> int:
        return len(self.shapes)

    def images(self, index: int) -> int:
        """How many images sample ``index`` carries."""
        if self.no_image_every and index % self.no_image_every == 0:
            return 0
        return self.max_images

    def load(self, index: int, fields: Any) -> dict[str, Any]:
        want = set(fields)
        base = self.shapes.load(index, ["image", "input_ids", "attention_mask", "label"])
        ids, mask = base["input_ids"], base["attention_mask"]
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        labels[0] = -100  # [BOS] is given, not predicted
        n = self.images(index)
        pixels = torch.zeros(self.max_images, *base["image"].shape)
        if n:
            pixels[0] = base["image"]
        for k in range(1, n):  # another view of the same colour, shape and place
            attrs = self.shapes.attributes(index)
            rng = np.random.default_rng([self.shapes.seed, self.shapes._global_index(index), 1000 + k])
            view = render(
                attrs["color"], attrs["shape"], attrs["position"], rng, self.shapes.image_size, self.shapes.noise
            )
            pixels[k] = torch.from_numpy((view - PIXEL_MEAN) / PIXEL_STD)
        out = {
            "pixel_values": pixels,
            "n_images": torch.tensor(n),
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "label": torch.tensor(base["label"]),
        }
        return {k: v for k, v in out.items() if k in want}


class ShapesCaptionsData(L.LightningDataModule):
    """The captioning data for ``recipes/train.py experiment=vlm_shapes`` (``conf/data/vlm_shapes.yaml``):
    training samples with 0 or ``max_images`` images, held-out ones all with images."""

    def __init__(
        self, batch_size: int, train_size: int, held_out: int = 128, max_images: int = 2, no_image_every: int = 4
    ) -> None:
        super().__init__()
        self.batch_size, self.held_out = int(batch_size), int(held_out)
        self.train = ShapesCaptions("train", int(train_size), max_images, no_image_every)
        self.test = ShapesCaptions("test", self.held_out, max_images, 0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size)


class Losses(L.Callback):
    """Every step's loss, written by rank 0 to ``path`` (the workers' callbacks are copies)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.losses))


def build(lr: float, max_images: int = 1, vit: dict | None = None, llm: dict | None = None, **flags: Any) -> VLM:
    """The tiny VLM: a timm ViT (``vit``: img_size, patch_size, width, depth, heads) + MLP projector +
    a Llama (``llm``: width, layers, heads) over the caption vocabulary, AdamW at ``lr``; ``flags``:
    ``freeze_vit``, ``frozen_llm``. Defaults: 32 px, patch 8, width 48, 2 blocks; width 64, 2 layers."""
    v = {"img_size": 32, "patch_size": 8, "width": 48, "depth": 2, "heads": 4, **(vit or {})}
    t = {"width": 64, "layers": 2, "heads": 4, **(llm or {})}
    vocab = build_caption_tokenizer().get_vocab_size()
    lm = LlamaForCausalLM(tiny_llama_config(vocab=vocab, **t))
    return VLM(vit=tiny_vit(**v), lm=lm, vit_width=v["width"], max_images=max_images, optimizer="adamw", lr=lr, **flags)


def build_from_config(model_cfg: Any, lr: float) -> VLM:
    """:func:`build` from ``conf/model/vlm_*.yaml`` (a mapping: ``vit``, ``llm``, ``max_images``, flags)."""
    cfg = dict(model_cfg)
    return build(
        lr,
        int(cfg.get("max_images", 1)),
        dict(cfg.get("vit") or {}),
        dict(cfg.get("llm") or {}),
        freeze_vit=bool(cfg.get("freeze_vit", False)),
        frozen_llm=bool(cfg.get("frozen_llm", False)),
    )


@torch.no_grad()
def generate(
    model: VLM, pixel_values: torch.Tensor, steps: int = CONTEXT - 1, n_images: torch.Tensor | None = None
) -> list[list[int]]:
    """Greedy captions: the image prefix, ``[BOS]``, then the most likely word until ``[EOS]``."""
    model.eval()
    n = pixel_values.shape[0]
    n_images = torch.full((n,), pixel_values.shape[1], dtype=torch.long) if n_images is None else n_images
    embeds = model.vision(pixel_values, n_images)
    ids = torch.full((n, 1), BOS_ID, dtype=torch.long)
    for _ in range(steps):
        mask = torch.ones_like(ids)
        logits = model.language(ids, mask, ids, n_images, embeds)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    out = []
    for row in ids.tolist():
        words = row[1:]
        out.append(words[: words.index(EOS_ID)] if EOS_ID in words else words)
    return out


def caption_report(model: VLM, held: ShapesCaptions, show: int = 8) -> list[str]:
    """Generated captions of the held-out images next to the true ones, and the share that name the
    right colour and shape next to chance (1 in 32)."""
    batch = next(iter(DataLoader(held, batch_size=len(held))))
    shapes = ShapesDataset(held.shapes.split, size=len(held), fields=["caption"])
    tok = build_caption_tokenizer()
    captions = [decode(ids, tok) for ids in generate(model, batch["pixel_values"], n_images=batch["n_images"])]
    right = [names_right(c, int(label)) for c, label in zip(captions, batch["label"])]
    lines = [f"{'generated':40s} | true"]
    lines += [f"{captions[i]:40s} | {shapes[i]['caption']}" for i in range(min(show, len(captions)))]
    chance = 1 / (len(COLORS) * len(SHAPES))
    lines.append(
        f"colour and shape right: {sum(right) / len(right):.1%} of {len(right)} held-out images (chance {chance:.1%})"
    )
    return lines


def loss_line(losses: list[float], seconds: float) -> str:
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return f"train loss: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({seconds:.0f} s)"


def names_right(caption: str, label: int) -> bool:
    """The caption names the sample's colour and shape, and no other colour or shape."""
    colour, shape, _ = describe(label)
    words = caption.split()
    return (
        colour in words
        and shape in words
        and not any(c in words for c in COLORS if c != colour)
        and not any(s in words for s in SHAPES if s != shape)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--image-dp", type=int, default=1, help="encoder replicas; the LLM gets one more rank")
    ap.add_argument("--single", action="store_true", help="an ordinary single-process Trainer (the reference)")
    ap.add_argument("--held-out", type=int, default=128)
    args = ap.parse_args()

    L.seed_everything(0)
    model = build(args.lr)
    data = DataLoader(ShapesCaptions("train", args.steps * args.batch), batch_size=args.batch, drop_last=True)
    losses = Losses(str(Path(tempfile.mkdtemp()) / "losses.json"))
    common: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    if args.single:
        trainer = L.Trainer(devices=1, **common)
    else:
        world = args.image_dp + 1
        plan = ldm.Plan(world, {"image": {"ranks": list(range(args.image_dp))}, "llm": {"ranks": [args.image_dp]}})
        trainer = L.Trainer(devices=world, strategy=ldm.DistMMStrategy(plan=plan, start_method="spawn"), **common)
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    if not trainer.is_global_zero:
        return
    recorded = json.loads(Path(losses.path).read_text()) if Path(losses.path).exists() else []
    if recorded:
        print(loss_line(recorded, seconds))
    for line in caption_report(model, ShapesCaptions("test", args.held_out)):
        print(line)


if __name__ == "__main__":
    main()
