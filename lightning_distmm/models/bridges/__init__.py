"""Weights in and out: open_clip checkpoints and Hugging Face ``CLIPModel`` folders <-> :class:`CLIPModel`.

The recipe's towers are a timm ``VisionTransformer`` and a transformers ``CLIPTextModel`` plus a
projection. Configured as CLIP's ViT (``pre_norm: true, norm_eps: 1e-5, head_bias: false``; see
:mod:`lightning_distmm.models.clip`), both are open_clip's ``CLIP`` and Hugging Face's
``CLIPModel`` tensor for tensor: every weight has one place in each, only the layout differs
(open_clip fuses q, k, v into ``in_proj_weight`` and stores projections transposed; Hugging Face
splits timm's fused ``qkv``). Each format is translated to and from one neutral layout per tower
(:mod:`.layout`), so the six conversions are three readers and three writers.

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

Files: :mod:`.layout` (the neutral layout, shared checks), :mod:`.openclip`, :mod:`.hf`.
"""

from lightning_distmm.models.bridges.hf import from_hf, save_hf, to_hf
from lightning_distmm.models.bridges.neutral import CLIP_VIT_KEYS, open_clip_compatible
from lightning_distmm.models.bridges.openclip import (
    from_open_clip,
    from_open_clip_config,
    save_open_clip,
    to_open_clip,
    to_open_clip_config,
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
