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

Tower archs (``vit``, ``clip_text``, ``bert``): :mod:`lightning_distmm.models.towers`.

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
import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from lightning_distmm.losses import clip_loss, siglip_loss
from lightning_distmm.mixin import DistMMMixin
from lightning_distmm.models import coca
from lightning_distmm.models.towers import BertTower, TextTower, _require, build_tower, build_vit, to_plain
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
