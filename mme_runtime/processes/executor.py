"""An executor: the one process that serves a model on one device (a GPU, or the CPU).

The backend server forks it for the first frontend connection assigned to its device, and hands it that
connection and every later one for the same device over a control socket (``hand_over``). The executor binds its
GPU before its first CUDA call, places the model there once, and serves each connection from a thread of its own:
the connection's thread reads MMS's messages, runs ``input_fn``/``output_fn`` for its requests, and waits while the
model's batcher runs their ``predict_fn``, one forward pass at a time, together with other connections' requests.
So worker count buys concurrency, not copies of the weights.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from mms.protocol.otf_message_handler import LOAD_MSG, retrieve_msg

from mme_runtime.base import devices
from mme_runtime.base.config import Config
from mme_runtime.base.logs import configure_logging
from mme_runtime.models.loading import (
    WORKER_BOOT_ERROR,
    LoadedModel,
    LoadFailure,
    ModelSpec,
    check_memory,
    die_with_parent,
    fail_load,
    load_model,
    refuse_load,
)
from mme_runtime.operations import metrics
from mme_runtime.operations.scaler import request_workers
from mme_runtime.processes import fork_safety
from mme_runtime.serving.connection import serve_connection
from mme_runtime.serving.connection_demand import ConnectionDemand

# What an executor writes on its control socket once it has loaded the model: the server then counts it as served.
READY = b"READY"

logger = logging.getLogger(__name__)

CONTROL_MESSAGE_BYTES = 4096
MAX_FDS_PER_RECEIVE = 32
# How long an executor whose load failed waits for the connection it must answer before it exits.
REFUSE_WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class Assignment:
    """What a connection's LOAD message told the server: the frontend's GPU for it and MMS's batch size."""

    gpu: int | None
    batch_size: int

    @classmethod
    def from_load_message(cls, message: dict[str, Any]) -> Assignment:
        gpu = message.get("gpu")
        return cls(None if gpu is None else int(gpu), max(1, int(message.get("batchSize") or 1)))


def read_assignment(connection: socket.socket, model_name: str, timeout: float) -> Assignment | None:
    """Reads a frontend connection's first message, its LOAD (the GPU the frontend assigned it); None, with the
    connection closed and the cause logged, when something else or nothing arrives within ``timeout``."""
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


def hand_over(control: socket.socket, connection: socket.socket, assignment: Assignment) -> None:
    """Passes a frontend connection whose LOAD message the server has read to the device's executor.

    One ``sendmsg`` per connection: a line of JSON carrying the descriptor. The control socket is a stream (its
    buffer holds hundreds of these, so the server never waits on an executor that is still loading), and Linux
    never returns two descriptor-carrying messages from one ``recvmsg``; ``_receive`` pairs lines with descriptors
    all the same."""
    header = json.dumps({"gpu": assignment.gpu, "batch_size": assignment.batch_size}) + "\n"
    socket.send_fds(control, [header.encode()], [connection.fileno()])


def _receive(control: socket.socket) -> list[tuple[socket.socket, Assignment]] | None:
    """The connections the server handed over since the last call, or None once the server is gone."""
    try:
        data, fds, _, _ = socket.recv_fds(control, CONTROL_MESSAGE_BYTES, MAX_FDS_PER_RECEIVE)
    except OSError:
        return None
    if not data:
        return None
    received = []
    for line, fd in zip(data.decode().splitlines(), fds, strict=True):
        values = json.loads(line)
        connection = socket.socket(fileno=fd)
        connection.setblocking(True)
        received.append((connection, Assignment(values["gpu"], values["batch_size"])))
    return received


