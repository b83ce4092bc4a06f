"""The warm process's device hosts, keyed by device and tenant: one per device (a card, or one of
the CPU's pool) for every model that shares, and one per device for each model that needs isolation
(tenant: its name). Each is forked CUDA-free on first use (``start_own``: a private one on the CPU,
at its model's LOAD), with the crash board that says, once it has died, whose code killed it
(``crash_board.py``).

``shared_models.py`` decides what goes to which host and what a crash costs a model; this module
starts hosts, talks to them and reads what a dead one left behind.
"""

from __future__ import annotations

import functools
import logging
import socket
import time
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mme_runtime.base import failures
from mme_runtime.base.child_processes import fork_child, kill
from mme_runtime.base.config import Config
from mme_runtime.base.nvidia import gpu_count
from mme_runtime.processes.crash_board import CrashBoard, crash_report_path, crashed_stack
from mme_runtime.processes.device_host import run_host
from mme_runtime.processes.warm_protocol import MAX_FDS, receive, send

logger = logging.getLogger(__name__)

# what ps shows, then its device (and model, for a host of one model's own)
HOST_TITLE = "mme-device-host"
CONTROL_SECONDS = 10.0
CRASHES_BEFORE_QUARANTINE = 2
SHARED = "shared"  # the tenant of every model that shares its device's host


@dataclass(frozen=True)
class HostKey:
    """Which host: its device (the card's name within CUDA_VISIBLE_DEVICES, ``cpu=N`` for one of the
    CPU's pool of shared hosts, ``cpu`` for a private one) and its tenant (``SHARED``, or the one
    model a private host serves)."""

    device: str
    tenant: str = SHARED

    @classmethod
    def own(cls, model: str, device: str | None = None) -> HostKey:
        """The host of a model that needs one of its own, on ``device`` (None: the CPU)."""
        return cls(device or "cpu", model)

    @property
    def private(self) -> bool:
        return self.tenant != SHARED

    @property
    def in_cpu_pool(self) -> bool:
        return not self.private and self.device.startswith("cpu")

    def __str__(self) -> str:
        return f"{self.device} model={self.tenant}" if self.private else self.device


class CpuPool:
    """Which of the CPU's shared hosts (``MME_CPU_HOSTS``) serves each shared model: the one with
    the fewest models when its first connection arrives (one GIL per host: a pool lets Python-bound
    models run side by side), or the one that serves its artifacts under another name already (so
    that they are there once). The counts are kept as models come and go, so a choice costs the same
    at 2,000 models as at 2 (a scan of every model cost the warm process milliseconds a LOAD)."""

    def __init__(self, size: int) -> None:
        self.models_on: Counter[str] = Counter({f"cpu={index}": 0 for index in range(size)})
        self._by_artifacts: dict[Hashable, Counter[str]] = {}  # a package's key: its hosts
        self._placed: dict[str, tuple[str, Hashable | None]] = {}  # a model: its host, its key

    def host_for(self, name: str, artifacts: Hashable | None) -> str:
        """The host of model ``name`` (whose package's key is ``artifacts``): chosen once, kept
        until ``leave``."""
        placed = self._placed.get(name)
        if placed is not None:
            return placed[0]
        same = None if artifacts is None else self._by_artifacts.get(artifacts)
        # the first with the fewest models: the pool's order breaks ties
        host = next(iter(same)) if same else min(self.models_on, key=self.models_on.__getitem__)
        self._placed[name] = host, artifacts
        self.models_on[host] += 1
        if artifacts is not None:
            self._by_artifacts.setdefault(artifacts, Counter())[host] += 1
        return host

    def leave(self, name: str) -> None:
        """Model ``name`` is gone (its UNLOAD): it counts no more."""
        placed = self._placed.pop(name, None)
        if placed is None:
            return
        host, artifacts = placed
        self.models_on[host] -= 1
        same = None if artifacts is None else self._by_artifacts.get(artifacts)
        if same is not None:
            same[host] -= 1
            if same[host] <= 0:
                del same[host]
            if not same:
                del self._by_artifacts[artifacts]


