"""Fine-tune a tiny transformers LLaVA on conversations about the embedded shapes under distmm, then
ask it about held-out images (docs/vlm.md, "Your own LLaVA").

The model is transformers' own ``LlavaForConditionalGeneration`` (a CLIP vision tower and a Llama,
built at random, or loaded from ``--init`` folder), trained as two towers (the vision tower and its
projector on rank 0, the language model on rank 1) on LLaVA-format conversations
(``ldm.data.ConversationPairs``) of three questions: "what colour is the shape" -> "it is red",
"what shape is it" -> "a circle", "where is it" -> "at the top left". Each sample asks them in one
of the six orders (:data:`ORDERS`, by index), all three in even samples and the first two in odd
ones, so that every question comes right after the image in a third of the samples and after
another exchange in the rest. Afterwards rank 0 asks the colour about held-out images with
transformers' ``generate``, then the shape and the place after the colour's answer, and prints the
answers beside the truth and the share right against chance; ``--export`` writes the trained model
as a folder ``LlavaForConditionalGeneration.from_pretrained`` loads.

    python recipes/llava_shapes.py                          # 2000 steps of 32, 2 CPU processes
    python recipes/llava_shapes.py --export out/llava       # and save the trained model
    python recipes/llava_shapes.py --init out/llava --steps 100

Nothing is downloaded: the images are rendered, the tokenizer is built here from the words used.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_distmm as ldm
from lightning_distmm.data.datasets.conversations import ConversationPairs
from lightning_distmm.data.demo.captions import COLORS, POSITIONS, SHAPES
from lightning_distmm.data.demo.shapes import ShapesDataset, describe
from lightning_distmm.models.llava import LlavaModule
from lightning_distmm.models.tiny import quiet_trainer_kwargs

COLOUR_Q, SHAPE_Q, WHERE_Q = "what colour is the shape", "what shape is it", "where is it"
SPECIAL = ["<pad>", "<unk>", "<image>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
PATCHES = 16  # 32 px images in 8 px patches; the CLS token dropped ("default" feature selection)
FEATURE_LAYER = -2  # LLaVA's: the penultimate layer's patch tokens
#: the questions of sample ``i`` in order: ``ORDERS[i % 6]``, only the first two in odd samples. With
#: the colour always asked first, the shape stays at chance: the tower's shape features and the language
#: model's look back past the colour's exchange would have to be learnt together. Asked right after the
#: image in a third of the samples, each question is learnt there and then answered after another one.
ORDERS = (
    (COLOUR_Q, WHERE_Q, SHAPE_Q),
    (COLOUR_Q, SHAPE_Q, WHERE_Q),
    (SHAPE_Q, COLOUR_Q, WHERE_Q),
    (SHAPE_Q, WHERE_Q, COLOUR_Q),
    (WHERE_Q, COLOUR_Q, SHAPE_Q),
    (WHERE_Q, SHAPE_Q, COLOUR_Q),
)


def build_tokenizer() -> Any:
    """A word-level tokenizer over the conversations' words, the roles and ``<image>``, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    places = {w for _, where in POSITIONS for w in where.split()}
    words = sorted({*COLOUR_Q.split(), *SHAPE_Q.split(), *WHERE_Q.split(), "it", "is", "a", *COLORS, *SHAPES, *places})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIAL + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL[2:]})
    fast.chat_template = TEMPLATE
    return fast


