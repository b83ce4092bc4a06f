"""What the JDK's launcher leaves in the kernel for each model's stub, freed at the lowest priority
before the stub's UNLOAD would pay for it.

MMS starts each stub through the JDK's ``jspawnhelper``, which lists ``/proc/self/fd`` to close the
frontend's descriptors (2 per model loaded): the kernel makes an entry for each and keeps it after
the descriptor closes, until the number is looked up again or the process is reaped. At an UNLOAD,
Java's reaper of the stub frees them all (4.4 ms of CPU at 4,000 entries, 2,000 models) while MMS
holds the netty event loop that read the UNLOAD (it answers once the stub is reaped): 40% of the CPU
a drain of 1,500 models took. So once a stub's model has loaded, the warm process sends its pid to
one process of its own at the lowest priority (nice 19), which looks up each number of that stub's
``/proc/<pid>/fd`` the launcher can have listed (``descriptor_table.forget_closed_descriptors``):
the stale entries go between the model's LOAD and its UNLOAD. Not as the stub arrives: the walk
would run beside that LOAD's own work (at 2,000 models our part of a LOAD grew 1.34x from the first
200, against 1.06x sent once loaded and 1.09x with no walk at all, docs/benchmarks.md); while LOADs
follow one another it runs beside the next one's start in MMS. Not ``SCHED_IDLE``: a process that
may get no CPU at all for as long as others want it could hold an entry the reaper then waits for.
Best effort: a stub it did not reach in time is freed at its reap, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import sys

from mme_runtime.base.descriptor_table import (
    forget_closed_descriptors,
    open_descriptors,
    status_number,
)

logger = logging.getLogger(__name__)

TITLE = "mme-launcher-entries"
PID = struct.Struct("=i")


class LauncherEntries:
    """The warm process's side: ``start()`` starts the low-priority process, a fresh interpreter
    reading a pipe (a fork of the warm process would keep the original of each page the warm
    process writes later, a copy the more the longer it lives); ``forget(pid)`` queues a stub for
    it, starting a new one if it has ended; ``exited(pid)`` says whether a child that ended was
    it."""

    def __init__(self, environment: dict[str, str]) -> None:
        self._environment = environment
        self.pid: int | None = None
        self._queue: int | None = None  # the pipe's end we write, non-blocking

    def start(self) -> None:
        """Starts the process; where that fails, the stubs are left to their reaps (logged)."""
        try:
            self._start()
        except OSError as exc:
            logger.warning("launcher entries left to the stubs' reaps: %s", exc)

    def forget(self, stub_pid: int) -> None:
        """Queues ``stub_pid``. Never waits: if the process is a pipe's worth behind (about 16,000
        stubs), the stub is left to its reap."""
        message = PID.pack(stub_pid)
        try:
            try:
                self._send(message)
            except BrokenPipeError:  # it ended, not yet reaped: a new one
                self.close()
                self._send(message)
        except BlockingIOError:
            pass
        except OSError as exc:  # no fork: never the LOAD's concern
            logger.warning("launcher entries of stub pid=%d left to its reap: %s", stub_pid, exc)
            self.close()

    def exited(self, pid: int) -> bool:
        """True when ``pid`` was the process (a new one starts with the next stub)."""
        if pid != self.pid:
            return False
        self.pid = None
        self.close()
        return True

    def close(self) -> None:
        """Lets the process go: it ends once it has read what was queued."""
        if self._queue is not None:
            os.close(self._queue)
            self._queue = None

    def _send(self, message: bytes) -> None:
        if self._queue is None:
            self._start()
        assert self._queue is not None
        os.write(self._queue, message)

    def _start(self) -> None:
        # here, not above: the process runs this module afresh, and needs none of child_processes
        from mme_runtime.base.child_processes import fork_child

        read_end, write_end = os.pipe()
        try:
            self.pid = fork_child(TITLE, _fresh, self._environment, stdio=(read_end, 1, 2))
        except OSError:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        os.set_blocking(write_end, False)
        self._queue = write_end


def listed_below(stub_pid: int) -> int | None:
    """A bound on the numbers the launcher listed in ``stub_pid``: its parent's (the frontend's)
    descriptors, which the kernel numbers lowest first, so from 0 to about as many as it holds,
    with an eighth more for the holes UNLOADs leave and what it opened since. Where a frontend's
    highest number is further up, the entries above are left to the stub's reap. None (the whole
    table, twice the descriptors at worst) where the kernel does not count them."""
    parent = status_number(stub_pid, b"PPid:")
    held = None if parent is None else open_descriptors(parent)
    return None if held is None else held + held // 8 + 64


def _fresh() -> int:
    """In the forked child: this module's ``main`` in a new interpreter (it dies with the warm
    process still: the kernel keeps that across ``exec``)."""
    os.execv(sys.executable, [sys.executable, "-m", __name__])
    return 1  # not reached: exec replaces the process or raises


def main() -> int:
    """The process: its queue is its stdin. Its priority is lowered before it takes its title, by
    which it is found."""
    import setproctitle

    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    setproctitle.setproctitle(TITLE)
    return run(0)


def run(queue: int) -> int:
    """The process: for each pid read from ``queue``, frees that process's stale entries; 0 once
    the warm process has closed it."""
    pending = b""
    while chunk := os.read(queue, 4096):
        pending += chunk
        whole = len(pending) - len(pending) % PID.size
        for (pid,) in PID.iter_unpack(pending[:whole]):
            forget_closed_descriptors(pid, below=listed_below(pid))
        pending = pending[whole:]
    return 0


if __name__ == "__main__":
    sys.exit(main())
