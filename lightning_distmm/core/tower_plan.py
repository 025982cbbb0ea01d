"""One tower's share of the machine (:class:`TowerPlan`) and how a batch is split over replicas."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_distmm.core.plan_schema import FSDP_SHARDS


def split_batch(n: int, weights: Sequence[int] | None, replicas: int) -> list[int]:
    """Split ``n`` samples over ``replicas`` replicas.

    ``weights`` are the replica batches the plan was made for; a batch of another size (the last,
    partial batch of an epoch) is split in the same proportions by largest remainder, so the split
    of the nominal batch is exactly ``weights``. Without weights the split is even, the first
    replicas taking one more sample when ``n`` does not divide.
    """
    if weights is None:
        return [n // replicas + (1 if i < n % replicas else 0) for i in range(replicas)]
    total = sum(weights)
    if n == total:
        return list(weights)
    exact = [n * w / total for w in weights]
    sizes = [int(x) for x in exact]
    order = sorted(range(replicas), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[: n - sum(sizes)]:
        sizes[i] += 1
    return sizes


@dataclass
class TowerPlan:
    """One tower's share of the machine.

    ``ranks`` are laid out data-parallel outermost, then pipeline, then context-parallel, then
    tensor-parallel innermost, so replica ``i`` owns ``ranks[i*w:(i+1)*w]`` with ``w = pp*cp*tp``
    and each pipeline stage of a replica ``cp*tp`` consecutive ranks. The ``cp`` ranks of a stage
    read the same rows and split the tokens of each row between them (docs/runtime.md, "Sequence
    and context parallelism"). ``replica_batch`` gives each data-parallel replica's samples for the
    nominal global batch (uneven allowed); ``None`` splits evenly.
    """

    ranks: list[int]
    replica_batch: list[int] | None = None
    tp: int = 1
    pp: int = 1
    microbatch: int | None = None
    schedule: str = "gpipe"
    recompute: bool | int = False
    """Activation checkpointing: keep each transformer block's input, recompute the block in backward
    (Megatron-LM ``--recompute-granularity full``, open_clip ``--grad-checkpointing``); ``true`` every
    block, an int ``N`` the first ``N`` blocks of each pipeline stage (Megatron-LM's ``--recompute-method
    block``), the others keeping their activations."""
    shard: str = "none"
    """Parameters, gradients and optimizer state over the tower's data-parallel ranks: ``none``
    (replicated), ``optimizer`` (the optimizer state sharded over all replicas, weights and gradients
    whole: ZeRO-1, Megatron-LM's distributed optimizer), ``full`` (sharded over all replicas, FSDP), ``zero2`` (sharded over all replicas,
    each layer's weights gathered once in the forward and kept to the backward: FSDP2's
    ``reshard_after_forward=False``) or ``hybrid`` (sharded over the replicas on one node, replicated
    across nodes, HSDP)."""
    cp: int = 1
    """Context parallelism: each row's token sequence split over ``cp`` ranks of the replica, attention
    exact across the split (DeepSpeed-Ulysses all-to-all over heads: the heads must divide by
    ``cp * tp``); gradients summed over the replicas and the cp ranks together."""
    sp: bool = False
    """Sequence parallelism with TP (Megatron-LM): the norm / dropout / residual regions sharded
    along the sequence over the ``tp`` ranks instead of replicated; needs ``tp > 1``."""
    compile: bool = False
    """Regional compilation: each transformer block's forward compiled with ``torch.compile``
    (inductor), once for every block and batch size; a tower that fails to compile runs eagerly
    (docs/runtime.md, "Compiling a tower")."""

    @property
    def sharded(self) -> bool:
        """FSDP shards the tower's parameters (``zero2``, ``full``, ``hybrid``)."""
        return self.shard in FSDP_SHARDS

    @property
    def stage_width(self) -> int:
        """Ranks of one pipeline stage of a replica: its context- and tensor-parallel ranks (``cp * tp``)."""
        return self.cp * self.tp

    @property
    def dp(self) -> int:
        return len(self.ranks) // (self.stage_width * self.pp)

    def replica_ranks(self, replica: int) -> list[int]:
        width = self.stage_width * self.pp
        return self.ranks[replica * width : (replica + 1) * width]

    def feature_rank(self, replica: int) -> int:
        """The rank that holds replica ``replica``'s output features: last pipeline stage, first cp and tensor rank."""
        return self.replica_ranks(replica)[(self.pp - 1) * self.stage_width]

    def replica_of(self, rank: int) -> int | None:
        """The data-parallel replica that ``rank`` belongs to, or None if it does not run this tower."""
        if rank not in self.ranks:
            return None
        return self.ranks.index(rank) // (self.stage_width * self.pp)

    def split(self, n: int) -> list[int]:
        """Per-replica sample counts for a global batch of ``n``."""
        return split_batch(n, self.replica_batch, self.dp)
