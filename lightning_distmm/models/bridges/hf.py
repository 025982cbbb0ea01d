"""Hugging Face ``transformers.CLIPModel`` (an object or a local folder) in and out."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_distmm.models.bridges.neutral import (
    CLIP_VIT_KEYS,
    _check_ours,
    _hf_layers_from,
    _hf_layers_to,
    _hf_text_prefix,
    _load_exact,
    _plain,
    _text_from_ours,
    _text_to_ours,
    _vit_from_ours,
    _vit_to_ours,
    finetune_defaults,
)
from lightning_distmm.models.clip import CLIPModel


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
        logit_scale_init_value=float(model.logit_scale.detach()),
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
    """A :class:`CLIPModel` holding a Hugging Face ``CLIPModel`` (an object, or a local folder); ``optim``'s
    unset keys take fine-tuning's lr and warmup (:data:`~.layout.FINETUNE_OPTIM`)."""
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
    model = CLIPModel(cfg, finetune_defaults(optim))
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
