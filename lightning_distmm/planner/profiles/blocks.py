"""The per-sample cost of one piece of a tower, and the pieces transformer towers are made of.

A :class:`Block` lists what one sample costs a piece of a tower: its GEMM shapes (and how tensor
parallelism splits each), attention sizes, elementwise traffic and activations kept for backward,
split or replicated under tp. :mod:`lightning_distmm.planner.profiles.profile` builds a tower from these
pieces (embeddings, ``layers`` identical blocks, a head); ``cost/`` turns them into time, memory
and bytes on links. The parameter counts follow timm's and transformers' modules layer by layer
(``tests/test_planner_profiles.py`` compares them with real modules).
"""

from __future__ import annotations

from dataclasses import dataclass

BWD_ELEM_RATIO = 1.5
"""Backward elementwise traffic per forward traffic where a block does not count it: an elementwise
op's forward reads its input and writes its output (2 accesses), its backward reads the input (or the
output) and the output gradient and writes the input gradient (3)."""


@dataclass(frozen=True)
class Gemm:
    """``tokens`` per sample times a ``[k, n]`` weight; ``split`` under tensor parallelism:
    ``col`` divides ``n``, ``row`` divides ``k``, ``rep`` is replicated. ``input_grad``: the backward
    computes the input's gradient (not for a tower's input, e.g. a ViT's pixels)."""

    tokens: int
    k: int
    n: int
    split: str = "rep"
    input_grad: bool = True


@dataclass(frozen=True)
class Attn:
    """Attention core of one sample: ``q`` query tokens against ``kv`` key tokens over ``width``
    channels in ``heads`` heads (split by tp)."""

    q: int
    kv: int
    width: int
    heads: int


@dataclass
class Block:
    """Per-sample costs of one piece of a tower (elements, not bytes: the precision decides bytes)."""

    params: int = 0
    gemms: tuple[Gemm, ...] = ()
    attn: tuple[Attn, ...] = ()
    elem_rep: float = 0.0  # elementwise elements read+written in forward, replicated under tp
    elem_split: float = 0.0  # elementwise elements read+written in forward, divided by tp
    elem_rep_bwd: float | None = None  # the same in backward; None: BWD_ELEM_RATIO x forward
    elem_split_bwd: float | None = None
    act_rep: float = 0.0  # activation elements kept for backward, replicated under tp
    act_split: float = 0.0  # activation elements kept for backward, divided by tp
    act_scores: float = 0.0  # attention probabilities kept without flash attention (divided by tp)
    act_sp_recomputed: float = 0.0  # of act_split: the MLP activation's output, which sp recomputes instead
    tp_allreduce: float = 0.0  # elements all-reduced per sample in forward when tp > 1
    casts: float = 0.0  # residual-stream elements cast to the compute dtype per forward (norm outputs into GEMMs)
    kernels: int = 0
    boundary: float = 0.0  # elements per sample handed to the next pipeline stage

    def backward_elems(self) -> tuple[float, float]:
        """Elementwise elements read and written in backward (replicated, split by tp): as counted
        for the block, else :data:`BWD_ELEM_RATIO` times the forward's."""
        rep = self.elem_rep * BWD_ELEM_RATIO if self.elem_rep_bwd is None else self.elem_rep_bwd
        split = self.elem_split * BWD_ELEM_RATIO if self.elem_split_bwd is None else self.elem_split_bwd
        return rep, split

    def flops(self) -> float:
        """Forward FLOPs of one sample."""
        f = sum(2.0 * g.tokens * g.k * g.n for g in self.gemms)
        f += sum(4.0 * a.q * a.kv * a.width for a in self.attn)
        return f


# ---------------------------------------------------------------------- the blocks towers are made of
def transformer_block(s: int, h: int, heads: int, m: int) -> Block:
    """A pre-LN transformer block (self-attention + MLP), as in timm ViT, CLIP text and BERT."""
    params = 4 * h * h + 4 * h + 2 * h * m + m + h + 4 * h  # qkv+o (+bias), fc1, fc2 (+bias), 2 LayerNorms
    return Block(
        params=params,
        gemms=(Gemm(s, h, 3 * h, "col"), Gemm(s, h, h, "row"), Gemm(s, h, m, "col"), Gemm(s, m, h, "row")),
        attn=(Attn(s, s, h, heads),),
        elem_rep=10.0 * s * h,  # 2 LayerNorms (read+write), 2 residual adds (2 reads + write): the residual dtype
        elem_split=2.0 * s * m,  # GELU read+write
        # backward: 2 LayerNorms (read input and output gradient, write input gradient), the residual
        # stream's gradient summed with each branch's (2 reads + write); GELU (read input and output
        # gradient, write input gradient)
        elem_rep_bwd=12.0 * s * h,
        elem_split_bwd=3.0 * s * m,
        act_rep=4.0 * s * h,  # LN inputs, attention input, MLP input
        act_split=4.0 * s * h + 2.0 * s * m,  # q, k, v, proj input; fc1 out, GELU out
        act_sp_recomputed=float(s * m),  # GELU out: sp's fc2 keeps fc1's output only
        act_scores=float(heads * s * s),
        tp_allreduce=2.0 * s * h,
        casts=2.0 * s * h,  # both LayerNorms' outputs, into the qkv and fc1 GEMMs
        kernels=10,
        boundary=float(s * h),
    )


