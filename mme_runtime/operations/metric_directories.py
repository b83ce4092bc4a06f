"""Where the model processes' Prometheus files live (``metrics.py`` writes them, ``metrics_exporter.py`` merges
them): a directory per model process under ``metrics/models/<model>/<pid>/``, moved to ``metrics/unloaded/`` when
the process stops, and marked with its owner's start time so that a reused pid is never taken for it.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import time
import urllib.parse
from pathlib import Path

logger = logging.getLogger(__name__)

# A server's directory holds this file: its process's start time, so a reused pid is not taken for the server.
OWNER_FILE = "owner"
# A hosted model's directory holds this file: its tensors' bytes in host memory (the host's PSS is every model's).
HOST_BYTES_FILE = "host_bytes"
MKDIR_ATTEMPTS = 3


def models_dir(metrics_dir: Path) -> Path:
    return metrics_dir / "models"


def scan(directory: Path, pattern: str) -> list[Path]:
    """The paths under ``directory`` that match ``pattern``, sorted. Processes remove directories at any time (a host
    lets a model go): one that goes mid-scan is skipped, where ``Path.glob`` raises FileNotFoundError."""
    return sorted(Path(path) for path in glob.glob(os.path.join(glob.escape(str(directory)), pattern)))


def unloaded_dir(metrics_dir: Path) -> Path:
    return metrics_dir / "unloaded"


def model_dir_name(model: str) -> str:
    return urllib.parse.quote(model, safe="")


def move_to_unloaded(metrics_dir: Path, server_dir: Path) -> None:
    """Hands a model server's values over to the exporter's fold (``OSError`` if another process did it first)."""
    target = unloaded_dir(metrics_dir) / f"{server_dir.parent.name}@{server_dir.name}"
    if target.exists():  # a host that served this model before (an UNLOAD and a re-LOAD): not folded yet
        target = target.with_name(f"{target.name}.{time.monotonic_ns()}")
    target.parent.mkdir(parents=True, exist_ok=True)
    server_dir.rename(target)
    with contextlib.suppress(OSError):  # not empty: another server of this model runs
        server_dir.parent.rmdir()


def process_started(pid: int) -> float | None:
    """When process ``pid`` started, in clock ticks since boot (what ``OWNER_FILE`` holds), or None if there is no
    such process. Read from /proc: psutil's start times add the boot time, which a VM whose clock is stepped reports
    differently from one read to the next."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces and parentheses): state is the 3rd, starttime the 22nd.
    return float(stat.rsplit(")", 1)[1].split()[19])


def server_alive(server_dir: Path) -> bool:
    """Whether the model server that owns ``server_dir`` still runs (not merely a process with its pid)."""
    try:
        recorded = float((server_dir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return process_started(int(server_dir.name)) is not None  # being created: trust the pid
    return process_started(int(server_dir.name)) == recorded


def carry_over(directory: Path) -> None:
    """Moves the files of this model's hosts that died into ``directory``: the exporter folds them as an ended
    process's (counters and histograms kept, gauges dropped)."""
    for sibling in directory.parent.iterdir():
        if sibling == directory or not sibling.name.isdigit() or server_alive(sibling):
            continue
        if not (sibling / HOST_BYTES_FILE).exists():
            continue  # a loader's or a server's: nothing of the model's own to keep
        for path in scan(sibling, "*.db"):
            with contextlib.suppress(OSError):
                path.rename(directory / path.name)


def claim(metrics_dir: Path, directory: Path) -> None:
    """Marks ``directory`` as this process's. Processes of this model that died without stopping (a crash, or an
    UNLOAD and a quick re-LOAD) end here: this one's counts start from zero, as after any restart."""
    (directory / OWNER_FILE).write_text(str(process_started(os.getpid())))
    for sibling in directory.parent.iterdir():
        if sibling != directory and sibling.name.isdigit() and not server_alive(sibling):
            with contextlib.suppress(OSError):
                move_to_unloaded(metrics_dir, sibling)


def make_directory(directory: Path) -> bool:
    for attempt in range(MKDIR_ATTEMPTS):  # the exporter may remove an empty parent at the same moment
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return True
        except OSError as exc:
            if attempt == MKDIR_ATTEMPTS - 1:
                logger.warning("metrics off here: cannot create %s: %s", directory, exc)
    return False
