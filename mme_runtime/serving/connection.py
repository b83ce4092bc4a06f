"""One frontend connection, from the socket to the handler and back: its first message (the LOAD,
which names the GPU the frontend assigned it) read by the warm process, which routes the connection
to its device's host; there its LOAD is answered, then each inference message read with MMS's
protocol (``mms.protocol``), answered by MMS's ``Service`` (which calls ``handler_service.handle``
and so the model's ``ServedModel``, ``served_model.py``), and written back, with the request metrics
recorded after.

A device host runs it on a thread per connection: every connection of a model answers at once. A
batching model's ``ConnectionDemand`` counts its busy connections and asks for more once they are
all busy (MMS sends one request per connection at a time, so a batch of ``batch_size`` needs that
many).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from mms.protocol.otf_message_handler import LOAD_MSG, create_load_model_response, retrieve_msg
from mms.service import emit_metrics

from mme_runtime.base import devices
from mme_runtime.models.loading import LoadedModel, ModelSpec
from mme_runtime.operations import metrics


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

    @contextmanager
    def connection(self) -> Iterator[None]:
        with self._lock:
            self._open += 1
        try:
            yield
        finally:
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
SERVICE_LOG = logging.getLogger("mms.service")  # where emit_metrics writes its per-request lines


@dataclass(frozen=True)
class Assignment:
    """What a connection's LOAD message says: the frontend's GPU for it and MMS's batch size."""

    gpu: int | None
    batch_size: int

    @classmethod
    def from_load_message(cls, message: dict[str, Any]) -> Assignment:
        gpu = message.get("gpu")
        return cls(None if gpu is None else int(gpu), max(1, int(message.get("batchSize") or 1)))


def read_assignment(
    connection: socket.socket, model_name: str, timeout: float
) -> Assignment | None:
    """Reads a frontend connection's first message, its LOAD (the GPU the frontend assigned it);
    None, with the connection closed and the cause logged, when something else or nothing arrives
    within ``timeout``."""
    try:
        connection.settimeout(timeout)
        command, message = retrieve_msg(connection)
        connection.settimeout(None)
        if command != LOAD_MSG:
            raise ValueError(f"expected a LOAD message first, got {command!r}")
    except (ValueError, OSError) as exc:
        logger.warning("model=%s dropped a frontend connection: %s", model_name, exc)
        connection.close()
        return None
    return Assignment.from_load_message(message)


def device_of(assignment: Assignment, visible_devices: str | None) -> str | None:
    """The card a connection's device names (two frontend ids can name one card within an outer
    ``CUDA_VISIBLE_DEVICES``); None for the CPU."""
    return None if assignment.gpu is None else devices.visible_gpu(assignment.gpu, visible_devices)


def serve_connection(
    connection: socket.socket,
    spec: ModelSpec,
    loaded: LoadedModel,
    running: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    demand: ConnectionDemand | None = None,
) -> None:
    """One frontend connection: its LOAD answered, then its inference messages, one at a time, until
    it closes. ``running`` brackets each message's handling (a device host marks whose code runs); a
    batching model's ``demand`` counts its busy connections, to open more when they are all busy
    (``ConnectionDemand``, below)."""
    try:
        with demand.connection() if demand else contextlib.nullcontext():
            connection.sendall(
                create_load_model_response(200, f"loaded model {spec.name}. [PID]:{os.getpid()}")
            )
            _answer_messages(connection, loaded, running, demand)
    except (ValueError, OSError) as exc:
        # the frontend disconnected (mms.protocol raises ValueError): a normal end
        logger.debug("model=%s connection closed: %s", spec.name, exc)
    finally:
        connection.close()


def _answer_messages(
    connection: socket.socket,
    loaded: LoadedModel,
    running: Callable[[], AbstractContextManager[Any]],
    demand: ConnectionDemand | None,
) -> None:
    while True:
        command, message = retrieve_msg(connection)
        if command != b"I":
            raise ValueError(f"unexpected command {command!r} after LOAD")
        started = time.monotonic()
        with demand.answering() if demand else contextlib.nullcontext():
            with running():
                context, response = _answer(loaded, message)
            connection.sendall(response)
        # Recorded once the answer is on its way: the caller does not wait for its metrics.
        metrics.record_requests(
            functools.partial(_statuses, context, response), time.monotonic() - started
        )


def _answer(loaded: LoadedModel, message: list[dict[str, Any]]) -> tuple[Any, bytes]:
    """MMS's own ``Service.predict`` for one message (its metrics, its statuses for errors outside
    the handler), on a copy of the service whose context is the message's own: the connections'
    threads answer at once. Returns that context, which holds each request's status, with the
    answer."""
    service = copy.copy(loaded.service)
    # Service keeps its context in ``_context`` (MMS 1.1.11, pinned); the copy shares
    # system_properties, not requests.
    service._context = copy.copy(loaded.service.context)
    response = service.predict(message)
    if service.context.metrics is not None and SERVICE_LOG.isEnabledFor(logging.INFO):
        # off in a device host
        emit_metrics(service.context.metrics.store)
    return service.context, bytes(response)


def _statuses(context: Any, response: bytes) -> list[int]:
    """Each request's HTTP status: the response's own code when ``Service.predict`` failed them all
    (it leads the response), else what the handler set for each."""
    requests = context.request_ids or {}
    code = int.from_bytes(response[:4], "big", signed=True)
    if code != 200:
        return [code] * len(requests)
    return [context.get_response_status(idx)[0] or 200 for idx in requests]
