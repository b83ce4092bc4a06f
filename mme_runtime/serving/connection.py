"""One frontend connection, from the socket to the handler and back: its first message (the LOAD,
which names the GPU the frontend assigned it) read by the warm process, which routes the connection
to its device's host; there its LOAD is answered, then each inference message read with MMS's
protocol (``mms.protocol``), answered by MMS's ``Service`` (which calls ``handler_service.handle``
and so the model's ``ServedModel``, ``served_model.py``), and written back, with the request metrics
recorded after.

A device host keeps its connections in ``Turns``: an idle connection waits in one epoll set, and a
worker thread waiting on the set answers it when its message arrives (workers are made when none is
left waiting and end after a while with nothing to do), so a host's threads follow the requests in
flight, not the models it holds. Every connection of a model answers at once. A batching model's
``ConnectionDemand`` (made by ``start_batching``) counts its busy connections and asks for more
once they are all busy (MMS sends one request per connection at a time, so a batch of
``batch_size`` needs that many).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from mms.context import Context
from mms.protocol.otf_message_handler import LOAD_MSG, create_load_model_response, retrieve_msg
from mms.service import emit_metrics

from mme_runtime.base import devices
from mme_runtime.base.config import Config
from mme_runtime.models.loading import LoadedModel, ModelSpec
from mme_runtime.operations import metrics
from mme_runtime.operations.scaler import request_workers


class ConnectionDemand:
    """Counts one model's connections on this device and the requests they are answering; calls
    ``ask_for(full)`` once, the first time the ``at_load`` connections (or more) are all busy."""

    def __init__(self, ask_for: Callable[[int], None], at_load: int, full: int) -> None:
        self._ask_for = ask_for
        self._at_load = at_load
        self._full = full
        self._lock = threading.Lock()
        self._open = 0
        self._busy = 0
        self._asked = at_load >= full  # the LOAD asked for the whole batch already

    @property
    def connections(self) -> int:
        return self._open

    def opened(self) -> None:
        with self._lock:
            self._open += 1

    def closed(self) -> None:
        with self._lock:
            self._open -= 1

    @contextmanager
    def answering(self) -> Iterator[None]:
        """Brackets one request, from its message read to its answer sent."""
        with self._lock:
            self._busy += 1
            # Not before the LOAD's connections are all open: until then one request alone fills
            # them.
            grow = not self._asked and self._open >= self._at_load and self._busy >= self._open
            self._asked = self._asked or grow
        if grow:
            self._ask_for(self._full)
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1


logger = logging.getLogger(__name__)
# How long a host's worker waits for another connection's turn before it ends, and how many wait
# for good: a turn that found none waiting would first make a thread (a tenth of a millisecond on
# the request's path).
WORKER_IDLE_SECONDS = 10.0
SPARE_WORKERS = 2
SERVICE_LOG = logging.getLogger("mms.service")  # where emit_metrics writes its per-request lines


def start_batching(spec: ModelSpec, config: Config, loaded: LoadedModel) -> ConnectionDemand | None:
    """From here on the handler is called from many threads; our handler then batches their forward
    passes. A batching model asks for the frontend connections that fill its batches as it comes to
    need them: the returned ``ConnectionDemand`` watches its connections."""
    if not hasattr(loaded.module, "start_batcher"):
        # another handler (MMS's ``module:function``): it is called from the connections' threads as
        # it is
        return None
    settings = loaded.module.start_batcher()
    if not settings.batching or settings.source == "LOAD":
        return None  # MMS's own batching (LOAD's batch_size) fills its batches itself

    def ask_for(per_device: int, serving: bool = True) -> None:
        try:
            request_workers(config.runtime_dir, spec.name, per_device, serving)
        except OSError as exc:
            logger.warning(
                "model=%s could not ask for %d workers per device: %s", spec.name, per_device, exc
            )

    at_load = min(config.batch_connections_at_load, settings.batch_size)
    ask_for(at_load, serving=False)
    return ConnectionDemand(ask_for, at_load, settings.batch_size)


@dataclass(frozen=True)
class Assignment:
    """What a connection's LOAD message says: the model it is for (the warm process routes by it),
    the frontend's GPU for it and MMS's batch size."""

    model: str
    gpu: int | None
    batch_size: int

    @classmethod
    def from_load_message(cls, message: dict[str, Any]) -> Assignment:
        gpu = message.get("gpu")
        return cls(
            bytes(message["modelName"]).decode(),  # mms.protocol reads it as a bytearray
            None if gpu is None else int(gpu),
            max(1, int(message.get("batchSize") or 1)),
        )


def read_assignment(connection: socket.socket, timeout: float) -> Assignment | None:
    """Reads a frontend connection's first message, its LOAD (the model and the GPU the frontend
    assigned it); None, with the connection closed and the cause logged, when something else or
    nothing arrives within ``timeout``."""
    try:
        connection.settimeout(timeout)
        command, message = retrieve_msg(connection)
        connection.settimeout(None)
        if command != LOAD_MSG:
            raise ValueError(f"expected a LOAD message first, got {command!r}")
    except (ValueError, OSError) as exc:
        logger.warning("dropped a frontend connection: %s", exc)
        connection.close()
        return None
    return Assignment.from_load_message(message)


def device_of(assignment: Assignment, visible_devices: str | None) -> str | None:
    """The card a connection's device names (two frontend ids can name one card within an outer
    ``CUDA_VISIBLE_DEVICES``); None for the CPU."""
    return None if assignment.gpu is None else devices.visible_gpu(assignment.gpu, visible_devices)


def answer_load(connection: socket.socket, spec: ModelSpec) -> None:
    """A connection's first answer, once its model is loaded here: MMS's worker is ready."""
    connection.sendall(
        create_load_model_response(200, f"loaded model {spec.name}. [PID]:{os.getpid()}")
    )


def answer_message(
    connection: socket.socket,
    loaded: LoadedModel,
    running: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    demand: ConnectionDemand | None = None,
) -> None:
    """Reads one inference message and answers it. Raises ``ValueError`` or ``OSError`` when the
    frontend has disconnected (a normal end: ``mms.protocol`` raises ValueError for a closed
    socket). ``running`` brackets the handling (a device host marks whose code runs); a batching
    model's ``demand`` counts its busy connections."""
    command, message = retrieve_msg(connection)
    if command != b"I":
        raise ValueError(f"unexpected command {command!r} after LOAD")
    started = time.monotonic()
    with demand.answering() if demand else contextlib.nullcontext():
        with running():
            context, response = _answer(loaded, message)
        # Counted before the answer leaves (microseconds): a host killed once a client has its
        # answer, or an UNLOAD right after it, loses no count.
        metrics.record_requests(
            functools.partial(_statuses, context, response), time.monotonic() - started
        )
        connection.sendall(response)


