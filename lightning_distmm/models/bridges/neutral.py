"""The neutral per-tower layout every format is translated through, and what all of them share.

A tower in the neutral layout: ``{"embed": {...}, "layers": [{ln1_w, ln1_b, qkv_w, qkv_b, out_w,
out_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b}], "final_w", "final_b", "proj"}``. Our model's
state dict is read into it and written from it here (:func:`_vit_from_ours`, :func:`_text_from_ours`
and their inverses); :mod:`.openclip` and :mod:`.hf` translate between it and their library's
names. Also here: the check that a model has a place for every weight in those libraries
(:func:`_check_ours`) and the strict load that refuses a weight without one (:func:`_load_exact`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_distmm.models.clip import CLIPModel

CLIP_VIT_KEYS = {"pre_norm": True, "norm_eps": 1e-5, "head_bias": False}

#: timm's defaults for those keys (what a tower config without them builds)


_VIT_DEFAULTS = {"pre_norm": False, "norm_eps": 1e-6, "head_bias": True}


State = dict[str, Tensor]

#: the optimiser settings a model loaded from trained weights starts with (over ``DEFAULT_OPTIM``'s
#: from-scratch lr 3e-3 and warmup 100): open_clip users fine-tune at 1e-5 - 5e-5 with a short warmup;
#: ``conf/optim/adamw.yaml``'s ``finetune`` block is the recipe's copy
FINETUNE_OPTIM: dict[str, Any] = {"lr": 1e-5, "warmup_steps": 20}


def finetune_defaults(optim: Mapping[str, Any] | None) -> dict[str, Any]:
    """``optim`` for a model loaded from trained weights: :data:`FINETUNE_OPTIM` unless ``optim`` sets them."""
    return {**FINETUNE_OPTIM, **dict(optim or {})}


def open_clip_compatible(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``model_cfg`` with its ViT configured as CLIP's (the layout open_clip and HF use) and the text
    tower on the image tower's activation (CLIP has one for both). ``conf/model/clip_tiny_openclip.yaml``
    is ``clip_tiny`` so configured."""
    cfg = json.loads(json.dumps(dict(model_cfg)))
    image = cfg["towers"]["image"]
    image.update(CLIP_VIT_KEYS)
    image["act"] = image.get("act") or "gelu"
    if "text" in cfg["towers"]:
        cfg["towers"]["text"]["act"] = image["act"]
    return cfg


