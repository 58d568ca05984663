"""Ports for the tests' rendezvous (torch.distributed's TCP store on rank 0).

A port found by binding port 0 comes from the kernel's ephemeral range, the range every outgoing connection and
every gloo pair also draws from: between the moment the finder closes it and the moment rank 0 listens on it, a
gloo connection of another check (another xdist worker, another pool) can take it, and rank 0 fails with
EADDRINUSE. ``free_port`` hands out ports below the ephemeral range instead, which nothing picks by itself: each
xdist worker draws from its own slice, never hands out the same port twice, and checks that the port binds.
"""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_LOWEST = 10000  # below this, ports that services listen on by convention
_FALLBACK_EPHEMERAL_START = 32768  # Linux's default ip_local_port_range starts here


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_START


def _worker_ports() -> range:
    """This process's ports: its xdist worker's share of [_LOWEST, the ephemeral range's start)."""
    lo = _ephemeral_start()
    if lo - _LOWEST < 1000:  # an ephemeral range that starts low: nothing sits outside it
        return range(0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    index = int(worker[2:]) % count if worker[2:].isdigit() else 0
    width = (lo - _LOWEST) // count
    return range(_LOWEST + index * width, _LOWEST + (index + 1) * width)


_PORTS = _worker_ports()
_next = random.Random(os.getpid()).randrange(len(_PORTS)) if _PORTS else 0  # where this process starts in its slice
_TRIES = 200


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that binds now and that no other check of this test run was given."""
    global _next
    for _ in range(min(_TRIES, len(_PORTS))):
        port = _PORTS[_next % len(_PORTS)]
        _next += 1
        if _binds(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no port outside the ephemeral range binds
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
