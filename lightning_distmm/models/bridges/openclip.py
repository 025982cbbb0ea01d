"""open_clip checkpoints in and out: its model config and ``state_dict`` <-> :class:`CLIPModel`."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_distmm.models.bridges.neutral import (
    CLIP_VIT_KEYS,
    State,
    _check_ours,
    _hf_text_prefix,
    _layers,
    _load_exact,
    _named_from,
    _named_to,
    _plain,
    _text_from_ours,
    _text_to_ours,
    _vit_from_ours,
    _vit_to_ours,
    finetune_defaults,
)
from lightning_distmm.models.clip import CLIPModel


def to_open_clip_config(model: CLIPModel) -> dict[str, Any]:
    """open_clip's ``model_cfg`` for ``model``'s architecture."""
    image, text, act = _check_ours(model)
    cfg: dict[str, Any] = {
        "embed_dim": int(model.model_cfg["embed_dim"]),
        "quick_gelu": act == "quick_gelu",
        "vision_cfg": {
            "image_size": int(image["img_size"]),
            "patch_size": int(image["patch_size"]),
            "width": int(image["width"]),
            "layers": int(image["layers"]),
            "head_width": int(image["width"]) // int(image["heads"]),
            "mlp_ratio": float(image.get("mlp_ratio", 4.0)),
        },
        "text_cfg": {
            "context_length": int(text["context_length"]),
            "vocab_size": int(text["vocab_size"]),
            "width": int(text["width"]),
            "heads": int(text["heads"]),
            "layers": int(text["layers"]),
            "mlp_ratio": float(text.get("mlp_ratio", 4.0)),
            "pad_id": int(text.get("pad_token_id", 0)),
            "eos_id": int(text.get("eos_token_id", 3)),
            "pool_type": "eos",
        },
    }
    for where, eps in (
        ("vision_cfg", float(image.get("norm_eps", 1e-6))),
        ("text_cfg", float(text.get("norm_eps", 1e-5))),
    ):
        if eps != 1e-5:  # open_clip's LayerNorm default
            cfg[where]["norm_kwargs"] = {"eps": eps}
    if "logit_bias" in dict(model.named_parameters()):
        cfg["init_logit_bias"] = float(model.logit_bias.detach())
    return cfg


def from_open_clip_config(oc: Mapping[str, Any], name: str = "open_clip") -> dict[str, Any]:
    """Our model config for open_clip's ``model_cfg`` ``oc`` (refusing what has no counterpart)."""
    vision, text = dict(oc.get("vision_cfg", {})), dict(oc.get("text_cfg", {}))
    unsupported = [
        f"vision_cfg.{k}"
        for k in ("timm_model_name", "attentional_pool", "ls_init_value", "no_ln_pre", "final_ln_after_pool")
        if vision.get(k)
    ] + [f"text_cfg.{k}" for k in ("hf_model_name", "ls_init_value", "embed_cls", "proj_bias") if text.get(k)]
    unsupported += [
        f"{w}.block_type={c['block_type']!r}"
        for w, c in (("vision_cfg", vision), ("text_cfg", text))
        if c.get("block_type") not in (None, "default")
    ]
    if vision.get("pool_type", "tok") != "tok":
        unsupported.append(f"vision_cfg.pool_type={vision['pool_type']!r}")
    if unsupported:
        raise NotImplementedError(f"open_clip features with no counterpart in the recipe's towers: {unsupported}")
    act = "quick_gelu" if oc.get("quick_gelu") else "gelu"
    width = int(vision.get("width", 768))
    image_size = vision.get("image_size", 224)
    patch_size = vision.get("patch_size", 16)
    cfg = {
        "name": name,
        "embed_dim": int(oc["embed_dim"]),
        "init_logit_scale": math.log(1 / 0.07),
        "sync_groups": 1,
        "towers": {
            "image": {
                "arch": "vit",
                "input": "image",
                "img_size": int(image_size if isinstance(image_size, int) else image_size[0]),
                "patch_size": int(patch_size if isinstance(patch_size, int) else patch_size[0]),
                "width": width,
                "layers": int(vision.get("layers", 12)),
                "heads": width // int(vision.get("head_width", 64)),
                "mlp_ratio": float(vision.get("mlp_ratio", 4.0)),
                "act": act,
                "frozen": False,
                **CLIP_VIT_KEYS,
                "norm_eps": float((vision.get("norm_kwargs") or {}).get("eps", 1e-5)),
            },
            "text": {
                "arch": "clip_text",
                "input": ["input_ids", "attention_mask"],
                "vocab_size": int(text.get("vocab_size", 49408)),
                "context_length": int(text.get("context_length", 77)),
                "width": int(text.get("width", 512)),
                "layers": int(text.get("layers", 12)),
                "heads": int(text.get("heads", 8)),
                "mlp_ratio": float(text.get("mlp_ratio", 4.0)),
                "act": act,
                "norm_eps": float((text.get("norm_kwargs") or {}).get("eps", 1e-5)),
                "pad_token_id": int(text.get("pad_id", 0)),
                "eos_token_id": int(text.get("eos_id", int(text.get("vocab_size", 49408)) - 1)),
                "bos_token_id": int(text.get("vocab_size", 49408)) - 2,
                "frozen": False,
            },
        },
    }
    if oc.get("init_logit_bias") is not None:
        cfg["loss"] = "siglip"
        cfg["init_logit_bias"] = float(oc["init_logit_bias"])
    return cfg