class Turns:
    """A device host's connections: each idle one waits in one epoll set; a worker thread waiting on
    the set takes a connection whose message arrived, runs ``turn(connection)``, and waits again,
    until a turn returns False (the connection has ended: it is closed here). One turn of a
    connection at a time (``EPOLLONESHOT``). A worker that takes a turn makes another when none
    would be left waiting, and one of more than ``SPARE_WORKERS`` waiting ends after
    ``idle_seconds``: threads follow the requests in flight, and a host of a thousand idle models
    runs two."""

    def __init__(self, name: str, idle_seconds: float = WORKER_IDLE_SECONDS) -> None:
        self._name = name
        self._idle_seconds = idle_seconds
        self._epoll = select.epoll()
        self._turns: dict[int, tuple[socket.socket, Callable[[socket.socket], bool]]] = {}
        self._armed: set[int] = (
            set()
        )  # registered with the epoll set (ONESHOT: re-armed after each turn)
        self._lock = threading.Lock()
        self._running: set[int] = set()  # connections in a turn
        self._released = threading.Condition(self._lock)  # a turn of one being released ended
        self._waiting = 0  # workers waiting on the epoll set
        self.workers = 0
        for _ in range(SPARE_WORKERS):
            self._add_worker()

    @property
    def connections(self) -> int:
        return len(self._turns)

    def add(self, connection: socket.socket, turn: Callable[[socket.socket], bool]) -> None:
        """Takes a connection (its LOAD answered): a turn each time a message arrives."""
        fd = connection.fileno()
        with self._lock:
            self._turns[fd] = (connection, turn)
            if self._arm(fd):
                return
            self._forget(fd)
        connection.close()

    def release(self, connection: socket.socket) -> bool:
        """Takes the connection out between two turns (one running ends first), open, for another
        process to serve: a message that arrives meanwhile stays in the socket for it. False if it
        had ended (closed here). The caller keeps the socket open while this process lives: a
        worker woken for it just before is then never handed a new connection under its number."""
        fd = connection.fileno()
        with self._lock:
            if self._turns.pop(fd, None) is None:  # no turn of it starts from now on
                return False
            self._released.wait_for(lambda: fd not in self._running)
            self._forget(fd)
        return True

    def _add_worker(self) -> None:
        with self._lock:
            self.workers += 1
            self._waiting += 1
        threading.Thread(target=self._work, name=f"{self._name}-turns", daemon=True).start()

    def _work(self) -> None:
        while True:
            events = self._epoll.poll(self._idle_seconds, 1)
            with self._lock:
                if not events and self._waiting > SPARE_WORKERS:
                    self._waiting -= 1
                    self.workers -= 1
                    return
                if not events:
                    continue
                self._waiting -= 1
                last = self._waiting == 0
            if last:  # another waits while this one answers: a long turn holds no other back
                self._add_worker()
            self._take_turn(events[0][0])
            with self._lock:
                self._waiting += 1

    def _take_turn(self, fd: int) -> None:
        """A turn of the connection whose message arrived. Its own frame: nothing of the turn (its
        model, through ``turn``) stays with the worker while it waits for the next (a worker held
        the last model it served after that model's UNLOAD)."""
        with self._lock:
            taken = self._turns.get(fd)  # None: released since its message woke this worker
            if taken is None:
                return
            self._running.add(fd)
        connection, turn = taken
        ended = not self._run_turn(connection, turn)
        with self._lock:  # what follows the turn, or its release: one or the other, never both
            self._running.discard(fd)
            self._released.notify_all()
            if fd not in self._turns or (not ended and self._arm(fd)):
                return  # released (the releaser's now), or waiting for its next message
            self._forget(fd)
        connection.close()

    @staticmethod
    def _run_turn(connection: socket.socket, turn: Callable[[socket.socket], bool]) -> bool:
        try:
            return turn(connection)
        except Exception:  # noqa: BLE001 - a turn that fails ends its connection, never the worker
            logger.exception("a frontend connection's turn failed: it is closed")
            return False

    def _arm(self, fd: int) -> bool:
        """The connection waits for its next message; False if it cannot (closed under us)."""
        events = select.EPOLLIN | select.EPOLLONESHOT
        try:
            if fd in self._armed:
                self._epoll.modify(fd, events)
            else:
                self._epoll.register(fd, events)
                self._armed.add(fd)
        except OSError as exc:
            logger.debug("a frontend connection could not wait for its next message: %s", exc)
            return False
        return True

    def _forget(self, fd: int) -> None:
        """The connection leaves the set (called with the lock held)."""
        if fd in self._armed:
            self._armed.discard(fd)
            with contextlib.suppress(OSError):  # closed under us: the epoll set let go of it then
                self._epoll.unregister(fd)
        self._turns.pop(fd, None)


