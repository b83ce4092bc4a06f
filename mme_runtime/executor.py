"""An executor: the one process that serves a model on one device (a GPU, or the CPU).

The backend server forks it for the first frontend connection assigned to its device, and hands it that
connection and every later one for the same device over a control socket (``hand_over``). The executor binds its
GPU before its first CUDA call, places the model there once, and serves each connection from a thread of its own:
the connection's thread reads MMS's messages, runs ``input_fn``/``output_fn`` for its requests, and waits while the
model's batcher runs their ``predict_fn``, one forward pass at a time, together with other connections' requests.
So worker count buys concurrency, not copies of the weights.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

from mms.protocol.otf_message_handler import create_load_model_response, create_predict_response, retrieve_msg
from mms.service import Service

from mme_runtime import devices, fork_safety
from mme_runtime.config import Config
from mme_runtime.loading import (
    WORKER_BOOT_ERROR,
    LoadedModel,
    LoadFailure,
    ModelSpec,
    check_memory,
    die_with_parent,
    load_model,
    refuse_load,
)
from mme_runtime.logs import configure_logging
from mme_runtime.scaler import request_workers

logger = logging.getLogger(__name__)

CONTROL_MESSAGE_BYTES = 4096
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


def hand_over(control: socket.socket, connection: socket.socket, assignment: Assignment) -> None:
    """Passes a frontend connection whose LOAD message the server has read to the device's executor."""
    header = json.dumps({"gpu": assignment.gpu, "batch_size": assignment.batch_size}).encode()
    socket.send_fds(control, [header], [connection.fileno()])


def _receive(control: socket.socket) -> tuple[socket.socket, Assignment] | None:
    """The next connection the server hands over, or None once the server is gone."""
    try:
        header, fds, _, _ = socket.recv_fds(control, CONTROL_MESSAGE_BYTES, 1)
    except OSError:
        return None
    if not fds:
        return None
    connection = socket.socket(fileno=fds[0])
    connection.setblocking(True)
    values = json.loads(header)
    return connection, Assignment(values["gpu"], values["batch_size"])


def serve_executor(
    control: socket.socket,
    spec: ModelSpec,
    config: Config,
    preloaded: LoadedModel | None,
    assignment: Assignment,
    threads: int,
    inherited_fds: tuple[int, ...] = (),
) -> None:
    """The executor's life: bind the device, place the model, then serve every connection handed over."""
    die_with_parent(signal.SIGKILL)
    for fd in inherited_fds:
        os.close(fd)
    fork_safety.set_threads(threads)  # the server runs single-threaded (fork_safety); before model_fn may set its own
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    configure_logging(config.log_level)
    try:
        loaded = _load_in_executor(spec, config, preloaded, assignment)
    except LoadFailure as failure:
        # Answer the connection that asked for this device with the cause; later ones get a fresh executor.
        control.settimeout(REFUSE_WAIT_SECONDS)
        received = _receive(control)
        if received is not None:
            refuse_load(received[0], failure, spec, config)
        sys.stdout.flush()
        os._exit(WORKER_BOOT_ERROR)
    settings = loaded.module.start_batcher()
    if settings.batching and settings.source != "LOAD":
        # Enough frontend connections to fill a batch; MMS's own batching (LOAD's batch_size) fills them itself.
        request_workers(config.runtime_dir, spec.name, per_device=settings.batch_size)
    logger.info("model=%s executor pid=%d gpu=%s serving", spec.name, os.getpid(), assignment.gpu)
    while (received := _receive(control)) is not None:
        connection, _ = received
        threading.Thread(target=_serve_connection, args=(connection, spec, loaded), daemon=True).start()
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
        preloaded.module.attach(preloaded.service.context)
    except Exception as exc:  # boundary: this device's LOAD fails with the cause
        status = int(getattr(exc, "status_code", 500))
        raise LoadFailure(status, f"model {spec.name}: {getattr(exc, 'message', exc)}") from exc
    return preloaded


def _serve_connection(connection: socket.socket, spec: ModelSpec, loaded: LoadedModel) -> None:
    """One frontend connection: its LOAD answered, then its inference messages, one at a time, until it closes."""
    try:
        connection.sendall(create_load_model_response(200, f"loaded model {spec.name}. [PID]:{os.getpid()}"))
        while True:
            command, message = retrieve_msg(connection)
            if command != b"I":
                raise ValueError(f"unexpected command {command!r} after LOAD")
            connection.sendall(_answer(loaded, message))
    except (ValueError, OSError) as exc:  # the frontend disconnected (mms.protocol raises ValueError): a normal end
        logger.debug("model=%s connection closed: %s", spec.name, exc)
    finally:
        connection.close()


def _answer(loaded: LoadedModel, message: list[dict[str, Any]]) -> bytes:
    """MMS's ``Service.predict`` for one message, with a context of the message's own: connections run at once."""
    headers, inputs, request_ids = Service.retrieve_data_for_inference(message)
    context = copy.copy(loaded.service.context)  # shares the model's system_properties, not its requests
    context.request_ids = request_ids
    context.request_processor = headers
    context.metrics = None
    try:
        bodies = loaded.module.handle(inputs, context)
    except Exception:  # the handler answers per request; this is a last guard, as in MMS's own Service
        logger.exception("model=%s request failed outside the handler", loaded.service.context.model_name)
        return bytes(create_predict_response(None, request_ids, "Prediction failed", 503))
    return bytes(create_predict_response(bodies, request_ids, "Prediction success", 200, context=context))
