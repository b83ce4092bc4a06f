"""Opens a batching model's frontend connections as its requests come to need them.

MMS sends a backend one request per connection at a time, so a batch of ``batch_size`` requests needs that many
connections on each device. Each costs a frontend thread (about 100 KiB of touched stack) and a thread here; a host
with hundreds of idle adapters should not hold sixteen of each. So a batching model asks for
``MME_BATCH_CONNECTIONS_AT_LOAD`` connections per device at LOAD (2), and for its whole batch the first time every
one of them is busy at once: its requests have begun to overlap, and more are likely queued in the frontend. The
entrypoint's scaler (``operations/scaler.py``) raises the model's workers either time. A lone client, one request
at a time, never fills two connections, so a model nobody calls concurrently keeps two.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class ConnectionDemand:
    """Counts one model's connections on this device and the requests they are answering; calls ``ask_for(full)``
    once, the first time the ``at_load`` connections (or more) are all busy."""

    def __init__(self, ask_for: Callable[[int], None], at_load: int, full: int) -> None:
        self._ask_for = ask_for
        self._at_load = at_load
        self._full = full
        self._lock = threading.Lock()
        self._open = 0
        self._busy = 0
        self._asked = at_load >= full  # the LOAD asked for the whole batch already

    @property
    def connections(self) -> int:
        return self._open

    @contextmanager
    def connection(self) -> Iterator[None]:
        with self._lock:
            self._open += 1
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1

    @contextmanager
    def answering(self) -> Iterator[None]:
        """Brackets one request, from its message read to its answer sent."""
        with self._lock:
            self._busy += 1
            # Not before the LOAD's connections are all open: until then one request alone fills them.
            grow = not self._asked and self._open >= self._at_load and self._busy >= self._open
            self._asked = self._asked or grow
        if grow:
            self._ask_for(self._full)
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