def serve_executor(
    control: socket.socket,
    spec: ModelSpec,
    config: Config,
    preloaded: LoadedModel | None,
    assignment: Assignment,
    threads: int,
    load_started: float | None = None,
    inherited_fds: tuple[int, ...] = (),
) -> None:
    """The executor's life: bind the device, place the model, then serve every connection handed over.

    ``load_started`` (the LOAD's start, for the model's first executor) asks it to report the LOAD's outcome."""
    die_with_parent(signal.SIGKILL)
    for fd in inherited_fds:
        os.close(fd)
    fork_safety.set_threads(threads)  # the server runs single-threaded (fork_safety); before model_fn may set its own
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    configure_logging(config.log_level)
    metrics.start_model(config, spec.name, os.getppid())  # forked: already writing; spawned: starts here
    try:
        loaded = _load_in_executor(spec, config, preloaded, assignment)
    except LoadFailure as failure:
        if load_started is not None:
            metrics.record_load(False, time.time() - load_started)
        # Answer the connections that asked for this device with the cause; later ones get a fresh executor.
        control.settimeout(REFUSE_WAIT_SECONDS)
        for connection, _ in _receive(control) or []:
            refuse_load(connection, failure, spec, config)
        sys.stdout.flush()
        os._exit(WORKER_BOOT_ERROR)
    demand = start_batching(spec, config, loaded)
    if load_started is not None:
        metrics.record_load(True, time.time() - load_started)
    if assignment.gpu is not None and devices.cuda_initialized():
        metrics.watch_gpu_memory(str(assignment.gpu))
    with contextlib.suppress(OSError):  # the server is gone: the loop below ends at once
        control.sendall(READY)
    logger.info("model=%s executor pid=%d gpu=%s serving", spec.name, os.getpid(), assignment.gpu)
    while (received := _receive(control)) is not None:
        for connection, _ in received:
            serve = functools.partial(serve_connection, connection, spec, loaded, demand=demand)
            threading.Thread(target=serve, daemon=True).start()
    logger.info("model=%s executor pid=%d: server gone, stopping", spec.name, os.getpid())
    sys.stdout.flush()
    os._exit(0)


def _load_in_executor(
    spec: ModelSpec, config: Config, preloaded: LoadedModel | None, assignment: Assignment
) -> LoadedModel:
    gpu = assignment.gpu
    ordinal = devices.bind_gpu(gpu, config.cuda_visible_devices)
    check_memory(spec, config, gpu, host=preloaded is None)
    if preloaded is None:
        return load_model(spec, assignment.batch_size, phase="executor", gpu=gpu, cuda_ordinal=ordinal)
    properties = preloaded.service.context.system_properties
    devices.record_gpu(properties, gpu, ordinal)
    properties["batch_size"] = assignment.batch_size
    try:
        if hasattr(preloaded.module, "attach"):
            preloaded.module.attach(preloaded.service.context)
    except Exception as exc:  # boundary: this device's LOAD fails with the cause
        raise fail_load(spec, gpu, exc) from exc
    return preloaded


def start_batching(spec: ModelSpec, config: Config, loaded: LoadedModel) -> ConnectionDemand | None:
    """From here on the handler is called from many threads; our handler then batches their forward passes. A
    batching model asks for the frontend connections that fill its batches as it comes to need them: the returned
    ``ConnectionDemand`` watches its connections (``serving/connection_demand.py``)."""
    if not hasattr(loaded.module, "start_batcher"):
        return None  # another handler (MMS's ``module:function``): it is called from the connections' threads as it is
    settings = loaded.module.start_batcher()
    if not settings.batching or settings.source == "LOAD":
        return None  # MMS's own batching (LOAD's batch_size) fills its batches itself

    def ask_for(per_device: int, serving: bool = True) -> None:
        try:
            request_workers(config.runtime_dir, spec.name, per_device, serving)
        except OSError as exc:
            logger.warning("model=%s could not ask for %d workers per device: %s", spec.name, per_device, exc)

    at_load = min(config.batch_connections_at_load, settings.batch_size)
    ask_for(at_load, serving=False)
    return ConnectionDemand(ask_for, at_load, settings.batch_size)
