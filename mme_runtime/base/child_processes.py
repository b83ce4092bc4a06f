"""The one place processes are made, and the plumbing of the processes that make them: collecting
exited children, Linux's ``prctl``, glibc's ``malloc_trim`` and waiting on many sockets.

``start_program`` starts a program (the supervisor's MMS frontend and warm process); ``fork_child``
forks every model process from the warm process (loaders and device hosts) and decides what such a
child inherits: the stdio it is given, none of the descriptors its parent named, the default SIGTERM
and SIGINT, the environment it is given, death with its parent, and the parent's objects frozen.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mme_runtime.base.descriptor_table import close_all_but

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
M_ARENA_MAX = -8  # mallopt's


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


def start_program(
    command: Sequence[str], env: Mapping[str, str], cwd: Path, group: int
) -> subprocess.Popen[bytes]:
    """Starts ``command`` in process group ``group`` (0: a new one, led by it): the supervisor
    signals a group, not each process. Descriptors other than stdio are not inherited
    (``subprocess``'s default)."""
    return subprocess.Popen(list(command), env=dict(env), cwd=cwd, process_group=group)


def fork_child(
    title: str,
    run: Callable[[], int],
    environment: Mapping[str, str],
    stdio: Sequence[int] = (),
    keep: Iterable[int] = (),
) -> int:
    """Forks a model process and returns its pid. The child takes ``stdio`` (if given) as its
    descriptors 0, 1 and 2 and keeps ``keep``; it closes every other descriptor (what the parent
    holds for models and other children: a copy would keep a connection or a package alive). It is
    named ``title`` for ``ps``, dies with its parent, gets the default SIGTERM and SIGINT and
    ``environment`` as its own, then runs ``run`` and exits with its status: it never returns into
    the parent's code. A fork copies only the calling thread, so the parent must hold no lock
    another thread could hold (the warm process runs one)."""
    sys.stdout.flush()  # or the child would write the parent's buffered output again
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    # What the parent made stays out of the child's collections: a cycle it had not yet collected
    # may hold a socket whose number this child closes and reuses, and collecting it would close
    # the child's own descriptor. Nor do the child's collections touch (copy) the parent's pages.
    gc.freeze()
    status = 1
    try:
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        _become_child(title, keep, environment)
        if os.getppid() != parent:
            # it died before the kernel was asked to tell us: nobody waits for us
            return status
        status = run()
    except BaseException:  # noqa: BLE001 - whatever happens, the child ends here
        logging.getLogger(__name__).exception("%s failed", title)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _become_child(title: str, keep: Iterable[int], environment: Mapping[str, str]) -> None:
    import setproctitle

    # before the environment is replaced: it finds the argv memory through it
    setproctitle.setproctitle(title)
    os.environ.clear()
    os.environ.update(environment)
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), "PR_SET_PDEATHSIG")
    close_all_but(keep)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


def prctl(option: int, value: int, what: str) -> None:
    """Sets a ``prctl`` option of this process; where that fails, the caller carries on without
    (logged)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(option, value, 0, 0, 0) != 0:
            logger.debug("prctl(%s) failed: %s", what, os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError):
        logger.debug("prctl(%s) unavailable", what)


def trim_heap() -> None:
    """Freed heap back to the system: glibc keeps what was freed unless asked."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def one_arena() -> None:
    """glibc's allocator with one arena for every thread of this process. The entrypoint's: a
    thread that allocates while another does gets an arena of its own otherwise (up to 8 per core),
    and each keeps pages the trim cannot give back (about 5 MiB more after the scrapes of 1,000
    models)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_ARENA_MAX, 1)


@functools.cache
def _libc() -> Any:
    """glibc, looked up once (each ``CDLL`` makes classes that only a full collection frees); None
    without it."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


class Watcher:
    """Sockets and what to call when each is readable, in one epoll set kept as sockets come and
    go, so that a process holding a few sockets per model pays per event, not per socket: a poll
    set hands the kernel every descriptor on every wait (about 2 ms a wait at 2,400 sockets, several
    waits a LOAD), epoll only those that are ready. A forked child closes the set's own descriptor
    too, as every other it is not given: it would share the set."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._handlers: dict[socket.socket, tuple[int, Callable[[], None]]] = {}
        self._by_fd: dict[int, socket.socket] = {}

    def watch(self, sock: socket.socket, handler: Callable[[], None]) -> None:
        """Calls ``handler`` whenever ``sock`` is readable (or closed by its peer), until
        ``forget``."""
        fd = sock.fileno()
        self.forget(sock)
        stale = self._by_fd.get(fd)
        if stale is not None:  # closed without ``forget``: its number is this socket's now
            self.forget(stale)
        self._handlers[sock] = (fd, handler)
        self._by_fd[fd] = sock
        self._epoll.register(fd, select.EPOLLIN)

    def forget(self, sock: socket.socket) -> None:
        """Stops watching ``sock``, before it closes: a child forked a moment earlier may still
        hold a copy, and epoll would keep reporting its number, which the next socket may reuse."""
        watched = self._handlers.pop(sock, None)
        if watched is None:
            return
        fd = watched[0]
        if self._by_fd.get(fd) is sock:
            del self._by_fd[fd]
            # closed already: the kernel dropped it from the set with its last descriptor
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)

    def watches(self, sock: socket.socket) -> bool:
        return sock in self._handlers

    def sockets(self) -> list[socket.socket]:
        return list(self._handlers)

    def run_once(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds and calls the handler of each socket that became
        readable, unless an earlier handler of the same wait forgot it (a socket is matched by
        identity, never by a descriptor number that a handler may have closed and reused)."""
        try:
            events = self._epoll.poll(timeout)
        except InterruptedError:
            return
        ready = [self._by_fd[fd] for fd, _ in events if fd in self._by_fd]
        for sock in ready:
            watched = self._handlers.get(sock)
            if watched is not None:
                watched[1]()


def kill(pid: int) -> None:
    """SIGTERM to ``pid``, unless it has gone already."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
