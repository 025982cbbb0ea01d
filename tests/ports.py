"""Rendezvous ports for the suite's runs, which never collide with one another.

A port the kernel hands out for ``bind(("", 0))`` (what Lightning's ``find_free_network_port`` and
the usual helper do) is free only until someone takes it: the suite runs several pytest workers at
once, each starting ranks whose gloo connections draw their own local ports from the same
ephemeral range, so a port picked by one run was now and then taken before its rank 0 listened on
it (``EADDRINUSE`` in ``TCPStore``). Ports here come from below the ephemeral range (which the
kernel never hands to an outgoing connection), from a block of their own for each pytest-xdist
worker, each port once per process, checked to be free before it is given."""

from __future__ import annotations

import itertools
import os
import socket

#: the lowest port handed out; blocks of ``BLOCK`` ports per worker stay under the ephemeral range
#: (32768 and up on Linux by default)
FIRST, BLOCK = 20000, 1500


def _worker() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3" under xdist; the main process is 0
    return int(name[2:]) % 8 if name.startswith("gw") and name[2:].isdigit() else 0


_next = itertools.count()


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port no other run of this suite will be given, free at the time of the call."""
    base = FIRST + _worker() * BLOCK
    for _ in range(BLOCK):
        port = base + next(_next) % BLOCK
        if _free(port):
            return port
    raise RuntimeError(f"no free port in {base}-{base + BLOCK - 1}")