def build_llava(tokenizer: Any) -> Any:
    """A random tiny LLaVA: CLIP vision (width 48, 3 layers, 32 px in 8 px patches) and Llama
    (width 64, 2 layers) over ``tokenizer``'s words."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=PATCHES,
        vision_feature_layer=FEATURE_LAYER,
        vision_feature_select_strategy="default",
    )
    return LlavaForConditionalGeneration(config)


def _rendered(image: Any) -> Any:
    """The images are rendered tensors already (:meth:`ShapesConversations._pixels`)."""
    return image


class ShapesConversations(ConversationPairs):
    """Conversations about the shapes, their images rendered rather than read from files."""

    def __init__(self, split: str, size: int, tokenizer: Any) -> None:
        self.shapes = ShapesDataset(split, size=size, fields=["image", "label"])
        records = []
        for i in range(size):
            colour, shape, place = describe(int(self.shapes.attributes(i)["label"]))
            answers = {COLOUR_Q: f"it is {colour}", SHAPE_Q: f"a {shape}", WHERE_Q: POSITIONS[place][1]}
            turns = []
            for question in ORDERS[i % len(ORDERS)][: 2 if i % 2 else 3]:
                value = question if turns else f"<image> {question}"
                turns += [{"from": "human", "value": value}, {"from": "gpt", "value": answers[question]}]
            records.append({"image": f"{split}-{i}", "conversations": turns})
        super().__init__(records, ".", tokenizer, PATCHES, transform=_rendered, max_length=56)

    def _pixels(self, index: int, image: str | None) -> torch.Tensor:
        return self.shapes.load(index, ["image"])["image"]


class ShapesConversationsData(L.LightningDataModule):
    """The data of ``recipes/train.py experiment=llava_shapes`` (``conf/data/llava_shapes.yaml``)."""

    def __init__(self, batch_size: int, train_size: int, held_out: int = 64) -> None:
        super().__init__()
        self.batch_size, self.held_out = int(batch_size), int(held_out)
        self.tokenizer = build_tokenizer()
        self.train = ShapesConversations("train", int(train_size), self.tokenizer)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, drop_last=True)


def build_module(model_cfg: Any, lr: float, tokenizer: Any, init: str | None = None) -> LlavaModule:
    """The :class:`LlavaModule` of ``conf/model/llava_tiny.yaml`` (random, or from the ``init`` folder)."""
    flags: dict[str, Any] = {k: bool(model_cfg.get(k, False)) for k in ("freeze_vision", "freeze_language")}
    pack = model_cfg.get("pack_tokens")
    flags["pack_tokens"] = int(pack) if pack is not None else None
    if init:
        return LlavaModule.from_pretrained(init, optimizer="adamw", lr=lr, **flags)
    return LlavaModule(build_llava(tokenizer), optimizer="adamw", lr=lr, **flags)


@torch.no_grad()
def ask(model: Any, tokenizer: Any, pixels: torch.Tensor, questions: list[list[dict[str, str]]]) -> list[str]:
    """transformers' greedy ``generate`` on each conversation so far (one image each), the answer's words."""
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    answers = []
    model.eval()
    for image, messages in zip(pixels, questions):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        expanded = [t for i in ids for t in ([i] * PATCHES if i == image_id else [i])]
        out = model.generate(
            input_ids=torch.tensor([expanded]),
            attention_mask=torch.ones(1, len(expanded), dtype=torch.long),
            pixel_values=image[None],
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
        answers.append(tokenizer.decode(out[0, len(expanded) :], skip_special_tokens=True).strip())
    return answers


def report(model: Any, tokenizer: Any, held_out: int, show: int = 6) -> list[str]:
    """The three questions about ``held_out`` test images (shape and place asked after the colour's
    answer): answers beside the truth, the share right and chance."""
    shapes = ShapesDataset("test", size=held_out, fields=["image", "label"])
    pixels = torch.stack([shapes.load(i, ["image"])["image"] for i in range(held_out)])
    truth = [describe(int(shapes.attributes(i)["label"])) for i in range(held_out)]
    colour_answers = ask(model, tokenizer, pixels, [[{"role": "user", "content": f"<image> {COLOUR_Q}"}]] * held_out)

    def then(question: str) -> list[list[dict[str, str]]]:
        return [
            [
                {"role": "user", "content": f"<image> {COLOUR_Q}"},
                {"role": "assistant", "content": a},
                {"role": "user", "content": question},
            ]
            for a in colour_answers
        ]

    shape_answers = ask(model, tokenizer, pixels, then(SHAPE_Q))
    place_answers = ask(model, tokenizer, pixels, then(WHERE_Q))
    colour_right = [c in a.split() for a, (c, _, _) in zip(colour_answers, truth)]
    shape_right = [s in a.split() for a, (_, s, _) in zip(shape_answers, truth)]
    place_right = [a == POSITIONS[p][1] for a, (_, _, p) in zip(place_answers, truth)]
    lines = [f"{'answers':52s} | true"]
    for i in range(min(show, held_out)):
        said = f"{colour_answers[i]} / {shape_answers[i]} / {place_answers[i]}"
        lines.append(f"{said:52s} | {truth[i][0]} {truth[i][1]} {POSITIONS[truth[i][2]][1]}")
    share = lambda right: f"{sum(right) / held_out:.1%}"  # noqa: E731
    lines.append(
        f"colour right: {share(colour_right)} (chance {1 / len(COLORS):.1%}); shape right: {share(shape_right)}"
        f" (chance {1 / len(SHAPES):.1%}); place right: {share(place_right)} (chance {1 / len(POSITIONS):.1%});"
        f" {held_out} held-out images"
    )
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--held-out", type=int, default=64)
    ap.add_argument("--init", default=None, help="a LlavaForConditionalGeneration folder to start from (local)")
    ap.add_argument("--export", default=None, help="write the trained model here (from_pretrained loads it)")
    ap.add_argument("--single", action="store_true", help="an ordinary single-process Trainer")
    args = ap.parse_args(argv)

    L.seed_everything(0)
    tokenizer = build_tokenizer()
    if args.init:
        module = LlavaModule.from_pretrained(args.init, optimizer="adamw", lr=args.lr)
    else:
        module = LlavaModule(build_llava(tokenizer), optimizer="adamw", lr=args.lr)
    data = DataLoader(
        ShapesConversations("train", args.steps * args.batch, tokenizer), batch_size=args.batch, drop_last=True
    )
    common = quiet_trainer_kwargs(accelerator="cpu", max_steps=args.steps)
    if args.single:
        trainer = L.Trainer(devices=1, **common)
    else:
        plan = ldm.Plan(2, {"vision": {"ranks": [0]}, "language": {"ranks": [1]}})
        trainer = L.Trainer(devices=2, strategy=ldm.DistMMStrategy(plan=plan, start_method="spawn"), **common)
    start = time.perf_counter()
    trainer.fit(module, data)
    lines = [f"trained {args.steps} steps of {args.batch} in {time.perf_counter() - start:.0f} s"]
    loss = trainer.callback_metrics.get("train/loss")
    if loss is not None:
        lines[0] += f", last loss {float(loss):.3f}"
    model = module.to_llava()
    if args.export:
        model.save_pretrained(args.export)
        lines.append(f"exported to {args.export}")
    lines += report(model, tokenizer, args.held_out)
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main()
