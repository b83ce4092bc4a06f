"""Ports for the servers tests and benchmarks start (a plain module: importing helpers from conftest is fragile,
since each test directory may have a conftest of its own)."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free TCP port below 32767: MMS 1.1.11 refuses higher ones, and Linux hands out ephemeral ports above."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port between 20000 and 32000")
