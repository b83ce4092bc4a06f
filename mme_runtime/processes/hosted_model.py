"""One model in a device host: its state there, a handler of its own, and the memory its tensors take and give back.

``device_host.py`` keeps one ``HostedModel`` per model it serves; nothing here talks to the warm process.
"""

from __future__ import annotations

import ctypes
import gc
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from mms.service import Service

from mme_runtime.base import devices
from mme_runtime.base.config import Config
from mme_runtime.huggingface.loading import HuggingFaceModel
from mme_runtime.models.loading import LoadedModel, LoadFailure, ModelSpec
from mme_runtime.operations.metric_series import Series
from mme_runtime.processes.executor import Assignment
from mme_runtime.serving.connection_demand import ConnectionDemand


@dataclass
class HostedModel:
    """One model in the host: its handler once loaded, or why it failed, and the connections that wait or run."""

    spec: ModelSpec
    slot: int
    series: Series | None  # its metrics
    loaded: LoadedModel | None = None
    failure: LoadFailure | None = None
    waiting: list[tuple[socket.socket, Assignment]] = field(default_factory=list)
    connections: set[socket.socket] = field(default_factory=set)
    demand: ConnectionDemand | None = None  # a batching model's busy connections, to open more (connection_demand.py)
    lock: threading.Lock = field(default_factory=threading.Lock)
    loading: threading.Thread | None = None
    borrowed_host_bytes: int = 0  # its tensors in host memory that another model brought (held once, theirs)
    borrowed_device_bytes: int = 0  # the same on its GPU
    borrows_all: bool = False  # it took the very model another one here unpacked (one package: all of it theirs)
    started: float = 0.0  # when its LOAD began (wall clock, the warm process's): its load time is counted from it
    after: threading.Thread | None = None  # the UNLOAD of a model of the same name, to end before this one loads
    package_unused: bool = False  # its package was made with other code: model_fn ran here


def model_handler(
    spec: ModelSpec, config: Config, gpu: int | None, ordinal: int | None, batch_size: int
) -> LoadedModel:
    """A handler of the model's own (the module-level ``handler_service`` one is one per process), wrapped in MMS's
    ``Service`` as the executor's is."""
    from handler_service import HandlerService

    handler = HandlerService(config)

    def entry_point(data: Any, context: Any) -> Any:
        if data is None:
            handler.initialize(context)
            return None
        return handler.handle(data, context)

    service = Service(spec.name, spec.model_dir, None, entry_point, ordinal, batch_size)
    devices.record_gpu(service.context.system_properties, gpu, ordinal)
    return LoadedModel(handler, service)


def tensor_bytes(model: Any) -> tuple[int, int]:
    """The bytes of a module's parameters and buffers in host memory and on a GPU, each storage once (tied weights
    share one); (0, 0) for what is not a module."""
    if isinstance(model, HuggingFaceModel):
        model = model.model
    if not isinstance(model, torch.nn.Module):
        return 0, 0
    seen: set[int] = set()
    host = device = 0
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        if tensor.device.type == "cpu":
            host += storage.nbytes()
        else:
            device += storage.nbytes()
    return host, device


def release_memory(ordinal: int | None) -> None:
    """Freed tensors back to the system: glibc keeps freed heap unless asked, torch keeps freed GPU blocks cached."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    if ordinal is not None and devices.cuda_initialized():
        torch.cuda.empty_cache()


class MemoryRelease:
    """Gives the memory of UNLOADed models back with ``release`` (a full collection, as a model's objects may hold
    reference cycles, then ``release_memory``) once for a burst of UNLOADs: ``settle_seconds`` after the last, at
    most ``most_seconds`` after the first. A collection per UNLOAD held the interpreter lock over every model's
    objects each time (110 ms at 1,000 models), so draining a host was quadratic and its other models stalled."""

    def __init__(self, release: Callable[[], None], settle_seconds: float = 0.2, most_seconds: float = 1.0) -> None:
        self._release = release
        self._settle, self._most = settle_seconds, most_seconds
        self._wanted = threading.Event()
        self.releases = 0  # done so far
        threading.Thread(target=self._run, name="memory-release", daemon=True).start()

    @staticmethod
    def of_host(ordinal: int | None) -> MemoryRelease:
        def release() -> None:
            gc.collect()
            release_memory(ordinal)

        return MemoryRelease(release)

    def request(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            first = time.monotonic()
            self._wanted.clear()
            while time.monotonic() - first < self._most and self._wanted.wait(self._settle):
                self._wanted.clear()  # another UNLOAD of the burst: wait for the last
            self._release()
            self.releases += 1
