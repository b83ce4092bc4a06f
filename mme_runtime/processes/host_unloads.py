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
from collections.abc import Callable

from mme_runtime.processes.hosted_model import HostedModel

logger = logging.getLogger(__name__)

LetGo = Callable[[HostedModel, int | None], None]


class Unloads:
    """``start`` lets a model go with ``let_go(model, successor)``; each UNLOAD under way is an
    event, set once it is done, until a LOAD of its name takes it (``pending``)."""

    def __init__(self, let_go: LetGo) -> None:
        self._let_go = let_go
        self._queue: queue.SimpleQueue[tuple[HostedModel, int | None, threading.Event]] = (
            queue.SimpleQueue()
        )
        self._in_turn: threading.Thread | None = None  # started by the first UNLOAD
        self._lock = threading.Lock()
        self._under_way: dict[str, threading.Event] = {}

    def start(self, model: HostedModel, successor: int | None = None) -> None:
        """Lets ``model`` go (its connections handed to host ``successor`` first, if any): in
        turn, or on a thread of its own when it must wait. Its requests are read unlocked: one that
        began since waits in turn, bounded (``DeviceHost._let_go``)."""
        done = threading.Event()
        with self._lock:
            self._under_way[model.spec.name] = done
        if model.loading is not None or model.turns or successor is not None:
            name = f"unload-{model.spec.name}"
            work = (model, successor, done)
            threading.Thread(target=self._run, args=work, name=name, daemon=True).start()
            return
        if self._in_turn is None:
            self._in_turn = threading.Thread(target=self._run_in_turn, name="unloads", daemon=True)
            self._in_turn.start()
        self._queue.put((model, successor, done))

    def pending(self, name: str) -> threading.Event | None:
        """The UNLOAD of ``name`` still under way, if any: a LOAD of that name waits for it."""
        with self._lock:
            return self._under_way.pop(name, None)

    def under_way(self) -> list[threading.Event]:
        with self._lock:
            return list(self._under_way.values())

    def wait(self, seconds: float) -> None:
        """Waits up to ``seconds`` for each UNLOAD under way (a host told to end)."""
        for done in self.under_way():
            done.wait(seconds)

    def _run_in_turn(self) -> None:
        while True:
            self._run(*self._queue.get())

    def _run(self, model: HostedModel, successor: int | None, done: threading.Event) -> None:
        try:
            self._let_go(model, successor)
        except Exception:  # noqa: BLE001
            # one model's UNLOAD must never stop the next one's
            logger.exception("model=%s: its UNLOAD failed in the device host", model.spec.name)
        finally:
            with self._lock:
                if self._under_way.get(model.spec.name) is done:
                    del self._under_way[model.spec.name]
            done.set()
