"""Process plumbing shared by the supervising processes: collecting exited children, and Linux's ``prctl``."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


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


def prctl(option: int, value: int, what: str) -> None:
    """Sets a ``prctl`` option of this process; where that fails, the caller carries on without (logged)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(option, value, 0, 0, 0) != 0:
            logger.debug("prctl(%s) failed: %s", what, os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError):
        logger.debug("prctl(%s) unavailable", what)
