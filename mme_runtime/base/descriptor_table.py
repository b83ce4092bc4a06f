"""This process's descriptor table: its size, its limit, closing it down, and the kernel's
``/proc/self/fd`` entries of numbers already closed. Light on imports: every model's stub imports
it."""

from __future__ import annotations

import os
import resource

# Every model's stub imports this module as it starts: typing is for the type checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable


def descriptor_table_size() -> int:
    """The size of this process's descriptor table (``FDSize``): every open descriptor is below it.
    One line of ``/proc/self/status``, where listing ``/proc/self/fd`` costs the kernel an entry a
    descriptor (14 ms in a loader at 1,600 models); ``RLIMIT_NOFILE`` where /proc cannot be read."""
    try:
        # bytes: the process's name (its title's first 15 bytes) may not be ASCII
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"FDSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


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


def forget_closed_descriptors() -> None:
    """Frees the kernel's ``/proc/self/fd`` entries of the numbers closed since someone listed the
    directory. Listing makes an entry (and an inode) per open descriptor, kept after the descriptor
    closes until the process is reaped, which then frees them all in the reaper's time; looking a
    number up finds its entry stale and frees it now. Costs about 4 us a number up to the table's
    size (the reaper's own freeing about 1 us an entry); an open number keeps its entry."""
    try:
        listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        for fd in range(descriptor_table_size()):
            os.access(str(fd), os.F_OK, dir_fd=listing, follow_symlinks=False)
    finally:
        os.close(listing)
