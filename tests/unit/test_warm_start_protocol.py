"""The warm-start wire format: framed JSON with file descriptors passed alongside (SCM_RIGHTS); the one socket where
the frontend connects for every model."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mme_runtime.processes.warm_protocol import (
    link_model_socket,
    listen_for_models,
    peer_closed,
    receive,
    send,
)


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


def test_messages_share_their_strings() -> None:
    """Every stub sends the same environment, and the warm process keeps each model's: received twice, its strings
    are held once (the names and values are made at run time, as a decoder makes them)."""
    left, right = socket.socketpair()
    value = "".join(["/opt/", "conda/bin"])
    stub = {"argv": ["worker", "--handler", "handler_service"], "env": {"PATH": value, "LANG": "C.UTF-8"}, "pid": 7}
    try:
        send(left, stub)
        send(left, stub)
        first, _ = receive(right)
        second, _ = receive(right)
    finally:
        left.close()
        right.close()
    assert first == second == stub
    assert first is not None and second is not None
    assert first["env"]["PATH"] is second["env"]["PATH"]
    assert next(iter(first["env"])) is next(iter(second["env"]))
    assert all(a is b for a, b in zip(first["argv"], second["argv"], strict=True))
    assert first["env"] is not second["env"]  # each model's own mapping, which it may change


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


def test_a_connection_the_peer_closed_after_its_message_is_told_apart_from_a_waiting_one() -> None:
    """A frontend worker that wrote its LOAD and was closed by an UNLOAD before the warm process read it."""
    left, right = socket.socketpair()
    left.sendall(b"LOAD")
    assert not peer_closed(right)  # a message waits
    assert right.recv(4) == b"LOAD"
    assert not peer_closed(right)  # nothing to read, but open: the frontend waits for the answer
    left.close()
    assert peer_closed(right)
    right.close()


def test_a_model_s_socket_path_links_to_the_socket_of_all_models(tmp_path: Path) -> None:
    listener = listen_for_models(str(tmp_path / "models.sock"))
    argv = ["stub", "--sock-name", str(tmp_path / ".mms.sock.9000")]
    (tmp_path / ".mms.sock.9000").write_text("left by an earlier process")
    path = link_model_socket(argv, str(tmp_path / "models.sock"))
    assert os.readlink(path) == str(tmp_path / "models.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(path)  # through the link
        accepted, _ = listener.accept()
        accepted.close()
    listener.close()
