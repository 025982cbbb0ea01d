"""Node liveness across hosts: :class:`NodeHeartbeat`.

A rank's failure records reach the other hosts through the job's store, but a machine that is
lost writes no record: its ranks die silently (power, kernel panic, a SIGKILL of everything on it,
the out-of-memory killer of a whole cgroup), and under NCCL the other nodes' ranks then wait in a
collective until NCCL's watchdog ends them (10 minutes by default). Each rank's
:class:`~lightning_distmm.faults.PeerFailureWatch` can only see its own host's processes.

So each node's first rank counts its node's key up in the job's store every beat and reads every
other node's count. A node whose count has not moved for ``grace`` seconds is lost; so is the node
that hosts the store (rank 0's: torch's ``TCPStore`` runs in rank 0's process, or in the launcher's
agent of that node under torchrun) when the store does not answer for ``grace`` seconds. The node
leader then writes a :data:`NODE_LOST` record in its host's run folder, which every rank of its host
reads within a second and ends with, naming the lost node.

One key per node, written and read by one rank per node: the store serves ``nodes x nodes`` small
reads per beat (100 nodes at the default beat of 1 s: 10,000 reads a second, well within what a
``TCPStore`` answers). No thread piles up on a store that hangs: a beat still in flight is waited for,
not repeated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from lightning_distmm.faults.records import FailureRecord

#: the kind of the record that names a node whose heartbeat stopped (or the store's node)
NODE_LOST = "NodeLost"


def _span(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


class NodeHeartbeat:
    """Beats for this node and watches the others' (only on each node's first rank; elsewhere
    :meth:`tick` does nothing).

    Args:
        store: the job's store (a ``PrefixStore`` keeps the keys apart is made here).
        run: the run's id (the keys of one run never meet another's).
        rank: this rank.
        nodes: the node of every global rank (``parallel.groups.nodes_of_ranks``).
        grace: seconds without a beat (or without an answer from the store) before a node is lost.
        store_address: where the store listens, for the message.
        wait: how long one beat may take before it counts as unanswered.
    """

    def __init__(
        self,
        store: Any,
        run: str,
        rank: int,
        nodes: Sequence[int],
        grace: float,
        store_address: str = "the job's store",
        wait: float = 2.0,
    ) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(f"distmm-heartbeat/{run}", store)
        self.rank, self.grace, self.wait, self.store_address = rank, grace, wait, store_address
        self.ranks_of: dict[int, list[int]] = {}
        for r, n in enumerate(nodes):
            self.ranks_of.setdefault(int(n), []).append(r)
        self.node = int(nodes[rank])
        self.leader = rank == self.ranks_of[self.node][0]
        self.store_node = int(nodes[0])
        now = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {n: (-1, now) for n in self.ranks_of if n != self.node}
        self._answered = now
        self._beat: threading.Thread | None = None
        self._counts: dict[int, int] | None = None

    def _exchange(self) -> None:
        counts = {}
        self.store.add(f"node{self.node}", 1)
        for n in self._seen:
            counts[n] = self.store.add(f"node{n}", 0)
        self._counts = counts

    def tick(self) -> FailureRecord | None:
        """One beat: count this node up, read the others; a record naming a lost node, or None."""
        if not self.leader or len(self.ranks_of) < 2:
            return None
        now = time.monotonic()
        if self._beat is None or not self._beat.is_alive():
            self._counts = None
            self._beat = threading.Thread(target=self._safe_exchange, name="distmm-heartbeat", daemon=True)
            self._beat.start()
        self._beat.join(self.wait)
        counts, self._counts = self._counts, None
        if counts is None:  # no answer (a store that hangs or refuses)
            silent = now - self._answered
            if silent < self.grace:
                return None
            ranks = self.ranks_of[self.store_node]
            return FailureRecord(
                ranks[0],
                time.time(),
                NODE_LOST,
                f"node {self.store_node} ({_span(ranks)}) is lost: the job's store it hosts ({self.store_address})"
                f" has not answered for {silent:.0f} s (the machine, its launcher or its network is gone)",
                False,
            )
        self._answered = now
        for n, count in counts.items():
            last, since = self._seen[n]
            if count != last:
                self._seen[n] = (count, now)
            elif now - since >= self.grace and not self._left(n):
                ranks = self.ranks_of[n]
                return FailureRecord(
                    ranks[0],
                    time.time(),
                    NODE_LOST,
                    f"node {n} ({_span(ranks)}) is lost: its heartbeat in the job's store has not moved for"
                    f" {now - since:.0f} s (the machine, its processes or its network are gone)",
                    False,
                )
        return None

    def store_silent(self, wait: float = 1.0) -> str | None:
        """On any rank, at once: when the job's store does not answer within ``wait`` seconds, a line
        naming the node that hosts it as likely lost; None when it answers or the job is one node.
        For a rank that is being stopped (torchrun's agent stops the survivors' ranks as soon as the
        rendezvous host is gone, before the heartbeat's grace has passed)."""
        if len(self.ranks_of) < 2:
            return None
        answered = threading.Event()

        def ask() -> None:
            try:
                self.store.add("probe", 0)
                answered.set()
            except Exception:  # noqa: BLE001 - no answer is the finding
                pass

        threading.Thread(target=ask, name="distmm-store-probe", daemon=True).start()
        if answered.wait(wait):
            return None
        return (
            f"node {self.store_node} ({_span(self.ranks_of[self.store_node])}), which hosts the job's store"
            f" ({self.store_address}), does not answer within {wait:.0f} s: node {self.store_node} is likely lost"
        )

    def _left(self, node: int) -> bool:
        """Whether ``node`` ended its trainer call (:meth:`close`): its beat stops, it is not lost."""
        try:
            return bool(self.store.check([f"left{node}"]))
        except Exception:  # noqa: BLE001 - the store's silence is tick's to count
            return False

    def close(self) -> None:
        """This node's trainer call ended well: the others stop watching its beat (a node that
        finishes a few seconds before another, which is still writing a checkpoint, is not lost)."""
        if not self.leader:
            return
        writer = threading.Thread(target=self._leave, name="distmm-heartbeat-leave", daemon=True)
        writer.start()
        writer.join(self.wait)

    def _leave(self) -> None:
        try:
            self.store.set(f"left{self.node}", "1")
        except Exception:  # noqa: BLE001 - a store that is gone needs no word
            pass

    def _safe_exchange(self) -> None:
        try:
            self._exchange()
        except Exception:  # noqa: BLE001 - an unanswered beat: tick counts the silence
            self._counts = None