def cross_block(s: int, h: int, heads: int, m: int, n_ctx: int, h_ctx: int) -> Block:
    """A cross-attention residual block with its own MLP (open_clip CoCa's multimodal decoder)."""
    params = 2 * h * h + 2 * h_ctx * h + 4 * h + 2 * h + 2 * h_ctx + 2 * h * m + m + h + 2 * h
    return Block(
        params=params,
        gemms=(
            Gemm(s, h, h, "col"),
            Gemm(n_ctx, h_ctx, 2 * h, "col"),
            Gemm(s, h, h, "row"),
            Gemm(s, h, m, "col"),
            Gemm(s, m, h, "row"),
        ),
        attn=(Attn(s, n_ctx, h, heads),),
        elem_rep=10.0 * s * h + 2.0 * n_ctx * h_ctx,
        elem_split=2.0 * s * m,
        elem_rep_bwd=12.0 * s * h + 3.0 * n_ctx * h_ctx,
        elem_split_bwd=3.0 * s * m,
        act_rep=4.0 * s * h + n_ctx * h_ctx,
        act_split=2.0 * s * h + 2.0 * n_ctx * h + 2.0 * s * m,
        act_scores=float(heads * s * n_ctx),
        tp_allreduce=2.0 * s * h,
        casts=2.0 * s * h,
        kernels=10,
        boundary=0.0,
    )


def attention_pool(s: int, h: int, E: int, queries: int, heads: int) -> Block:
    """open_clip's ``AttentionalPooler`` (CoCa) as a ViT's head: ``queries`` learned queries of width
    ``E`` (the embedding width) attend to the ``s`` tokens of width ``h`` (LayerNorms on both), then
    ``ln_post`` and the ``E x E`` projection of the first (pooled) token. Parameters as in open_clip
    3.x: queries, q/k/v and output projections with biases, three LayerNorms, the projection."""
    params = queries * E + 2 * E * E + 2 * E * h + 4 * E + 2 * E + 2 * h + 2 * E + E * E
    return Block(
        params=params,
        gemms=(Gemm(s, h, 2 * E, "rep"), Gemm(queries, E, E, "rep"), Gemm(queries, E, E, "rep"), Gemm(1, E, E, "rep")),
        attn=(Attn(queries, s, E, heads),),
        elem_rep=4.0 * s * h + 6.0 * queries * E,
        act_rep=float(s * h + 2 * s * E + 3 * queries * E),
        kernels=8,
    )


def map_pool(s: int, h: int, heads: int, m: int) -> Block:
    """timm's ``AttentionPoolLatent`` (SigLIP's ``map`` head): one learned latent attends to the ``s``
    tokens (q, kv and output projections with biases), a LayerNorm and an MLP of width ``m``."""
    params = h + 4 * h * h + 4 * h + 2 * h + 2 * h * m + m + h
    return Block(
        params=params,
        gemms=(
            Gemm(s, h, 2 * h, "rep"),
            Gemm(1, h, h, "rep"),
            Gemm(1, h, h, "rep"),
            Gemm(1, h, m, "rep"),
            Gemm(1, m, h, "rep"),
        ),
        attn=(Attn(1, s, h, heads),),
        elem_rep=2.0 * s * h + 8.0 * h,
        act_rep=float(s * h + 2 * s * h),
        kernels=8,
    )


def merge_blocks(a: Block, b: Block) -> Block:
    """Two pieces of a tower priced as one (a pooling head after the final norm, say)."""
    (arep, asplit), (brep, bsplit) = a.backward_elems(), b.backward_elems()
    return Block(
        params=a.params + b.params,
        gemms=a.gemms + b.gemms,
        attn=a.attn + b.attn,
        elem_rep=a.elem_rep + b.elem_rep,
        elem_split=a.elem_split + b.elem_split,
        elem_rep_bwd=arep + brep,
        elem_split_bwd=asplit + bsplit,
        act_rep=a.act_rep + b.act_rep,
        act_split=a.act_split + b.act_split,
        act_scores=a.act_scores + b.act_scores,
        act_sp_recomputed=a.act_sp_recomputed + b.act_sp_recomputed,
        tp_allreduce=a.tp_allreduce + b.tp_allreduce,
        casts=a.casts + b.casts,
        kernels=a.kernels + b.kernels,
        boundary=max(a.boundary, b.boundary),
    )
