"""A device host's UNLOADs (host_unloads.py): a burst runs in turn on one thread, an UNLOAD that must wait holds up
no other, and a LOAD of a name still being let go waits for it."""

from __future__ import annotations

import threading
import time
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
    loads_end, answered = threading.Event(), threading.Event()
    let_go: dict[str, threading.Event] = {name: threading.Event() for name in ("loading", "answering", "idle")}

    def let_go_of(leaving: HostedModel, successor: int | None) -> None:
        if leaving.loading is not None:  # as DeviceHost._let_go: the model's LOAD first
            leaving.loading.join()
        if leaving.turns:  # then the requests it took
            answered.wait(5)
        let_go[leaving.spec.name].set()

    unloads = Unloads(let_go_of)
    loading, answering, idle = model("loading", tmp_path), model("answering", tmp_path), model("idle", tmp_path)
    loading.loading = threading.Thread(target=loads_end.wait, daemon=True)
    loading.loading.start()
    answering.turns = 1
    for leaving in (loading, answering, idle):
        unloads.start(leaving)
    assert let_go["idle"].wait(5)
    assert not let_go["loading"].is_set() and not let_go["answering"].is_set()
    loads_end.set()
    answered.set()
    assert let_go["loading"].wait(5) and let_go["answering"].wait(5)


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


def test_an_unload_stuck_in_turn_is_left_to_itself_and_the_others_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A handler's close that joins a pass still running user code after its request timed out never returns.
    never = threading.Event()
    let_go: dict[str, threading.Event] = {name: threading.Event() for name in ("queued", "next")}

    def let_go_of(leaving: HostedModel, successor: int | None) -> None:
        if leaving.spec.name == "stuck":
            never.wait(10)
        else:
            let_go[leaving.spec.name].set()

    unloads = Unloads(let_go_of, stuck_seconds=0.2)
    try:
        unloads.start(model("stuck", tmp_path))
        unloads.start(model("queued", tmp_path))  # behind it
        assert not let_go["queued"].wait(0.4)
        unloads.start(model("next", tmp_path))  # finds it stuck: another thread for the rest
        assert let_go["queued"].wait(5) and let_go["next"].wait(5)
        assert "one UNLOAD has held the device host's others" in caplog.text
    finally:
        never.set()


def test_a_host_that_ends_waits_for_its_unloads_once_in_all(tmp_path: Path) -> None:
    never = threading.Event()
    unloads = Unloads(lambda leaving, successor: never.wait(10), stuck_seconds=60)
    try:
        for index in range(5):
            unloads.start(model(f"m{index}", tmp_path))
        started = time.monotonic()
        unloads.wait(0.2)
        assert time.monotonic() - started < 0.6  # not 0.2 for each of the 5
    finally:
        never.set()


def test_an_unload_with_no_thread_to_run_it_leaves_nothing_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = threading.Event()
    unloads = Unloads(lambda leaving, successor: done.set())

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", no_thread)
        with pytest.raises(RuntimeError):
            unloads.start(model("a", tmp_path))
    assert unloads.under_way() == []  # a LOAD of "a" does not wait for it
    unloads.start(model("b", tmp_path))  # the next one starts the thread
    assert done.wait(5)
