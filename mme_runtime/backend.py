"""The backend server MMS starts for each model, speaking MMS's own socket protocol (``mms.protocol``).

With preload on, it runs ``model_fn`` once, to host memory, in this CUDA-free process, then forks one worker per
frontend connection; each worker binds its assigned GPU before its first CUDA call. Before every fork it checks
that CUDA is not initialised here; a ``model_fn`` that initialised it makes the server re-execute itself with
preload off for this model, so every worker loads for itself instead of dying after fork.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import multiprocessing
import os
import platform
import re
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

from mms.arg_parser import ArgParser
from mms.protocol.otf_message_handler import create_load_model_response, retrieve_msg
from mms.service import Service, emit_metrics

from mme_runtime import devices, memory
from mme_runtime.config import INHERITED_LIFELINE_FD, INHERITED_LISTEN_FD, INHERITED_PENDING_FD, Config
from mme_runtime.errors import InsufficientMemory
from mme_runtime.janitor import mark_failed_load
from mme_runtime.logs import configure_logging

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
ACCEPT_TIMEOUT_SECONDS = 1.0
CHILD_STOP_SECONDS = 5.0
WORKER_BOOT_ERROR = 3
LOG_DRAIN_SECONDS = 0.3
# LOAD failures answered with their own status: 403 (outside the model root) and 507 (SageMaker evicts and
# retries). A bad name is not among them: the janitor could not address a name holding "/" to clean it up.
REPLIED_STATUSES = frozenset({403, 507})
# SageMaker's model names are opaque hashes; anything path-like is refused before it reaches a log, a module name
# or a file name.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
# The frontend reads these exact lines on stdout to learn our pid and that we listen (WorkerLifeCycle).
STARTED_LINE = "MMS worker started."


@dataclass(frozen=True)
class ModelSpec:
    """What MMS tells the server about its model (command line and first LOAD message)."""

    name: str
    model_dir: str
    handler: str
    tmp_dir: str


@dataclass
class LoadedModel:
    """A model's handler module and MMS service, as loaded in the server (preload) or in a worker."""

    module: ModuleType
    service: Service


class LoadFailure(Exception):
    """Loading failed: the status and message every worker's LOAD reply carries."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def main(lifeline: socket.socket | None = None) -> int:
    """Runs the server. ``lifeline`` is the warm-start stub's connection: when it closes, MMS is done with us."""
    args = ArgParser.model_service_worker_args().parse_args()
    config = Config.from_process_env()
    configure_logging(config.log_level)
    _die_with_parent(signal.SIGTERM)
    if lifeline is None and config.inherited_lifeline_fd is not None:
        lifeline = socket.socket(fileno=config.inherited_lifeline_fd)
        lifeline.set_inheritable(False)
    spec = ModelSpec(args.model_name, args.model_path, args.handler, args.tmp_dir)
    server = BackendServer(spec, config, _listener(args, config), lifeline)
    return server.run()


