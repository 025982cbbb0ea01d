"""Weights in and out: open_clip checkpoints and Hugging Face ``CLIPModel`` folders <-> :class:`CLIPModel`.

The recipe's towers are a timm ``VisionTransformer`` and a transformers ``CLIPTextModel`` plus a
projection. Configured as CLIP's ViT (``pre_norm: true, norm_eps: 1e-5, head_bias: false``; see
:mod:`lightning_distmm.models.clip`), both are open_clip's ``CLIP`` and Hugging Face's
``CLIPModel`` tensor for tensor: every weight has one place in each, only the layout differs
(open_clip fuses q, k, v into ``in_proj_weight`` and stores projections transposed; Hugging Face
splits timm's fused ``qkv``). Each format is translated to and from one neutral layout per tower
(:func:`_vit_from_ours` & co.), so the six conversions are three readers and three writers.

- :func:`from_open_clip` / :func:`to_open_clip`: a state dict + open_clip's model config (the JSON
  of ``open_clip.get_model_config(arch)``, or the arch name when open_clip is installed);
  :func:`save_open_clip` writes a folder that ``open_clip.create_model("local-dir:<folder>")`` loads.
- :func:`from_hf` / :func:`to_hf` / :func:`save_hf`: a ``transformers.CLIPModel`` or a local folder
  (``from_pretrained(folder, local_files_only=True)``).

Features agree with the other library's to float rounding when given the same inputs: pixel tensors,
and token ids whose end token is the last attended one (our text tower pools there, open_clip pools at
the ``eos_id`` (``pool_type: eos``) or the highest id (``argmax``: the end token of CLIP's BPE), Hugging
Face at its ``eos_token_id``). What does not map (an open_clip timm or HF text tower, attentional
pooling, layer scale, custom blocks; a tower built without ``pre_norm``) is refused, naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_distmm.models.clip import CLIPModel

#: what an exported checkpoint's towers need (model config keys), for :func:`open_clip_compatible`
CLIP_VIT_KEYS = {"pre_norm": True, "norm_eps": 1e-5, "head_bias": False}

#: timm's defaults for those keys (what a tower config without them builds)
_VIT_DEFAULTS = {"pre_norm": False, "norm_eps": 1e-6, "head_bias": True}

State = dict[str, Tensor]


# ---------------------------------------------------------------------- configs
def open_clip_compatible(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``model_cfg`` with its ViT configured as CLIP's (the layout open_clip and HF use)."""
    cfg = json.loads(json.dumps(dict(model_cfg)))
    cfg["towers"]["image"].update(CLIP_VIT_KEYS)
    return cfg


def _check_ours(model: CLIPModel) -> tuple[dict[str, Any], dict[str, Any], str]:
    towers = model.model_cfg["towers"]
    if set(towers) != {"image", "text"}:
        raise ValueError(f"a CLIP checkpoint has an image and a text tower; this model has {sorted(towers)}")
    image, text = towers["image"], towers["text"]
    if image.get("arch") != "vit" or text.get("arch") != "clip_text":
        raise ValueError(f"exports need a 'vit' image and a 'clip_text' text tower, got {image['arch']}/{text['arch']}")
    have = {**_VIT_DEFAULTS, **{k: image[k] for k in _VIT_DEFAULTS if k in image}}
    wrong = {k: v for k, v in have.items() if k != "norm_eps" and v != CLIP_VIT_KEYS[k]}
    if wrong or image.get("global_pool", "token") != "token":
        raise ValueError(
            f"the image tower is not CLIP's ViT ({wrong}): build it with {CLIP_VIT_KEYS} (see"
            " bridges.open_clip_compatible) so that every weight has a place in open_clip / Hugging Face"
        )
    act_image, act_text = image.get("act") or "gelu", text.get("act") or "quick_gelu"
    if act_image != act_text:
        raise ValueError(f"the towers use different activations ({act_image} / {act_text}); CLIP uses one for both")
    return image, text, act_image


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


# ---------------------------------------------------------------------- the neutral layout
# a tower: {"embed": {...}, "layers": [{ln1_w, ln1_b, qkv_w, qkv_b, out_w, out_b, ln2_w, ln2_b,
#            fc1_w, fc1_b, fc2_w, fc2_b}], "final_w", "final_b", "proj" ([embed_dim, width], Linear layout)}
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


def _hf_layers_from(s: State, p: str) -> list[dict[str, Tensor]]:
    layers = []
    for i in range(_layers(s, f"{p}encoder.layers.")):
        b = f"{p}encoder.layers.{i}."
        layer = {
            f"{k}_{'w' if kind == 'weight' else 'b'}": s[f"{b}{n}.{kind}"]
            for k, n in _HF_NAMES.items()
            for kind in ("weight", "bias")
        }
        for kind, short in (("weight", "w"), ("bias", "b")):
            layer[f"qkv_{short}"] = torch.cat([s[f"{b}self_attn.{x}_proj.{kind}"] for x in "qkv"])
        layers.append(layer)
    return layers


