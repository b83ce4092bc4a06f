"""Clears the registration MMS 1.1.11 leaves behind after a LOAD that failed with our own status
(403, 507).

To carry a status, a worker must answer its LOAD with it; the frontend then answers the caller, but
its cleanup interrupts itself and puts the model back, registered with no worker: every later LOAD
of that name would answer 409. The worker leaves a marker before it answers; the entrypoint's
supervisor calls ``sweep`` a few times a second, and unregisters such a leftover with an ordinary
DELETE, which then succeeds.

The marker side runs in workers; the sweep runs in the entrypoint. Neither imports torch.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER_LIFETIME_SECONDS = 30.0
# The marker is written before the worker answers, so the first sweeps may still see the failing
# LOAD's own worker: a model with workers is judged "loaded properly since" only once its marker is
# older than this.
SETTLE_SECONDS = 5.0
FOLLOW_SECONDS = 2.0
FOLLOW_INTERVAL_SECONDS = 0.02
REQUEST_TIMEOUT_SECONDS = 2.0


def markers_dir(runtime_dir: Path) -> Path:
    return runtime_dir / "failed-loads"


def write_marker(directory: Path, model_name: str, record: dict[str, object]) -> None:
    """A request from a backend to the entrypoint, one file per model, written whole (rename) so no
    sweep reads half of it. Shared with the scaler."""
    directory.mkdir(parents=True, exist_ok=True)
    name = urllib.parse.quote(model_name, safe="")
    staging = directory / f".{name}.tmp"
    staging.write_text(json.dumps({"model": model_name, **record}))
    staging.replace(directory / name)


def mark_failed_load(runtime_dir: Path, model_name: str, status: int) -> None:
    """Written by a backend just before it answers its LOAD with ``status``."""
    write_marker(markers_dir(runtime_dir), model_name, {"status": status})


class Janitor:
    """Unregisters models MMS left half-registered after a failed LOAD."""

    def __init__(self, runtime_dir: Path, port: int) -> None:
        self.directory = markers_dir(runtime_dir)
        self.base = f"http://127.0.0.1:{port}/models/"

    def sweep(self) -> None:
        if not self.directory.is_dir():
            return
        for marker in self.directory.iterdir():
            if marker.name.startswith("."):
                continue  # being written
            try:
                model = json.loads(marker.read_text())["model"]
            except (OSError, ValueError, KeyError):
                continue
            # The leftover appears milliseconds after the caller got its answer; follow it closely
            # so a caller that retries at once meets as short a window of 409s as we can manage.
            deadline = time.monotonic() + FOLLOW_SECONDS
            while True:
                try:
                    age = time.time() - marker.stat().st_mtime
                except OSError:
                    break
                if self._settle(model, age):
                    marker.unlink(missing_ok=True)
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(FOLLOW_INTERVAL_SECONDS)

    def _settle(self, model: str, age: float) -> bool:
        """True once nothing is left to do for ``model``."""
        url = self.base + urllib.parse.quote(model, safe="")
        description = get_json(url)
        if description is None:
            # Not registered (yet): the frontend puts it back a moment after it answered the LOAD.
            return age > MARKER_LIFETIME_SECONDS
        if isinstance(description, list):  # MMS describes a model as a list of its versions
            description = description[0] if description else {}
        if not isinstance(description, dict):
            return True
        leftover = not description.get("workers") and description.get("maxWorkers") == 0
        if not leftover:
            # still failing, or loaded again properly since: not ours to touch
            return age > SETTLE_SECONDS
        try:
            urllib.request.urlopen(
                urllib.request.Request(url, method="DELETE"), timeout=REQUEST_TIMEOUT_SECONDS
            )
        except (urllib.error.URLError, OSError) as exc:
            logger.warning("could not unregister %s after its failed LOAD: %s", model, exc)
            return False
        logger.info("unregistered %s, which MMS left registered after its failed LOAD", model)
        return True


def get_json(url: str) -> object | None:
    try:
        with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_SECONDS) as response:
            value: object = json.loads(response.read())
            return value
    except (urllib.error.URLError, OSError, ValueError):
        return None
