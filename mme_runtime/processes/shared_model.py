"""One model MMS started, as the warm process holds it (``shared_models.py`` holds them all): its
stub, its loader, its package, its hosts, and the messages a host takes it by."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from mme_runtime.base import failures
from mme_runtime.models.loading import LoadFailure, ModelSpec
from mme_runtime.models.model_package import Package
from mme_runtime.models.package_cache import Key
from mme_runtime.processes import warm_protocol
from mme_runtime.processes.device_hosts import SHARED, CpuPool, HostKey
from mme_runtime.serving.connection import Assignment


@dataclass
class SharedModel:
    """One model MMS started, in the warm process: its stub, its loader, its package, its hosts."""

    spec: ModelSpec
    # the stub's command line, environment and directory: its hosts' environment
    request: dict[str, Any]
    stub: socket.socket  # closes when MMS ends the model's process (UNLOAD)
    # the stub's stdin, stdout and stderr: the model's log (-1: closed once it was served)
    stdio: list[int]
    socket_path: str  # where the frontend connects for it: a link to the models' socket
    slot: int
    started: float
    loader: int | None = None
    result: socket.socket | None = None
    package: Package | None = None  # None while loading, or where the host runs model_fn
    ready: bool = False  # connections are routed from now on
    # frontend connections and their LOAD messages, until it is ready
    waiting: list[tuple[socket.socket, Assignment]] = field(default_factory=list)
    failure: LoadFailure | None = None
    hosts: set[HostKey] = field(default_factory=set)
    # or its own name: it needs a host of its own (the loader said why, or it crashed twice)
    tenant: str = SHARED
    threads: int | None = None  # the intra-op threads its model_fn chose, for a host of its own
    cache_key: Key | None = None  # its package's in the package cache (package_cache.py)
    served: bool = False  # a host has had it
    load_recorded: bool = False
    # the kernel's OOM kill counts as its loader started
    oom_kills: dict[str, int] = field(default_factory=dict)
    loader_silent: bool = False  # its loader died before it reported
    artifact_bytes: int = 0  # its files' size: what its loader's memory check counts
    batch_size: int = 1  # MMS's, as its first connection's LOAD message gave it
    load_seconds: float | None = None  # its LOAD's, once a host reported it loaded
    # what its loader resolved (None: a kept package's host resolves it)
    resolved: dict[str, Any] | None = None

    def host_key(self, device: str | None, cpu_pool: CpuPool) -> HostKey:
        """The host of a connection assigned ``device`` (a card's name; None for the CPU): on the
        CPU, a shared model goes to one of the pool (``CpuPool``), a private one to its own."""
        if self.tenant != SHARED:
            return HostKey.own(self.tenant, device)
        return HostKey(device or cpu_pool.host_for(self.spec.name, self.cache_key))

    def load_message(self, batch_size: int, moved: bool = False) -> dict[str, Any]:
        """The model as a host takes it (its package's descriptors go beside), before its first
        connection there (``moved``: from a drained host, whose connections follow)."""
        return {
            "op": "load",
            "model": self.spec.name,
            "spec": dataclasses.asdict(self.spec),
            "slot": self.slot,
            "package": None if self.package is None else self.package.layout,
            "resolved": self.resolved,
            "batch_size": batch_size,
            "restart": self.served and not moved,  # served before, by a host that has died since
            "moved": moved,
            "load_seconds": self.load_seconds,  # a moved model's metrics keep its LOAD's
            # its load time counts from this
            "started": time.time() if self.served else self.started,
            # a shared host keeps torch's default
            "threads": None if self.tenant == SHARED else self.threads,
        }

    def assignment(self) -> dict[str, Any]:
        """A connection's assignment, as its LOAD message gave it, for one on the CPU."""
        return {"model": self.spec.name, "gpu": None, "batch_size": self.batch_size}

    def loader_failure(self, exit_code: int | None) -> LoadFailure:
        """The LOAD's failure when the loader ended with no report: how it ended (``exit_code``:
        None if unknown). 507 when the kernel's out-of-memory killer ended it, so that SageMaker
        makes room and tries again."""
        if exit_code is None:
            return LoadFailure(
                500, f"model {self.spec.name}: its loader died before it reported (see the log)"
            )
        cause = failures.exit_cause(exit_code, self.oom_kills)
        status = 507 if failures.oom_killed(exit_code, self.oom_kills) else 500
        return LoadFailure(status, f"model {self.spec.name}: its loader {cause} before it reported")

    def tell_stub(self, payload: dict[str, Any]) -> None:
        try:
            warm_protocol.send(self.stub, payload)
        except OSError:
            pass  # the stub is gone: its unload follows

    def stop_logging(self) -> None:
        """Lets go of the stub's stdio once the model is served: its loader has read and written all
        it will (a host logs to the container's own output), and the stub (``head -c 1`` now) holds
        its connection alone. MMS counted the model's process started when it connected, so its
        pipes may end (earlier, MMS would fail the LOAD: "Backend stream closed"); MMS reads each
        with a thread of about 90 KiB, which ends with it."""
        for index in (0, 1, 2):
            if self.stdio[index] >= 0:
                os.close(self.stdio[index])
                self.stdio[index] = -1

    def close(self) -> None:
        """Removes its socket path; closes its waiting connections, its stub and its stdio."""
        with contextlib.suppress(OSError):
            os.remove(self.socket_path)
        for connection, _ in self.waiting:
            connection.close()
        self.waiting = []
        self.stub.close()
        for fd in self.stdio:
            if fd >= 0:
                os.close(fd)
        self.stdio = [-1, -1, -1]