def _hf_layers_to(layers: list[dict[str, Tensor]], p: str) -> State:
    out = {}
    for i, layer in enumerate(layers):
        b = f"{p}encoder.layers.{i}."
        for k, n in _HF_NAMES.items():
            out[f"{b}{n}.weight"], out[f"{b}{n}.bias"] = layer[f"{k}_w"], layer[f"{k}_b"]
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


# ---------------------------------------------------------------------- open_clip layout
_OC_NAMES = {"ln1": "ln_1", "out": "attn.out_proj", "ln2": "ln_2", "fc1": "mlp.c_fc", "fc2": "mlp.c_proj"}


def _oc_layers_from(s: State, p: str) -> list[dict[str, Tensor]]:
    layers = []
    for i in range(_layers(s, f"{p}transformer.resblocks.")):
        b = f"{p}transformer.resblocks.{i}."
        layer = {
            f"{k}_{'w' if kind == 'weight' else 'b'}": s[f"{b}{n}.{kind}"]
            for k, n in _OC_NAMES.items()
            for kind in ("weight", "bias")
        }
        layer["qkv_w"], layer["qkv_b"] = s[f"{b}attn.in_proj_weight"], s[f"{b}attn.in_proj_bias"]
        layers.append(layer)
    return layers


def _oc_layers_to(layers: list[dict[str, Tensor]], p: str) -> State:
    out = {}
    for i, layer in enumerate(layers):
        b = f"{p}transformer.resblocks.{i}."
        for k, n in _OC_NAMES.items():
            out[f"{b}{n}.weight"], out[f"{b}{n}.bias"] = layer[f"{k}_w"], layer[f"{k}_b"]
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


# ---------------------------------------------------------------------- public: open_clip
def _scalars(state: State) -> State:
    return {k: state[k] for k in ("logit_scale", "logit_bias") if k in state}


def _plain(state: Mapping[str, Tensor]) -> State:
    return {k: v.detach().cpu().clone().contiguous() for k, v in state.items()}


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
        optim: the optimiser config for further training.
    """
    cfg = from_open_clip_config(_open_clip_cfg(arch), name=str(arch) if isinstance(arch, str) else "open_clip")
    s = dict(_read_state(state) if isinstance(state, str | Path) else state)
    model = CLIPModel(cfg, optim)
    vit, text = _from_open_clip_state(s)
    text_state = _text_to_ours(text, m=_hf_text_prefix(model.state_dict()))
    ours = {**_vit_to_ours(vit), **text_state, **_scalars(s)}
    _load_exact(model, ours, "open_clip")
    return model


def save_open_clip(model: CLIPModel, folder: str | Path) -> Path:
    """Write ``open_clip_config.json`` + ``open_clip_model.safetensors``: ``create_model("local-dir:<folder>")``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg, state = to_open_clip(model)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}, indent=2))
    save_file(state, str(folder / "open_clip_model.safetensors"))
    return folder


# ---------------------------------------------------------------------- public: Hugging Face
def to_hf(model: CLIPModel) -> Any:
    """A ``transformers.CLIPModel`` with ``model``'s weights.

    A SigLIP model (``loss: siglip``) is refused: Hugging Face's ``CLIPModel`` has no logit bias, so
    its logits would silently lose the learned bias; :func:`save_open_clip` keeps it.
    """
    from transformers import CLIPConfig
    from transformers import CLIPModel as HFCLIPModel

    if "logit_bias" in dict(model.named_parameters()):
        raise ValueError(
            f"this model has a logit bias ({model.loss_name} loss), which Hugging Face's CLIPModel has no place for:"
            " export it with save_open_clip (open_clip's CLIP keeps logit_bias), or drop the bias knowingly"
        )
    image, text, act = _check_ours(model)
    vision_config = {
        "hidden_size": int(image["width"]),
        "intermediate_size": int(int(image["width"]) * float(image.get("mlp_ratio", 4.0))),
        "num_hidden_layers": int(image["layers"]),
        "num_attention_heads": int(image["heads"]),
        "image_size": int(image["img_size"]),
        "patch_size": int(image["patch_size"]),
        "hidden_act": act,
        "layer_norm_eps": float(image.get("norm_eps", 1e-6)),
    }
    hf_text = model.text.transformer.config.to_dict()
    text_config = {k: hf_text[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "max_position_embeddings", "hidden_act",
                                           "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id")}  # fmt: skip
    embed_dim = int(model.model_cfg["embed_dim"])
    config = CLIPConfig(
        text_config=text_config,
        vision_config=vision_config,
        projection_dim=embed_dim,
        logit_scale_init_value=float(model.logit_scale),
    )
    hf = HFCLIPModel(config)
    s = model.state_dict()
    vit, txt = _vit_from_ours(s), _text_from_ours(s)
    e = vit["embed"]
    state = {
        "vision_model.embeddings.class_embedding": e["cls"],
        "vision_model.embeddings.patch_embedding.weight": e["patch"],
        "vision_model.embeddings.position_embedding.weight": e["pos"],
        "vision_model.pre_layrnorm.weight": e["pre_w"],
        "vision_model.pre_layrnorm.bias": e["pre_b"],
        **_hf_layers_to(vit["layers"], "vision_model."),
        "vision_model.post_layernorm.weight": vit["final_w"],
        "vision_model.post_layernorm.bias": vit["final_b"],
        "visual_projection.weight": vit["proj"],
        **{
            "text_model." + k.removeprefix("text.transformer."): v
            for k, v in _text_to_ours(txt).items()
            if k.startswith("text.transformer.")
        },
        "text_projection.weight": txt["proj"],
        "logit_scale": s["logit_scale"],
    }
    _load_exact(hf, _plain(state), "Hugging Face CLIPModel", ignore=("position_ids",))
    return hf


