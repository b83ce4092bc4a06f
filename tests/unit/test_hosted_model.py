"""What a device host does for its models' memory: UNLOADs in a burst share one collection."""

from __future__ import annotations

import gc
import time
from typing import Any

from mme_runtime.operations.memory import MemoryRelease


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
