"""Process plumbing shared by the supervising processes: collecting exited children, Linux's ``prctl``, waiting on
many sockets, and the descriptor limit."""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import select
import signal
import socket
from collections.abc import Iterable, Iterator, Mapping

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


def become_child(title: str, close_fds: Iterable[int], environment: Mapping[str, str]) -> None:
    """First steps of a child the warm process forked: named for ``ps``, killed with its parent, holding none of the
    parent's descriptors it was given, with the default SIGTERM and SIGINT, and ``environment`` as its own."""
    import setproctitle

    setproctitle.setproctitle(title)  # before the environment is replaced: it finds the argv memory through it
    os.environ.clear()
    os.environ.update(environment)
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), "PR_SET_PDEATHSIG")
    for fd in close_fds:
        os.close(fd)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


def prctl(option: int, value: int, what: str) -> None:
    """Sets a ``prctl`` option of this process; where that fails, the caller carries on without (logged)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(option, value, 0, 0, 0) != 0:
            logger.debug("prctl(%s) failed: %s", what, os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError):
        logger.debug("prctl(%s) unavailable", what)


def readable(sockets: list[socket.socket], timeout: float) -> list[socket.socket]:
    """Which of ``sockets`` can be read within ``timeout``. poll, not select: a process holding a few sockets per model
    passes descriptor 1024 at a few hundred models, where select stops working."""
    poller = select.poll()
    by_fd = {sock.fileno(): sock for sock in sockets}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    try:
        events = poller.poll(timeout * 1000)
    except InterruptedError:
        return []
    return [by_fd[fd] for fd, _ in events if fd in by_fd]


def raise_descriptor_limit() -> None:
    """Each shared model holds a few descriptors in this process (its socket, its stub's, its package): lift the
    soft limit to the hard one, so that thousands of models fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
