"""Cache directories built once across processes, however many workers and models ask for them at
once; a runtime directory held by one server at a time."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mme_runtime.base.errors import ConfigError

RUNTIME_LOCK = "server.lock"


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``path`` (created if needed); the kernel releases it if we
    die."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _entry_lock(entry: Path) -> Path:
    return entry.parent / f".{entry.name}.lock"


def build_once(entry: Path, build: Callable[[Path], Path]) -> bool:
    """Makes the cache directory ``entry`` unless it exists; True if this call built it.

    ``build`` gets an empty staging directory beside ``entry`` and returns the directory inside it
    to move into place, so a failure (its exception propagates) never leaves a half-written entry.
    One builder at a time, under a file lock; whoever waited finds the entry made.
    """
    if entry.is_dir():
        return False
    with file_lock(_entry_lock(entry)):
        if entry.is_dir():  # another process built it while we waited
            return False
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=entry.parent))
        try:
            build(staging).rename(entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return True


def discard(entry: Path) -> None:
    """Takes the cache directory ``entry`` out of use: moved aside under its lock (the one
    ``build_once`` takes), so another process sees the old entry or none, never half of it, then
    deleted."""
    stale = entry.with_name(f".stale-{entry.name}-{os.getpid()}")
    with file_lock(_entry_lock(entry)):
        try:
            entry.rename(stale)
        except OSError:
            return  # another process discarded it first
    shutil.rmtree(stale, ignore_errors=True)


def hold_runtime_dir(runtime_dir: Path, port: int) -> int:
    """Takes ``runtime_dir`` for this server for as long as this process lives (the kernel lets go
    if it dies), and returns the descriptor that holds it. Two servers in one directory would share
    the warm process's socket and its pending requests, each serving the other's models: a second
    one is refused, naming the first."""
    runtime_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(runtime_dir / RUNTIME_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a server"
        os.close(fd)
        raise ConfigError(
            f"MME_RUNTIME_DIR={runtime_dir} is in use by another server ({holder}): give each "
            "server a runtime directory of its own"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, port {port}\n".encode(), 0)
    return fd
