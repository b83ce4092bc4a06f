"""The warm process's side of the device hosts: every model, its load, its connections, its hosts.

For each model MMS starts, the warm process links the model's socket path to the socket of all
models and forks a loader (``model_loader``), which runs ``model_fn`` once, CUDA-free, and hands
back a package (or says why the host must load it, or why the LOAD fails), and whether the model
needs a host of its own. Each frontend connection's LOAD message names its model; it waits here
until the model is ready, then goes to the host of its device and tenant (``device_hosts.py``),
forked on first use (on the CPU, the host of a model that no host may share while its loader
loads); the model is sent to that host once, before its first connection. Each model is a
``SharedModel``: the stub MMS started for it, its loader's result socket, its package and its hosts.

When the stub goes (UNLOAD), every host lets the model go (its package may be kept for a re-LOAD),
and a private host ends. When a host dies, the model whose code killed it is named
(``crash_board.py``); one named in two crashes of a shared host moves to a host of its own; the
others are loaded again from their packages into a new host as the frontend reconnects.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from mme_runtime.base import failures
from mme_runtime.base.child_processes import Watcher, kill
from mme_runtime.base.config import Config
from mme_runtime.models.loading import (
    LoadFailure,
    ModelSpec,
    check_location,
    container_reason,
    refuse_load,
)
from mme_runtime.models.model_package import Package
from mme_runtime.models.package_cache import PackageCache
from mme_runtime.models.tensor_store import TensorStore
from mme_runtime.operations import metrics
from mme_runtime.processes import warm_protocol
from mme_runtime.processes.crash_board import SLOTS
from mme_runtime.processes.device_hosts import (
    SHARED,
    CpuPool,
    Crash,
    CrashCount,
    DeviceHosts,
    Host,
)
from mme_runtime.processes.host_recycling import HostRecycling
from mme_runtime.processes.model_loader import start_loader
from mme_runtime.processes.shared_model import SharedModel
from mme_runtime.serving.connection import Assignment, device_of, read_assignment

logger = logging.getLogger(__name__)

# The frontend sends its LOAD message as soon as it connects; one that does not within this is
# dropped.
LOAD_MESSAGE_SECONDS = 2.0
# How long the warm process waits for the rest of a loader's report once it has begun to arrive.
RESULT_SECONDS = 1.0


class SharedModels:
    """Every model and device host of the warm process. The methods follow a model's life: what the
    warm process's loop asks, a model arrives, its connections, a host dies, a model goes."""

    def __init__(
        self, config: Config, watcher: Watcher, stub_loaded: Callable[[int], None]
    ) -> None:
        self.config = config
        # the warm process's: every socket of ours it waits on, with what to do
        self.watcher = watcher
        # told each stub's pid once its model has loaded (``launcher_entries.py``)
        self.stub_loaded = stub_loaded
        self.models: dict[str, SharedModel] = {}
        # slots on the crash board given back by UNLOADs, taken first
        # numbers, not int objects: those would outlive their models and pin Python's arenas
        self._free_slots = array.array("i")
        self.last_unload = 0.0  # monotonic
        self.hosts = DeviceHosts(config)
        self.cpu_pool = CpuPool(config.cpu_hosts)
        self.crash_count = CrashCount()
        # every package, its tensors held once by content
        self.store = TensorStore(config.share_weights)
        self.cache = PackageCache(config, self.store.release)
        # where the frontend's connections for every model arrive
        self.models_socket = str(config.models_socket)
        self.listener = warm_protocol.listen_for_models(self.models_socket)
        watcher.watch(self.listener, self._connection_arrived)
        self.recycling = HostRecycling(
            self.hosts, watcher, self.models, self._send_moved, self._watch_host
        )

    def child_exited(self, pid: int, code: int) -> bool:
        """True when ``pid`` was ours (a loader or a host)."""
        crash = self.hosts.exited(pid, code)
        if crash is not None:
            self._host_died(crash)
            return True
        for model in self.models.values():
            if model.loader == pid:
                model.loader = None
                reporting = model.result is not None or model.loader_silent
                if reporting and not model.ready and model.failure is None:
                    # its report, if it sent one before it exited
                    self._loader_reported(model, exit_code=code)
                return True
        return False

    def stop(self) -> None:
        self.hosts.stop()

    def add(
        self, spec: ModelSpec, request: dict[str, Any], stub: socket.socket, stdio: list[int]
    ) -> None:
        """Links the model's socket, tells the frontend it may connect, and starts the model's
        loader (unless the same artifacts are loaded under another name already: then the model
        takes their package)."""
        if (existing := self.models.get(spec.name)) is not None:
            # unloaded, and loaded again before its stub went
            self._unload(existing)
        if len(self.models) >= SLOTS:
            raise RuntimeError(
                f"{SLOTS} shared models are loaded already: the device hosts track no more"
            )
        socket_path = warm_protocol.link_model_socket(request["argv"], self.models_socket)
        os.write(
            stdio[1], f"[PID] {request.get('pid', os.getpid())}\nMMS worker started.\n".encode()
        )
        model = SharedModel(spec, request, stub, stdio, socket_path, self._free_slot(), time.time())
        self.models[spec.name] = model
        self.watcher.watch(stub, lambda: self._stub_readable(model))
        if check_location(spec, self.config) is None:
            # else its loader refuses it: nothing of its files is read
            model.cache_key = self.cache.key(spec)
            model.package = (
                None if model.cache_key is None else self.cache.take(model.cache_key, spec.name)
            )
            if model.package is not None and model.cache_key is not None:
                private, threads = self.cache.placement(model.cache_key)
                if private is not None:
                    self._make_private(model, private, threads)
                self._ready(model)
                return
            loading = sum(
                other.artifact_bytes for other in self.models.values() if other.loader is not None
            )
            # kept packages give way to what loaders need
            model.artifact_bytes = self.cache.make_room(spec, loading)
        # should it die: whether the kernel's out-of-memory killer did it
        model.oom_kills = failures.oom_kills()
        model.loader, model.result = start_loader(spec, request, stdio)
        # a loader's child could hold the socket open after the loader died
        model.result.settimeout(RESULT_SECONDS)
        self.watcher.watch(model.result, lambda: self._loader_reported(model))
        if container_reason(spec.handler, self.config) is not None:
            own = self.hosts.start_own(spec.name, model.request["env"])
            if own is not None:  # it ends with the model, should the model never reach it
                self.watcher.watch(own.control, lambda: self._host_reported(own))
                model.hosts.add(own.key)

    def forget(self, name: str) -> bool:
        """After ``add`` failed halfway: lets go of what it took; True if that included the stub and
        its stdio."""
        model = self.models.get(name)
        if model is None:
            return False
        self._unload(model)
        return True

    def _loader_reported(self, model: SharedModel, exit_code: int | None = None) -> None:
        """The loader's report (or its end: ``exit_code`` once it is reaped), read and acted on."""
        report: dict[str, Any] | None = None
        fds: list[int] = []
        if model.result is not None:
            with contextlib.suppress(OSError, ValueError):
                report, fds = warm_protocol.receive(model.result, with_fds=1)
            self.watcher.forget(model.result)
            model.result.close()
            model.result = None
        spec = model.spec
        if report is None and exit_code is None and model.loader is not None:
            # it died before it reported: how it ended, once reaped, says why
            model.loader_silent = True
            return
        if report is None:
            model.failure = model.loader_failure(exit_code)
        elif "failure" in report:
            model.failure = LoadFailure(report["failure"]["status"], report["failure"]["message"])
        elif "package" in report:
            package = Package.from_layout(fds, report["package"])
            model.package = self.store.add(package, share=bool(report.get("share_weights")))
            if model.cache_key is not None:
                placement = report.get("private"), report.get("threads")
                model.package = self.cache.add(
                    model.cache_key, spec.name, model.package, *placement
                )
        else:
            logger.warning(
                "model=%s model_fn runs in the device host: %s", spec.name, report["host_loads"]
            )
        model.resolved = None if report is None else report.get("resolved")
        if report is not None and report.get("private"):
            self._make_private(model, report["private"], report.get("threads"))
        if model.failure is not None:
            metrics.record_load(False, time.time() - model.started)
            model.load_recorded = True
            self._leave_hosts(model)  # a host started for it while it loaded ends
        self._ready(model)

    def _ready(self, model: SharedModel) -> None:
        """From now on the model's connections are routed (or refused with its failure)."""
        if model.failure is None:
            where = (
                "shares its device host" if model.tenant == SHARED else "has its own device host"
            )
            seconds = time.time() - model.started
            logger.info("model=%s %s (loaded in %.2f s)", model.spec.name, where, seconds)
        model.ready = True
        model.tell_stub({"shared": True})
        while model.waiting:  # one at a time: those not yet routed stay the model's to close
            self._route(model, *model.waiting.pop(0))

    def _make_private(self, model: SharedModel, reason: str, threads: int | None) -> None:
        """From its next connection on, the model is served by a device host of its own."""
        model.tenant, model.threads = model.spec.name, threads
        logger.info("model=%s served by a device host of its own: %s", model.spec.name, reason)

    def _move_to_own_host(self, model: SharedModel, reason: str) -> None:
        """Quarantine: every shared host lets the model go, and its connections (the frontend
        reconnects) go to a host of its own, which loads it from its package."""
        self._leave_hosts(model)
        self._make_private(model, reason, model.threads)

    def _connection_arrived(self) -> None:
        """A frontend connection, watched until its first message arrives (the LOAD, which MMS
        writes as it connects): the loop never waits for it."""
        try:
            connection, _ = self.listener.accept()
        except OSError:
            return  # BlockingIOError (none waits after all), InterruptedError
        self.watcher.watch(connection, lambda: self._load_message(connection))

    def _load_message(self, connection: socket.socket) -> None:
        """Routes a connection by the model its LOAD message names, once that model is ready; drops
        one whose model is not loaded, or that the frontend has closed already (a worker of an
        earlier LOAD of the same name)."""
        self.watcher.forget(connection)
        assignment = read_assignment(connection, LOAD_MESSAGE_SECONDS)
        if assignment is None:
            return
        model = self.models.get(assignment.model)
        if model is None or warm_protocol.peer_closed(connection):
            logger.info("model=%s: a connection of an earlier LOAD dropped", assignment.model)
            connection.close()
        elif not model.ready:
            model.waiting.append((connection, assignment))
        else:
            self._route(model, connection, assignment)

    def _route(self, model: SharedModel, connection: socket.socket, assignment: Assignment) -> None:
        """A connection of a ready model to its host (or refused with the model's failure)."""
        model.stop_logging()
        if model.failure is not None:
            refuse_load(connection, model.failure, model.spec, self.config, drain=False)
            return
        device = device_of(assignment, self.config.cuda_visible_devices)
        key = model.host_key(device, self.cpu_pool)
        try:
            host = self.hosts.get(key, assignment.gpu, model.request["env"])
            if not self.watcher.watches(host.control):  # a host started just now
                self._watch_host(host)
            if host.successor is not None and host.handing_over:
                host = host.successor  # it takes the models of a drained one
            if model.spec.name not in host.models:
                self._send_model(host, model, assignment.batch_size)
                model.hosts.add(key)
            payload = {"op": "connect", **dataclasses.asdict(assignment)}  # model, gpu, batch_size
            self.hosts.send(host, payload, [connection.fileno()])
        except OSError as exc:
            # the host is dying: the frontend reconnects, and its reap starts a new one
            logger.warning("model=%s gpu=%s device host unreachable: %s", model.spec.name, key, exc)
        finally:
            connection.close()  # the host holds its own descriptor now

    def _send_model(
        self, host: Host, model: SharedModel, batch_size: int, moved: bool = False
    ) -> None:
        """The model to a host, before its first connection there (whose LOAD message carries MMS's
        batch size), or ``moved`` there from a drained host (``host_recycling.py``)."""
        fds = [] if model.package is None else model.package.fds
        self.hosts.send(host, model.load_message(batch_size, moved), fds)
        model.batch_size = batch_size
        host.models.add(model.spec.name)
        host.peak = max(host.peak, len(host.models))
        host.empty_since = None

    def _send_moved(self, host: Host, model: SharedModel) -> None:
        self._send_model(host, model, model.batch_size, moved=True)

    def _watch_host(self, host: Host) -> None:
        self.watcher.watch(host.control, lambda: self._host_reported(host))

    def _host_reported(self, host: Host) -> None:
        """A host's word on a model's load there (the LOAD's outcome is counted once), or on its
        recycling."""
        message, fds = self.hosts.report(host)
        if message is None:
            self.watcher.forget(host.control)  # it is dying: its reap names the cause
            return
        if self.recycling.reported(host, message, fds):
            return
        model = self.models.get(message.get("model", ""))
        if model is not None and not model.load_recorded:
            model.load_seconds = time.time() - model.started
            metrics.record_load(bool(message.get("loaded")), model.load_seconds)
            model.load_recorded = True
            if message.get("loaded") and isinstance(model.request.get("pid"), int):
                self.stub_loaded(model.request["pid"])
        if model is not None and message.get("package_unused"):
            # made with code the model no longer has
            self._release_package(model, keep=False)  # other hosts run its model_fn too

    def _host_died(self, crash: Crash) -> None:
        """Names the model whose code killed the host and counts the crash against it (a second one
        in a shared host moves it to a host of its own); the frontend's reconnections start a new
        host and send it the models again."""
        key = crash.host.key
        self.watcher.forget(crash.host.control)  # before it closes: its number may be reused
        crash.host.control.close()
        if crash.successor:  # a drained host's: the models it took reconnect, to the old one
            if (recycled := self.hosts.hosts.get(key)) is not None:
                self.recycling.successor_died(recycled)
        else:
            self.recycling.host_died(crash.host)
            for model in self.models.values():
                model.hosts.discard(key)  # its own host too, had the model not reached it yet
        on_host = [model for model in self.models.values() if model.spec.name in crash.host.models]
        for model in on_host:
            model.served = True
        if crash.host.ended_by_warm:
            logger.warning(
                "device host pid=%d gpu=%s ended: its models load again", crash.host.pid, key
            )
            return
        name = self.crash_count.blame(crash, {model.slot: model.spec.name for model in on_host})
        culprit = None if name is None else self.models.get(name)
        if culprit is not None and culprit.tenant == SHARED:
            metrics.record_quarantine(culprit.spec.name)
            crashes = self.crash_count.crashes[culprit.spec.name]
            self._move_to_own_host(culprit, f"it crashed its device host {crashes} times")

    def _stub_readable(self, model: SharedModel) -> None:
        with contextlib.suppress(OSError):
            if model.stub.recv(4096):
                return
        self._unload(model)  # its end of the stub closed (or broke)

    def _unload(self, model: SharedModel) -> None:
        """The model's process in MMS is gone (UNLOAD, or MMS stopping): every host lets it go, its
        memory is freed."""
        name = model.spec.name
        if self.models.get(name) is not model:
            return
        del self.models[name]
        self.cpu_pool.leave(name)
        self._free_slots.append(model.slot)
        self.last_unload = time.monotonic()
        self.watcher.forget(model.stub)
        if model.loader is not None:
            kill(model.loader)
        if model.result is not None:
            self.watcher.forget(model.result)
            warm_protocol.drain(model.result)  # a package sent and never read: its memfd too
        self._leave_hosts(model)
        self._release_package(model, keep=True)
        model.close()
        logger.info("model=%s unloaded", name)

    def _release_package(self, model: SharedModel, keep: bool) -> None:
        """The model lets go of its package: kept for a re-LOAD if it has a key, ``keep`` and it
        fits; else freed."""
        if model.package is not None and model.cache_key is not None:
            self.cache.release(model.cache_key, model.spec.name, keep)
        elif model.package is not None:
            self.store.release(model.package)
        model.package, model.cache_key = None, None

    def _leave_hosts(self, model: SharedModel) -> None:
        """Every host that has the model lets it go; one left with none may end (``left_empty``)."""
        name = model.spec.name
        for key in model.hosts:
            host = self.hosts.hosts.get(key)
            if host is None:
                continue
            for holder in (host, host.successor):  # a drained host's successor has it too
                if holder is not None and name in holder.models:
                    holder.models.discard(name)
                    holder.pending.discard(name)
                    try:
                        self.hosts.send(holder, {"op": "unload", "model": name})
                    except OSError as exc:
                        logger.info("model=%s device host gone before its unload: %s", name, exc)
            if host.successor is not None:
                self.recycling.advance(host)
            elif not host.models and self.hosts.left_empty(host):
                self._retire(host)
        model.hosts.clear()

    def tend_hosts(self) -> None:
        """The pool's hosts with no model for a while end, and drained ones are recycled
        (``host_recycling.py``): the warm process's loop asks."""
        for host in self.hosts.idle():
            self._retire(host)
        self.recycling.recycle(self.last_unload)

    def _retire(self, host: Host) -> None:
        self.watcher.forget(host.control)  # before its socket closes: the number may be reused
        self.hosts.retire(host)

    def _free_slot(self) -> int:
        """A slot no loaded model holds: one an UNLOAD gave back, else the next never used (called
        below SLOTS)."""
        return self._free_slots.pop() if self._free_slots else len(self.models)
