"""The backend server MMS starts for each model, speaking MMS's own socket protocol (``mms.protocol``).

Every frontend worker connects here. The server reads each connection's LOAD message, which names the GPU the
frontend assigned it, and hands the connection to the model's executor for that device (``executor.py``), forking
the executor for the first connection to each device (``executor_pool.py``). So a model has one process, and one
copy of its weights, per device, however many workers the frontend runs.

With preload on, the server runs ``model_fn`` once, to host memory, in this CUDA-free process with one intra-op
thread, before its first fork; each executor binds its GPU before its first CUDA call and sets its own thread count.
After ``model_fn`` a forked probe checks that executors could still use CUDA and run parallel CPU ops
(``fork_safety``), and before every fork the server checks that CUDA is not initialised. A ``model_fn`` that broke
either makes the server re-execute itself with preload off for this model, so each executor loads the model itself
instead of dying or hanging after fork. A crashed executor is forked again when the frontend reconnects.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import platform
import select
import signal
import socket
import sys
import time
from types import FrameType

from mms.arg_parser import ArgParser

from mme_runtime.base import devices, nvidia
from mme_runtime.base.config import Config
from mme_runtime.base.logs import configure_logging
from mme_runtime.base.settings import (
    INHERITED_LIFELINE_FD,
    INHERITED_LISTEN_FD,
    INHERITED_LOAD_STARTED,
    INHERITED_PENDING_FD,
)
from mme_runtime.models.loading import (
    LoadedModel,
    LoadFailure,
    ModelSpec,
    check_location,
    check_memory,
    die_with_parent,
    load_model,
    refuse_load,
)
from mme_runtime.operations import metrics
from mme_runtime.processes import fork_safety
from mme_runtime.processes.executor import Assignment, device_of, hand_over, read_assignment
from mme_runtime.processes.executor_pool import Executor, ExecutorPool

logger = logging.getLogger(__name__)

ACCEPT_TIMEOUT_SECONDS = 1.0
# The frontend sends its LOAD message as soon as it connects; a connection that does not is dropped.
LOAD_MESSAGE_SECONDS = 10.0
# The frontend reads these exact lines on stdout to learn our pid and that we listen (WorkerLifeCycle).
STARTED_LINE = "MMS worker started."


def main(lifeline: socket.socket | None = None) -> int:
    """Runs the server. ``lifeline`` is the warm-start stub's connection: when it closes, MMS is done with us."""
    args = ArgParser.model_service_worker_args().parse_args()
    config = Config.from_process_env()
    configure_logging(config.log_level)
    faulthandler.enable(all_threads=False)  # a crash in model_fn (here) or in an executor prints its stack to the log
    die_with_parent(signal.SIGTERM)
    if lifeline is None and config.inherited_lifeline_fd is not None:
        lifeline = socket.socket(fileno=config.inherited_lifeline_fd)
        lifeline.set_inheritable(False)
    spec = ModelSpec(args.model_name, args.model_path, args.handler, args.tmp_dir)
    metrics.start_model(config, spec.name, os.getpid())
    server = BackendServer(spec, config, _listener(args, config), lifeline)
    return server.run()