def _check_ours(model: CLIPModel) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The image and text tower configs and the activation, or one error naming everything that has
    no place in open_clip's CLIP / Hugging Face's CLIPModel."""
    towers = model.model_cfg["towers"]
    if set(towers) != {"image", "text"}:
        raise ValueError(f"a CLIP checkpoint has an image and a text tower; this model has {sorted(towers)}")
    if model.model_cfg.get("loss") == "coca":
        raise ValueError("a CoCa model (loss: coca) has no open_clip / Hugging Face export here: only CLIP and SigLIP")
    image, text = towers["image"], towers["text"]
    if image.get("arch") != "vit" or text.get("arch") != "clip_text":
        raise ValueError(f"exports need a 'vit' image and a 'clip_text' text tower, got {image['arch']}/{text['arch']}")
    problems = []
    have = {**_VIT_DEFAULTS, **{k: image[k] for k in _VIT_DEFAULTS if k in image}}
    wrong = {k: v for k, v in have.items() if k != "norm_eps" and v != CLIP_VIT_KEYS[k]}
    if wrong or image.get("global_pool", "token") != "token":
        problems.append(f"the image tower is not CLIP's ViT ({wrong}; it needs {CLIP_VIT_KEYS})")
    act_image, act_text = image.get("act") or "gelu", text.get("act") or "quick_gelu"
    if act_image != act_text:
        problems.append(f"the towers use different activations ({act_image} / {act_text}; CLIP uses one for both)")
    if problems:
        raise ValueError(
            "this model does not map onto open_clip / Hugging Face CLIP: " + "; ".join(problems) + "."
            " Train with a config built by bridges.open_clip_compatible (recipes: model=clip_tiny_openclip, or"
            f" +model.towers.image.pre_norm=true +model.towers.image.norm_eps=1e-5 +model.towers.image.head_bias=false"
            f" +model.towers.text.act={act_image})"
        )
    return image, text, act_image


_LAYER = ("ln1_w", "ln1_b", "qkv_w", "qkv_b", "out_w", "out_b", "ln2_w", "ln2_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b")


def _layers(state: State, prefix: str) -> int:
    found = {int(k[len(prefix) :].split(".")[0]) for k in state if k.startswith(prefix)}
    return max(found) + 1 if found else 0


def _vit_from_ours(s: State, p: str = "visual.") -> dict[str, Any]:
    layers = []
    for i in range(_layers(s, f"{p}blocks.")):
        b = f"{p}blocks.{i}."
        width = s[f"{b}attn.qkv.weight"].shape[1]
        layers.append(
            {
                "ln1_w": s[f"{b}norm1.weight"], "ln1_b": s[f"{b}norm1.bias"],
                "qkv_w": s[f"{b}attn.qkv.weight"], "qkv_b": s.get(f"{b}attn.qkv.bias", torch.zeros(3 * width)),
                "out_w": s[f"{b}attn.proj.weight"], "out_b": s[f"{b}attn.proj.bias"],
                "ln2_w": s[f"{b}norm2.weight"], "ln2_b": s[f"{b}norm2.bias"],
                "fc1_w": s[f"{b}mlp.fc1.weight"], "fc1_b": s[f"{b}mlp.fc1.bias"],
                "fc2_w": s[f"{b}mlp.fc2.weight"], "fc2_b": s[f"{b}mlp.fc2.bias"],
            }
        )  # fmt: skip
    return {
        "embed": {
            "cls": s[f"{p}cls_token"].reshape(-1),
            "pos": s[f"{p}pos_embed"][0],
            "patch": s[f"{p}patch_embed.proj.weight"],
            "pre_w": s[f"{p}norm_pre.weight"],
            "pre_b": s[f"{p}norm_pre.bias"],
        },
        "layers": layers,
        "final_w": s[f"{p}norm.weight"],
        "final_b": s[f"{p}norm.bias"],
        "proj": s[f"{p}head.weight"],
    }


def _vit_to_ours(t: dict[str, Any], p: str = "visual.") -> State:
    e = t["embed"]
    out = {
        f"{p}cls_token": e["cls"].reshape(1, 1, -1),
        f"{p}pos_embed": e["pos"].unsqueeze(0),
        f"{p}patch_embed.proj.weight": e["patch"],
        f"{p}norm_pre.weight": e["pre_w"],
        f"{p}norm_pre.bias": e["pre_b"],
        f"{p}norm.weight": t["final_w"],
        f"{p}norm.bias": t["final_b"],
        f"{p}head.weight": t["proj"],
    }
    names = {"ln1": "norm1", "qkv": "attn.qkv", "out": "attn.proj", "ln2": "norm2", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    for i, layer in enumerate(t["layers"]):
        for key, v in layer.items():
            short, kind = key.rsplit("_", 1)
            out[f"{p}blocks.{i}.{names[short]}.{'weight' if kind == 'w' else 'bias'}"] = v
    return out


_HF_NAMES = {
    "ln1": "layer_norm1",
    "out": "self_attn.out_proj",
    "ln2": "layer_norm2",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}


def _named_from(s: State, b: str, names: dict[str, str]) -> dict[str, Tensor]:
    """A layer's weights and biases under our short names (``ln1_w``, ...), read from the module
    names ``names`` maps them to under prefix ``b`` (the bridges' layer tables)."""
    return {f"{k}_{kind[0]}": s[f"{b}{n}.{kind}"] for k, n in names.items() for kind in ("weight", "bias")}


def _named_to(layer: dict[str, Tensor], b: str, names: dict[str, str]) -> State:
    """:func:`_named_from` the other way: the layer's weights and biases under their module names."""
    return {f"{b}{n}.{kind}": layer[f"{k}_{kind[0]}"] for k, n in names.items() for kind in ("weight", "bias")}


def _hf_layers_from(s: State, p: str) -> list[dict[str, Tensor]]:
    layers = []
    for i in range(_layers(s, f"{p}encoder.layers.")):
        b = f"{p}encoder.layers.{i}."
        layer = _named_from(s, b, _HF_NAMES)
        for kind, short in (("weight", "w"), ("bias", "b")):
            layer[f"qkv_{short}"] = torch.cat([s[f"{b}self_attn.{x}_proj.{kind}"] for x in "qkv"])
        layers.append(layer)
    return layers


def _hf_layers_to(layers: list[dict[str, Tensor]], p: str) -> State:
    out = {}
    for i, layer in enumerate(layers):
        b = f"{p}encoder.layers.{i}."
        out.update(_named_to(layer, b, _HF_NAMES))
        for short, kind in (("w", "weight"), ("b", "bias")):
            for x, v in zip("qkv", layer[f"qkv_{short}"].chunk(3)):
                out[f"{b}self_attn.{x}_proj.{kind}"] = v
    return out


def _hf_text_prefix(keys: Any, p: str = "text.") -> str:
    """Where the ``CLIPTextModel``'s weights sit (transformers < 5 nests them under ``text_model.``)."""
    nested = f"{p}transformer.text_model."
    return nested if any(k.startswith(nested) for k in keys) else f"{p}transformer."


def _text_from_ours(s: State, p: str = "text.") -> dict[str, Any]:
    m = _hf_text_prefix(s, p)
    return {
        "embed": {
            "tok": s[f"{m}embeddings.token_embedding.weight"],
            "pos": s[f"{m}embeddings.position_embedding.weight"],
        },
        "layers": _hf_layers_from(s, m),
        "final_w": s[f"{m}final_layer_norm.weight"],
        "final_b": s[f"{m}final_layer_norm.bias"],
        "proj": s[f"{p}proj.weight"],
    }


def _text_to_ours(t: dict[str, Any], p: str = "text.", m: str | None = None) -> State:
    m = m if m is not None else f"{p}transformer."
    return {
        f"{m}embeddings.token_embedding.weight": t["embed"]["tok"],
        f"{m}embeddings.position_embedding.weight": t["embed"]["pos"],
        **_hf_layers_to(t["layers"], m),
        f"{m}final_layer_norm.weight": t["final_w"],
        f"{m}final_layer_norm.bias": t["final_b"],
        f"{p}proj.weight": t["proj"],
    }


def _plain(state: Mapping[str, Tensor]) -> State:
    """Detached CPU copies; meta tensors (a model built on the meta device) stay meta: shapes only."""
    return {k: v.detach() if v.is_meta else v.detach().cpu().clone().contiguous() for k, v in state.items()}


def _load_exact(
    module: torch.nn.Module, state: State, source: str, ignore: tuple[str, ...] = ("position_ids",)
) -> None:
    """Load ``state`` and fail on any weight without a place (a silent mismatch would give other features)."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(ignore)]
    if missing or unexpected:
        raise RuntimeError(
            f"{source} weights do not map one to one: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
