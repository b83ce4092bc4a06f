"""A backend server's executors: one per device, forked (or spawned) for the first connection to that device, reaped
when they end, retired when they stop taking connections, and stopped with the server.

It counts what the LOAD metrics need: whether an executor ever served (its end is an UNLOAD, not a failed LOAD), and
whether a new executor for a device replaces one that served there (a restart).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from mme_runtime.base import failures
from mme_runtime.base.config import Config
from mme_runtime.models.loading import LoadedModel, ModelSpec
from mme_runtime.operations import metrics
from mme_runtime.processes.executor import READY, Assignment, serve_executor

logger = logging.getLogger(__name__)

# A hand-over fits in the control socket's buffer many times over: one that waits this long has a stuck executor.
HAND_OVER_SECONDS = 10.0
CHILD_STOP_SECONDS = 5.0

Device = str | None  # a card's CUDA_VISIBLE_DEVICES name; None is the CPU


@dataclass
class Executor:
    process: multiprocessing.process.BaseProcess
    control: socket.socket  # the server's end: connections for this device are handed over on it
    ready: bool = False  # it loaded the model and served (it says so on the control socket)
    oom_kills: dict[str, int] = field(default_factory=failures.oom_kills)  # the kernel's count when it started
    killed_by_us: bool = False  # retired: its SIGKILL was ours

    def served(self) -> bool:
        """Whether the executor has loaded its model: it writes ``READY`` once, even if it has ended since."""
        if not self.ready:
            try:
                self.ready = self.control.recv(len(READY), socket.MSG_DONTWAIT) == READY
            except OSError:  # nothing yet (BlockingIOError), or the socket is closed
                pass
        return self.ready


class ExecutorPool:
    """The executors of one model, by device."""

    def __init__(self, spec: ModelSpec, config: Config) -> None:
        self.spec = spec
        self.config = config
        # Explicit, never the platform default (Python 3.14 changed it on Linux). Typed Any: typeshed's
        # overloads want a literal, not our Literal union.
        self.context: Any = multiprocessing.get_context(config.start_method)
        self.executors: dict[Device, Executor] = {}
        self.devices_started: set[Device] = set()
        self.devices_served: set[Device] = set()  # an executor loaded the model there (a new one is a restart)

    def get(self, device: Device) -> Executor | None:
        return self.executors.get(device)

    def served(self) -> bool:
        """Whether any executor ever loaded the model: the server's end is then an UNLOAD."""
        return bool(self.devices_served) or any(executor.served() for executor in self.executors.values())

    def start(
        self,
        device: Device,
        assignment: Assignment,
        loaded: LoadedModel | None,
        worker_threads: int,
        load_started: float,
        server_fds: tuple[int, ...],
    ) -> Executor:
        """Forks the executor of ``device``. ``server_fds`` are the server's descriptors it must close (with fork)."""
        # The first executor answers the LOAD (so it reports its outcome); one for a device served before is a restart.
        first_load_started = None if self.devices_started else load_started
        if device in self.devices_served:
            metrics.record_executor_restart()
        self.devices_started.add(device)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.settimeout(HAND_OVER_SECONDS)
        inherited = self._inherited_fds(ours, server_fds)
        arguments = (theirs, self.spec, self.config, loaded, assignment, worker_threads, first_load_started, inherited)
        process = self.context.Process(target=serve_executor, args=arguments, daemon=False)
        try:
            process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        executor = Executor(process, ours)
        self.executors[device] = executor
        logger.info("model=%s gpu=%s executor pid=%s started", self.spec.name, device, process.pid)
        return executor

    def retire(self, device: Device, executor: Executor) -> None:
        """Ends an executor that cannot take connections any more (it is dying, or stuck), and forgets it."""
        self._note_served(device, executor)
        if executor.process.exitcode is None:
            executor.killed_by_us = True  # its SIGKILL is ours: not the kernel's out-of-memory killer's
            executor.process.kill()
        executor.process.join(CHILD_STOP_SECONDS)
        self.reap()
        if self.executors.get(device) is executor:  # not reaped: the kill did not take within the wait
            del self.executors[device]
            executor.control.close()

    def reap(self) -> None:
        """Forgets the executors that ended, with a log line that names how."""
        for device, executor in list(self.executors.items()):
            process = executor.process
            if process.exitcode is None:
                continue
            self._note_served(device, executor)
            del self.executors[device]
            executor.control.close()
            code = process.exitcode
            ours = executor.killed_by_us and code == -signal.SIGKILL
            cause = "killed by SIGKILL (ours: it could not take connections)" if ours else None
            cause = cause or failures.exit_cause(code, executor.oom_kills)
            if code < 0:
                logger.error("model=%s gpu=%s executor pid=%d %s", self.spec.name, device, process.pid, cause)
            else:
                logger.info("model=%s gpu=%s executor pid=%d %s", self.spec.name, device, process.pid, cause)

    def stop(self) -> bool:
        """True if every executor ended when asked to; False if one had to be killed."""
        clean = True
        processes = [executor.process for executor in self.executors.values()]
        for process in processes:
            process.terminate()
        deadline = time.monotonic() + CHILD_STOP_SECONDS
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                clean = False
                process.kill()
                process.join(1.0)
        for executor in self.executors.values():
            executor.control.close()
        self.executors.clear()
        return clean

    def _note_served(self, device: Device, executor: Executor) -> None:
        """Before an executor is forgotten: if it had loaded the model, the next one for its device is a restart."""
        if executor.served():
            self.devices_served.add(device)

    def _inherited_fds(self, control: socket.socket, server_fds: tuple[int, ...]) -> tuple[int, ...]:
        """Descriptors a forked executor must close: the server's own (listener, lifeline, its copy of the connection
        being routed, which the executor receives again as its own) and its control ends (a spawned executor
        inherits nothing)."""
        if self.config.start_method != "fork":
            return ()
        controls = tuple(executor.control.fileno() for executor in self.executors.values())
        return (*server_fds, control.fileno(), *controls)
