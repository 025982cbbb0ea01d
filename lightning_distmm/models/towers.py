"""The towers of the recipe's models, built from their config entries (``conf/model``).

Tower archs:

- ``vit``: ``timm.models.vision_transformer.VisionTransformer`` (class token pooling); its head
  (``num_classes=embed_dim``) is the projection. Optional ``pretrained_path`` (a local
  ``state_dict`` file; a head of another shape is skipped). Optional keys, timm's defaults when
  absent: ``pre_norm`` (a LayerNorm before the blocks, no patch-embedding bias), ``norm_eps``
  (1e-6), ``act`` (``gelu`` | ``quick_gelu``), ``head_bias`` (true), ``qkv_bias`` (true). With
  ``pre_norm: true, norm_eps: 1e-5, head_bias: false`` the tower is the CLIP ViT of open_clip and
  Hugging Face, tensor for tensor (:mod:`lightning_distmm.models.bridges`). ``attn_pool:
  {queries, heads}`` (CoCa): open_clip's attentional pooler replaces the final norm and the head,
  and the tower returns ``[B, queries, embed_dim]`` (:class:`~lightning_distmm.models.coca.CoCaImageHead`).
- ``clip_text``: :class:`TextTower`, ``transformers.CLIPTextModel`` + a linear projection, pooled at
  the last attended token (the ``[EOS]`` of :mod:`lightning_distmm.data.demo.tokenizer`), computed from
  ``attention_mask``, so it does not depend on ``eos_token_id`` conventions. Optional keys:
  ``act`` (``quick_gelu``, Hugging Face's default, | ``gelu``), ``norm_eps`` (1e-5),
  ``pad_token_id`` / ``bos_token_id`` / ``eos_token_id`` (those of the embedded tokenizer),
  ``output_tokens`` (CoCa, set by ``loss: coca``: the row also carries the token states and ids,
  :func:`~lightning_distmm.models.coca.pack_text`).
- ``bert``: :class:`BertTower`, ``transformers.BertModel`` (no pooler), first-token ([BOS]/[CLS])
  pooling + a linear projection.

Every tower maps its inputs to ``[B, embed_dim]`` features (CoCa's to the packed rows above).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_distmm.models import coca

# special-token ids of lightning_distmm.data.demo.tokenizer
_PAD_ID, _BOS_ID, _EOS_ID = 0, 2, 3


def to_plain(cfg: Any) -> Any:
    """A DictConfig / ListConfig / mapping as plain Python containers (a deep copy)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(cfg, Mapping):
        return {k: to_plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_plain(v) for v in cfg]
    return copy.deepcopy(cfg)


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise KeyError(f"{where} needs {key!r}; it has {sorted(cfg)}")
    return cfg[key]


# ---------------------------------------------------------------------- towers
class _ProjectedEncoder(nn.Module):
    """A transformers text encoder (``transformer``) whose pooled token a bias-free linear ``proj``
    maps to the embedding; the subclass builds the encoder and says how it pools (``_head``)."""

    def _attach(self, transformer: nn.Module, width: int, embed_dim: int, context_length: int) -> None:
        self.context_length = context_length
        self.transformer = transformer
        self.proj = nn.Linear(width, embed_dim, bias=False)
        nn.init.normal_(self.proj.weight, std=width**-0.5)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self._head(hidden, {"input_ids": input_ids, "attention_mask": attention_mask})

    def _head(self, hidden: Tensor, rows: Mapping[str, Tensor]) -> Tensor:
        raise NotImplementedError


class TextTower(_ProjectedEncoder):
    """``CLIPTextModel`` + linear projection; pools the last attended token (``[EOS]``)."""

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float,
        embed_dim: int,
        pad_token_id: int = _PAD_ID,
        bos_token_id: int = _BOS_ID,
        eos_token_id: int = _EOS_ID,
        act: str = "quick_gelu",
        norm_eps: float = 1e-5,
        output_tokens: bool = False,
    ):
        super().__init__()
        from transformers import CLIPTextConfig, CLIPTextModel

        config = CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=width,
            intermediate_size=int(width * mlp_ratio),
            projection_dim=embed_dim,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=context_length,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            hidden_act=act,
            layer_norm_eps=norm_eps,
        )
        #: CoCa: return the embedding, the token states and the ids in one row (coca.pack_text)
        self.output_tokens, self.id_digits = bool(output_tokens), coca.id_digits(vocab_size)
        self._attach(CLIPTextModel(config), width, embed_dim, context_length)

    def _pool(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        last = (attention_mask.long().sum(dim=-1) - 1).clamp(min=0)  # right padding: last real token
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.proj(pooled)

    def _head(self, hidden: Tensor, rows: Mapping[str, Tensor]) -> Tensor:
        mask = rows.get("attention_mask")
        embedding = self._pool(hidden, mask if mask is not None else torch.ones_like(rows["input_ids"]))
        if not self.output_tokens:
            return embedding
        return coca.pack_text(embedding, hidden, rows["input_ids"], self.id_digits)

    def pipeline_stages(self, pp: int) -> list:
        """The cut used by distmm's pipeline parallelism (``pp`` stages of the encoder layers)."""
        from lightning_distmm.parallel.families.clip_text import clip_text_stages

        return clip_text_stages(self.transformer, pp, self._head, [self.proj])


class BertTower(_ProjectedEncoder):
    """``BertModel`` (no pooler) + linear projection; pools the first token ([BOS] / [CLS])."""

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float,
        embed_dim: int,
        pad_token_id: int = _PAD_ID,
    ):
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(
            vocab_size=vocab_size,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=int(width * mlp_ratio),
            max_position_embeddings=context_length,
            type_vocab_size=1,
            pad_token_id=pad_token_id,
        )
        self._attach(BertModel(config, add_pooling_layer=False), width, embed_dim, context_length)

    def _head(self, hidden: Tensor, rows: Mapping[str, Tensor]) -> Tensor:
        return self.proj(hidden[:, 0])


