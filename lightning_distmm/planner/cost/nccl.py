"""NCCL's ring cost model with its protocol choice (LL, LL128, Simple) by message size.

NCCL prices every (algorithm, protocol) pair as ``latency + bytes / bandwidth`` and runs the
cheapest (``ncclTopoGetAlgoTime``); the constants below are those of NCCL v2.30.7
(``src/graph/tuning.cc``, ``ncclTunerConstantsDefaults`` and ``ncclTopoTuneModel``), ring algorithm:

* latency = ``baseLat[p] + (steps - interSteps) * intraLat[p] + interSteps * netLat[p]``, with
  ``steps = 2 (r-1)`` for an all-reduce, ``r-1`` for an all-gather or reduce-scatter; across nodes
  ``intraLat`` is at least the network overhead (1 us on x86 Intel hosts, x3 for Simple), and a
  multi-node Simple all-reduce's latency is multiplied by 1.4 on sm80+ ("plateau effect of ring");
* bandwidth: Simple the link's, LL128 ``0.92`` of it (120 of 128 bytes carry data), LL half of it
  capped at ``llMaxBw`` (87.7 GB/s on one Ampere node, 141 on one Hopper node, 39.0 on two nodes,
  20.4 beyond, Intel hosts).

So small messages (a tensor-parallel all-reduce of one microbatch's activations) go LL or LL128
at a fraction of Simple's 56 us ring latency at tp 8, large ones (gradients) Simple at full
bandwidth. Tree, NVLS and CollNet are not modelled (rings only). The link terms are this
package's hierarchical ones (NVLink share inside nodes, each node's NIC across them), each at the
protocol's bandwidth.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LATENCY = {"LL": 6.6e-6, "LL128": 14.0e-6, "Simple": 8.4e-6}  # baseLatencies, Ring
NVLINK_LATENCY = {"LL": 0.6e-6, "LL128": 1.9e-6, "Simple": 3.4e-6}  # hwLatencies NVLINK, Ring
NET_LATENCY = {"LL": 2.7e-6, "LL128": 4.0e-6, "Simple": 14.0e-6}  # hwLatencies NET, Ring
NET_OVERHEAD = {"LL": 1.0e-6, "LL128": 1.0e-6, "Simple": 3.0e-6}  # getNetOverhead (x86 Intel), x3 for Simple
BANDWIDTH_FACTOR = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
RING_PLATEAU = 1.4  # multi-node Simple all-reduce latency factor, sm80 and later
LL_MAX_BW_ONE_NODE = {"volta": 39.0e9, "ampere": 87.7e9, "hopper": 141.0e9, "blackwell": 282.0e9}
LL_MAX_BW_NODES = {2: 39.0e9, 4: 20.4e9}  # llMaxBws, Intel hosts: two nodes, more than two


def ll_max_bandwidth(arch: str, nodes: Any) -> Any:
    """NCCL's cap on LL's bus bandwidth (bytes/s) for a ring over ``nodes`` nodes."""
    nodes = np.asarray(nodes, dtype=float)
    one = LL_MAX_BW_ONE_NODE.get(arch, LL_MAX_BW_ONE_NODE["ampere"])
    return np.where(nodes <= 1, one, np.where(nodes <= 2, LL_MAX_BW_NODES[2], LL_MAX_BW_NODES[4]))


def protocol_times(
    arch: str,
    intra_bw: float,
    inter_bw: float,
    steps_per_rank: int,
    ranks: Any,
    nodes: Any,
    intra_bytes: Any,
    inter_bytes: Any,
) -> dict[str, Any]:
    """Seconds of a ring collective under each protocol.

    ``steps_per_rank``: 2 for an all-reduce, 1 for an all-gather or reduce-scatter; ``intra_bytes``
    each member sends over NVLink, ``inter_bytes`` the busiest node pushes through its NIC (bytes/s
    ``intra_bw`` and ``inter_bw``, the links' achievable rates). Numbers or numpy arrays."""
    ranks, nodes = np.asarray(ranks, dtype=float), np.asarray(nodes, dtype=float)
    steps = steps_per_rank * (ranks - 1)
    inter_steps = steps_per_rank * np.maximum(nodes - 1, 0)
    multi = nodes > 1
    cap = ll_max_bandwidth(arch, nodes)
    out = {}
    for p in PROTOCOLS:
        intra_lat = np.where(multi, max(NVLINK_LATENCY[p], NET_OVERHEAD[p]), NVLINK_LATENCY[p])
        lat = BASE_LATENCY[p] + (steps - inter_steps) * intra_lat + inter_steps * NET_LATENCY[p]
        if p == "Simple" and steps_per_rank == 2:
            lat = np.where(multi, lat * RING_PLATEAU, lat)
        f = BANDWIDTH_FACTOR[p]
        bw_in, bw_out = f * intra_bw, f * inter_bw
        if p == "LL":
            bw_in, bw_out = np.minimum(bw_in, cap), np.minimum(bw_out, cap)
        t = lat + np.asarray(intra_bytes, dtype=float) / bw_in
        out[p] = t + np.where(multi, np.asarray(inter_bytes, dtype=float) / bw_out, 0.0)
    return out


def ring_time(
    arch: str,
    intra_bw: float,
    inter_bw: float,
    steps_per_rank: int,
    ranks: Any,
    nodes: Any,
    intra_bytes: Any,
    inter_bytes: Any,
) -> Any:
    """Seconds of a ring collective under the protocol NCCL would pick (the cheapest)."""
    times = protocol_times(arch, intra_bw, inter_bw, steps_per_rank, ranks, nodes, intra_bytes, inter_bytes)
    return np.minimum.reduce([times[p] for p in PROTOCOLS])


def choose_protocol(
    arch: str,
    intra_bw: float,
    inter_bw: float,
    steps_per_rank: int,
    ranks: int,
    nodes: int,
    intra_bytes: float,
    inter_bytes: float,
) -> str:
    """The protocol NCCL's model picks for one collective (scalars)."""
    times = protocol_times(arch, intra_bw, inter_bw, steps_per_rank, ranks, nodes, intra_bytes, inter_bytes)
    return min(PROTOCOLS, key=lambda p: float(times[p]))


__all__ = ["PROTOCOLS", "protocol_times", "ring_time", "choose_protocol", "ll_max_bandwidth"]
