"""Device memory: the static bytes (weights, gradients, optimizer state) of a pipeline stage, the
activations a schedule keeps for backward, and the loss buffers of a batch-sync.

Static memory is the precision policy's bytes per parameter (:class:`PrecisionPolicy`: 18 in bf16
mixed precision, 16 in fp32), divided over the data-parallel replicas as the tower's ``shard`` says
(ZeRO-1 splits the optimizer state, ZeRO-3 everything); activations are the profile's bytes per sample times what each schedule keeps alive at its peak
(:func:`memory_per_device`). Functions take numpy arrays (the partitioner's grids) as well as numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.cost.pipeline import RECOMPUTE, sync_group_rows
from lightning_distmm.planner.profiles.profile import TowerProfile


def stage_params(profile: TowerProfile, tp: int, pp: int) -> float:
    """Parameters held by one device of the heaviest stage (layer weights split tp ways)."""
    if not profile.analytic:
        return float(profile.params)
    layers = profile.layers // pp * profile.layer.params / tp
    ends = profile.pre.params + profile.post.params if pp == 1 else max(profile.pre.params, profile.post.params)
    return layers + ends


def static_per_param(profile: TowerProfile, opts: CostOptions, shard: str = "none", dp: Any = 1) -> Any:
    """Static bytes per parameter of the stage on one device: weights, gradients, optimizer state,
    divided over ``dp`` replicas as ``shard`` says (ZeRO stages, Rajbhandari et al. SC'20 figure 1:
    ``none`` W + G + O, ``optimizer`` W + G + O/dp, ``full`` (W + G + O)/dp). A frozen tower holds
    its weights (split under ``full``)."""
    pol = opts.policy
    dp = np.asarray(dp, dtype=float)
    frac = 0.0 if profile.frozen else profile.trainable_params / max(profile.params, 1)
    weights = pol.weights + 0 * dp
    trained = frac * (pol.grads + pol.optimizer) + 0 * dp
    if shard == "optimizer":
        trained = frac * (pol.grads + pol.optimizer / dp)
    elif shard == "zero2":  # the weights stay whole (gathered in the forward, kept to the backward)
        trained = trained / dp
    elif shard in ("full", "hybrid"):  # (hybrid: ``dp`` is the node's shard group, cost.options.shard_group)
        weights, trained = weights / dp, trained / dp
    elif shard != "none":
        raise ValueError(f"shard={shard!r}: choose one of none, optimizer, zero2, full, hybrid")
    return weights + trained


def gathered_layers_bytes(profile: TowerProfile, opts: CostOptions, tp: int) -> float:
    """Extra bytes a fully sharded stage holds unsharded at once: the layer it computes and the one
    FSDP2 prefetches (their bf16 weights), and one layer's gradients before their reduce-scatter."""
    per_layer = (profile.layer.params if profile.analytic else profile.params) / tp
    pol = opts.policy
    return per_layer * (2 * pol.weights + (0 if profile.frozen else pol.grads))


