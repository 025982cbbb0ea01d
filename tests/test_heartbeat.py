"""Node liveness across hosts (``faults.NodeHeartbeat``), in this process over a real TCPStore: a node
whose beat stops is named lost after the grace, a node that ended its call is not, and a store that
stops answering names the node that hosts it."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from ports import free_port
from torch.distributed import TCPStore

from lightning_distmm.faults import NODE_LOST, NodeHeartbeat

NODES = [0, 0, 1, 1]  # ranks 0-1 on node 0, 2-3 on node 1


def _port() -> int:
    return free_port()


@pytest.fixture
def stores():
    port = _port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield server, lambda: TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))


def _beats(store, rank, grace=0.6):
    return NodeHeartbeat(store, "test", rank, NODES, grace=grace, store_address="127.0.0.1:x", wait=0.5)


def _tick_until(beat, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        found = beat.tick()
        if found is not None:
            return found
        time.sleep(0.1)
    return None


def test_a_node_whose_beat_stops_is_lost(stores):
    server, client = stores
    node0, node1, follower = _beats(server, 0), _beats(client(), 2), _beats(client(), 1)
    assert node0.leader and node1.leader and not follower.leader and follower.tick() is None
    for _ in range(4):  # both beat: nobody is lost
        assert node0.tick() is None and node1.tick() is None
        time.sleep(0.2)
    found = _tick_until(node0, 3.0)  # node 1 stops beating
    assert found is not None and found.kind == NODE_LOST and found.rank == 2 and not found.consequence
    assert "node 1 (ranks 2-3) is lost: its heartbeat" in found.message


def test_a_node_that_ended_its_call_is_not_lost(stores):
    server, client = stores
    node0, node1 = _beats(server, 0), _beats(client(), 2)
    assert node0.tick() is None and node1.tick() is None
    node1.close()
    assert _tick_until(node0, 1.5) is None


@pytest.mark.slow
def test_a_store_that_stops_answering_names_its_node():
    """The store lives in another process (as in rank 0's, or its node's launcher); that process is killed."""
    import subprocess
    import sys
    from datetime import timedelta

    port = _port()
    host = f"from torch.distributed import TCPStore; import time; s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); time.sleep(120)"
    server = subprocess.Popen([sys.executable, "-c", host])
    try:
        node1 = _beats(TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)), 2)
        node0 = _beats(TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)), 0)
        for _ in range(3):
            assert node0.tick() is None and node1.tick() is None
        server.kill()  # node 0 is gone, and the store with it
        server.wait()
        found = _tick_until(node1, 5.0)
    finally:
        server.kill()
    assert found is not None and found.kind == NODE_LOST and found.rank == 0
    assert "node 0 (ranks 0-1) is lost: the job's store it hosts (127.0.0.1:x) has not answered" in found.message
