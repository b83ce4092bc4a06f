"""A process's descriptor table: its size, this process's limit, closing it down, and the kernel's
``/proc/<pid>/fd`` entries of numbers already closed."""

from __future__ import annotations

import os
import resource
import select
from collections.abc import Iterable


def descriptor_table_size() -> int:
    """The size of this process's descriptor table (``FDSize``): every open descriptor is below it.
    One line of ``/proc/self/status``, where listing ``/proc/self/fd`` costs the kernel an entry a
    descriptor (14 ms in a loader at 1,600 models); ``RLIMIT_NOFILE`` where /proc cannot be read."""
    size = status_number("self", b"FDSize:")
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] if size is None else size


def status_number(pid: int | str, field: bytes) -> int | None:
    """A number of ``/proc/<pid>/status`` (``FDSize:``, ``PPid:``); None if it cannot be read."""
    try:
        # bytes: the process's name (its title's first 15 bytes) may not be ASCII
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def open_descriptors(pid: int) -> int | None:
    """How many descriptors ``pid`` holds, without listing them: the size ``stat`` gives its
    ``/proc/<pid>/fd`` (Linux 6.2 on; None before, where that size is 0, or if it has gone)."""
    try:
        count = os.stat(f"/proc/{pid}/fd").st_size
    except OSError:
        return None
    return count or None


def close_all_but(keep: Iterable[int]) -> None:
    """Closes every descriptor from 3 up but ``keep``, each run between two kept ones in one call
    (``close_range``): a child of the warm process, which holds two descriptors per model, closes
    thousands in a few calls. The runs end at the size of the descriptor table, so that where
    ``close_range`` is missing or refused, CPython's fallback (one ``close`` per number) closes no
    more than that."""
    low = 3
    for fd in sorted({fd for fd in keep if fd >= low}):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, descriptor_table_size())


def raise_descriptor_limit() -> None:
    """Each shared model holds a few descriptors in this process (its stub's connection, its
    package): lift the soft limit to the hard one, so that thousands of models fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def forget_closed_descriptors(pid: int, below: int | None = None) -> None:
    """Frees the kernel's ``/proc/<pid>/fd`` entries of the numbers ``pid`` closed since someone
    listed the directory. Listing makes an entry (and an inode) per open descriptor, kept after it
    closes until the number is looked up again or the process is reaped, whose reaper then frees
    them all; looking a number up finds its entry stale and frees it now. Each number below
    ``below`` and the table's size is looked up, about 2 us each (the reaper frees an entry in
    about 1 us: this moves the work to another time and does more of it). Stops once the process
    has ended, leaving the rest to its reaper; nothing if it has gone."""
    try:
        process = os.pidfd_open(pid)
    except OSError:
        return
    try:
        listing = os.open(f"/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        os.close(process)
        return
    ended = select.poll()
    ended.register(process, select.POLLIN)  # readable once it has exited
    try:
        size = status_number(pid, b"FDSize:") or 0
        for fd in range(size if below is None else min(size, below)):
            if fd % 64 == 0 and ended.poll(0):
                break
            # following the link: glibc makes that the faccessat call every seccomp profile
            # allows (not following needs faccessat2, which older profiles refuse)
            os.access(str(fd), os.F_OK, dir_fd=listing)
    finally:
        os.close(listing)
        os.close(process)
