"""A stand-in for MMS's management API: describes one model as MMS does (a list of its versions) and records the
calls that change it, for the entrypoint's sweeps (scaler, janitor) to be tested without a frontend."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeManagement(ThreadingHTTPServer):
    """``description`` is what a GET of the model answers (None: 404, not registered); PUTs and DELETEs are
    recorded in ``calls`` as "METHOD path"."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.description: dict[str, Any] | None = None
        self.calls: list[str] = []

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    server: FakeManagement

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.server.description is None:
            self._answer(404, {"code": 404, "message": "Model not found"})
        else:
            self._answer(200, [self.server.description])

    def do_PUT(self) -> None:  # noqa: N802
        self.server.calls.append(f"PUT {self.path}")
        self._answer(202, {"status": "Processing worker updates..."})

    def do_DELETE(self) -> None:  # noqa: N802
        self.server.calls.append(f"DELETE {self.path}")
        self.server.description = None
        self._answer(200, {"status": "Model unregistered"})

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def running_management() -> Iterator[FakeManagement]:
    server = FakeManagement()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
