"""The janitor unregisters what MMS leaves registered after a LOAD failed with our status, and only that: against
a stand-in for MMS's management API, through the states a failing LOAD passes (still loading when the marker is
written, briefly unregistered, then put back with no worker)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_management import FakeManagement, running_management

from mme_runtime.base import janitor
from mme_runtime.base.janitor import Janitor, mark_failed_load

LOADING = {"modelName": "m", "maxWorkers": 1, "workers": [{"status": "UNLOADING"}]}
LEFTOVER = {"modelName": "m", "maxWorkers": 0, "workers": []}
SERVING = {"modelName": "m", "maxWorkers": 1, "workers": [{"status": "READY"}]}


@pytest.fixture
def management() -> Iterator[FakeManagement]:
    with running_management() as server:
        yield server


def later(seconds: float, change: dict[str, object] | None, management: FakeManagement) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: setattr(management, "description", change))
    timer.start()
    return timer


def test_the_leftover_is_unregistered_though_the_marker_was_written_while_loading(
    management: FakeManagement, tmp_path: Path
) -> None:
    # The worker writes its marker before it answers: the first sweeps still see the failing LOAD's own worker.
    management.description = LOADING
    mark_failed_load(tmp_path, "m", 403)
    later(0.1, None, management)
    later(0.2, LEFTOVER, management)
    sweeper = Janitor(tmp_path, management.port)
    deadline = time.monotonic() + 5
    while management.calls == [] and time.monotonic() < deadline:
        sweeper.sweep()
    assert management.calls == ["DELETE /models/m"]
    assert not list(janitor.markers_dir(tmp_path).iterdir())


def test_a_model_loaded_properly_since_is_left_alone(
    management: FakeManagement, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    management.description = SERVING
    mark_failed_load(tmp_path, "m", 507)
    sweeper = Janitor(tmp_path, management.port)
    monkeypatch.setattr(janitor, "FOLLOW_SECONDS", 0.1)
    sweeper.sweep()
    assert list(janitor.markers_dir(tmp_path).iterdir()), "a young marker is kept: its LOAD may still be failing"
    monkeypatch.setattr(janitor, "SETTLE_SECONDS", 0.0)
    sweeper.sweep()
    assert management.calls == [] and not list(janitor.markers_dir(tmp_path).iterdir())
