"""What a device host does for its models' memory: UNLOADs in a burst share one collection, and a finished one
leaves nothing behind."""

from __future__ import annotations

import gc
import socket
import threading
import time
from pathlib import Path
from typing import Any

from mme_runtime.base.config import Config
from mme_runtime.models.loading import ModelSpec
from mme_runtime.operations.memory import MemoryRelease
from mme_runtime.processes.crash_board import CrashBoard
from mme_runtime.processes.device_host import DeviceHost
from mme_runtime.processes.hosted_model import HostedModel


def wait_for(release: MemoryRelease, count: int, timeout: float = 5) -> int:
    deadline = time.monotonic() + timeout
    while release.releases < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return release.releases


def test_a_burst_of_unloads_is_one_collection_soon_after_the_last() -> None:
    release = MemoryRelease(lambda collect: None, settle_seconds=0.1, most_seconds=2)
    for _ in range(50):
        release.request()
        time.sleep(0.002)
    started = time.monotonic()
    assert wait_for(release, 1) == 1 and time.monotonic() - started < 1
    time.sleep(0.3)
    assert release.releases == 1


def test_a_steady_stream_of_unloads_still_gets_its_memory_back_every_so_often() -> None:
    release = MemoryRelease(lambda collect: None, settle_seconds=0.1, most_seconds=0.2)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        release.request()
        time.sleep(0.05)
    assert wait_for(release, 2) >= 2


class Part:
    """Something an UNLOAD lets go of."""

    def __init__(self) -> None:
        self.me: Any = None


def test_a_full_collection_runs_only_when_a_cycle_keeps_what_an_unload_let_go_of() -> None:
    # A full collection holds the interpreter lock over every model's objects (260 ms at 1,000 models): the models
    # that stay answer late meanwhile (issue #37). What refcounting freed needs none.
    asked: list[bool] = []
    release = MemoryRelease(asked.append, settle_seconds=0.05, most_seconds=0.5)
    gc.disable()  # the test's own collections decide
    try:
        freed = Part()
        release.request([freed, None])  # None: nothing to watch
        del freed
        assert wait_for(release, 1) == 1
        cyclic = Part()
        cyclic.me = cyclic  # only a collection frees it
        release.request([cyclic])
        del cyclic
        # alive at its first release (a worker could still hold it): the next one collects
        assert wait_for(release, 3) == 3
        release.request([{"model": "a dict cannot be watched"}])
        assert wait_for(release, 4) == 4
    finally:
        gc.enable()
    assert asked == [False, False, True, True]
    assert release.collections == 2


def test_an_unload_that_is_done_leaves_nothing_of_itself_in_its_host(tmp_path: Path) -> None:
    # The last UNLOADs of a burst had their finished threads kept until the next UNLOAD: about 100 after a mass
    # UNLOAD, whose small objects pinned the host's heap where the models had been (issue #37).
    left, right = socket.socketpair()
    host = DeviceHost(left, Config.from_env({"MME_RUNTIME_DIR": str(tmp_path)}), None, CrashBoard())
    host.release = MemoryRelease(lambda collect: None)
    loads_end = threading.Event()  # each UNLOAD waits for its model's LOAD first
    try:
        for name in ("a", "b", "c"):
            model = HostedModel(ModelSpec(name, str(tmp_path), "handler", str(tmp_path)), 0, None)
            model.loading = threading.Thread(target=loads_end.wait, daemon=True)
            model.loading.start()
            host.models[name] = model
            host._dispatch({"op": "unload", "model": name}, [])
        under_way = host.unloads.under_way()
        assert len(under_way) == 3  # a LOAD of one of these names now would wait for its UNLOAD
        loads_end.set()
        assert all(done.wait(5) for done in under_way)
        assert host.unloads.under_way() == []
    finally:
        left.close()
        right.close()


def test_a_load_that_is_done_leaves_no_thread_in_its_model(tmp_path: Path) -> None:
    # A model kept its finished LOAD's thread (with its event, condition and lock, about 1.5 KiB) for as long as it was
    # loaded: at thousands of models, heap that stays after they go (issue #37).
    from serving import wait_until

    left, right = socket.socketpair()
    config = Config.from_env({"MME_RUNTIME_DIR": str(tmp_path), "MME_METRICS_PORT": "0"})
    host = DeviceHost(left, config, None, CrashBoard())
    spec = ModelSpec("a", str(tmp_path / "nothing-here"), "handler_service", str(tmp_path))
    message = {"spec": vars(spec), "slot": 0, "started": time.time(), "batch_size": 1}
    try:
        host._dispatch({"op": "load", "model": "a", **message}, [])
        model = host.models["a"]
        assert wait_until(lambda: model.loading is None, timeout=10, interval=0.01)
        assert model.failure is not None  # it had nothing to load: done all the same
    finally:
        left.close()
        right.close()
