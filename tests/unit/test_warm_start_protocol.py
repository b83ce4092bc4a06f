"""The warm-start wire format: framed JSON with file descriptors passed alongside (SCM_RIGHTS); the one socket where
the frontend connects for every model; what the warm process keeps of each stub's message."""

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
from mme_runtime.processes.warm_start import _shared


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


def test_messages_share_their_names() -> None:
    """The warm process and the hosts keep a message or more for every model: each key is held once."""
    left, right = socket.socketpair()
    stub = {"argv": ["worker", "--handler", "handler_service"], "env": {"PATH": "/opt/conda/bin"}, "pid": 7}
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
    assert all(a is b for a, b in zip(first, second, strict=True))
    assert next(iter(first["env"])) is next(iter(second["env"]))


def test_the_warm_process_keeps_one_copy_of_what_every_stub_s_environment_holds() -> None:
    # Every stub sends the same environment, kept for each model's hosts: about 10 KiB a model (issue #37). Values
    # are shared with the last stub's, never interned (an interned string may live for good: Python 3.12).
    previous = {"PATH": "".join(["/opt/", "conda/bin"]), "LANG": "C.UTF-8", "GONE": "x"}
    environment = {"PATH": "".join(["/opt/", "conda/bin"]), "LANG": "".join(["en_", "US"]), "NEW": "y"}
    shared = _shared(environment, previous)
    assert shared == environment
    assert shared["PATH"] is previous["PATH"] and environment["PATH"] is not previous["PATH"]
    assert shared["LANG"] is environment["LANG"] and shared["NEW"] is environment["NEW"]
    # the next stub's, equal: one dict for both models (about 1.5 KiB a model)
    assert _shared(dict(environment), shared) is shared


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
