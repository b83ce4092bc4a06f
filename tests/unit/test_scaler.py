"""The scaler raises a batching model's workers only once its LOAD has answered: against a stand-in for MMS's
management API, it waits until the model has been READY for ``READY_SECONDS``, scales it once, and never lowers a
minimum set higher."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_management import FakeManagement, running_management

from mme_runtime.operations import scaler
from mme_runtime.operations.scaler import Scaler, request_workers


def describe(status: str, min_workers: int = 1) -> dict[str, object]:
    return {"modelName": "m", "minWorkers": min_workers, "workers": [{"status": status}]}


@pytest.fixture
def management() -> Iterator[FakeManagement]:
    with running_management() as server:
        server.description = describe("UNLOADING")
        yield server


def test_a_model_is_scaled_once_it_has_been_ready_for_a_while(
    management: FakeManagement, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr(scaler.time, "monotonic", lambda: clock[0])
    request_workers(tmp_path, "m", 4)
    sweeper = Scaler(tmp_path, management.port, devices=2)
    sweeper.sweep()  # still loading
    management.description = describe("READY")
    sweeper.sweep()  # READY, but its LOAD may not have answered yet
    clock[0] += scaler.READY_SECONDS / 2
    sweeper.sweep()
    assert management.calls == []
    clock[0] += scaler.READY_SECONDS
    sweeper.sweep()
    assert management.calls == ["PUT /models/m?min_worker=8&max_worker=8&synchronous=false"]
    sweeper.sweep()  # the request is done: no second call
    assert len(management.calls) == 1 and not list(scaler.requests_dir(tmp_path).iterdir())


def test_a_minimum_set_higher_is_left_alone(management: FakeManagement, tmp_path: Path) -> None:
    management.description = describe("READY", min_workers=32)
    request_workers(tmp_path, "m", 4)
    Scaler(tmp_path, management.port, devices=1).sweep()
    assert management.calls == [] and not list(scaler.requests_dir(tmp_path).iterdir())


def test_a_request_from_a_serving_model_is_acted_on_at_once(management: FakeManagement, tmp_path: Path) -> None:
    management.description = describe("READY", min_workers=2)
    request_workers(tmp_path, "m", 16, serving=True)
    Scaler(tmp_path, management.port, devices=1).sweep()
    assert management.calls == ["PUT /models/m?min_worker=16&max_worker=16&synchronous=false"]


def test_a_request_written_while_an_earlier_one_is_handled_is_kept(
    management: FakeManagement, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    management.description = describe("READY", min_workers=2)
    request_workers(tmp_path, "m", 2)  # the LOAD's ask, already met
    sweeper = Scaler(tmp_path, management.port, devices=1)
    settle = sweeper._settle

    def settle_while_the_model_asks_again(*args: object) -> bool:
        request_workers(tmp_path, "m", 16, serving=True)
        return settle(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sweeper, "_settle", settle_while_the_model_asks_again)
    sweeper.sweep()
    assert [json.loads(path.read_text())["per_device"] for path in scaler.requests_dir(tmp_path).iterdir()] == [16]