class BackendServer:
    """Accepts one connection per MMS worker and forks a worker process to serve it (the pre-fork pattern)."""

    def __init__(
        self, spec: ModelSpec, config: Config, listener: socket.socket, lifeline: socket.socket | None = None
    ) -> None:
        self.spec = spec
        self.config = config
        self.listener = listener
        self.lifeline = lifeline
        # A spawned worker starts from nothing, so preloading only pays with fork.
        self.preload = config.preload_model_gpu is not False and config.start_method == "fork"
        # Explicit, never the platform default (Python 3.14 changed it on Linux). Typed Any: typeshed's
        # overloads want a literal, not our Literal union.
        self.context: Any = multiprocessing.get_context(config.start_method)
        self.loaded: LoadedModel | None = None
        self.load_failure: LoadFailure | None = None
        self.workers: dict[int, multiprocessing.process.BaseProcess] = {}
        self._pending: list[int] = []

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        self.load_failure = check_location(self.spec, self.config)
        if self.config.inherited_listen_fd is None:
            print(f"[PID] {os.getpid()}", flush=True)
            print(STARTED_LINE, flush=True)
        logger.info(
            "backend server model=%s preload=%s start_method=%s python=%s",
            self.spec.name,
            self.preload,
            self.config.start_method,
            platform.python_version(),
        )
        try:
            if self.config.inherited_pending_fd is not None:
                self._start_worker(socket.socket(fileno=self.config.inherited_pending_fd))
            while not self._pending:
                self._reap()
                connection = self._accept()
                if connection is None:
                    continue
                # Preload once a worker is connected: MMS 1.1.11 hangs the LOAD for good if the server dies
                # (user code can os._exit or crash at import) before any of its workers got through.
                if self.preload and self.loaded is None and self.load_failure is None:
                    self._preload(connection)
                self._start_worker(connection)
        finally:
            self._stop_workers()
            self.listener.close()
        return 0

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._pending.append(signum)  # record only; the loop stops within ACCEPT_TIMEOUT_SECONDS

    def _preload(self, pending: socket.socket) -> None:
        started = time.monotonic()
        try:
            check_memory(self.spec, self.config, gpu=None)
            self.loaded = load_model(self.spec, gpu=None, batch_size=1, phase="preload")
        except LoadFailure as failure:
            # Every worker that connects answers its LOAD with this, so the frontend fails the LOAD with it.
            self.load_failure = failure
            return
        if devices.cuda_initialized():
            self._fall_back_to_per_worker_loading(
                "model_fn initialised CUDA in the preload server (forked workers could not use it); "
                "load to host memory in model_fn to get a single load",
                pending,
            )
        logger.info("model=%s preloaded seconds=%.2f", self.spec.name, time.monotonic() - started)

    def _fall_back_to_per_worker_loading(self, reason: str, pending: socket.socket) -> None:
        """Re-executes this server with preload off, keeping the listening socket, the connection in hand and
        those still queued."""
        logger.warning("model=%s preload off for this model: %s", self.spec.name, reason)
        sys.stdout.flush()
        self.listener.set_inheritable(True)
        handover = {
            "MME_PRELOAD_MODEL_GPU": "false",
            "MME_WARM_START": "false",  # run the server in this process again, not through the warm process
            INHERITED_LISTEN_FD: str(self.listener.fileno()),
            INHERITED_PENDING_FD: str(pending.fileno()),
        }
        pending.set_inheritable(True)
        if self.lifeline is not None:
            self.lifeline.set_inheritable(True)
            handover[INHERITED_LIFELINE_FD] = str(self.lifeline.fileno())
        env = self.config.child_environment(handover)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    def _accept(self) -> socket.socket | None:
        watched = [self.listener] if self.lifeline is None else [self.listener, self.lifeline]
        try:
            readable, _, _ = select.select(watched, [], [], ACCEPT_TIMEOUT_SECONDS)
        except InterruptedError:
            return None
        if self.lifeline is not None and self.lifeline in readable and not self.lifeline.recv(1):
            # The process MMS started for us is gone (UNLOAD, or MMS stopping): stop with it.
            logger.info("model=%s frontend process gone: stopping", self.spec.name)
            self._pending.append(signal.SIGTERM)
            return None
        if self.listener not in readable:
            return None
        try:
            connection, _ = self.listener.accept()
        except (TimeoutError, BlockingIOError, InterruptedError):
            return None
        connection.setblocking(True)
        return connection

    def _start_worker(self, connection: socket.socket) -> None:
        if self.preload and self.loaded is not None and devices.cuda_initialized():
            # Never fork a worker that would die on its first CUDA call.
            self._fall_back_to_per_worker_loading("CUDA was initialised in the preload server before fork", connection)
        process = self.context.Process(
            target=serve_worker,
            args=(connection, self.spec, self.config, self.loaded, self.load_failure, self._inherited_fds()),
            daemon=False,
        )
        process.start()
        connection.close()
        if process.pid is not None:
            self.workers[process.pid] = process
            logger.info("model=%s worker pid=%d started", self.spec.name, process.pid)

    def _inherited_fds(self) -> tuple[int, ...]:
        """Descriptors a forked worker must close: the listener (a spawned worker inherits nothing)."""
        if self.config.start_method != "fork":
            return ()
        lifeline = () if self.lifeline is None else (self.lifeline.fileno(),)
        return (self.listener.fileno(), *lifeline)

    def _reap(self) -> None:
        for pid, process in list(self.workers.items()):
            if process.exitcode is None:
                continue
            del self.workers[pid]
            code = process.exitcode
            if code < 0:
                hint = " (perhaps out of memory)" if -code == signal.SIGKILL else ""
                logger.warning(
                    "model=%s worker pid=%d killed by %s%s", self.spec.name, pid, signal.Signals(-code).name, hint
                )
            else:
                logger.info("model=%s worker pid=%d exited status=%d", self.spec.name, pid, code)

    def _stop_workers(self) -> None:
        for process in self.workers.values():
            process.terminate()
        deadline = time.monotonic() + CHILD_STOP_SECONDS
        for process in self.workers.values():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join(1.0)
        self.workers.clear()


