"""One shared model as the warm process holds it (``shared_models.py`` holds them all), and the sockets it owns:
the stub MMS started for it, the model's own socket where the frontend connects, its loader's result socket.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mme_runtime.base import failures
from mme_runtime.models.loading import LoadFailure, ModelSpec
from mme_runtime.models.model_cache import Key
from mme_runtime.models.model_package import Package
from mme_runtime.processes.device_hosts import SHARED, HostKey
from mme_runtime.processes.warm_protocol import receive, send


@dataclass
class SharedModel:
    """One model MMS started, in the warm process: its stub, its socket, its loader, its package, its hosts."""

    spec: ModelSpec
    request: dict[str, Any]  # the stub's command line, environment and directory: its hosts' environment
    stub: socket.socket  # closes when MMS ends the model's process (UNLOAD)
    stdio: list[int]  # the stub's stdin, stdout and stderr: the model's log (-1: closed once it was served)
    listener: socket.socket
    slot: int
    started: float
    loader: int | None = None
    result: socket.socket | None = None
    package: Package | None = None  # None while loading, or where the host runs model_fn
    ready: bool = False  # connections are routed from now on
    failure: LoadFailure | None = None
    hosts: set[HostKey] = field(default_factory=set)
    tenant: str = SHARED  # or its own name: it needs a host of its own (the loader said why, or it crashed twice)
    threads: int | None = None  # the intra-op threads its model_fn chose, for a host of its own
    cache_key: Key | None = None  # its package's in the package cache (package_cache.py)
    cpu_host: str | None = None  # which of the CPU's hosts serves it
    served: bool = False  # a host has had it
    load_recorded: bool = False
    oom_kills: dict[str, int] = field(default_factory=dict)  # the kernel's OOM kill counts as its loader started
    loader_silent: bool = False  # its loader died before it reported
    artifact_bytes: int = 0  # its files' size: what its loader's memory check counts

    def host_key(self, device: str | None, models: Iterable[SharedModel], cpu_hosts: int) -> HostKey:
        """The host of a connection assigned ``device`` (a card's name; None for the CPU): on the CPU, a shared model
        goes to one of the pool (``cpu_host_for``), a private one to its own."""
        if self.tenant != SHARED:
            return HostKey(device or "cpu", self.tenant)
        return HostKey(device or cpu_host_for(self, models, cpu_hosts))

    def load_message(self, batch_size: int) -> dict[str, Any]:
        """The model as a host takes it (its package's descriptors go beside), before its first connection there."""
        return {
            "op": "load",
            "model": self.spec.name,
            "spec": dataclasses.asdict(self.spec),
            "slot": self.slot,
            "package": None if self.package is None else self.package.layout,
            "batch_size": batch_size,
            "restart": self.served,  # served before, by a host that has died since
            "started": time.time() if self.served else self.started,  # its load time counts from this
            "threads": None if self.tenant == SHARED else self.threads,  # a shared host keeps torch's default
        }

    def loader_failure(self, exit_code: int | None) -> LoadFailure:
        """The LOAD's failure when the loader ended with no report: how it ended (``exit_code``: None if unknown).
        507 when the kernel's out-of-memory killer ended it, so that SageMaker makes room and tries again."""
        if exit_code is None:
            return LoadFailure(500, f"model {self.spec.name}: its loader died before it reported (see the log)")
        cause = failures.exit_cause(exit_code, self.oom_kills)
        status = 507 if failures.oom_killed(exit_code, self.oom_kills) else 500
        return LoadFailure(status, f"model {self.spec.name}: its loader {cause} before it reported")

    def tell_stub(self, payload: dict[str, Any]) -> None:
        try:
            send(self.stub, payload)
        except OSError:
            pass  # the stub is gone: its unload follows

    def accept(self) -> socket.socket | None:
        """A frontend connection waiting on the model's socket (None if there is none after all). MMS connects once it
        has read "MMS worker started." and counted the model's process started: from then on the stub's pipes may end
        (earlier, MMS would fail the LOAD: "Backend stream closed")."""
        try:
            connection, _ = self.listener.accept()
        except OSError:  # BlockingIOError (none waits after all), InterruptedError, a socket closing
            return None
        self.stop_logging()
        return connection

    def stop_logging(self) -> None:
        """Lets go of the stub's stdout and stderr once the model is served: its loader has written all it will (a
        host logs to the container's own output), and the stub (``cat`` now) holds /dev/null instead. MMS reads each
        of the two pipes with a thread of its own, about 90 KiB each, which ends at the pipe's end."""
        for index in (1, 2):
            if self.stdio[index] >= 0:
                os.close(self.stdio[index])
                self.stdio[index] = -1

    def close(self) -> None:
        """Closes the model's socket (and removes its path), its stub and the stub's stdio."""
        path = self.listener.getsockname()
        self.listener.close()
        if isinstance(path, str) and path:
            try:
                os.unlink(path)
            except OSError:
                pass
        self.stub.close()
        for fd in self.stdio:
            if fd >= 0:
                os.close(fd)
        self.stdio = [-1, -1, -1]


def cpu_host_for(model: SharedModel, models: Iterable[SharedModel], cpu_hosts: int) -> str:
    """The CPU host of the pool (MME_CPU_HOSTS) that serves the model: the one with the fewest models when its first
    connection arrived (one GIL per host: a pool lets Python-bound models run side by side), or the one that has its
    artifacts under another name (so that they are there once)."""
    if model.cpu_host is None:
        pool = [f"cpu={index}" for index in range(cpu_hosts)]
        others = list(models)
        taken = [other.cpu_host for other in others]
        same = [o.cpu_host for o in others if o.cpu_host and o.cache_key == model.cache_key]
        model.cpu_host = same[0] if model.cache_key is not None and same else min(pool, key=taken.count)
    return model.cpu_host


def bind_model_socket(argv: list[str]) -> socket.socket:
    """The socket MMS's stub command line names (``--sock-name``), bound and listening, where the frontend's
    connections for the model wait in the backlog until the model is ready."""
    path = argv[argv.index("--sock-name") + 1]
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    listener.setblocking(False)
    return listener


def drain(result: socket.socket) -> None:
    """Closes a loader's result socket and any descriptor waiting in it."""
    result.setblocking(False)
    try:
        while True:
            _, fds = receive(result, with_fds=1)
            for fd in fds:
                os.close(fd)
            if not fds:
                break
    except (OSError, ValueError):
        pass
    result.close()


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
