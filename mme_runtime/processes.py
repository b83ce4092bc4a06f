"""Collecting exited children, for the processes that supervise others (the entrypoint, the warm process)."""

from __future__ import annotations

import os
from collections.abc import Iterator


def exited_children() -> Iterator[tuple[int, int]]:
    """(pid, exit code) of every child that has exited, without blocking: waitpid until 0 or ECHILD.

    The exit code is negative for a child killed by a signal, as in ``subprocess``.
    """
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)