def act_per_sample(
    profile: TowerProfile, opts: CostOptions, tp: int, pp: int, mb: Any = 1.0, cp: int = 1, sp: bool = False
) -> Any:
    """Activation bytes kept for backward per sample on the heaviest stage.

    ``cp``: each rank keeps its ``1/cp`` of every layer's tokens (attention probabilities too: its
    ``heads/cp`` over the whole sequence, Ulysses); the embeddings and the head run on the whole
    sequence. ``sp``: the activations TP replicates (LayerNorm inputs, the inputs of the gathered
    linears, which keep only this rank's tokens) are divided by ``tp`` too, and the MLP's activation
    output is not kept (sp's fc2 recomputes it from fc1's output, ``act_sp_recomputed``)."""
    if not profile.analytic:
        fit = profile.measured
        assert fit is not None
        mb = np.asarray(mb, dtype=float)
        return (fit.act_bytes[0] + fit.act_bytes[1] * mb) / np.maximum(mb, 1.0) / cp
    lay = profile.layer
    split_rep = sp or opts.sequence_parallel  # sequence parallelism splits the replicated activations
    rep = lay.act_rep / tp if split_rep else lay.act_rep
    split = lay.act_split - (lay.act_sp_recomputed if sp else 0.0)
    per_layer = (rep + split / tp + (0.0 if opts.flash_attention else lay.act_scores / tp)) / cp
    ends = profile.pre.act_rep + profile.post.act_rep + (profile.pre.act_split + profile.post.act_split) / tp
    if pp > 1:
        ends = max(profile.pre.act_rep + profile.pre.act_split / tp, profile.post.act_rep + profile.post.act_split / tp)
    return opts.bytes_el * (profile.layers // pp * per_layer + ends)


def memory_per_device(
    profile: TowerProfile,
    opts: CostOptions,
    schedule: str,
    mb: Any,
    K: Any,
    replica_batch: Any,
    tp: int,
    pp: int,
    loss_bytes: Any = 0.0,
    shard: str = "none",
    dp: Any = 1,
    recompute_layers: int | None = None,
    cp: int = 1,
    sp: bool = False,
) -> dict[str, Any]:
    """Peak bytes on the busiest device of a replica: static (weights, grads, optimizer; sharded over
    ``dp`` replicas as ``shard`` says, and their ``cp`` ranks), activations (:func:`act_per_sample`
    with ``cp`` and ``sp``), loss. ``recompute_layers`` (with :data:`RECOMPUTE`): only that many of
    the stage's layers keep just their input (Megatron-LM's block method); the others keep
    everything, as ``gpipe`` does."""
    mb = np.asarray(mb, dtype=float)
    K = np.asarray(K, dtype=float)
    static = stage_params(profile, tp, pp) * static_per_param(profile, opts, shard, np.asarray(dp) * cp)
    if shard in ("full", "hybrid"):
        static = static + gathered_layers_bytes(profile, opts, tp)
    elif shard == "zero2" and not profile.frozen:  # one layer's gradients before their reduce-scatter
        static = static + (profile.layer.params if profile.analytic else profile.params) / tp * opts.policy.grads
    aps = act_per_sample(profile, opts, tp, pp, mb, cp, sp)
    layer_act = aps / max(profile.layers // pp, 1)
    if profile.frozen:
        act = mb * layer_act * 2  # no-grad forward: a layer's input and output at a time
    elif schedule == "cached":
        act = np.minimum(K, pp) * mb * aps + mb * layer_act * 2
    elif schedule == RECOMPUTE and recompute_layers is not None and profile.analytic:
        # the first ``recompute_layers`` layers keep their input only, the rest all they save
        k = recompute_layers
        saved = k * (layer_act - opts.bytes_el * profile.layer.boundary)
        act = np.asarray(replica_batch, dtype=float) * (aps - saved) + (mb * layer_act * 2 if k else 0.0)
    elif schedule == RECOMPUTE:
        ckpt = opts.bytes_el * (profile.layers // pp * profile.layer.boundary) if profile.analytic else aps
        act = np.asarray(replica_batch, dtype=float) * ckpt + mb * layer_act * 2
    elif schedule == "distmm":
        # one sync group's microbatches, plus the P-1 forwards of the second group that stage 0 runs
        # ahead of its first backward (1F1B between the groups; stage s runs P-1-s, stage 0 is the heaviest)
        group0, group1 = sync_group_rows("distmm", np.asarray(replica_batch, dtype=float))
        act = (group0 + np.minimum((pp - 1) * mb, group1)) * aps
    else:
        act = np.asarray(replica_batch, dtype=float) * aps
    return {
        "static": static + 0 * mb,
        "activations": act,
        "loss": np.asarray(loss_bytes, dtype=float) + 0 * mb,
        "total": static + act + loss_bytes,
    }


def loss_bytes(global_batch: int, world: int, n_contrastive: int, opts: CostOptions, embed_dim: int) -> float:
    """Gathered features plus this rank's rows of the logits (forward, softmax, gradient)."""
    rows = math.ceil(global_batch / max(world, 1))
    feats = n_contrastive * global_batch * embed_dim * opts.feature_bytes * 2
    return feats + 3.0 * 4 * rows * global_batch * max(n_contrastive - 1, 1) * 2


def grad_bytes_per_device(profile: TowerProfile, opts: CostOptions, tp: int, pp: int, shard: str = "none") -> float:
    """Bytes one device of the heaviest stage all-reduces per step for its gradients (trainable
    parameters only), in the gradient dtype of the precision policy (fp32 under bf16-mixed).

    ``optimizer`` (ZeRO-1) reduce-scatters the gradients and all-gathers the updated weights: a ring
    moves ``(r-1)/r`` of each, the same as an all-reduce of their mean size, so it is priced as one.
    ``full`` (ZeRO-3) moves its gradients layer by layer during the backward
    (:func:`lightning_distmm.planner.cost.comm.shard_comm`): nothing is left for the step's end."""
    if profile.frozen or shard in ("full", "zero2", "hybrid"):
        return 0.0
    frac = profile.trainable_params / max(profile.params, 1)
    per = opts.grad_bytes if shard == "none" else (opts.grad_bytes + opts.policy.weights) / 2
    return stage_params(profile, tp, pp) * frac * per


__all__ = [
    "static_per_param",
    "gathered_layers_bytes",
    "stage_params",
    "act_per_sample",
    "memory_per_device",
    "loss_bytes",
    "grad_bytes_per_device",
]
