"""The scaler raises a batching model's workers only once its LOAD has answered: against a stand-in for MMS's
management API, it waits until the model has been READY for ``READY_SECONDS``, scales it once, and never lowers a
minimum set higher."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from mme_runtime.operations import scaler
from mme_runtime.operations.scaler import Scaler, request_workers


class FakeManagement(ThreadingHTTPServer):
    """Describes one model as MMS does, and records the scale calls it gets."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status = "UNLOADING"
        self.min_workers = 1
        self.scale_calls: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    server: FakeManagement

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = [{"modelName": "m", "minWorkers": self.server.min_workers, "workers": [{"status": self.server.status}]}]
        self._answer(body)

    def do_PUT(self) -> None:  # noqa: N802
        self.server.scale_calls.append(self.path)
        self._answer({"status": "Processing worker updates..."})

    def _answer(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def management() -> Iterator[FakeManagement]:
    server = FakeManagement()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_model_is_scaled_once_it_has_been_ready_for_a_while(
    management: FakeManagement, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr(scaler.time, "monotonic", lambda: clock[0])
    request_workers(tmp_path, "m", 4)
    sweeper = Scaler(tmp_path, management.server_address[1], devices=2)
    sweeper.sweep()  # still loading
    management.status = "READY"
    sweeper.sweep()  # READY, but its LOAD may not have answered yet
    clock[0] += scaler.READY_SECONDS / 2
    sweeper.sweep()
    assert management.scale_calls == []
    clock[0] += scaler.READY_SECONDS
    sweeper.sweep()
    assert management.scale_calls == ["/models/m?min_worker=8&max_worker=8&synchronous=false"]
    sweeper.sweep()  # the request is done: no second call
    assert len(management.scale_calls) == 1 and not list(scaler.requests_dir(tmp_path).iterdir())


def test_a_minimum_set_higher_is_left_alone(management: FakeManagement, tmp_path: Path) -> None:
    management.status, management.min_workers = "READY", 32
    request_workers(tmp_path, "m", 4)
    Scaler(tmp_path, management.server_address[1], devices=1).sweep()
    assert management.scale_calls == [] and not list(scaler.requests_dir(tmp_path).iterdir())