# a tower: {"embed": {...}, "layers": [{ln1_w, ln1_b, qkv_w, qkv_b, out_w, out_b, ln2_w, ln2_b,
#            fc1_w, fc1_b, fc2_w, fc2_b}], "final_w", "final_b", "proj" ([embed_dim, width], Linear layout)}


_OC_NAMES = {"ln1": "ln_1", "out": "attn.out_proj", "ln2": "ln_2", "fc1": "mlp.c_fc", "fc2": "mlp.c_proj"}


def _oc_layers_from(s: State, p: str) -> list[dict[str, Tensor]]:
    layers = []
    for i in range(_layers(s, f"{p}transformer.resblocks.")):
        b = f"{p}transformer.resblocks.{i}."
        layer = _named_from(s, b, _OC_NAMES)
        layer["qkv_w"], layer["qkv_b"] = s[f"{b}attn.in_proj_weight"], s[f"{b}attn.in_proj_bias"]
        layers.append(layer)
    return layers


def _oc_layers_to(layers: list[dict[str, Tensor]], p: str) -> State:
    out = {}
    for i, layer in enumerate(layers):
        b = f"{p}transformer.resblocks.{i}."
        out.update(_named_to(layer, b, _OC_NAMES))
        out[f"{b}attn.in_proj_weight"], out[f"{b}attn.in_proj_bias"] = layer["qkv_w"], layer["qkv_b"]
    return out


def _open_clip_state(vit: dict[str, Any], text: dict[str, Any], scalars: State) -> State:
    e = vit["embed"]
    out = {
        "visual.class_embedding": e["cls"],
        "visual.positional_embedding": e["pos"],
        "visual.conv1.weight": e["patch"],
        "visual.ln_pre.weight": e["pre_w"],
        "visual.ln_pre.bias": e["pre_b"],
        **_oc_layers_to(vit["layers"], "visual."),
        "visual.ln_post.weight": vit["final_w"],
        "visual.ln_post.bias": vit["final_b"],
        "visual.proj": vit["proj"].T,
        "token_embedding.weight": text["embed"]["tok"],
        "positional_embedding": text["embed"]["pos"],
        **_oc_layers_to(text["layers"], ""),
        "ln_final.weight": text["final_w"],
        "ln_final.bias": text["final_b"],
        "text_projection": text["proj"].T,
    }
    out.update(scalars)
    return out