def build_vit(cfg: Mapping[str, Any], embed_dim: int) -> nn.Module:
    """A timm ViT whose head projects to ``embed_dim``."""
    from timm.models.vision_transformer import VisionTransformer

    where = "a vit tower"
    norm_eps = float(cfg.get("norm_eps", 1e-6))
    model = VisionTransformer(
        img_size=int(_require(cfg, "img_size", where)),
        patch_size=int(_require(cfg, "patch_size", where)),
        in_chans=int(cfg.get("in_chans", 3)),
        embed_dim=int(_require(cfg, "width", where)),
        depth=int(_require(cfg, "layers", where)),
        num_heads=int(_require(cfg, "heads", where)),
        mlp_ratio=float(cfg.get("mlp_ratio", 4.0)),
        num_classes=embed_dim,
        global_pool=cfg.get("global_pool", "token"),
        pre_norm=bool(cfg.get("pre_norm", False)),
        qkv_bias=bool(cfg.get("qkv_bias", True)),
        norm_layer=functools.partial(nn.LayerNorm, eps=norm_eps),
        act_layer=cfg.get("act") or "gelu",
    )
    if not cfg.get("head_bias", True):  # CLIP's image projection is a matrix without bias
        model.head = nn.Linear(model.embed_dim, embed_dim, bias=False)
    path = cfg.get("pretrained_path")
    if path:
        _load_local_weights(model, path, skip_prefixes=("head.",))
    pool = cfg.get("attn_pool")
    if pool:  # CoCa: every token (no pooling by timm) to the attentional pooler, which has its own norms
        model.global_pool = ""
        model.norm = nn.Identity()
        queries, heads = int(pool.get("queries", 256)), int(pool.get("heads", 8))
        model.head = coca.CoCaImageHead(model.embed_dim, embed_dim, queries, heads, norm_eps=norm_eps)
    return model


def _load_local_weights(model: nn.Module, path: str | Path, skip_prefixes: tuple[str, ...] = ()) -> None:
    """Load a local ``state_dict`` (never downloads); entries of another shape under ``skip_prefixes`` are dropped."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"pretrained_path {str(path)!r} is not a local file (nothing is downloaded)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        for key in ("state_dict", "model"):
            if isinstance(state, dict) and key in state and isinstance(state[key], dict):
                state = state[key]
    own = model.state_dict()
    state = {
        k: v for k, v in state.items() if not (k.startswith(skip_prefixes) and k in own and own[k].shape != v.shape)
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad_missing = [k for k in missing if not k.startswith(skip_prefixes)]
    if bad_missing or unexpected:
        raise RuntimeError(
            f"{path}: weights do not fit the tower: missing {bad_missing[:8]}, unexpected {list(unexpected)[:8]}"
        )


def build_tower(cfg: Mapping[str, Any], embed_dim: int) -> nn.Module:
    """One tower from its config entry."""
    arch = _require(cfg, "arch", "a tower config")
    if arch == "vit":
        return build_vit(cfg, embed_dim)
    if arch in ("clip_text", "bert"):
        where = f"a {arch} tower"
        kwargs = dict(
            vocab_size=int(_require(cfg, "vocab_size", where)),
            context_length=int(_require(cfg, "context_length", where)),
            width=int(_require(cfg, "width", where)),
            layers=int(_require(cfg, "layers", where)),
            heads=int(_require(cfg, "heads", where)),
            mlp_ratio=float(cfg.get("mlp_ratio", 4.0)),
            embed_dim=embed_dim,
        )
        if arch == "clip_text":
            optional = ("act", "norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "output_tokens")
            kwargs.update({k: cfg[k] for k in optional if cfg.get(k) is not None})
        tower: nn.Module = TextTower(**kwargs) if arch == "clip_text" else BertTower(**kwargs)
        if cfg.get("pretrained_path"):
            _load_local_weights(tower, cfg["pretrained_path"], skip_prefixes=("proj.",))
        return tower
    if arch == "text_decoder":
        raise ValueError(coca.NOT_A_TOWER)
    raise ValueError(f"unknown tower arch {arch!r}; archs are 'vit', 'clip_text', 'bert'")
