"""Memory honesty before a load: estimate what the model needs and refuse (507) what will not fit;
and memory given back after UNLOADs (``MemoryRelease``).

The estimate is the size of the model's artifacts (what a loaded PyTorch model roughly occupies),
against the host's available memory in the server and, in a worker bound to a GPU, that GPU's free
memory as nvidia-smi reports it: asking NVML through nvidia-smi keeps CUDA uninitialised. SageMaker
answers a 507 by unloading other models and retrying the LOAD.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil
import torch

from mme_runtime.base import devices, failures
from mme_runtime.base.child_processes import trim_heap
from mme_runtime.base.errors import InsufficientMemory
from mme_runtime.base.nvidia import gpu_free_bytes
from mme_runtime.base.parsing import MIB

logger = logging.getLogger(__name__)

SKIPPED_DIRECTORIES = frozenset({"code"})
# The container's page cache that the kernel reclaims first (cgroup v2, then v1).
CGROUP_MEMORY_STAT = (
    (Path("/sys/fs/cgroup/memory.stat"), "inactive_file"),
    (Path("/sys/fs/cgroup/memory/memory.stat"), "total_inactive_file"),
)


def artifact_bytes(model_dir: Path) -> int:
    """Apparent size of the model's files, its code excepted (a sparse file counts at its full
    size)."""
    total = 0
    for path in model_dir.rglob("*"):
        if path.is_file() and not SKIPPED_DIRECTORIES.intersection(
            path.relative_to(model_dir).parts
        ):
            total += path.stat().st_size
    return total


def needs(model_bytes: int, headroom_mb: int) -> str:
    """``needs about X MiB (the model's M MiB + MME_MEMORY_HEADROOM_MB=H)``: what a refused LOAD
    asked for."""
    needed = (model_bytes + headroom_mb * MIB) // MIB
    return (
        f"needs about {needed} MiB (the model's {model_bytes // MIB} MiB + "
        f"MME_MEMORY_HEADROOM_MB={headroom_mb})"
    )


def available_bytes() -> tuple[int, str]:
    """The host memory a LOAD may still take, and whose bound that is: the system's available
    memory, or in a container whose cgroup sets a lower limit, what that limit leaves (its inactive
    page cache counted as free: the kernel reclaims it first). /proc/meminfo, which psutil reads,
    knows nothing of the container's limit."""
    available = psutil.virtual_memory().available
    limit = failures.cgroup_memory()
    if limit is not None:
        used, most = limit
        in_container = most - used + _inactive_file_bytes()
        if in_container < available:
            return max(0, in_container), f"of the container's {most // MIB} MiB limit"
    return available, "on the host"


def check_host_memory(model_dir: Path, headroom_mb: int) -> None:
    """Raises InsufficientMemory when the artifacts plus headroom exceed the host's available
    memory."""
    model_bytes = artifact_bytes(model_dir)
    available, bound = available_bytes()
    if model_bytes + headroom_mb * MIB > available:
        raise InsufficientMemory(
            f"out of host memory: {needs(model_bytes, headroom_mb)}, {available // MIB} MiB "
            f"available {bound}"
        )


def _inactive_file_bytes() -> int:
    for path, key in CGROUP_MEMORY_STAT:
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        except (OSError, ValueError):
            continue
    return 0


def check_context_memory(model_dir: Path, headroom_mb: int, model_bytes: int | None = None) -> bool:
    """In a process whose CUDA context exists (a device host): the artifacts plus headroom against
    what that context can still allocate, the card's free memory plus what torch's caching allocator
    holds unused. False when this process has no CUDA context (nothing checked: never create one for
    this). ``model_bytes``: what the model adds there when that is known to be less than its
    artifacts (tensors it shares with models already on the card)."""
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return False
    free, _ = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    model_bytes = artifact_bytes(model_dir) if model_bytes is None else model_bytes
    if model_bytes + headroom_mb * MIB > free:
        raise InsufficientMemory(
            f"out of GPU memory: {needs(model_bytes, headroom_mb)}, {free // MIB} MiB free to this "
            "process's CUDA context (the card's free memory and torch's unused cache)"
        )
    return True


def check_gpu_memory(model_dir: Path, gpu: str, headroom_mb: int) -> None:
    """Raises InsufficientMemory when the artifacts plus headroom exceed the free memory of ``gpu``
    (an nvidia-smi index or UUID: the physical card)."""
    free = gpu_free_bytes(gpu)
    if free is None:
        return
    model_bytes = artifact_bytes(model_dir)
    if model_bytes + headroom_mb * MIB > free:
        raise InsufficientMemory(
            f"out of GPU memory: {needs(model_bytes, headroom_mb)}, {free // MIB} MiB free on GPU "
            f"{gpu} (nvidia-smi)"
        )


def release_memory(ordinal: int | None) -> None:
    """Freed tensors back to the system: glibc keeps freed heap unless asked, torch keeps freed GPU
    blocks cached."""
    trim_heap()
    if ordinal is not None and devices.cuda_initialized():
        torch.cuda.empty_cache()


class MemoryRelease:
    """Gives the memory of UNLOADed models back with ``release`` once for a burst of UNLOADs:
    ``settle_seconds`` after the last, at most ``most_seconds`` after the first. ``release`` is told
    whether a full collection is needed: only when something an UNLOAD let go of (``request``) is
    still alive at a release and at the next, held by a reference cycle. A full collection holds
    the interpreter lock over every model's objects (260 ms at 1,000 models on the 2-core VM), and
    the models that stay wait for it: a model invoked meanwhile answered in 312 ms instead of 30.
    An UNLOAD whose model leaves no cycle behind (the collector found none but a metrics value
    class per model, now reused, and ctypes' per-call classes) costs them only the heap's trim."""

    def __init__(
        self,
        release: Callable[[bool], None],
        settle_seconds: float = 0.2,
        most_seconds: float = 1.0,
    ) -> None:
        self._release = release
        self._settle, self._most = settle_seconds, most_seconds
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._leaving: list[weakref.ref[Any]] = []  # what the burst's UNLOADs let go of
        self._collect = False  # something that cannot be watched: collect to be sure
        self.releases = 0  # done so far
        self.collections = 0  # of them, with a full collection
        threading.Thread(target=self._run, name="memory-release", daemon=True).start()

    @staticmethod
    def of_host(ordinal: int | None) -> MemoryRelease:
        def release(collect: bool) -> None:
            if collect:
                gc.collect()
            release_memory(ordinal)

        return MemoryRelease(release)

    def request(self, leaving: Iterable[Any] = ()) -> None:
        """An UNLOAD let go of ``leaving`` (its model, its handler, its modules): their memory goes
        back soon, with a full collection if a cycle keeps any of them alive till then."""
        with self._lock:
            for part in leaving:
                try:
                    self._leaving.append(weakref.ref(part))
                except TypeError:  # cannot be watched (None is nothing to watch)
                    self._collect = self._collect or part is not None
        self._wanted.set()

    def _run(self) -> None:
        # alive at the last release: held by a thread that is ending, or by a cycle
        waiting: list[weakref.ref[Any]] = []
        while True:
            self._wanted.wait()
            first = time.monotonic()
            self._wanted.clear()
            while time.monotonic() - first < self._most and self._wanted.wait(self._settle):
                self._wanted.clear()  # another UNLOAD of the burst: wait for the last
            with self._lock:
                leaving, self._leaving = self._leaving, []
                collect, self._collect = self._collect, False
            # Alive at two releases in a row: a cycle holds it (a worker that still answered the
            # model's last message when the release ran has ended by the next one).
            collect = collect or any(part() is not None for part in waiting)
            waiting = [] if collect else [part for part in leaving if part() is not None]
            if waiting:
                self._wanted.set()  # looked at again, a settle later
            del leaving
            self._release(collect)
            self.releases += 1
            self.collections += collect
