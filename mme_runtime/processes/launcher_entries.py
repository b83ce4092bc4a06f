"""What the JDK's launcher leaves in the kernel for each model's stub, freed on idle CPU before the
stub's UNLOAD would pay for it.

MMS starts each stub through the JDK's ``jspawnhelper``, which lists ``/proc/self/fd`` to close the
frontend's descriptors (2 per model loaded): the kernel makes an entry for each and keeps it after
the descriptor closes, until the number is looked up again or the process is reaped. At an UNLOAD,
Java's reaper of the stub frees them all (4.4 ms of CPU at 4,000 entries, 2,000 models) while MMS
holds the netty event loop that read the UNLOAD (it answers once the stub is reaped), and a drain of
thousands of models spent most of its CPU there. So the warm process sends each stub's pid to one
process of its own at idle priority, which looks up every number of that stub's ``/proc/<pid>/fd``
(``descriptor_table.forget_closed_descriptors``): the stale entries go when the CPU has nothing else
to do. Best effort: a stub it did not reach is freed at its reap, as before.
"""

from __future__ import annotations

import functools
import logging
import os
import struct

from mme_runtime.base.child_processes import fork_child
from mme_runtime.base.descriptor_table import forget_closed_descriptors

logger = logging.getLogger(__name__)

TITLE = "mme-launcher-entries"
PID = struct.Struct("=i")


class LauncherEntries:
    """The warm process's side: ``forget(pid)`` queues a stub for the idle process (started on
    first use, again once it has ended); ``exited(pid)`` says whether a child that ended was it."""

    def __init__(self, environment: dict[str, str]) -> None:
        self._environment = environment
        self._pid: int | None = None
        self._queue: int | None = None  # the pipe's end we write, non-blocking

    def forget(self, stub_pid: int) -> None:
        """Queues ``stub_pid``. Never waits: if the idle process is a pipe's worth behind (about
        16,000 stubs), the stub is left to its reap."""
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
        """True when ``pid`` was the idle process (a new one starts with the next stub)."""
        if pid != self._pid:
            return False
        self._pid = None
        self.close()
        return True

    def close(self) -> None:
        """Lets the idle process go: it ends once it has read what was queued."""
        if self._queue is not None:
            os.close(self._queue)
            self._queue = None

    def _send(self, message: bytes) -> None:
        if self._queue is None:
            self._start()
        assert self._queue is not None
        os.write(self._queue, message)

    def _start(self) -> None:
        read_end, write_end = os.pipe()
        try:
            idle = functools.partial(run, read_end)
            self._pid = fork_child(TITLE, idle, self._environment, keep=(read_end,))
        except OSError:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        os.set_blocking(write_end, False)
        self._queue = write_end


def run(queue: int) -> int:
    """The idle process: for each pid read from ``queue``, frees that process's stale entries; 0
    once the warm process has closed it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # where SCHED_IDLE is refused, the lowest priority a process may take
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    pending = b""
    while chunk := os.read(queue, 4096):
        pending += chunk
        whole = len(pending) - len(pending) % PID.size
        for (pid,) in PID.iter_unpack(pending[:whole]):
            forget_closed_descriptors(pid)
        pending = pending[whole:]
    return 0
