"""The UNLOADs a device host is letting go of (``device_host.py``): one thread runs them in turn, so
that a burst of UNLOADs (SageMaker evicting models under memory pressure) costs the host no thread
each.

With a thread per UNLOAD, a drain of 2,000 models left a few hundred of them alive at once in each
host, queued on its locks and its interpreter lock beside the models it still served: a model
invoked meanwhile answered later (docs/benchmarks.md). An UNLOAD that must wait gets a thread of its
own, so that it holds up no other: its model still loading or answering requests it took, or its
connections handed over to another host (``host_recycling.py``). A LOAD of a name still being let
go waits for that UNLOAD (``pending``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from mme_runtime.processes.hosted_model import HostedModel

logger = logging.getLogger(__name__)

LetGo = Callable[[HostedModel, int | None], None]
# how long one UNLOAD may hold the thread that runs them in turn before the rest go on without it
STUCK_SECONDS = 10.0


class Unloads:
    """``start`` lets a model go with ``let_go(model, successor)``; each UNLOAD under way is an
    event, set once it is done, until a LOAD of its name takes it (``pending``).

    A model's UNLOAD can still hang in turn (its handler's close joins a pass that runs on after its
    request timed out, in user code that never returns): once the thread has spent ``stuck_seconds``
    on one, it is left to it, and the next call here starts another for the rest of the queue."""

    def __init__(self, let_go: LetGo, stuck_seconds: float = STUCK_SECONDS) -> None:
        self._let_go = let_go
        self._stuck_seconds = stuck_seconds
        self._queue: queue.SimpleQueue[tuple[HostedModel, int | None, threading.Event]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._under_way: dict[str, threading.Event] = {}
        self._in_turn: threading.Thread | None = None  # started by the first UNLOAD in turn
        self._busy_since: float | None = None  # monotonic: when it began the UNLOAD it runs

    def start(self, model: HostedModel, successor: int | None = None) -> None:
        """Lets ``model`` go (its connections handed to host ``successor`` first, if any): in
        turn, or on a thread of its own when it must wait. Its requests are read unlocked: one that
        began since is waited for in turn, up to ``UNLOAD_SECONDS`` (``DeviceHost._let_go``)."""
        done = threading.Event()
        with self._lock:
            self._under_way[model.spec.name] = done
        try:
            if model.loading is not None or model.turns or successor is not None:
                name = f"unload-{model.spec.name}"
                work = (model, successor, done)
                threading.Thread(target=self._run, args=work, name=name, daemon=True).start()
                return
            self._queue.put((model, successor, done))
            self._keep_turning()
        except BaseException:  # no thread (memory pressure, say): nothing waits on it forever
            self._finished(model, done)
            raise

    def pending(self, name: str) -> threading.Event | None:
        """The UNLOAD of ``name`` still under way, if any: a LOAD of that name waits for it."""
        self._keep_turning()
        with self._lock:
            return self._under_way.pop(name, None)

    def under_way(self) -> list[threading.Event]:
        with self._lock:
            return list(self._under_way.values())

    def wait(self, seconds: float) -> None:
        """Waits up to ``seconds`` in all for the UNLOADs under way (a host told to end)."""
        self._keep_turning()
        deadline = time.monotonic() + seconds
        for done in self.under_way():
            done.wait(max(0.0, deadline - time.monotonic()))

    def _keep_turning(self) -> None:
        """Starts the thread that runs UNLOADs in turn where there is none, or another where it has
        been stuck on one for ``stuck_seconds``."""
        with self._lock:
            running = self._in_turn is not None
            busy = 0.0 if self._busy_since is None else time.monotonic() - self._busy_since
            if running and busy <= self._stuck_seconds:
                return
            if running:
                logger.warning(
                    "one UNLOAD has held the device host's others %.0f s: they go on without it",
                    busy,
                )
            thread = threading.Thread(target=self._run_in_turn, name="unloads", daemon=True)
            thread.start()  # first: where it cannot, the next call tries again
            self._in_turn, self._busy_since = thread, None

    def _run_in_turn(self) -> None:
        while True:
            model, successor, done = self._queue.get()
            with self._lock:
                self._busy_since = time.monotonic()
            self._run(model, successor, done)
            with self._lock:
                if self._in_turn is not threading.current_thread():  # left to it: another runs
                    return
                self._busy_since = None
            del model, successor, done  # nothing of the last UNLOAD is kept while it waits

    def _run(self, model: HostedModel, successor: int | None, done: threading.Event) -> None:
        try:
            self._let_go(model, successor)
        except Exception:  # noqa: BLE001
            # one model's UNLOAD must never stop the next one's
            logger.exception("model=%s: its UNLOAD failed in the device host", model.spec.name)
        finally:
            self._finished(model, done)

    def _finished(self, model: HostedModel, done: threading.Event) -> None:
        with self._lock:
            if self._under_way.get(model.spec.name) is done:
                del self._under_way[model.spec.name]
        done.set()
