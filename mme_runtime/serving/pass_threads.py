"""The threads that run the forward passes of every model on one GPU, and how a model's passes get
there.

A device host serves many models on one card; their batchers, generation schedulers and lone
``generate`` calls hand each pass to these threads (``RunPass``) instead of running it on threads of
each model's own.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mme_runtime.operations import metrics
from mme_runtime.operations.metric_series import Series

# A pass that waits this long while every pass thread is held by one pass starts another.
HELD_SECONDS = 1.0
# A thread past the count that has had nothing to do for this long ends.
IDLE_SECONDS = 60.0


# runs a pass (a function) somewhere and returns what it returned
RunPass = Callable[[Callable[[], Any]], Any]


def run_here(function: Callable[[], Any]) -> Any:
    """The ``RunPass`` of a model with no pass threads: on the calling thread."""
    return function()


class PassThreads:
    """The threads that run the forward passes of every model on one GPU: a few, however many
    models.

    A thread that runs a CUDA op keeps a cuBLAS handle and its workspace on the card for as long as
    it lives (about 100 MiB on an H100 with torch 2.11, measured by scripts/gpu-proof), so a thread
    per model cost the card that per model. Threads start as passes overlap, up to ``count``. Only
    when every one has been in the same pass for ``held_seconds`` (a pass hung in user code, a long
    beam search) does a waiting pass start one more, which ends after ``idle_seconds`` without work:
    a hung pass holds its own thread, never the other models of the card.
    """

    def __init__(
        self,
        count: int,
        name: str,
        held_seconds: float = HELD_SECONDS,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self._count = max(1, count)
        self._name = name
        self._held_seconds, self._idle_seconds = held_seconds, idle_seconds
        self._work: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads not running a pass
        self._pending = 0  # passes handed over and not started yet
        self._passes_since: dict[int, float] = {}  # thread ident -> when its current pass started
        # set on the pool's threads: a pass that runs a pass runs it in place
        self._mine = threading.local()
        self._started = 0
        self.threads: list[threading.Thread] = []

    def run(
        self,
        function: Callable[[], Any],
        series: Series | None,
        started: Callable[[], None] = lambda: None,
        ended: Callable[[], None] = lambda: None,
    ) -> Any:
        """``function()`` on one of the threads, recording into ``series`` and bracketed by
        ``started`` and ``ended`` there (the host marks the thread its model's meanwhile); returns
        or raises what it did."""
        if getattr(self._mine, "pool", False):
            return function()
        picked, done = threading.Event(), threading.Event()
        outcome: list[Any] = [None, None]

        def work() -> None:
            with self._lock:
                self._idle -= 1
                self._pending -= 1
                self._passes_since[threading.get_ident()] = time.monotonic()
            picked.set()
            try:
                metrics.bind(series)
                started()
                try:
                    outcome[0] = function()
                finally:
                    ended()
                    metrics.bind(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                outcome[1] = exc
            finally:
                with self._lock:
                    # idle before its caller wakes: the caller's next pass finds this thread free
                    self._idle += 1
                    del self._passes_since[threading.get_ident()]
                done.set()

        with self._lock:
            self._pending += 1
            if self._idle < self._pending and len(self.threads) < self._count:
                self._start()
        self._work.put(work)
        # Woken at the end of the pass alone: a wake-up while it runs would take the interpreter
        # lock from it.
        while not done.wait(self._held_seconds):
            with self._lock:
                if not picked.is_set() and self._idle < self._pending and self._all_held():
                    self._start()  # past count: every thread is held by one long pass
        if outcome[1] is not None:
            raise outcome[1]
        return outcome[0]

    def _all_held(self) -> bool:
        """Called holding ``_lock``: whether every thread is in a pass it started ``held_seconds``
        ago or more."""
        oldest_allowed = time.monotonic() - self._held_seconds
        held = sum(1 for since in self._passes_since.values() if since <= oldest_allowed)
        return held == len(self.threads)

    def _start(self) -> None:
        """Called holding ``_lock``."""
        self._idle += 1
        self._started += 1
        thread = threading.Thread(
            target=self._serve, name=f"passes-{self._name}-{self._started}", daemon=True
        )
        self.threads.append(thread)
        thread.start()

    def _serve(self) -> None:
        self._mine.pool = True
        while True:
            try:
                work = self._work.get(timeout=self._idle_seconds)
            except queue.Empty:
                with self._lock:  # one past count ends, leaving a thread for each pass handed over
                    if len(self.threads) > self._count and self._idle > self._pending:
                        self._idle -= 1
                        self.threads.remove(threading.current_thread())
                        return
                continue
            work()
            # nothing of the pass (its model, through ``function``) held while the next is awaited
            del work
