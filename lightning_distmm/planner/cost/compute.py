"""Device time: a tower's forward and backward on one pipeline stage, the optimizer step, and how
devices that share a host stretch each other's compute.

Everything is priced from shapes (:class:`lightning_distmm.planner.machine.cluster.Device`):

* every GEMM by :meth:`Device.gemm_time`, a roofline of its FLOPs at the kernel efficiency of its
  size class times its wave quantisation (output tiles over SMs) against its bytes (operands and
  output in the compute dtype) over the streaming bandwidth. The backward is the two GEMMs autograd
  runs, each with its own shape: the input gradient (output ``T x k``, reduce over ``n``; skipped for
  a tower's input) and the weight gradient (output ``k x n``, reduce over the ``T`` tokens), plus the
  weight gradient's accumulation into the fp32 gradient buffer. An output of fewer tiles than there
  are SMs may split its reduction (split-K), as cuBLAS does;
* attention by :meth:`Device.attention_time`: FlashAttention's FLOPs (backward 2.5x the forward:
  it recomputes the scores) at the device's ``attention_efficiency`` over its (query block x head)
  tiles, or its bytes if more;
* elementwise work (norms, activations, residual adds) as bytes moved over the streaming bandwidth,
  forward and backward counted per block (:meth:`lightning_distmm.planner.profiles.profile.Block.backward_elems`);
* plus a fixed cost per kernel (measured on CPUs, 0 on GPUs).

A measured profile (:class:`MeasuredFit`) replaces the analytic time at ``tp = pp = 1`` and
rescales it for other splits. All functions take numpy arrays of microbatch sizes as well as plain
numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_distmm.planner.cost.memory import stage_params
from lightning_distmm.planner.cost.options import LAYER_SHARDS, CostOptions
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.profiles.profile import Block, TowerProfile

ATTN_BWD_FLOPS = 2.5
"""FlashAttention's backward FLOPs per forward FLOP: five matrix products (the scores recomputed,
the value, probability, query and key gradients) against the forward's two (Dao, FlashAttention-2,
2023, section 4.1)."""


UNFUSED_SCORE_PASSES = (4.0, 7.0)
"""Passes over the ``q x kv`` score matrix per head of unfused attention, forward and backward:
forward writes the scores, the softmax reads them and writes the probabilities, ``P V`` reads them
(4); backward reads ``P`` for the value gradient, writes ``dP``, the softmax backward reads ``P``
and ``dP`` and writes ``dS``, the query and key gradients read ``dS`` (7)."""


TORCH_SOFTMAX_BYTES = (24.0, 28.0)
"""Bytes per score element the unfused softmax moves beyond the fused kernel's passes, forward and
backward, when it runs as PyTorch ops in fp32 (Megatron's and NeMo's ``forward_torch_softmax`` with
``softmax_in_fp32``, forced by ``apply_query_key_layer_scaling``): forward ``input.float()`` (write
4), ``* scale`` (read 4, write 4), softmax (read 4, write 4), ``.bfloat16()`` (read 4): six fp32
passes; backward the cast of the probability gradient (write 4), the softmax backward (read it and
the saved fp32 probabilities, write 4: 12), the scale (read 4, write 4), the cast back (read 4),
less the compute-dtype read of the probabilities the fused backward makes (priced as
:data:`UNFUSED_SCORE_PASSES`)."""


def torch_softmax_times(block: Block, cluster: Cluster, opts: CostOptions, mb: Any, tp: int) -> tuple[Any, Any]:
    """Extra forward and backward seconds of ``block``'s attention when its softmax runs as fp32
    PyTorch ops instead of the fused kernel (:data:`TORCH_SOFTMAX_BYTES`)."""
    mb = np.asarray(mb, dtype=float)
    scores = sum(mb * a.q * a.kv * a.heads / tp for a in block.attn) + 0 * mb
    fwd, bwd = TORCH_SOFTMAX_BYTES
    dev = cluster.device
    return dev.stream_time(fwd * scores), dev.stream_time((bwd - opts.bytes_el) * scores)


def block_times(block: Block, cluster: Cluster, opts: CostOptions, mb: Any, tp: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds of ``block`` for ``mb`` samples on one device of a ``tp``-way split."""
    dev = cluster.device
    bel = opts.bytes_el
    mb = np.asarray(mb, dtype=float)
    f = np.zeros_like(mb)
    b = np.zeros_like(mb)
    weights = 0.0
    if block.gemms:  # every GEMM of the block at once: rows are GEMMs, columns microbatch sizes
        kn = np.array(
            [
                (g.k, g.n / tp) if g.split == "col" else (g.k / tp, g.n) if g.split == "row" else (g.k, g.n)
                for g in block.gemms
            ]
        )
        k, n = kn[:, :1], kn[:, 1:]
        T = np.array([[g.tokens] for g in block.gemms], dtype=float) * mb.reshape(1, -1)
        flops = 2.0 * T * k * n
        f = f + dev.gemm_time(flops, bel * (T * k + k * n + T * n), T, n, reduce=k).sum(axis=0).reshape(mb.shape)
        dgrad = dev.gemm_time(flops, bel * (T * n + n * k + T * k), T, k, reduce=n)  # dX = dY W^T: output T x k
        wgrad = dev.gemm_time(flops, bel * (T * k + T * n + k * n), k, n, reduce=T)  # dW = X^T dY: output k x n
        needs = np.array([[g.input_grad] for g in block.gemms], dtype=float)
        b = b + (needs * dgrad + wgrad).sum(axis=0).reshape(mb.shape)
        weights = float((k * n).sum())
        if opts.separate_bias:
            # Megatron's linear (``output + bias`` after the matmul): a column-parallel GEMM's bias
            # is its own pass over the output (read + write); a row-parallel one's is fused into
            # bias-dropout-add. Every bias gradient is a reduction reading the output gradient.
            col = np.array([[g.split == "col"] for g in block.gemms], dtype=float)
            lin = np.array([[g.split in ("col", "row")] for g in block.gemms], dtype=float)
            out = bel * T * n
            f = f + dev.stream_time((2.0 * col * out).sum(axis=0)).reshape(mb.shape)
            b = b + dev.stream_time((lin * out).sum(axis=0)).reshape(mb.shape)
    for a in block.attn:
        width = a.width / tp
        heads = max(a.heads // tp, 1)
        flops = 4.0 * mb * a.q * a.kv * width
        io = bel * mb * (2 * a.q + 2 * a.kv) * width
        bwd_flops, bwd_io = ATTN_BWD_FLOPS * flops, 2.0 * io
        if not opts.flash_attention:
            # the unfused core (nn.MultiheadAttention's training path, Megatron's masked softmax):
            # the scores are written, the softmax reads them and writes the probabilities, the
            # value product reads them (UNFUSED_SCORE_PASSES); the backward does not recompute
            scores = bel * mb * a.q * a.kv * a.heads / tp
            io = io + UNFUSED_SCORE_PASSES[0] * scores
            bwd_flops, bwd_io = 2.0 * flops, bwd_io + UNFUSED_SCORE_PASSES[1] * scores
        # one (query block x head dim) output tile per (sample, head): FlashAttention's work split
        f = f + dev.attention_time(flops, io, a.q, a.width / a.heads, mb * heads)
        b = b + dev.attention_time(bwd_flops, bwd_io, a.q, a.width / a.heads, mb * heads)
    rep_bwd, split_bwd = block.backward_elems()
    res = opts.residual_bytes  # norms and the residual stream: fp32 under autocast
    sp = tp if opts.sequence_parallel else 1  # sequence parallelism splits the replicated work
    casts = opts.cast_bytes * block.casts / sp  # norm outputs cast to the compute dtype (and their gradients back)
    f = f + dev.stream_time(mb * (res * block.elem_rep / sp + bel * block.elem_split / tp + casts))
    b = b + dev.stream_time(mb * (res * rep_bwd / sp + bel * split_bwd / tp + casts))
    # autocast casts every fp32 weight to the compute dtype once per forward (its copy is cached for
    # the backward); each microbatch's weight gradients (compute dtype) are added into the fp32
    # gradient buffer
    f = f + dev.stream_time(weights * opts.weight_cast_bytes) + 0 * mb
    b = b + dev.stream_time(weights * (bel + 2.0 * opts.grad_bytes)) + 0 * mb
    return f + block.kernels * dev.kernel_overhead, b + 2 * block.kernels * dev.kernel_overhead


def block_time(block: Block, cluster: Cluster, opts: CostOptions, mb: Any, tp: int) -> np.ndarray:
    """Forward seconds of ``block`` for ``mb`` samples on one device of a ``tp``-way split."""
    return block_times(block, cluster, opts, mb, tp)[0]


def stage_compute(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int
) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward compute seconds of the slowest pipeline stage for one microbatch."""
    mb = np.asarray(mb, dtype=float)
    if mb.size > 32:  # the partitioner's grids repeat few microbatch sizes: price each once
        sizes, where = np.unique(mb, return_inverse=True)
        if sizes.size < mb.size:
            f, b = stage_compute(profile, cluster, opts, sizes, tp, pp)
            return f[where].reshape(mb.shape), b[where].reshape(mb.shape)
    fit = profile.measured
    if not profile.analytic:
        if fit is None or tp != 1 or pp != 1:
            raise ValueError(f"tower {profile.name!r} has only a measured profile: it can only run with tp = pp = 1")
        f, b = fit.fwd_time(mb), fit.bwd_time(mb)
    else:
        f, b = _analytic_stage(profile, cluster, opts, mb, tp, pp)
        if fit is not None:
            rf, rb = _analytic_stage(profile, cluster, opts, mb, 1, 1)
            f = fit.fwd_time(mb) * f / np.maximum(rf, 1e-30)
            b = fit.bwd_time(mb) * b / np.maximum(rb, 1e-30)
    if profile.frozen:
        b = np.zeros_like(f)
    return np.asarray(f, dtype=float), np.asarray(b, dtype=float)


def _analytic_stage(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int
) -> tuple[np.ndarray, np.ndarray]:
    n = profile.layers // pp
    lf, lb = block_times(profile.layer, cluster, opts, mb, tp)
    if profile.name in opts.torch_softmax_towers and not opts.flash_attention:
        xf, xb = torch_softmax_times(profile.layer, cluster, opts, mb, tp)
        lf, lb = lf + xf, lb + xb
    (pf, pb), (qf, qb) = (block_times(x, cluster, opts, mb, tp) for x in (profile.pre, profile.post))
    if pp == 1:
        return lf * n + pf + qf, lb * n + pb + qb
    return lf * n + np.maximum(pf, qf), lb * n + np.maximum(pb, qb)  # the first or the last stage


def optimizer_time(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, tp: int, pp: int, shard: str = "none", dp: int = 1
) -> float:
    """One Adam step on a device: measured when the profile has a timed step (its share of the
    tower's parameters for tp/pp splits, plus what stepping the runtime's DTensors adds where that
    was measured: ``MeasuredFit.optimizer_overhead``), else the optimizer's memory traffic over HBM
    bandwidth.
    A sharded optimizer state (``optimizer``, ``full``) is stepped by each replica for its 1/dp."""
    if profile.frozen:
        return 0.0
    share = 1.0 / dp if shard != "none" else 1.0
    fit = profile.measured
    if fit is not None and fit.opt_time is not None:
        # stepping DTensors costs more per tensor (a stage holds 1/pp of them), as measured
        kinds = (["tp"] if tp > 1 else []) + (["fsdp"] if shard in LAYER_SHARDS else [])
        dtensors = sum(fit.optimizer_overhead.get(k, 0.0) for k in kinds) / pp
        return fit.opt_time * stage_params(profile, tp, pp) / max(profile.params, 1) * share + dtensors
    frac = profile.trainable_params / max(profile.params, 1)
    return stage_params(profile, tp, pp) * frac * opts.optimizer_traffic / cluster.device.stream_bandwidth * share


def shared_host_phases(
    times: Mapping[str, float],
    ranks: Mapping[str, Sequence[int]],
    devices_per_node: int,
    concurrency: float,
    colocated: bool,
) -> dict[str, float]:
    """Wall time of each tower's phase when devices of a node slow each other down.

    ``concurrency`` (``Device.concurrency``, measured for CPU processes) is the factor by which
    compute stretches while all ``devices_per_node`` devices of a node compute. The node's devices
    share it as processor sharing does: ``devices_per_node`` ranks stretched ``concurrency`` times
    are ``devices_per_node / concurrency`` ranks' worth of cores, so while ``k`` ranks are busy each
    progresses at ``1 / stretch(k)``, ``stretch(k) = max(1, k * concurrency / devices_per_node)``;
    when a rank finishes its phase (the rank of a lighter tower), the busy ones speed up (on an
    oversubscribed CPU host its core serves them). A tower's phase ends when
    its slowest rank's does. Colocated towers run alike on every rank: each phase stretches by
    ``stretch(ranks on the node)``. On two devices this is ``T + (concurrency - 1) * min(T, O)``
    (``T`` the tower's phase alone, ``O`` the other device's).
    """
    node = lambda r: r // devices_per_node  # noqa: E731

    def stretch(k: int) -> float:
        if devices_per_node <= 1:
            return 1.0  # nothing shares the node
        return max(1.0, min(k, devices_per_node) * concurrency / devices_per_node)

    if colocated:
        busiest = max(
            (sum(1 for r in rs if node(r) == nd) for rs in ranks.values() for nd in {node(r) for r in rs}), default=1
        )
        return {n: t * stretch(busiest) for n, t in times.items()}
    work: dict[int, list[tuple[float, str]]] = {}  # node -> (phase alone, tower) per rank
    for n, rs in ranks.items():
        for r in rs:
            work.setdefault(node(r), []).append((float(times[n]), n))
    out = dict.fromkeys(times, 0.0)
    for jobs in work.values():
        clock, done = 0.0, 0.0  # wall time, and the work every busy rank has completed so far
        for i, (w, n) in enumerate(sorted(jobs)):
            clock += (w - done) * stretch(len(jobs) - i)
            done = w
            out[n] = max(out[n], clock)
    return out


def runtime_work(p: TowerProfile, tp: int, pp: int, shard: str, rows: Any, part: int) -> Any:
    """Seconds of the runtime's own per-layer work in a stage's forward (``part`` 0) or backward (1)
    of a microbatch of ``rows``: DTensor's dispatch under tensor parallelism, FSDP2's hooks and
    copies under a layer sharding, as the tower's measured fit says (``MeasuredFit.runtime_overhead``,
    timed on a mesh of one rank or on a pair of ranks); 0 where not measured. A stage holds ``1/pp`` of the layers."""
    over = p.measured.runtime_overhead if p.measured is not None else {}
    kinds = (["tp"] if tp > 1 else []) + (["fsdp"] if shard in LAYER_SHARDS else [])
    total = np.zeros_like(np.asarray(rows, dtype=float))
    for kind in kinds:
        if kind in over:
            a, k = over[kind][part]
            total = total + (a + k * np.asarray(rows, dtype=float)) / pp
    return total


__all__ = [
    "runtime_work",
    "ATTN_BWD_FLOPS",
    "UNFUSED_SCORE_PASSES",
    "TORCH_SOFTMAX_BYTES",
    "torch_softmax_times",
    "block_time",
    "block_times",
    "stage_compute",
    "optimizer_time",
    "shared_host_phases",
]