def _answer(loaded: LoadedModel, message: list[dict[str, Any]]) -> tuple[Any, bytes]:
    """MMS's own ``Service.predict`` for one message (its metrics, its statuses for errors outside
    the handler), on a copy of the service whose context is the message's own: the connections'
    threads answer at once. Returns that context, which holds each request's status, with the
    answer."""
    service = copy.copy(loaded.service)
    # Service keeps its context in ``_context`` (MMS 1.1.11, pinned); the copy shares
    # system_properties, not requests.
    service._context = WireContext.copy_of(loaded.service.context)
    response = service.predict(message)
    if service.context.metrics is not None and SERVICE_LOG.isEnabledFor(logging.INFO):
        # off in a device host
        emit_metrics(service.context.metrics.store)
    return service.context, with_first_status_whole(response)


# MMS 1.1.11's frontend decodes an answer as the pieces of its reads arrive, and two fields it reads
# without checking that they have arrived: a request's header map and its 4-byte status. A piece
# cut inside either is taken as a corrupt answer: the worker connection dies, and each request of
# the message answers 500 "Worker died.". The pieces are sized by the answers before (netty's
# adaptive buffer, a multiple of 16 bytes), so a model's large answer after many small ones met it
# (docs/troubleshooting.md).
READ_SIZE_MULTIPLE = 16
OK_CODE = (200).to_bytes(4, "big")


