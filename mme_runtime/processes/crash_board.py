"""Which model a device host was running when it died: a board the host writes and the warm process
reads after.

The board is an anonymous shared mapping made before the host's fork, so it outlives the host. It
holds, per model slot, how many of the model's calls are running, and, per thread of the host, the
model the thread works for (its connections', loading and batching threads each work for one model).
The host also has Python's ``faulthandler`` write the stacks of its threads to a file when a fatal
signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) kills it; that names the thread that crashed, and
the board names its model.
"""

from __future__ import annotations

import faulthandler
import mmap
import re
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

SLOTS = 1 << 16  # models: 256 KiB of counts, of which a host touches the pages of the slots it uses
THREADS = 4096
COUNT = struct.Struct("i")
# a thread's ident (threading.get_ident), the slot of the model it works for (-1: none)
OWNER = struct.Struct("Qi")
NO_MODEL = -1
# faulthandler's line for the thread that received the fatal signal, and its stack's lines after it.
CRASHED_THREAD = re.compile(r"^Current thread (0x[0-9a-f]+)", re.MULTILINE)
CRASHED_STACK = re.compile(r"^Current thread 0x[0-9a-f]+.*\n((?:  .*\n?)+)", re.MULTILINE)


class CrashBoard:
    def __init__(self) -> None:
        self.memory = mmap.mmap(-1, SLOTS * COUNT.size + THREADS * OWNER.size)
        self._lock = threading.Lock()
        for cell in range(THREADS):
            OWNER.pack_into(self.memory, self._owner_offset(cell), 0, NO_MODEL)
        # The host's own index of its cells: a GPU's pass threads are marked and unmarked at every
        # pass.
        self._cells: dict[int, int] = {}
        self._free = list(range(THREADS - 1, -1, -1))

    # -- written by the host
    # -------------------------------------------------------------------------------

    @contextmanager
    def running(self, slot: int) -> Iterator[None]:
        """Brackets a call into the model's code."""
        self._add(slot, 1)
        try:
            yield
        finally:
            self._add(slot, -1)

    def work_for(self, slot: int, ident: int | None = None) -> None:
        """Marks the thread ``ident`` (this one by default) as working for the model in ``slot``."""
        ident = ident or threading.get_ident()
        with self._lock:
            cell = self._cells.get(ident)
            if cell is None:
                if not self._free:
                    # a host with more threads than cells names fewer culprits, nothing worse
                    return
                cell = self._cells[ident] = self._free.pop()
            OWNER.pack_into(self.memory, self._owner_offset(cell), ident, slot)

    def done(self, ident: int | None = None) -> None:
        """The thread ends (its ident may be reused by a thread for another model), or is done with
        its model."""
        ident = ident or threading.get_ident()
        with self._lock:
            cell = self._cells.pop(ident, None)
            if cell is not None:
                OWNER.pack_into(self.memory, self._owner_offset(cell), 0, NO_MODEL)
                self._free.append(cell)

    # -- read by the warm process after the host died
    # --------------------------------------------------------

    def busy(self) -> list[int]:
        """Slots with a call running."""
        counts = memoryview(self.memory)[: SLOTS * COUNT.size].cast("i")
        try:
            return [slot for slot, count in enumerate(counts) if count > 0]
        finally:
            counts.release()

    def culprit(self, crash_report: str) -> int | None:
        """The slot of the model whose thread took the fatal signal, from faulthandler's report;
        None if unknown."""
        found = CRASHED_THREAD.search(crash_report)
        if found is None:
            return None
        ident = int(found.group(1), 16)
        for cell in range(THREADS):
            owner, slot = OWNER.unpack_from(self.memory, self._owner_offset(cell))
            if owner == ident and slot != NO_MODEL:
                return int(slot)
        return None

    def close(self) -> None:
        self.memory.close()

    def _add(self, slot: int, delta: int) -> None:
        with self._lock:
            offset = slot * COUNT.size
            COUNT.pack_into(self.memory, offset, COUNT.unpack_from(self.memory, offset)[0] + delta)

    @staticmethod
    def _owner_offset(cell: int) -> int:
        return SLOTS * COUNT.size + cell * OWNER.size


def report_crashes(path: Path) -> IO[str]:
    """In the host: faulthandler writes every thread's stack to ``path`` if a fatal signal kills the
    process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    report = path.open("w")
    faulthandler.enable(file=report, all_threads=True)
    return report


def crashed_stack(crash_report: str) -> str:
    """The stack of the thread that took the fatal signal, as faulthandler wrote it ("" if it wrote
    none)."""
    found = CRASHED_STACK.search(crash_report)
    return "" if found is None else found.group(1).rstrip()


def crash_report_path(runtime_dir: Path, host_pid: int) -> Path:
    return runtime_dir / "hosts" / f"{host_pid}.crash"
