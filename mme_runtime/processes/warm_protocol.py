"""The warm process's messages: length-prefixed JSON over a unix socket, with descriptors passed
beside them (SCM_RIGHTS). Stubs, loaders and the warm process speak it; the models' socket is
opened, and a loader's result socket drained, here. Light on imports: the stub imports it too."""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import sys

# Every model's stub imports this module as it starts: typing (3 ms there) is for the type checker
# only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HEADER = struct.Struct("!I")
# Beside warm.sock while the warm process starts (MMS starts meanwhile): a stub waits for the
# warm process to accept, for at most WARM_START_SECONDS, instead of failing its model.
STARTING_FILE = "warm.starting"
WARM_START_SECONDS = 60.0
MAX_MESSAGE = 1 << 20
# descriptors in one message of the connections a host hands over (the kernel allows 253)
MAX_FDS = 64
_INT_SIZE = array.array("i").itemsize


def send(sock: socket.socket, payload: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(payload).encode()
    message = HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(message)


def receive(sock: socket.socket, with_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One framed JSON message (and up to ``with_fds`` descriptors); None when the peer closed. Its
    keys are interned, one copy of each name however many models' messages a process keeps (the
    environment's names too: a bounded set, where an interned string may live for good)."""
    fds: list[int] = []
    ancillary = socket.CMSG_SPACE(with_fds * _INT_SIZE) if with_fds else 0
    header, ancdata, _, _ = sock.recvmsg(HEADER.size, ancillary)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[: len(data) - len(data) % _INT_SIZE]))
    while header and len(header) < HEADER.size:  # a stream may split even four bytes
        chunk = sock.recv(HEADER.size - len(header))
        if not chunk:
            break
        header += chunk
    if len(header) < HEADER.size:
        return None, fds
    (length,) = HEADER.unpack(header)
    if length > MAX_MESSAGE:
        raise ValueError(f"warm-start message of {length} bytes refused")
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return _DECODER.decode(body.decode()), fds


def _interned_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return {sys.intern(key): value for key, value in pairs}


_DECODER = json.JSONDecoder(object_pairs_hook=_interned_keys)  # one for every message


def listen_for_models(path: str) -> socket.socket:
    """The one socket where the frontend's connections for every model arrive (each model's path
    links to it: ``link_model_socket``); each connection's LOAD message names its model."""
    _remove_stale(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(socket.SOMAXCONN)
    listener.setblocking(False)
    return listener


def link_model_socket(argv: list[str], target: str) -> str:
    """Makes the path MMS's stub command line names (``--sock-name``) a link to the socket of all
    models, ``target``: the frontend connects there, again after a host dies, and a model holds no
    socket of its own. Returns the path. MMS gives each model a port (and so a path) of its own;
    the same model started again replaces its earlier self first."""
    path = argv[argv.index("--sock-name") + 1]
    _remove_stale(path)
    os.symlink(target, path)
    return path


def _remove_stale(path: str) -> None:
    """What an earlier process left at ``path``, if anything."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def peer_closed(sock: socket.socket) -> bool:
    """Whether the other end has closed ``sock``: nothing is left to read and its end is reached."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def drain(result: socket.socket) -> None:
    """Closes a loader's result socket and any descriptor waiting in it."""
    result.setblocking(False)
    try:
        while True:
            _, fds = receive(result, with_fds=1)
            for fd in fds:
                os.close(fd)
            if not fds:
                break
    except (OSError, ValueError):
        pass
    result.close()