class WireContext(Context):  # type: ignore[misc]
    """MMS's context for one message, whose answers carry each request's Content-Type in the field
    of MMS's wire format that holds it, and not also in the header map that follows (above). The
    frontend sets the HTTP Content-Type from that field alone, so clients see the same headers."""

    @staticmethod
    def copy_of(context: Context) -> WireContext:
        """A copy of the model's context for one message (``Service.predict`` sets its requests)."""
        copied = WireContext.__new__(WireContext)
        copied.__dict__.update(vars(context))
        return copied

    def get_response_content_type(self, idx: int) -> Any:
        headers = super().get_response_headers(idx)
        if "content-type" in headers:  # where the answer's own is set (and checked)
            return headers["content-type"]
        return next((v for k, v in headers.items() if k.lower() == "content-type"), None)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        headers = super().get_response_headers(idx)
        return {key: value for key, value in headers.items() if key.lower() != "content-type"}


def with_first_status_whole(answer: bytes | bytearray) -> bytes:
    """A 200 ``answer`` with its first request's status where no piece of a read can end inside it
    (above): its leading message, which the frontend does not use in a 200, gets up to 4 spaces.
    The status of a later request of an MMS batch stays where the answers before it put it. Copies
    ``answer`` once either way (``Service.predict`` builds it in a bytearray)."""
    if answer[:4] != OK_CODE:
        return bytes(answer)
    message_end = 8 + int.from_bytes(answer[4:8], "big")
    if answer[message_end : message_end + 4] == b"\xff\xff\xff\xff":  # no request
        return bytes(answer)
    content_type_at = message_end + 4 + int.from_bytes(answer[message_end : message_end + 4], "big")
    status_at = (
        content_type_at + 4 + int.from_bytes(answer[content_type_at : content_type_at + 4], "big")
    )
    # a piece ends at a multiple of 16: the 4 bytes must not start at one, nor run past one
    padding = {0: 1, 13: 4, 14: 3, 15: 2}.get(status_at % READ_SIZE_MULTIPLE, 0)
    if padding == 0:
        return bytes(answer)
    message = bytes(answer[8:message_end]) + b" " * padding
    rest = memoryview(answer)[message_end:]
    return b"".join((OK_CODE, len(message).to_bytes(4, "big"), message, rest))


def _statuses(context: Any, response: bytes) -> list[int]:
    """Each request's HTTP status: the response's own code when ``Service.predict`` failed them all
    (it leads the response), else what the handler set for each."""
    requests = context.request_ids or {}
    code = int.from_bytes(response[:4], "big", signed=True)
    if code != 200:
        return [code] * len(requests)
    return [context.get_response_status(idx)[0] or 200 for idx in requests]