@dataclass
class Host:
    key: HostKey
    pid: int
    control: socket.socket
    board: CrashBoard
    models: set[str] = field(default_factory=set)  # names sent to it
    empty_since: float | None = None  # monotonic: when a pool host was left with no model
    peak: int = 0  # the most models it has held
    # recycling (host_recycling.py): the fresh host its models move to, and for that one, the
    # models whose load it has not reported yet
    successor: Host | None = None
    pending: set[str] = field(default_factory=set)
    handing_over: bool = False  # the models go to the successor now
    recyclable: bool = True  # False once a recycling failed, or a model has no package
    ended_by_warm: bool = False  # killed by the warm process (a recycling gone wrong)
    # the kernel's count when it started
    oom_kills: dict[str, int] = field(default_factory=failures.oom_kills)

    def close(self) -> None:
        """Lets go of the host: with its control socket closed it lets its models go and exits."""
        self.control.close()
        self.board.close()


@dataclass(frozen=True)
class Crash:
    """What a dead host left: how it ended, the slot of the model whose thread took the fatal signal
    (if one did), the slots with a call running, and the crashed thread's stack (faulthandler's, for
    a fatal signal)."""

    host: Host
    cause: str
    culprit: int | None
    running: frozenset[int]
    stack: str = ""
    successor: bool = False  # a host that was taking a drained one's models (host_recycling.py)


class CrashCount:
    """Crashes by model name, kept across a model's UNLOAD and LOAD: the second one quarantines the
    model."""

    def __init__(self) -> None:
        self.crashes: dict[str, int] = {}

    def blame(self, crash: Crash, on_host: Mapping[int, str]) -> str | None:
        """Logs whose code killed the host, among its models (``on_host``: their names by slot), and
        counts it. Returns that model's name when it should leave for a host of its own."""
        running = sorted(name for slot, name in on_host.items() if slot in crash.running)
        culprit = None if crash.culprit is None else on_host.get(crash.culprit)
        if crash.culprit is None and len(running) == 1:
            # no fatal signal to go by (an exit, SIGKILL): the one model that was running
            culprit = running[0]
        logger.error(
            "device host pid=%d gpu=%s %s while running model %s (calls running: %s); the other "
            "models load again from their packages",
            crash.host.pid,
            crash.host.key,
            crash.cause,
            culprit or "unknown",
            ", ".join(running) or "none",
        )
        if crash.stack:
            logger.error(
                "device host pid=%d: the thread that crashed, most recent call first:\n%s",
                crash.host.pid,
                crash.stack,
            )
        if culprit is None:
            return None
        self.crashes[culprit] = self.crashes.get(culprit, 0) + 1
        return culprit if self.crashes[culprit] >= CRASHES_BEFORE_QUARANTINE else None


