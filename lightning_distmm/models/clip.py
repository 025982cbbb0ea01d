"""CLIP-style dual encoders built from a plain config, on timm and transformers.

The config (a dict or an OmegaConf ``DictConfig``; ``conf/model/*.yaml``; also read by the planner,
so the keys are a contract)::

    name: clip_tiny
    embed_dim: 64
    loss: clip                         # clip (softmax InfoNCE) | siglip (sigmoid, learnable bias) | coca
    init_logit_scale: 2.659            # log(1 / 0.07); siglip's default is log(10)
    towers:
      image: {arch: vit, input: image, img_size: 32, patch_size: 8, width: 64, layers: 2,
              heads: 2, mlp_ratio: 4.0, frozen: false}
      text:  {arch: clip_text, input: [input_ids, attention_mask], vocab_size: 64,
              context_length: 16, width: 64, layers: 2, heads: 2, mlp_ratio: 4.0, frozen: false}

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
  the last attended token (the ``[EOS]`` of :mod:`lightning_distmm.data.tokenizer`), computed from
  ``attention_mask``, so it does not depend on ``eos_token_id`` conventions. Optional keys:
  ``act`` (``quick_gelu``, Hugging Face's default, | ``gelu``), ``norm_eps`` (1e-5),
  ``pad_token_id`` / ``bos_token_id`` / ``eos_token_id`` (those of the embedded tokenizer),
  ``output_tokens`` (CoCa, set by ``loss: coca``: the row also carries the token states and ids,
  :func:`~lightning_distmm.models.coca.pack_text`).
- ``bert``: :class:`BertTower`, ``transformers.BertModel`` (no pooler), first-token ([BOS]/[CLS])
  pooling + a linear projection.

Every tower maps its inputs to ``[B, embed_dim]`` features (CoCa's to the packed rows above).

Losses (``loss``; ``clip`` when absent):

- ``clip``: :func:`lightning_distmm.losses.clip_loss`, the symmetric softmax InfoNCE of CLIP, with
  a learnable ``logit_scale`` (initialised to ``init_logit_scale``, default ``log(1 / 0.07)``).
- ``siglip``: :func:`lightning_distmm.losses.siglip_loss`, the pairwise sigmoid loss of SigLIP
  (Zhai et al., 2023), with a learnable ``logit_scale`` and ``logit_bias``, initialised as in the
  paper and open_clip's ``SigLipLoss`` models to ``log(10)`` and ``-10`` (``init_logit_scale``,
  ``init_logit_bias``): the bias starts the many negative pairs near their target, so early
  training is not dominated by them. ``conf/model/siglip_tiny.yaml`` is the tiny SigLIP.

- ``coca``: CoCa (:mod:`lightning_distmm.models.coca`, docs/coca.md): ``contrastive_loss_weight``
  (1) times the CLIP loss plus ``caption_loss_weight`` (2) times the captioning loss of a
  multimodal text decoder, the model config's top-level ``decoder: {width, layers, heads,
  mlp_ratio, vocab_size}``, which reads the text tower's token states and cross-attends to the image
  tower's tokens. The decoder is an interaction module, not a tower. ``conf/model/coca_tiny.yaml``.

All are sums of per-row terms, so under distmm each rank computes only its rows and any plan
(uneven replica batches included) equals one process.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from lightning_distmm.losses import clip_loss, siglip_loss
from lightning_distmm.mixin import DistMMMixin
from lightning_distmm.models import coca
from lightning_distmm.tower import Tower

#: the default tiny model (mirrors conf/model/clip_tiny.yaml)
CLIP_TINY: dict[str, Any] = {
    "name": "clip_tiny",
    "embed_dim": 64,
    "loss": "clip",  # clip | siglip (models.clip.LOSSES)
    "init_logit_scale": 2.659,  # log(1 / 0.07)
    "sync_groups": 1,  # 2 for the distmm schedule's loss (DistMMMixin.sync_groups)
    "towers": {
        "image": {
            "arch": "vit",
            "input": "image",
            "img_size": 32,
            "patch_size": 8,
            "width": 64,
            "layers": 2,
            "heads": 2,
            "mlp_ratio": 4.0,
            "frozen": False,
        },
        "text": {
            "arch": "clip_text",
            "input": ["input_ids", "attention_mask"],
            "vocab_size": 64,
            "context_length": 16,
            "width": 64,
            "layers": 2,
            "heads": 2,
            "mlp_ratio": 4.0,
            "frozen": False,
        },
    },
}

DEFAULT_OPTIM: dict[str, Any] = {
    "name": "adamw",
    "lr": 3e-3,
    "weight_decay": 0.1,
    "betas": [0.9, 0.98],
    "eps": 1e-6,
    "scheduler": "cosine",  # cosine | constant
    "warmup_steps": 100,
    "min_lr_ratio": 0.0,
}

#: logit_scale is clamped to log(100) in the loss, as in CLIP
MAX_LOGIT_SCALE = math.log(100.0)

#: the losses a model config's ``loss`` key selects
LOSSES = ("clip", "siglip", "coca")
#: CLIP's initial logit scale: a temperature of 0.07
CLIP_INIT_LOGIT_SCALE = math.log(1 / 0.07)
#: SigLIP's initial logit scale and bias (the paper's t' = log 10, b = -10; open_clip's ``init_logit_bias``)
SIGLIP_INIT_LOGIT_SCALE = math.log(10.0)
SIGLIP_INIT_LOGIT_BIAS = -10.0

# special-token ids of lightning_distmm.data.tokenizer
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
class TextTower(nn.Module):
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
        self.context_length = context_length
        #: CoCa: return the embedding, the token states and the ids in one row (coca.pack_text)
        self.output_tokens, self.id_digits = bool(output_tokens), coca.id_digits(vocab_size)
        self.transformer = CLIPTextModel(config)
        self.proj = nn.Linear(width, embed_dim, bias=False)
        nn.init.normal_(self.proj.weight, std=width**-0.5)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self._head(hidden, {"input_ids": input_ids, "attention_mask": attention_mask})

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
        from lightning_distmm.parallel.pipeline import clip_text_stages

        return clip_text_stages(self.transformer, pp, self._head, [self.proj])


class BertTower(nn.Module):
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
        self.context_length = context_length
        self.transformer = BertModel(config, add_pooling_layer=False)
        self.proj = nn.Linear(width, embed_dim, bias=False)
        nn.init.normal_(self.proj.weight, std=width**-0.5)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
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


# ---------------------------------------------------------------------- the LightningModule
class CLIPModel(DistMMMixin, L.LightningModule):
    """A CLIP dual encoder from a model config (see the module docstring) and an optimiser config.

    ``self.visual`` is the ``image`` tower, ``self.text`` the ``text`` tower; any further towers in
    the config become attributes ``tower_<name>``. ``training_step`` / ``validation_step`` come
    from :class:`DistMMMixin`, so the same module runs under any strategy.

    Args:
        model: the model config (default :data:`CLIP_TINY`).
        optim: the optimiser config, keys of :data:`DEFAULT_OPTIM` (missing keys take those defaults).
    """

    #: attribute names of the towers the config names
    TOWER_ATTRS = {"image": "visual", "text": "text"}

    def __init__(self, model: Mapping[str, Any] | None = None, optim: Mapping[str, Any] | None = None):
        super().__init__()
        model_cfg = to_plain(model) if model is not None else copy.deepcopy(CLIP_TINY)
        optim_cfg = {**DEFAULT_OPTIM, **(to_plain(optim) if optim is not None else {})}
        self.save_hyperparameters({"model": model_cfg, "optim": optim_cfg})
        self.model_cfg, self.optim_cfg = model_cfg, optim_cfg

        embed_dim = int(_require(model_cfg, "embed_dim", "the model config"))
        towers = _require(model_cfg, "towers", "the model config")
        if not towers:
            raise ValueError("the model config lists no towers")
        self.loss_name = str(model_cfg.get("loss") or "clip")
        if self.loss_name not in LOSSES:
            raise ValueError(f"model.loss {self.loss_name!r} is not one of {LOSSES}")
        coca.check_towers(towers)
        #: CoCa's settings (None for clip / siglip); its decoder is an interaction module, not a tower
        self.coca = coca.coca_spec(model_cfg) if self.loss_name == "coca" else None
        self._tower_attrs: dict[str, str] = {}
        for name, tower_cfg in towers.items():
            _require(tower_cfg, "input", f"tower {name!r}")
            if tower_cfg.get("attn_pool") and self.coca is None:
                raise ValueError(f"tower {name!r}: attn_pool gives CoCa's token rows, which only loss: coca reads")
            if self.coca is not None and name == "text":
                tower_cfg = {**tower_cfg, "output_tokens": True}
            attr = self.TOWER_ATTRS.get(name, f"tower_{name}")
            setattr(self, attr, build_tower(tower_cfg, embed_dim))
            self._tower_attrs[name] = attr
        if self.coca is not None:
            self.decoder = coca.build_decoder(model_cfg)
        siglip = self.loss_name == "siglip"
        default_scale = SIGLIP_INIT_LOGIT_SCALE if siglip else CLIP_INIT_LOGIT_SCALE
        self.logit_scale = nn.Parameter(torch.tensor(float(model_cfg.get("init_logit_scale", default_scale))))
        if siglip:  # SigLIP's learnable bias of every pair's logit (CLIP's softmax is shift-invariant: none)
            bias = model_cfg.get("init_logit_bias")
            self.logit_bias = nn.Parameter(torch.tensor(float(SIGLIP_INIT_LOGIT_BIAS if bias is None else bias)))
        # 2 with the distmm schedule: the loss over two sync groups (DistMMMixin.sync_groups)
        self.sync_groups = int(model_cfg.get("sync_groups", 1))

    # ------------------------------------------------------------------ DistMM contract
    def towers(self) -> dict[str, Tower]:
        out = {}
        for name, tower_cfg in self.model_cfg["towers"].items():
            inputs = tower_cfg["input"]
            inputs = inputs if isinstance(inputs, str) else list(inputs)
            out[name] = Tower(
                getattr(self, self._tower_attrs[name]), input=inputs, frozen=bool(tower_cfg.get("frozen", False))
            )
        return out

    def interaction_loss(self, features: dict[str, Tensor]) -> Tensor:
        """The configured loss (``loss``: clip | siglip | coca) over the whole batch's image and text features."""
        logit_scale = self.logit_scale.clamp(0.0, MAX_LOGIT_SCALE)
        if self.coca is not None:
            contrastive, caption = coca.coca_terms(self.coca, self.decoder, features, logit_scale)
            if self._loss_parts is not None:  # inside a step: its terms are logged after it
                for key, value in (("contrastive_loss", contrastive), ("caption_loss", caption)):
                    self._loss_parts[key] = self._loss_parts.get(key, 0.0) + value.detach()
            return self.coca.contrastive_weight * contrastive + self.coca.caption_weight * caption
        if self.loss_name == "siglip":
            return siglip_loss(features["image"], features["text"], logit_scale, self.logit_bias)
        return clip_loss(features["image"], features["text"], logit_scale)

    # ------------------------------------------------------------------ CoCa's two terms, logged apart
    #: the unweighted loss terms of the current step (CoCa only; None outside a step)
    _loss_parts: dict[str, Any] | None = None

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        return self._step_with_parts(super().training_step, "train", batch, batch_idx)

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        return self._step_with_parts(super().validation_step, "val", batch, batch_idx)

    def _step_with_parts(self, step: Any, stage: str, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        """The mixin's step; for CoCa also ``<stage>/contrastive_loss`` and ``<stage>/caption_loss``.

        Under distmm each batch-sync rank holds its rows' share of each term (the others none): the
        logged value is their sum over the ranks; elsewhere (one process, DDP) the mean, as the loss's.
        """
        if self.coca is None:
            return step(batch, batch_idx)
        self._loss_parts = {}
        try:
            loss = step(batch, batch_idx)
            parts = self._loss_parts
        finally:
            self._loss_parts = None
        keys = ("contrastive_loss", "caption_loss")
        values = torch.stack([torch.as_tensor(parts.get(k, 0.0), device=loss.device).float() for k in keys])
        if self._distmm_runner is not None and torch.distributed.is_initialized():
            torch.distributed.all_reduce(values)  # the ranks' shares: the whole batch's terms, on every rank
        for key, value in zip(keys, values):
            # equal on every rank under distmm; one process / DDP: as the loss is logged
            self.log(f"{stage}/{key}", value, sync_dist=stage == "val", batch_size=self.global_batch_size(batch))
        return loss

    def embedding(self, tower: str, features: Tensor) -> Tensor:
        """The embedding retrieval and zero-shot compare: the features, or the embedding in CoCa's packed rows."""
        return features if self.coca is None else coca.embedding(self.coca, tower, features)

    # ------------------------------------------------------------------ optimisation
    def _param_groups(self) -> list[dict[str, Any]]:
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            leaf = name.rsplit(".", 1)[-1]
            skip = (
                p.ndim < 2
                or leaf in ("cls_token", "pos_embed", "reg_token")
                or "position_embedding" in name
                or "token_embedding" in name
                or "word_embeddings" in name
            )
            (no_decay if skip else decay).append(p)
        wd = float(self.optim_cfg["weight_decay"])
        return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]

    def configure_optimizers(self) -> Any:
        o = self.optim_cfg
        if o.get("name", "adamw") != "adamw":
            raise ValueError(f"optim.name {o.get('name')!r} is not supported; CLIPModel builds AdamW ('adamw')")
        optimizer = torch.optim.AdamW(
            self._param_groups(), lr=float(o["lr"]), betas=tuple(o["betas"]), eps=float(o["eps"])
        )
        scheduler = o.get("scheduler") or "constant"
        warmup = int(o.get("warmup_steps") or 0)
        if scheduler == "constant" and warmup == 0:
            return optimizer
        if scheduler not in ("cosine", "constant"):
            raise ValueError(f"unknown scheduler {scheduler!r}; use 'cosine', 'constant' or null")
        total = self._total_steps()
        min_ratio = float(o.get("min_lr_ratio") or 0.0)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if scheduler == "constant" or total is None:
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step"}}

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: Any, map_location: Any = None, strict: bool | None = None, **kwargs: Any
    ) -> Any:  # type: ignore[override]
        """Lightning's ``load_from_checkpoint``, which also reads distmm's checkpoint folders
        (:func:`lightning_distmm.models.checkpoints.load_checkpoint`)."""
        from lightning_distmm.models.checkpoints import is_checkpoint_folder, load_checkpoint

        if is_checkpoint_folder(checkpoint_path):
            return load_checkpoint(cls, checkpoint_path, map_location=map_location, strict=strict, **kwargs)
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, strict=strict, **kwargs)

    def _total_steps(self) -> int | None:
        try:
            total = self.trainer.estimated_stepping_batches
        except Exception:  # no trainer attached (or no length)
            return None
        return int(total) if total is not None and math.isfinite(total) else None


def num_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


__all__ = [
    "CLIP_TINY",
    "DEFAULT_OPTIM",
    "LOSSES",
    "CLIPModel",
    "TextTower",
    "BertTower",
    "build_tower",
    "build_vit",
    "num_parameters",
]