def check_memory(spec: ModelSpec, config: Config, gpu: int | None, host: bool = True) -> None:
    """507 before loading what will not fit: host memory where the model is loaded, GPU memory where it goes."""
    try:
        if host:
            memory.check_host_memory(Path(spec.model_dir), config.memory_headroom_mb)
        if gpu is not None:
            memory.check_gpu_memory(Path(spec.model_dir), gpu, config.memory_headroom_mb)
    except InsufficientMemory as exc:
        logger.error("model=%s gpu=%s load refused status=507: %s", spec.name, gpu, exc)
        raise LoadFailure(507, f"model {spec.name}: {exc}") from exc


def check_location(spec: ModelSpec, config: Config) -> LoadFailure | None:
    """A model name must be a plain name, and in multi-model mode a LOAD may name only a directory under the model
    root (after resolving links and ``..``); URLs MMS downloaded land in its temp directory and are refused."""
    if not MODEL_NAME.fullmatch(spec.name):
        message = f"model name {spec.name!r} must be letters, digits, '.', '_' or '-' (at most 255), not a path"
        logger.error("load refused: %s", message)
        return LoadFailure(500, message)
    if not config.multi_model or config.allow_any_model_location:
        return None
    model_dir = Path(spec.model_dir).resolve()
    root = config.model_root.resolve()
    if model_dir.is_relative_to(root):
        return None
    message = f"model {spec.name}: {spec.model_dir} is outside the model root {root} (MME_MODEL_ROOT)"
    logger.error("model=%s load refused status=403: %s", spec.name, message)
    return LoadFailure(403, message)


def load_model(spec: ModelSpec, gpu: int | None, batch_size: int, phase: str) -> LoadedModel:
    """Imports the handler and runs its load step (``preload`` on the server, ``attach`` or ``handle`` in a worker)."""
    try:
        module_name, _, function_name = spec.handler.partition(":")
        module = importlib.import_module(Path(module_name).stem)
        entry_point: Callable[..., Any] = getattr(module, function_name or "handle")
        service = Service(spec.name, spec.model_dir, None, entry_point, gpu, batch_size)
        if phase == "preload" and hasattr(module, "preload"):
            module.preload(service.context)
        elif hasattr(module, "attach"):
            module.attach(service.context)
        else:
            entry_point(None, service.context)
    except Exception as exc:  # boundary: the LOAD reply carries the status and cause; the traceback is logged
        status = int(getattr(exc, "status_code", 507 if isinstance(exc, MemoryError) else 500))
        message = str(getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")
        # Status-carrying errors were logged with their traceback where they arose.
        expected = hasattr(exc, "status_code")
        logger.error(
            "model=%s gpu=%s load failed status=%d: %s",
            spec.name,
            gpu,
            status,
            message,
            exc_info=None if expected else exc,
        )
        raise LoadFailure(status, f"model {spec.name}: {message}") from exc
    return LoadedModel(module, service)


def serve_worker(
    connection: socket.socket,
    spec: ModelSpec,
    config: Config,
    preloaded: LoadedModel | None,
    failure: LoadFailure | None,
    inherited_fds: tuple[int, ...] = (),
) -> None:
    """A worker: bind the assigned GPU, place the model there, then answer the frontend until it disconnects."""
    _die_with_parent(signal.SIGKILL)
    for fd in inherited_fds:
        os.close(fd)
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
    devices.restrict_to_gpu(gpu, config.cuda_visible_devices)
    check_memory(spec, config, gpu, host=preloaded is None)
    if preloaded is None:
        return load_model(spec, gpu, batch_size, phase="worker")
    properties = preloaded.service.context.system_properties
    properties["gpu_id"] = gpu
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


def _listener(args: argparse.Namespace, config: Config) -> socket.socket:
    if config.inherited_listen_fd is not None:
        listener = socket.socket(fileno=config.inherited_listen_fd)
        listener.set_inheritable(False)
    elif args.sock_type == "unix":
        try:
            os.remove(args.sock_name)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(args.sock_name)
        listener.listen(128)
    else:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((args.host or "127.0.0.1", int(args.port)))
        listener.listen(128)
    listener.settimeout(ACCEPT_TIMEOUT_SECONDS)
    return listener


def _die_with_parent(signum: int) -> None:
    """Asks the kernel to send ``signum`` when our parent dies, so no process outlives its model."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable")