class DeviceHosts:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.hosts: dict[HostKey, Host] = {}
        self.cpu_only = gpu_count() == 0  # no card for the frontend to assign

    def get(self, key: HostKey, gpu: int | None, env: dict[str, str]) -> Host:
        """The host of ``key``, forked now if there is none, with the environment MMS gives its
        model processes (it reads some of it, such as ``MMS_DECODE_INPUT_REQUEST``, while
        answering)."""
        host = self.hosts.get(key)
        if host is not None:
            return host
        host = self.hosts[key] = self._fork(key, gpu, env)
        return host

    def fork_successor(self, host: Host, env: dict[str, str]) -> Host:
        """A fresh host for ``host``'s key, its ``successor`` until it takes the models and the key
        (``promote``)."""
        host.successor = self._fork(host.key, None, env)
        return host.successor

    def promote(self, host: Host) -> Host:
        """``host``'s successor takes its key; ``host``, which holds no model now, ends (its control
        socket closes). Returns the successor."""
        successor, host.successor = host.successor, None
        assert successor is not None
        self.hosts[host.key] = successor
        successor.peak = len(successor.models)
        if not successor.models:
            self.left_empty(successor)
        host.close()
        logger.info(
            "device host pid=%d gpu=%s retired: pid=%d serves its models",
            host.pid,
            host.key,
            successor.pid,
        )
        return successor

    def _fork(self, key: HostKey, gpu: int | None, env: dict[str, str]) -> Host:
        board = CrashBoard()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        title = f"{HOST_TITLE} gpu={gpu}" if gpu is not None else f"{HOST_TITLE} {key.device}"
        if key.private:  # named as the model's stub is, so that ps tells whose it is
            title += f" --model-name {key.tenant}"
        try:
            run = functools.partial(run_host, theirs, self.config, gpu, board)
            pid = fork_child(title, run, env, keep=[theirs.fileno()])
        except OSError:
            ours.close()
            board.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(CONTROL_SECONDS)
        logger.info("device host pid=%d gpu=%s started", pid, key)
        return Host(key, pid, ours, board)

    def start_own(self, model: str, env: dict[str, str]) -> Host | None:
        """The host of a model that no host may share, forked before its first connection (while
        its loader loads) where its key is known by then: on the CPU. On GPUs the card comes with
        the connection, and so does the host (None)."""
        return self.get(HostKey.own(model), None, env) if self.cpu_only else None

    def send(self, host: Host, payload: dict[str, Any], fds: list[int] | None = None) -> None:
        """``OSError`` when the host is gone or stuck: its reap follows."""
        send(host.control, payload, fds)

    def report(self, host: Host) -> tuple[dict[str, Any] | None, list[int]]:
        """The host's next report and the descriptors it carries, once its control socket is
        readable; None once it is gone."""
        try:
            return receive(host.control, with_fds=MAX_FDS)
        except (OSError, ValueError):
            return None, []

    def exited(self, pid: int, code: int) -> Crash | None:
        """The crash of host ``pid`` (its report read, the host forgotten); None if ``pid`` was no
        host of ours."""
        host = next((host for host in self.hosts.values() if host.pid == pid), None)
        recycled = next(
            (old for old in self.hosts.values() if old.successor and old.successor.pid == pid), None
        )
        if recycled is not None and recycled.successor is not None:
            # a successor: the models that did not move stay where they are
            host, recycled.successor = recycled.successor, None
        elif host is None:
            return None
        else:
            del self.hosts[host.key]  # its control socket: closed by the caller, once it forgot it
        path = crash_report_path(self.config.runtime_dir, pid)
        try:
            report = path.read_text(errors="replace")
            path.unlink()
        except OSError:
            report = ""
        cause = failures.exit_cause(code, host.oom_kills)
        crash = Crash(
            host,
            cause,
            host.board.culprit(report),
            frozenset(host.board.busy()),
            crashed_stack(report),
            successor=recycled is not None,
        )
        host.board.close()
        return crash

    def left_empty(self, host: Host) -> bool:
        """``host`` has no model left: True when it ends now (a private one). One of the CPU's pool
        ends once ``MME_EMPTY_HOST_SECONDS`` pass without a model (``idle``): its models' freed heap
        goes with it (40-50 MiB after a mass UNLOAD), while LOAD-UNLOAD churn keeps it. A GPU's
        shared host stays with its CUDA context (a new one costs its next LOAD seconds)."""
        if host.key.in_cpu_pool:
            host.empty_since = time.monotonic()
        return host.key.private

    def idle(self) -> list[Host]:
        """The pool's hosts that have had no model for ``MME_EMPTY_HOST_SECONDS``, to retire (the
        next model the pool chooses one for forks it again, in milliseconds)."""
        now = time.monotonic()
        return [
            host
            for host in self.hosts.values()
            if host.empty_since is not None
            and not host.models
            and now - host.empty_since >= self.config.empty_host_seconds
        ]

    def retire(self, host: Host) -> None:
        """Ends a host with no model: with its control socket closed it lets its models go and
        exits (its exit is no crash: it is no host of ours any more)."""
        if self.hosts.get(host.key) is host:
            del self.hosts[host.key]
            host.close()
            logger.info("device host pid=%d gpu=%s retired: it serves no model", host.pid, host.key)

    def stop(self) -> None:
        for host in self.hosts.values():
            kill(host.pid)
            if host.successor is not None:
                kill(host.successor.pid)
