"""The backend server MMS starts for each model, speaking MMS's own socket protocol (``mms.protocol``).

With preload on, it runs ``model_fn`` once, to host memory, in this CUDA-free process with one intra-op thread,
then forks one worker per frontend connection; each worker binds its assigned GPU before its first CUDA call and
sets its own thread count. After ``model_fn`` a forked probe checks that workers could still use CUDA and run
parallel CPU ops (``fork_safety``), and before every fork the server checks that CUDA is not initialised. A
``model_fn`` that broke either makes the server re-execute itself with preload off for this model, so every worker
loads for itself instead of dying or hanging after fork.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import platform
import select
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

from mms.arg_parser import ArgParser

from mme_runtime import devices, fork_safety, nvidia
from mme_runtime.config import INHERITED_LIFELINE_FD, INHERITED_LISTEN_FD, INHERITED_PENDING_FD, Config
from mme_runtime.loading import (
    LoadedModel,
    LoadFailure,
    ModelSpec,
    check_location,
    check_memory,
    die_with_parent,
    load_model,
)
from mme_runtime.logs import configure_logging
from mme_runtime.worker import serve_worker

logger = logging.getLogger(__name__)

ACCEPT_TIMEOUT_SECONDS = 1.0
CHILD_STOP_SECONDS = 5.0
# The frontend reads these exact lines on stdout to learn our pid and that we listen (WorkerLifeCycle).
STARTED_LINE = "MMS worker started."


def main(lifeline: socket.socket | None = None) -> int:
    """Runs the server. ``lifeline`` is the warm-start stub's connection: when it closes, MMS is done with us."""
    args = ArgParser.model_service_worker_args().parse_args()
    config = Config.from_process_env()
    configure_logging(config.log_level)
    die_with_parent(signal.SIGTERM)
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
        self.worker_threads = fork_safety.DEFAULT_THREADS
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
        fork_safety.single_threaded()
        try:
            check_memory(self.spec, self.config, gpu=None)
            self.loaded = load_model(self.spec, batch_size=1, phase="preload")
        except LoadFailure as failure:
            # Every worker that connects answers its LOAD with this, so the frontend fails the LOAD with it.
            self.load_failure = failure
            return
        self.worker_threads = fork_safety.threads_for_workers()
        reason = self._fork_hazard()
        if reason is not None:
            self._fall_back_to_per_worker_loading(
                f"{reason}; load to host memory in model_fn to get a single load", pending
            )
        logger.info("model=%s preloaded seconds=%.2f", self.spec.name, time.monotonic() - started)

    def _fork_hazard(self) -> str | None:
        """Why workers forked from this server now could not use their GPU, or None when they can."""
        if devices.cuda_initialized():
            return "model_fn initialised CUDA in the preload server (forked workers could not use it)"
        # CUDA matters only where the frontend hands out GPUs (it counts them with nvidia-smi too): a CPU host with a
        # CUDA build of torch (and no NVML) poisons forks on any is_available(), and its workers never touch CUDA.
        return fork_safety.probe(self.worker_threads, check_cuda=nvidia.gpu_count() > 0)

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
            args=(
                connection,
                self.spec,
                self.config,
                self.loaded,
                self.load_failure,
                self.worker_threads,
                self._inherited_fds(),
            ),
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