def _from_open_clip_state(s: State) -> tuple[dict[str, Any], dict[str, Any]]:
    vit = {
        "embed": {
            "cls": s["visual.class_embedding"],
            "pos": s["visual.positional_embedding"],
            "patch": s["visual.conv1.weight"],
            "pre_w": s["visual.ln_pre.weight"],
            "pre_b": s["visual.ln_pre.bias"],
        },
        "layers": _oc_layers_from(s, "visual."),
        "final_w": s["visual.ln_post.weight"],
        "final_b": s["visual.ln_post.bias"],
        "proj": s["visual.proj"].T,
    }
    text = {
        "embed": {"tok": s["token_embedding.weight"], "pos": s["positional_embedding"]},
        "layers": _oc_layers_from(s, ""),
        "final_w": s["ln_final.weight"],
        "final_b": s["ln_final.bias"],
        "proj": s["text_projection"].T,
    }
    return vit, text


def _scalars(state: State) -> State:
    return {k: state[k] for k in ("logit_scale", "logit_bias") if k in state}


def to_open_clip(model: CLIPModel) -> tuple[dict[str, Any], State]:
    """``(open_clip model_cfg, state_dict)`` for ``model``; ``open_clip.model.CLIP(**cfg)`` loads it strictly."""
    cfg = to_open_clip_config(model)
    s = model.state_dict()
    return cfg, _plain(_open_clip_state(_vit_from_ours(s), _text_from_ours(s), _scalars(s)))


def _read_state(path: str | Path) -> State:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a local file (nothing is downloaded)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    return {k.removeprefix("module."): v for k, v in state.items()}


def _open_clip_cfg(arch: str | Mapping[str, Any] | Path) -> dict[str, Any]:
    if isinstance(arch, Mapping):
        return dict(arch.get("model_cfg", arch))
    path = Path(arch)
    if path.suffix == ".json" and path.is_file():
        data = json.loads(path.read_text())
        return dict(data.get("model_cfg", data))
    try:
        import open_clip
    except ImportError as e:
        raise ImportError(
            f"an open_clip arch name ({arch!r}) needs open_clip installed; or pass its config (JSON)"
        ) from e
    cfg = open_clip.get_model_config(str(arch))
    if cfg is None:
        raise KeyError(f"open_clip knows no arch {arch!r}")
    return dict(cfg)


def from_open_clip(
    state: Mapping[str, Tensor] | str | Path,
    arch: str | Mapping[str, Any] | Path,
    optim: Mapping[str, Any] | None = None,
) -> CLIPModel:
    """A :class:`CLIPModel` holding an open_clip checkpoint.

    Args:
        state: an open_clip ``state_dict``, or a local file of one (``.pt``/``.bin``/``.safetensors``;
            a ``{"state_dict": ...}`` training checkpoint and DDP's ``module.`` prefix are accepted).
        arch: open_clip's model config: a mapping, a JSON file (``open_clip_config.json`` or a
            ``model_configs/*.json``), or an arch name (``"ViT-B-32"``, open_clip installed).
        optim: the optimiser config for further training (unset keys: fine-tuning's lr 1e-5 and 20
            warmup steps, :data:`~.layout.FINETUNE_OPTIM`, then ``DEFAULT_OPTIM``'s).
    """
    cfg = from_open_clip_config(_open_clip_cfg(arch), name=str(arch) if isinstance(arch, str) else "open_clip")
    s = dict(_read_state(state) if isinstance(state, str | Path) else state)
    model = CLIPModel(cfg, finetune_defaults(optim))
    vit, text = _from_open_clip_state(s)
    text_state = _text_to_ours(text, m=_hf_text_prefix(model.state_dict()))
    ours = {**_vit_to_ours(vit), **text_state, **_scalars(s)}
    _load_exact(model, ours, "open_clip")
    return model


def save_open_clip(model: CLIPModel, folder: str | Path) -> Path:
    """Write ``open_clip_config.json`` + ``open_clip_model.safetensors``: ``create_model("local-dir:<folder>")``."""
    from safetensors.torch import save_file

    cfg, state = to_open_clip(model)  # refused before a folder is made
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}, indent=2))
    save_file(state, str(folder / "open_clip_model.safetensors"))
    return folder