class BackendServer:
    """Accepts one connection per MMS worker and hands it to its device's executor, forked once per device."""

    def __init__(
        self, spec: ModelSpec, config: Config, listener: socket.socket, lifeline: socket.socket | None = None
    ) -> None:
        self.spec = spec
        self.config = config
        self.listener = listener
        self.lifeline = lifeline
        # A spawned executor starts from nothing, so preloading only pays with fork.
        self.preload = config.preload_model_gpu is not False and config.start_method == "fork"
        self.executors = ExecutorPool(spec, config)
        self.loaded: LoadedModel | None = None
        self.worker_threads = fork_safety.DEFAULT_THREADS
        self.load_failure: LoadFailure | None = None
        self.refused = False  # a LOAD answered with load_failure: counted once
        self.started = config.inherited_load_started or time.time()  # the LOAD's start, for its duration
        self.stop_requested: float | None = None
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
                self._route(socket.socket(fileno=self.config.inherited_pending_fd))
            while not self._pending:
                self.executors.reap()
                connection = self._accept()
                if connection is None:
                    continue
                # Preload once a worker is connected: MMS 1.1.11 hangs the LOAD for good if the server dies
                # (user code can os._exit or crash at import) before any of its workers got through.
                if self.preload and self.loaded is None and self.load_failure is None:
                    self._preload(connection)
                self._route(connection)
        finally:
            self._unload()
        return 0

    def _unload(self) -> None:
        """Stops every executor, then hands this server's metrics over (its model's series go away)."""
        served = self.executors.served()
        stopped = self.stop_requested or time.monotonic()
        clean = self.executors.stop()
        self.listener.close()
        if served:  # a LOAD that failed is no UNLOAD
            metrics.record_unload(clean, time.monotonic() - stopped)
        metrics.stop_model(self.config)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._pending.append(signum)  # record only; the loop stops within ACCEPT_TIMEOUT_SECONDS
        self.stop_requested = self.stop_requested or time.monotonic()

    def _preload(self, pending: socket.socket) -> None:
        started = time.monotonic()
        fork_safety.single_threaded()
        try:
            check_memory(self.spec, self.config, gpu=None)
            self.loaded = load_model(self.spec, batch_size=1, phase="preload")
        except LoadFailure as failure:
            # Every connection that arrives gets its LOAD answered with this, so the frontend fails the LOAD with it.
            self.load_failure = failure
            return
        self.worker_threads = fork_safety.threads_for_workers()
        reason = self._fork_hazard()
        if reason is not None:
            self._fall_back_to_loading_per_executor(
                f"{reason}; load to host memory in model_fn to get a single load", pending
            )
        logger.info("model=%s preloaded seconds=%.2f", self.spec.name, time.monotonic() - started)

    def _fork_hazard(self) -> str | None:
        """Why executors forked from this server now could not use their GPU, or None when they can."""
        if devices.cuda_initialized():
            return "model_fn initialised CUDA in the preload server (forked executors could not use it)"
        # CUDA matters only where the frontend hands out GPUs (it counts them with nvidia-smi too): a CPU host with a
        # CUDA build of torch (and no NVML) poisons forks on any is_available(), and its executors never touch CUDA.
        return fork_safety.probe(self.worker_threads, check_cuda=nvidia.gpu_count() > 0)

    def _fall_back_to_loading_per_executor(self, reason: str, pending: socket.socket) -> None:
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
            INHERITED_LOAD_STARTED: repr(self.started),
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
            self.stop_requested = time.monotonic()
            return None
        if self.listener not in readable:
            return None
        try:
            connection, _ = self.listener.accept()
        except (TimeoutError, BlockingIOError, InterruptedError):
            return None
        connection.setblocking(True)
        return connection

    def _route(self, connection: socket.socket) -> None:
        """Reads the connection's LOAD message and hands the connection to the executor of its device."""
        if self.preload and self.loaded is not None and devices.cuda_initialized():
            # Never fork an executor that would die on its first CUDA call.
            reason = "CUDA was initialised in the preload server before fork"
            self._fall_back_to_loading_per_executor(reason, connection)
        assignment = read_assignment(connection, self.spec.name, LOAD_MESSAGE_SECONDS)
        if assignment is None:
            return
        if self.load_failure is not None:
            if not self.executors.devices_started and not self.refused:
                metrics.record_load(False, time.time() - self.started)
            self.refused = True
            refuse_load(connection, self.load_failure, self.spec, self.config)
            return
        device = device_of(assignment, self.config.cuda_visible_devices)  # one executor per card
        try:
            for attempt in (1, 2):
                executor = self.executors.get(device) or self._start_executor(device, assignment, connection)
                try:
                    hand_over(executor.control, connection, assignment)
                    break
                except OSError as exc:  # it died since the last reap, or stopped reading: fork a fresh one, once
                    logger.warning("model=%s gpu=%s executor unreachable: %s", self.spec.name, device, exc)
                    self.executors.retire(device, executor)
                    if attempt == 2:
                        raise
        except OSError as exc:
            logger.error("model=%s gpu=%s could not reach an executor: %s", self.spec.name, device, exc)
        finally:
            connection.close()  # the executor holds its own descriptor now

    def _start_executor(self, device: str | None, assignment: Assignment, routed: socket.socket) -> Executor:
        lifeline = () if self.lifeline is None else (self.lifeline.fileno(),)
        server_fds = (self.listener.fileno(), *lifeline, routed.fileno())
        return self.executors.start(device, assignment, self.loaded, self.worker_threads, self.started, server_fds)


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