def save_hf(model: CLIPModel, folder: str | Path) -> Path:
    """``to_hf(model).save_pretrained(folder)``: ``transformers.CLIPModel.from_pretrained(folder)`` loads it."""
    folder = Path(folder)
    to_hf(model).save_pretrained(str(folder))
    return folder


def from_hf(source: Any, optim: Mapping[str, Any] | None = None) -> CLIPModel:
    """A :class:`CLIPModel` holding a Hugging Face ``CLIPModel`` (an object, or a local folder)."""
    if isinstance(source, str | Path):
        from transformers import CLIPModel as HFCLIPModel

        if not Path(source).expanduser().is_dir():
            raise FileNotFoundError(f"{str(source)!r} is not a local folder (nothing is downloaded)")
        source = HFCLIPModel.from_pretrained(str(source), local_files_only=True)
    vc, tc = source.config.vision_config, source.config.text_config
    if vc.hidden_act != tc.hidden_act:
        raise ValueError(f"the towers use different activations ({vc.hidden_act} / {tc.hidden_act})")
    cfg = {
        "name": "hf_clip",
        "embed_dim": int(source.config.projection_dim),
        "init_logit_scale": float(source.logit_scale),
        "sync_groups": 1,
        "towers": {
            "image": {
                "arch": "vit", "input": "image", "img_size": int(vc.image_size), "patch_size": int(vc.patch_size),
                "width": int(vc.hidden_size), "layers": int(vc.num_hidden_layers), "heads": int(vc.num_attention_heads),
                "mlp_ratio": vc.intermediate_size / vc.hidden_size, "act": vc.hidden_act, "frozen": False,
                **CLIP_VIT_KEYS, "norm_eps": float(vc.layer_norm_eps),
            },
            "text": {
                "arch": "clip_text", "input": ["input_ids", "attention_mask"], "vocab_size": int(tc.vocab_size),
                "context_length": int(tc.max_position_embeddings), "width": int(tc.hidden_size),
                "layers": int(tc.num_hidden_layers), "heads": int(tc.num_attention_heads),
                "mlp_ratio": tc.intermediate_size / tc.hidden_size, "act": tc.hidden_act,
                "norm_eps": float(tc.layer_norm_eps), "pad_token_id": tc.pad_token_id,
                "bos_token_id": tc.bos_token_id, "eos_token_id": tc.eos_token_id, "frozen": False,
            },
        },
    }  # fmt: skip
    model = CLIPModel(cfg, optim)
    s = source.state_dict()
    vit = {
        "embed": {
            "cls": s["vision_model.embeddings.class_embedding"],
            "pos": s["vision_model.embeddings.position_embedding.weight"],
            "patch": s["vision_model.embeddings.patch_embedding.weight"],
            "pre_w": s["vision_model.pre_layrnorm.weight"],
            "pre_b": s["vision_model.pre_layrnorm.bias"],
        },
        "layers": _hf_layers_from(s, "vision_model."),
        "final_w": s["vision_model.post_layernorm.weight"],
        "final_b": s["vision_model.post_layernorm.bias"],
        "proj": s["visual_projection.weight"],
    }
    text_state = {f"text.transformer.{k}": v for k, v in s.items() if k.startswith("text_model.")}
    text_state["text.proj.weight"] = s["text_projection.weight"]
    text = _text_to_ours(_text_from_ours(text_state), m=_hf_text_prefix(model.state_dict()))
    ours = {**_vit_to_ours(vit), **text, "logit_scale": s["logit_scale"]}
    _load_exact(model, ours, "Hugging Face CLIPModel")
    return model


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


__all__ = [
    "CLIP_VIT_KEYS",
    "from_hf",
    "from_open_clip",
    "from_open_clip_config",
    "open_clip_compatible",
    "save_hf",
    "save_open_clip",
    "to_hf",
    "to_open_clip",
    "to_open_clip_config",
]
