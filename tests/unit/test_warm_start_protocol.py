"""The warm-start wire format: framed JSON with file descriptors passed alongside (SCM_RIGHTS); the one socket where
the frontend connects for every model, and how its connections wait for their model."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mme_runtime.base.child_processes import Watcher
from mme_runtime.base.config import Config
from mme_runtime.models.loading import ModelSpec
from mme_runtime.processes.shared_models import SharedModel, SharedModels
from mme_runtime.processes.warm_protocol import (
    link_model_socket,
    listen_for_models,
    peer_closed,
    receive,
    send,
)
from mme_runtime.serving.connection import Assignment


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


def test_connections_still_waiting_are_closed_in_a_host_forked_while_an_earlier_one_is_routed(tmp_path: Path) -> None:
    """A model's connections wait in the warm process while it loads, and are routed one by one once it is ready: a
    host forked to take the first must close the others (a copy would keep them open after their own host dies)."""
    config = Config(runtime_dir=tmp_path)
    shared = SharedModels(config, Watcher(), list)
    spec = ModelSpec(name="m", model_dir=str(tmp_path), handler="handler_service", tmp_dir=str(tmp_path))
    stub, stub_peer = socket.socketpair()
    model = SharedModel(spec, {}, stub, [-1, -1, -1], "", slot=0, started=0.0)
    pairs = [socket.socketpair() for _ in range(3)]
    model.waiting = [(ours, Assignment(None, 1, "m")) for ours, _ in pairs]
    shared.models["m"] = model
    closed_in_a_fork: list[tuple[int, list[int]]] = []

    def route(_: SharedModel, connection: socket.socket, assignment: Assignment) -> None:
        closed_in_a_fork.append((connection.fileno(), shared.descriptors()))

    shared._route = route  # type: ignore[method-assign]
    shared._ready(model)
    assert [fd for fd, _ in closed_in_a_fork] == [ours.fileno() for ours, _ in pairs]
    for index, (_, descriptors) in enumerate(closed_in_a_fork):
        assert {ours.fileno() for ours, _ in pairs[index + 1 :]} <= set(descriptors)
    for ours, theirs in pairs:
        ours.close()
        theirs.close()
    stub.close()
    stub_peer.close()
    shared.listener.close()
