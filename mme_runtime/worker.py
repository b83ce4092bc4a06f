"""A worker: forked (or spawned) by the backend server for one frontend connection, it binds its GPU, places the
model there, and answers the frontend over MMS's protocol until it disconnects.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

from mms.protocol.otf_message_handler import create_load_model_response, retrieve_msg
from mms.service import emit_metrics

from mme_runtime import devices, fork_safety
from mme_runtime.config import Config
from mme_runtime.janitor import mark_failed_load
from mme_runtime.loading import LoadedModel, LoadFailure, ModelSpec, check_memory, die_with_parent, load_model
from mme_runtime.logs import configure_logging

logger = logging.getLogger(__name__)

WORKER_BOOT_ERROR = 3
LOG_DRAIN_SECONDS = 0.3
# LOAD failures answered with their own status: 403 (outside the model root) and 507 (SageMaker evicts and
# retries). A bad name is not among them: the janitor could not address a name holding "/" to clean it up.
REPLIED_STATUSES = frozenset({403, 507})


def serve_worker(
    connection: socket.socket,
    spec: ModelSpec,
    config: Config,
    preloaded: LoadedModel | None,
    failure: LoadFailure | None,
    threads: int,
    inherited_fds: tuple[int, ...] = (),
) -> None:
    """A worker: bind the assigned GPU, place the model there, then answer the frontend until it disconnects."""
    die_with_parent(signal.SIGKILL)
    for fd in inherited_fds:
        os.close(fd)
    fork_safety.set_threads(threads)  # the server runs single-threaded (fork_safety); before model_fn may set its own
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    configure_logging(config.log_level)
    status = 0
    try:
        command, message = retrieve_msg(connection)
        if command != b"L":
            raise ValueError(f"expected a LOAD message first, got {command!r}")
        gpu = message.get("gpu")
        batch_size = int(message.get("batchSize") or 1)
        loaded = _load_in_worker(spec, config, preloaded, failure, gpu, batch_size)
        connection.sendall(create_load_model_response(200, f"loaded model {spec.name}. [PID]:{os.getpid()}"))
        _serve(connection, loaded)
    except LoadFailure as load_failure:
        # The cause is in the log: give the frontend's log reader a moment to take it before our answer or
        # disconnect makes it stop reading.
        sys.stdout.flush()
        time.sleep(LOG_DRAIN_SECONDS)
        if load_failure.status in REPLIED_STATUSES:
            # Statuses the platform acts on are answered; MMS then leaves the model half-registered, which the
            # entrypoint's janitor unregisters (mme_runtime/janitor.py).
            mark_failed_load(config.runtime_dir, spec.name, load_failure.status)
            connection.sendall(create_load_model_response(load_failure.status, load_failure.message))
        # Otherwise close without a reply: MMS fails the LOAD with 500 and unregisters the model cleanly.
        status = WORKER_BOOT_ERROR
    except ValueError as exc:  # the frontend disconnected (mms.protocol raises ValueError): a normal end
        logger.info("model=%s worker pid=%d: %s", spec.name, os.getpid(), exc)
    finally:
        connection.close()
        sys.stdout.flush()
    os._exit(status)


def _load_in_worker(
    spec: ModelSpec,
    config: Config,
    preloaded: LoadedModel | None,
    failure: LoadFailure | None,
    gpu: int | None,
    batch_size: int,
) -> LoadedModel:
    if failure is not None:
        raise failure
    ordinal = devices.bind_gpu(gpu, config.cuda_visible_devices)
    check_memory(spec, config, gpu, host=preloaded is None)
    if preloaded is None:
        return load_model(spec, batch_size, phase="worker", gpu=gpu, cuda_ordinal=ordinal)
    properties = preloaded.service.context.system_properties
    devices.record_gpu(properties, gpu, ordinal)
    properties["batch_size"] = batch_size
    try:
        if hasattr(preloaded.module, "attach"):
            preloaded.module.attach(preloaded.service.context)
    except Exception as exc:  # boundary: this worker's LOAD fails with the cause
        status = int(getattr(exc, "status_code", 500))
        raise LoadFailure(status, f"model {spec.name}: {getattr(exc, 'message', exc)}") from exc
    return preloaded


def _serve(connection: socket.socket, loaded: LoadedModel) -> None:
    service = loaded.service
    while True:
        command, message = retrieve_msg(connection)
        if command != b"I":
            raise ValueError(f"unexpected command {command!r} after LOAD")
        connection.sendall(service.predict(message))
        metrics = service.context.metrics
        if metrics is not None:
            emit_metrics(metrics.store)
