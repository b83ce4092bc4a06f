"""A device host: the one process that serves every shareable model on one device (a GPU, or the
CPU), or a model that needs isolation on it (a private host: the same process, with one tenant).

The warm process forks it, CUDA-free, for the first connection assigned to its device; the host
binds its GPU before its first CUDA call, so a GPU holds one CUDA context and one caching allocator
however many models it serves. The warm process sends it, over the control socket, each model once
(``load``, with the model packed by the loader, or with no package when ``model_fn`` must run here)
and then each frontend connection for it (``connect``). Each model keeps its own handler (user
module, batcher, settings, context: a ``HostedModel``), loaded on a thread of its own; each
connection is served from a thread of its own. ``unload`` lets a model go; its memory goes back to
the system once per burst of UNLOADs (``MemoryRelease``).

Every thread the host runs for a model is marked as that model's on the crash board
(``crash_board.py``), and a fatal signal writes the threads' stacks to a file: if user code kills
the host, the warm process can tell whose it was.

On a GPU, tensors that several models hold at one place in host memory are one tensor on the card
(``DeviceTensors`` in ``tensor_store.py``); on the CPU, the models' copy-on-write mappings of that
place are one copy already.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

from mme_runtime.base import devices
from mme_runtime.base.config import Config
from mme_runtime.base.logs import configure_logging
from mme_runtime.huggingface.loading import HuggingFaceModel
from mme_runtime.models.loading import (
    LoadedModel,
    ModelSpec,
    ResolvedModel,
    check_memory,
    fail_load,
    is_our_handler,
    load_model,
    refuse_load,
)
from mme_runtime.models.model_package import Package, unpack
from mme_runtime.models.tensor_store import MAX_SEGMENTS, DeviceTensors, module_of, tensor_bytes
from mme_runtime.operations import metrics
from mme_runtime.operations.memory import MemoryRelease, release_memory
from mme_runtime.processes.crash_board import CrashBoard, crash_report_path, report_crashes
from mme_runtime.processes.host_unloads import Unloads
from mme_runtime.processes.hosted_model import HostedModel
from mme_runtime.processes.warm_protocol import MAX_FDS, receive, send
from mme_runtime.serving.connection import (
    Assignment,
    Turns,
    answer_load,
    answer_message,
    start_batching,
)
from mme_runtime.serving.pass_threads import PassThreads

logger = logging.getLogger(__name__)

MAX_PACKAGE_FDS = MAX_SEGMENTS + 1  # a model's own file and the files of the tensors it shares
UNLOAD_SECONDS = 5.0  # how long a host that is told to end waits for the UNLOADs still under way


class DeviceHost:
    def __init__(
        self, control: socket.socket, config: Config, gpu: int | None, board: CrashBoard
    ) -> None:
        self.control = control
        self.config = config
        self.gpu = gpu
        self.board = board
        self.ordinal: int | None = None
        self.models: dict[str, HostedModel] = {}
        self.unloads = Unloads(self._unload)
        self._control_lock = threading.Lock()
        # a model's metrics directory changes hands under it: from an UNLOAD to a LOAD of its name
        self._directories = threading.Lock()
        self._unpacked: weakref.WeakValueDictionary[tuple[int, int, int], Any] = (
            weakref.WeakValueDictionary()
        )
        self.shared: DeviceTensors | None = None  # on a GPU, with MME_SHARE_WEIGHTS
        # on a GPU: the threads that run every model's passes
        self.passes: PassThreads | None = None
        self.release: MemoryRelease  # made once the GPU is bound
        # every model's connections: idle in one epoll set, answered by workers
        self.turns = Turns("connections")
        self._handed_over: list[socket.socket] = []  # open until this host ends (Turns.release)

    def serve(self) -> None:
        self.ordinal = devices.bind_gpu(self.gpu, self.config.cuda_visible_devices)
        # the CPU where torch has no CUDA, whatever nvidia-smi says
        device = devices.worker_device(self.ordinal)
        if device.type == "cuda" and self.config.share_weights:
            self.shared = DeviceTensors(device)
        self.release = MemoryRelease.of_host(self.ordinal)
        if self.gpu is not None:
            # on a card nvidia-smi lists (the tests' fake ones too): the same path
            self.passes = PassThreads(self.config.gpu_pass_threads, f"gpu{self.gpu}")
        logger.info("device host pid=%d gpu=%s serving", os.getpid(), self.gpu)
        while True:
            try:
                message, fds = receive(self.control, with_fds=MAX_PACKAGE_FDS)
            except (OSError, ValueError):
                message, fds = None, []
            if message is None:
                break
            try:
                self._dispatch(message, fds)
            except Exception:  # noqa: BLE001
                # one bad message must not take every model of the host down
                logger.exception(
                    "device host pid=%d: message %s not handled", os.getpid(), message.get("op")
                )
        # a private host's last model, say: its UNLOAD counted
        self.unloads.wait(2 * UNLOAD_SECONDS)  # its messages' wait, then the rest
        logger.info("device host pid=%d: the warm process let go, stopping", os.getpid())

    def _dispatch(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message["op"]
        name = message["model"]
        if op == "load":
            spec = ModelSpec(**message["spec"])
            if message.get("threads"):
                # a private host: the count its model's model_fn chose in the loader
                devices.set_threads(int(message["threads"]))
                logger.info(
                    "model=%s threads=%d, as its model_fn chose", name, int(message["threads"])
                )
            model = self.models[name] = HostedModel(spec, int(message["slot"]), None)
            model.started, model.moved = message["started"], bool(message.get("moved"))
            model.load_seconds = message.get("load_seconds")
            # the same name's UNLOAD, maybe still letting go
            model.after = self.unloads.pending(name)
            package = (
                None
                if message.get("package") is None
                else Package.from_layout(fds, message["package"])
            )
            if package is not None:
                # blobs in other models' files: held for them first, counted there
                model.borrowed_host_bytes = sum(
                    blob.nbytes for blob in package.blobs if blob.segment
                )
            # what its loader resolved; else _our_handler resolves it
            if message.get("resolved") is not None:
                model.resolved = ResolvedModel.from_message(message["resolved"])
            batch_size, restart = int(message["batch_size"]), bool(message.get("restart"))
            arguments = (model, package, fds, batch_size, restart)
            model.loading = threading.Thread(
                target=self._load, args=arguments, name=f"load-{name}", daemon=True
            )
            model.loading.start()
        elif op == "connect":
            connection = socket.socket(fileno=fds[0])
            connection.setblocking(True)
            hosted = self.models.get(name)
            if hosted is None:  # unloaded meanwhile: the frontend is done with this connection too
                connection.close()
                return
            assignment = Assignment(name, message["gpu"], message["batch_size"])
            self._connect(hosted, connection, assignment, adopted=bool(message.get("adopted")))
        elif op in ("unload", "hand_over"):  # hand_over: to the host ``to``, which has it loaded
            leaving = self.models.pop(name, None)
            if leaving is not None:
                self.unloads.start(leaving, message.get("to"))

    def _load(
        self,
        model: HostedModel,
        package: Package | None,
        fds: list[int],
        batch_size: int,
        restart: bool,
    ) -> None:
        """The model's handler here: the packed model adopted (or ``model_fn`` run here when there
        is no package), placed on this host's device and warmed up; then the connections that waited
        for it are served."""
        spec = model.spec
        if model.after is not None:
            # what the old model holds under this name, its metrics directory included, goes
            # before the new one takes it
            model.after.wait(self.config.response_timeout_seconds)
            model.after = None
        with self._directories:  # that UNLOAD, if still running, leaves the directory to this one
            model.series = metrics.start_hosted(self.config, spec.name, restart)
        metrics.bind(model.series)
        self.board.work_for(model.slot)
        if restart:
            metrics.record_restart()
        try:
            check_memory(
                spec,
                self.config,
                self.gpu,
                host=package is None,
                device_bytes=self._new_bytes(package),
            )
            if is_our_handler(spec.handler):
                loaded = self._our_handler(model, package, batch_size)
            else:
                # MMS's ``module:function``: initialised and called as MMS would, on this host's
                # device
                with self.board.running(model.slot):
                    loaded = load_model(spec, batch_size, "host", self.gpu, self.ordinal)
        except BaseException as exc:  # noqa: BLE001
            # boundary: user code's sys.exit too fails this LOAD alone
            model.failure = fail_load(spec, self.gpu, exc)
        else:
            model.loaded = loaded
            seconds = model.load_seconds if model.moved else time.time() - model.started
            if seconds is not None:
                metrics.record_model_load(seconds)
        finally:
            for fd in fds:
                os.close(fd)
            self.board.done()
        self._report(
            {
                "model": spec.name,
                "loaded": model.loaded is not None,
                "package_unused": model.package_unused,
            }
        )
        with model.lock:
            waiting, model.waiting = model.waiting, []
        for connection, assignment, adopted in waiting:
            self._connect(model, connection, assignment, adopted)
        # What loading freed goes back once the LOAD is answered (7 ms): after its first large free
        # glibc raises its mmap threshold, and later loads' buffers would stay as free heap.
        release_memory(None)
        model.loading = None  # done: an UNLOAD has nothing to wait for, and the thread goes

    def _our_handler(
        self, model: HostedModel, package: Package | None, batch_size: int
    ) -> LoadedModel:
        """The model's own ``HandlerService``: the package adopted (or ``model_fn`` run), placed,
        its threads marked as the model's on the crash board, its batching started."""
        spec = model.spec
        from handler_service import model_handler  # the handler layer, above this one

        loaded = model_handler(spec, self.config, self.gpu, self.ordinal, batch_size)
        handler = loaded.module
        context = loaded.service.context
        with self.board.running(model.slot):
            adopted = package is not None and handler.served.adopt(
                context, lambda: self._unpack(model, package), package.code, model.resolved
            )
            if package is not None and not adopted:  # its code changed: model_fn ran here instead
                model.borrowed_host_bytes, model.package_unused = 0, True
            handler.attach(context, model.resolved)
        if self.shared is not None:
            shared = self.shared
            handler.served.after_forward = lambda: shared.check_writes(spec.name)
        handler.served.thread_started = functools.partial(self.board.work_for, model.slot)
        handler.served.thread_ended = self.board.done
        handler.served.pass_threads = self.passes
        model.demand = start_batching(spec, self.config, loaded)
        self._record_memory(model, handler.served)
        return loaded

    def _unpack(self, hosted: HostedModel, package: Package) -> Any:
        """The model in the package; a package that another model here unpacked already (the same
        artifacts under two names: the warm process's package cache) gives the same object, so its
        weights are here once. On a GPU, its tensors held for other models too go to the card once
        (``DeviceTensors`` in ``tensor_store.py``)."""
        name = hosted.spec.name
        identity = (os.fstat(package.fd).st_ino, package.pickle_offset, package.pickle_bytes)
        with self._control_lock:
            model = self._unpacked.get(identity)
        if model is not None:
            logger.info(
                "model=%s takes the model its package already gave this host (one copy)", name
            )
            hosted.borrows_all = True
            if self.shared is not None:
                # its tensors on the card stay while it uses them, whoever brought them
                self.shared.join(
                    name,
                    [(package.segment_ids[blob.segment], blob.offset) for blob in package.blobs],
                )
            return model
        unpacked = unpack(package)
        model, module = unpacked.model, module_of(unpacked.model)
        if self.shared is not None and module is not None and unpacked.locations:
            hosted.borrowed_device_bytes = self.shared.place(module, unpacked.locations, name)
        with self._control_lock, contextlib.suppress(TypeError):
            # what cannot be weakly referenced is not shared
            self._unpacked[identity] = model
        return model

    def _new_bytes(self, package: Package | None) -> int | None:
        """What the package's tensors add to this host's GPU, beyond those its models hold there
        already."""
        if package is None or self.shared is None or not package.blobs:
            return None
        places = [
            ((package.segment_ids[blob.segment], blob.offset), blob.nbytes)
            for blob in package.blobs
        ]
        return self.shared.new_bytes(places)

    def _report(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        with self._control_lock:  # load threads report at once
            try:
                send(self.control, message, fds)
            except OSError:
                pass  # the warm process is gone: the main loop ends

    def _connect(
        self,
        model: HostedModel,
        connection: socket.socket,
        assignment: Assignment,
        adopted: bool = False,
    ) -> None:
        """Serves a connection of the model once it is loaded: its LOAD answered first, unless it is
        ``adopted`` from a host that answered it (``hand_over``)."""
        with model.lock:
            if model.loaded is None and model.failure is None:
                model.waiting.append((connection, assignment, adopted))
                return
        if model.failure is not None:
            arguments = (connection, model.failure, model.spec, self.config)
            threading.Thread(target=refuse_load, args=arguments, daemon=True).start()
            return
        try:
            if not adopted:
                answer_load(connection, model.spec)
        except OSError as exc:
            logger.debug(
                "model=%s connection closed before its LOAD was answered: %s", model.spec.name, exc
            )
            connection.close()
            return
        model.connections.add(connection)
        if model.demand is not None:
            model.demand.opened()
        self.turns.add(connection, functools.partial(self._turn, model))

    def _record_memory(self, model: HostedModel, loaded: Any) -> None:
        """What the model's LOAD added: a tensor held for another model first is that model's
        (counted once); a LoRA adapter's own tensors are its own."""
        own = loaded.model.model if isinstance(loaded.model, HuggingFaceModel) else loaded.model
        host_bytes, device_bytes = (0, 0) if model.borrows_all else tensor_bytes(own)
        host_bytes, device_bytes = (
            host_bytes - model.borrowed_host_bytes,
            device_bytes - model.borrowed_device_bytes,
        )
        if self.ordinal is None:
            host_bytes += loaded.adapter_bytes
        else:
            device_bytes += loaded.adapter_bytes
        metrics.record_host_bytes(model.series, max(0, host_bytes))
        if self.gpu is not None and devices.cuda_initialized():
            metrics.record_device_bytes(str(self.gpu), max(0, device_bytes))

    def _turn(self, model: HostedModel, connection: socket.socket) -> bool:
        """One message of the model's connection answered, on a worker thread that works for the
        model meanwhile (its metrics series, its cell on the crash board); False once the frontend
        has gone or the model was unloaded."""
        with model.turns_ended:
            model.turns += 1
            loaded = None if model.closing else model.loaded
        metrics.bind(model.series)
        self.board.work_for(model.slot)
        try:
            if loaded is None:
                raise ValueError("the model was unloaded")
            answer_message(
                connection, loaded, functools.partial(self.board.running, model.slot), model.demand
            )
            return True
        except (ValueError, OSError) as exc:
            # the frontend disconnected (mms.protocol raises ValueError): a normal end
            logger.debug("model=%s connection closed: %s", model.spec.name, exc)
            model.connections.discard(connection)
            if model.demand is not None:
                model.demand.closed()
            return False
        finally:
            self.board.done()
            metrics.bind(None)
            with model.turns_ended:
                model.turns -= 1
                model.turns_ended.notify_all()

    def _unload(self, model: HostedModel, successor: int | None) -> None:
        """Lets the model go, its connections handed to host ``successor`` first, if any
        (``host_unloads.py`` runs it)."""
        if successor is not None:
            self._hand_over(model, successor)
        self._let_go(model, successor)

    def _hand_over(self, model: HostedModel, successor: int) -> None:
        """The model's connections, each between two messages (MMS sends the next once answered: it
        waits in the socket), back to the warm process for host ``successor``, where a drained
        host's models move (``host_recycling.py``); kept open here until this host ends."""
        if (loading := model.loading) is not None:
            loading.join()
        # one whose frontend went meanwhile is closed here already
        connections = [c for c in list(model.connections) if self.turns.release(c)]
        model.connections.clear()
        self._handed_over += connections
        fds = [connection.fileno() for connection in connections]
        for start in range(0, max(len(fds), 1), MAX_FDS):  # the last says so
            last = start + MAX_FDS >= len(fds)
            handed = {"model": model.spec.name, "handed_over": True, "last": last}
            self._report(handed, fds[start : start + MAX_FDS])
        logger.info("model=%s handed over to device host pid=%d", model.spec.name, successor)

    def _let_go(self, model: HostedModel, successor: int | None = None) -> None:
        """Closes the model's connections, ends its batcher and drops every reference, then gives
        the memory back; its metrics go with it to host ``successor``, if it moved there."""
        # an UNLOAD during the load waits for it (read once: the load drops its thread at its end)
        if (loading := model.loading) is not None:
            loading.join()
        with model.turns_ended:
            model.closing = True  # no message is answered from now on
        with model.lock:
            waiting, model.waiting = model.waiting, []
        for connection, _, _ in waiting:
            connection.close()
        for connection in list(model.connections):
            try:
                connection.shutdown(socket.SHUT_RDWR)  # its thread wakes from its read and ends
            except OSError:
                pass
        with model.turns_ended:  # answered, but not yet counted: its metrics first
            model.turns_ended.wait_for(lambda: model.turns == 0, UNLOAD_SECONDS)
        started = time.monotonic()
        served = model.loaded is not None and successor is None  # a failed LOAD is no UNLOAD
        ours = None if model.loaded is None else getattr(model.loaded.module, "served", None)
        # what must be freed: a full collection only if a cycle keeps some of it alive
        leaving: list[Any] = [model.loaded]
        if ours is not None:  # our handler (one that is not ours has nothing to end)
            leaving += ours.parts(owns_model=not model.borrows_all)
            ours.close()
        model.loaded = ours = None
        if self.shared is not None:
            self.shared.release(model.spec.name)
        self.release.request(leaving)  # soon, once for every UNLOAD of a burst
        leaving.clear()
        if model.series is not None:
            model.series.close()
            # handed to the exporter once written to for the last time (a value made later would
            # find no directory), unless a LOAD of the same name that waited too long took it
            with self._directories:
                same_name = self.models.get(model.spec.name)
                if successor is not None:
                    metrics.hand_over(self.config, model.series, successor)
                elif same_name is None or same_name.series is None:
                    metrics.stop_hosted(self.config, model.series)
        metrics.bind(None)  # the container's count: the host's own series
        if served:
            metrics.record_unload(True, time.monotonic() - started)
        if successor is None:
            logger.info("model=%s unloaded from the device host", model.spec.name)


def run_host(control: socket.socket, config: Config, gpu: int | None, board: CrashBoard) -> int:
    """The host's life, in the child the warm process forked (``fork_child``); returns its exit
    status."""
    configure_logging(config.log_level)
    # MMS's per-request "[METRICS]" lines: the frontend files a model process's away, but a host's
    # stdout is the container's (a CloudWatch Logs line per request on SageMaker). Our own metrics
    # count every request.
    logging.getLogger("mms.service").setLevel(logging.WARNING)
    devices.set_threads(devices.DEFAULT_THREADS)
    metrics.start_container(config)  # the host's own directory; each model gets one of its own too
    crash_report = report_crashes(crash_report_path(config.runtime_dir, os.getpid()))
    DeviceHost(control, config, gpu, board).serve()
    crash_report.close()
    crash_report_path(config.runtime_dir, os.getpid()).unlink(missing_ok=True)
    return 0
