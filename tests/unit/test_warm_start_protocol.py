"""The warm-start wire format: framed JSON with file descriptors passed alongside (SCM_RIGHTS)."""

from __future__ import annotations

import os
import socket

import pytest

from mme_runtime.processes.warm_protocol import receive, send


def test_message_and_descriptors_arrive_together() -> None:
    left, right = socket.socketpair()
    read_end, write_end = os.pipe()
    try:
        send(left, {"argv": ["worker", "--model-name", "m"]}, [write_end])
        message, fds = receive(right, with_fds=3)
        assert message == {"argv": ["worker", "--model-name", "m"]}
        assert len(fds) == 1
        os.write(fds[0], b"through the passed descriptor")
        assert os.read(read_end, 100) == b"through the passed descriptor"
        os.close(fds[0])
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        left.close()
        right.close()


def test_a_closed_peer_reads_as_none() -> None:
    left, right = socket.socketpair()
    left.close()
    assert receive(right) == (None, [])
    right.close()


def test_oversized_messages_are_refused() -> None:
    left, right = socket.socketpair()
    left.sendall((1 << 30).to_bytes(4, "big"))
    try:
        with pytest.raises(ValueError, match="refused"):
            receive(right)
    finally:
        left.close()
        right.close()
