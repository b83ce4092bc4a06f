"""What a device host does for its models' memory: UNLOADs in a burst share one collection."""

from __future__ import annotations

import time

from mme_runtime.operations.memory import MemoryRelease


def wait_for(release: MemoryRelease, count: int, timeout: float = 5) -> int:
    deadline = time.monotonic() + timeout
    while release.releases < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return release.releases


def test_a_burst_of_unloads_is_one_collection_soon_after_the_last() -> None:
    release = MemoryRelease(lambda: None, settle_seconds=0.1, most_seconds=2)
    for _ in range(50):
        release.request()
        time.sleep(0.002)
    started = time.monotonic()
    assert wait_for(release, 1) == 1 and time.monotonic() - started < 1
    time.sleep(0.3)
    assert release.releases == 1


def test_a_steady_stream_of_unloads_still_gets_its_memory_back_every_so_often() -> None:
    release = MemoryRelease(lambda: None, settle_seconds=0.1, most_seconds=0.2)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        release.request()
        time.sleep(0.05)
    assert wait_for(release, 2) >= 2
