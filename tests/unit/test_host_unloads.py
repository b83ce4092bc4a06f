"""A device host's UNLOADs (host_unloads.py): a burst runs in turn on one thread, an UNLOAD that must wait holds up
no other, and a LOAD of a name still being let go waits for it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mme_runtime.models.loading import ModelSpec
from mme_runtime.processes.host_unloads import Unloads
from mme_runtime.processes.hosted_model import HostedModel


def model(name: str, tmp_path: Path) -> HostedModel:
    return HostedModel(ModelSpec(name, str(tmp_path), "handler", str(tmp_path)), 0, None)


def test_a_burst_of_unloads_runs_in_turn_on_one_thread(tmp_path: Path) -> None:
    # A thread per UNLOAD left hundreds alive in a host during a drain of 2,000 models (issue #37).
    threads: list[str] = []
    gate = threading.Event()  # the first waits: the burst queues behind it

    def let_go_of(leaving: HostedModel, successor: int | None) -> None:
        gate.wait(5)
        threads.append(threading.current_thread().name)

    unloads = Unloads(let_go_of)
    models = [model(f"m{index}", tmp_path) for index in range(50)]
    for leaving in models:
        unloads.start(leaving)
    under_way = unloads.under_way()
    assert len(under_way) == 50
    gate.set()
    assert all(done.wait(5) for done in under_way)
    assert threads == ["unloads"] * 50
    assert unloads.under_way() == []  # each left once done: nothing of it kept


def test_an_unload_that_must_wait_holds_up_no_other(tmp_path: Path) -> None:
    loads_end = threading.Event()
    let_go: dict[str, threading.Event] = {name: threading.Event() for name in ("loading", "answering", "idle")}

    def let_go_of(leaving: HostedModel, successor: int | None) -> None:
        if leaving.loading is not None:  # as DeviceHost._let_go: the model's LOAD first
            leaving.loading.join()
        let_go[leaving.spec.name].set()

    unloads = Unloads(let_go_of)
    loading, answering, idle = model("loading", tmp_path), model("answering", tmp_path), model("idle", tmp_path)
    loading.loading = threading.Thread(target=loads_end.wait, daemon=True)
    loading.loading.start()
    answering.turns = 1
    for leaving in (loading, answering, idle):
        unloads.start(leaving)
    assert let_go["idle"].wait(5) and let_go["answering"].wait(5)
    assert not let_go["loading"].is_set()
    loads_end.set()
    assert let_go["loading"].wait(5)


def test_a_load_of_a_name_being_let_go_waits_for_that_unload(tmp_path: Path) -> None:
    release = threading.Event()
    unloads = Unloads(lambda leaving, successor: release.wait(5))
    unloads.start(model("a", tmp_path))
    after = unloads.pending("a")  # the LOAD of "a" takes it
    assert after is not None and not after.wait(0.1)
    assert unloads.pending("a") is None and unloads.under_way() == []
    release.set()
    assert after.wait(5)


def test_one_unload_that_fails_leaves_the_next_one_to_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    next_one = threading.Event()

    def let_go_of(leaving: HostedModel, successor: int | None) -> None:
        if leaving.spec.name == "broken":
            raise RuntimeError("its handler's close raised")
        next_one.set()

    unloads = Unloads(let_go_of)
    unloads.start(model("broken", tmp_path))
    unloads.start(model("next", tmp_path))
    assert next_one.wait(5)
    assert "model=broken: its UNLOAD failed in the device host" in caplog.text
