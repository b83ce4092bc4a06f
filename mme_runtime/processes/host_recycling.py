"""Host recycling: a CPU pool host that a burst of UNLOADs drained to a sixteenth of the most models
it held hands what is left to a fresh fork of the warm process, and ends.

Why: a host keeps the high-water mark of the models it held. Python's arenas and glibc's heap stay
held by a few objects made late, and every page of the warm process's that the host wrote to is a
copy in both. After 1,000 models came and went, the host that still served one model held 19 MiB
more than a fresh one, and the warm process 13 MiB more: a fresh fork shares its pages again.

How, with no request lost: the successor loads each model from the package the warm process holds
(``load``, marked ``moved``: no LOAD is counted). Once all are ready, the old host gets a
``hand_over`` for each: it takes the model's connections out between two messages (MMS sends the
next only once answered, so one sent meanwhile waits in the socket), sends them back over its
control socket, and lets the model go, its metrics moved to the successor's directory. The warm
process passes each connection on (``connect``, ``adopted``: its LOAD was answered). Until the
hand-over starts, new models and connections go to the old host (a model LOADed meanwhile loads in
the successor too, first), so a load that fails there leaves everything where it was; from then on
they go to the successor. Once the old host holds nothing, the successor takes its key and the old
host ends.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from mme_runtime.base.child_processes import Watcher, kill
from mme_runtime.processes.device_hosts import DeviceHosts, Host
from mme_runtime.processes.shared_model import SharedModel

logger = logging.getLogger(__name__)

# a host is recycled once it holds at most 1/FRACTION of its most models, when that was at least
# MME_RECYCLE_PEAK_MODELS, and no UNLOAD came for QUIET_SECONDS (the burst is over)
FRACTION = 16
QUIET_SECONDS = 2.0


class HostRecycling:
    """Recycles the drained hosts of ``hosts`` (the warm process's loop asks, ``recycle``); a host's
    reports during its recycling and the successor's come here first (``reported``)."""

    def __init__(
        self,
        hosts: DeviceHosts,
        watcher: Watcher,
        models: Mapping[str, SharedModel],
        send_model: Callable[[Host, SharedModel], None],
        watch: Callable[[Host], None],
    ) -> None:
        self.hosts = hosts
        self.peak = hosts.config.recycle_peak_models
        self.watcher = watcher
        self.models = models
        self._send_model = send_model  # a model's load, sent to a host
        self._watch = watch  # a new host's reports, read by the warm process's loop

    def recycle(self, last_unload: float) -> None:
        """Starts the recycling of each drained host, once a burst of UNLOADs is over."""
        if time.monotonic() - last_unload < QUIET_SECONDS:
            return
        for host in list(self.hosts.hosts.values()):
            if (
                host.key.in_cpu_pool
                and host.recyclable
                and host.successor is None
                and host.peak >= self.peak > 0
                and 0 < len(host.models) * FRACTION <= host.peak
            ):
                self._start(host)

    def _start(self, host: Host) -> None:
        models = [self.models.get(name) for name in sorted(host.models)]
        if not all(model is not None and model.package is not None for model in models):
            # one whose model_fn runs in the host: it would run again (seconds, twice the memory)
            host.recyclable = False
            return
        moving = [model for model in models if model is not None]
        try:
            successor = self.hosts.fork_successor(host, moving[0].request["env"])
        except OSError as exc:  # no fork under memory pressure, say: the models stay
            logger.warning("device host pid=%d gpu=%s not recycled: %s", host.pid, host.key, exc)
            host.recyclable = False
            return
        self._watch(successor)
        logger.info(
            "device host pid=%d gpu=%s holds %d of its %d models: they move to pid=%d",
            host.pid,
            host.key,
            len(moving),
            host.peak,
            successor.pid,
        )
        self._load_in_successor(host, moving)

    def _load_in_successor(self, host: Host, models: list[SharedModel]) -> None:
        successor = host.successor
        assert successor is not None
        successor.pending.update(model.spec.name for model in models)
        try:
            for model in models:
                self._send_model(successor, model)
        except OSError as exc:
            self._abandon(host, f"it is unreachable: {exc}")

    def reported(self, host: Host, message: dict[str, Any], fds: list[int]) -> bool:
        """Acts on a report that is part of a recycling (a successor's load, an old host's
        connections handed over); False for any other."""
        old = self._recycled_by(host)
        if old is not None and message.get("model") in host.pending:
            if not message.get("loaded"):
                self._abandon(old, f"model={message.get('model')} failed to load there")
                return True
            host.pending.discard(message.get("model", ""))
            self.advance(old)
            return True
        if "handed_over" in message and host.successor is not None:
            self._pass_on(host, host.successor, message["model"], fds, bool(message.get("last")))
            return True
        for fd in fds:  # none expected
            os.close(fd)
        return False

    def advance(self, host: Host) -> None:
        """The next step of ``host``'s recycling, if it is due: the hand-over once the successor has
        every model, the promotion once the old host has none (the warm process calls it when a
        model leaves too)."""
        successor = host.successor
        if successor is None:
            return
        if not host.handing_over and not successor.pending:
            # models LOADed here meanwhile: to the successor first
            names = host.models - successor.models
            arrived = [model for name in names if (model := self.models.get(name)) is not None]
            if arrived:
                self._load_in_successor(host, arrived)
                return
            host.handing_over = True  # from now on, connections go to the successor
            try:
                for name in sorted(host.models):
                    self.hosts.send(host, {"op": "hand_over", "model": name, "to": successor.pid})
            except OSError as exc:  # it is dying: its reap ends the successor too (host_died)
                logger.warning("device host pid=%d unreachable: %s", host.pid, exc)
                return
        if host.handing_over and not host.models:
            self.watcher.forget(host.control)  # before it closes: its number may be reused
            self.hosts.promote(host)

    def _pass_on(self, host: Host, successor: Host, name: str, fds: list[int], last: bool) -> None:
        """A model's connections, back from ``host`` (``last``: the last of them), to its successor
        (closed here once sent: a model unloaded meanwhile has no more use for them)."""
        model = self.models.get(name)
        try:
            if model is not None and name in successor.models:
                for fd in fds:
                    payload = {"op": "connect", **model.assignment(), "adopted": True}
                    self.hosts.send(successor, payload, [fd])
        except OSError as exc:  # it is dying: the frontend reconnects, to the old host's key
            logger.warning("model=%s: device host pid=%d unreachable: %s", name, successor.pid, exc)
        finally:
            for fd in fds:
                os.close(fd)
        if last:
            host.models.discard(name)
            self.advance(host)

    def _recycled_by(self, successor: Host) -> Host | None:
        """The host ``successor`` is taking the models of, if it is a successor."""
        old = self.hosts.hosts.get(successor.key)
        return old if old is not None and old.successor is successor else None

    def _abandon(self, host: Host, why: str) -> None:
        """The models stay in ``host``; its successor ends (before the hand-over no connection
        is routed to it: nothing is lost)."""
        successor, host.successor = host.successor, None
        host.recyclable = False
        if successor is None:
            return
        logger.warning(
            "device host pid=%d gpu=%s stays: its successor pid=%d ends (%s)",
            host.pid,
            host.key,
            successor.pid,
            why,
        )
        self.watcher.forget(successor.control)
        successor.close()

    def host_died(self, host: Host) -> None:
        """``host`` died while it was being recycled: its successor ends too (the frontend's
        reconnections start a new host for the key, as after any crash)."""
        if host.successor is not None:
            self._abandon(host, "it died")

    def successor_died(self, host: Host) -> None:
        """``host``'s successor died (``DeviceHosts.exited`` let it go). Before the hand-over the
        models stay; during it, ``host`` holds connections it released for the successor: it is
        killed too, and the frontend reconnects every model, as after any crash."""
        host.recyclable = False
        if host.handing_over:
            logger.error(
                "device host pid=%d gpu=%s ends: its successor died while its models moved there",
                host.pid,
                host.key,
            )
            host.ended_by_warm = True  # no model's code killed it: none is blamed
            kill(host.pid)
