"""Gives a batching model the frontend connections that fill its batches.

MMS sends a model at most one request per worker connection at a time, so a batch of ``batch_size``
needs that many connections per device. They cost a frontend thread and a device host thread each,
not a process or a copy of the weights. A batching model's device host asks for them in two steps
(``ConnectionDemand`` in ``serving/connection.py``): a few at LOAD, the whole batch once its
requests overlap. Each ask is a request file in the runtime directory; the entrypoint's supervisor,
which knows the management port, raises the model's worker count with MMS's scale call (``PUT
/models/{name}?min_worker=N``). The LOAD's ask waits until the LOAD has completed, and half a second
more: MMS answers a LOAD after its worker is READY, comparing its workers with the model's minimum
then, so a minimum raised in between would turn that LOAD's 200 into 210 "Workers scaling in
progress...". An ask from a model that serves is acted on at once. It never lowers a count someone
set higher. Neither side imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from mme_runtime.base.janitor import REQUEST_TIMEOUT_SECONDS, get_json, write_marker

logger = logging.getLogger(__name__)

# a LOAD slower than this gets no extra connections: the log says so
REQUEST_LIFETIME_SECONDS = 120.0
# how long a model is seen READY before it is scaled: its LOAD's answer has left by then
READY_SECONDS = 0.5


def requests_dir(runtime_dir: Path) -> Path:
    return runtime_dir / "worker-requests"


def request_workers(
    runtime_dir: Path, model_name: str, per_device: int, serving: bool = False
) -> None:
    """Written by a device host: ``model_name`` wants ``per_device`` frontend connections on each
    device. ``serving``: asked by a model that answers requests, so its LOAD has answered and the
    scaler need not wait."""
    write_marker(
        requests_dir(runtime_dir), model_name, {"per_device": per_device, "serving": serving}
    )


class Scaler:
    """Raises models' worker counts as their device hosts asked, on ``devices`` devices (GPUs, or 1
    for the CPU)."""

    def __init__(self, runtime_dir: Path, port: int, devices: int) -> None:
        self.directory = requests_dir(runtime_dir)
        self.base = f"http://127.0.0.1:{port}/models/"
        self.devices = max(1, devices)
        self._ready_since: dict[str, float] = {}  # model: when a sweep first saw it READY

    def sweep(self) -> None:
        if not self.directory.is_dir():
            return
        for request in self.directory.iterdir():
            if request.name.startswith("."):
                continue
            try:
                written = request.stat()
                wanted = json.loads(request.read_text())
            except (OSError, ValueError):
                continue
            model = str(wanted["model"])
            workers = int(wanted["per_device"]) * self.devices
            if self._settle(
                model, workers, time.time() - written.st_mtime, bool(wanted.get("serving"))
            ):
                self._ready_since.pop(model, None)
                with contextlib.suppress(OSError):
                    if request.stat().st_ino == written.st_ino:
                        # else a newer request replaced it meanwhile
                        request.unlink()

    def _settle(self, model: str, workers: int, age: float, serving: bool) -> bool:
        """True once nothing is left to do for this request."""
        url = self.base + urllib.parse.quote(model, safe="")
        description = get_json(url)
        if isinstance(description, list):  # MMS describes a model as a list of its versions
            description = description[0] if description else None
        expired = age > REQUEST_LIFETIME_SECONDS
        if not isinstance(description, dict) or not any(
            worker.get("status") == "READY" for worker in description.get("workers") or []
        ):
            # Not registered, or its LOAD has not completed: scaling now would race the LOAD's own
            # workers.
            if expired:
                logger.warning(
                    "model=%s never became ready: its %d batching workers were not added",
                    model,
                    workers,
                )
            return expired
        if int(description.get("minWorkers") or 0) >= workers:
            return True
        if (
            not serving
            and time.monotonic() - self._ready_since.setdefault(model, time.monotonic())
            < READY_SECONDS
        ):
            return False  # its LOAD may not have answered yet
        # never lower a maximum set higher
        maximum = max(workers, int(description.get("maxWorkers") or 0))
        query = urllib.parse.urlencode(
            {"min_worker": workers, "max_worker": maximum, "synchronous": "false"}
        )
        try:
            urllib.request.urlopen(
                urllib.request.Request(f"{url}?{query}", method="PUT"),
                timeout=REQUEST_TIMEOUT_SECONDS,
            )
        except (urllib.error.URLError, OSError) as exc:
            logger.warning("model=%s could not be scaled to %d workers: %s", model, workers, exc)
            return expired  # tried again at the next sweep, until the request expires
        logger.info(
            "model=%s scaled to %d workers to fill its batches on %d device(s)",
            model,
            workers,
            self.devices,
        )
        return True
