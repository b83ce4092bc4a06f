"""Starts the MMS frontend, keeps the process we started, and stops it with every worker on SIGTERM
or SIGINT.

Runs in the entrypoint (often PID 1). Signal handlers only record the signal; the loop acts on it.
It never imports torch.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from retrying import retry

from mme_runtime.base.child_processes import (
    PR_SET_CHILD_SUBREAPER,
    exited_children,
    prctl,
    start_program,
)
from mme_runtime.base.config import Config
from mme_runtime.base.errors import EXIT_BOOT, EXIT_OK
from mme_runtime.base.janitor import Janitor
from mme_runtime.base.nvidia import gpu_count
from mme_runtime.operations.metrics_exporter import ModelMetrics
from mme_runtime.operations.scaler import Scaler
from mme_runtime.processes.warm_protocol import STARTING_FILE, WARM_START_SECONDS

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2
METRICS_SWEEP_SECONDS = 1.0
KILL_WAIT_SECONDS = 5.0


class StartError(Exception):
    """MMS did not answer /ping: it exited, or the start timed out."""


@dataclass
class Supervisor:
    """Owns the MMS frontend process group for the life of the entrypoint."""

    config: Config
    command: list[str]
    env: dict[str, str]
    cwd: Path
    warm_command: list[str]
    model_metrics: ModelMetrics | None = None
    process: subprocess.Popen[bytes] | None = None
    warm_process: subprocess.Popen[bytes] | None = None
    group: int | None = None
    exit_status: int | None = None
    _pending: list[int] = field(default_factory=list)

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        # Orphaned workers re-parent to us even when we are not PID 1, so we can reap and account
        # for them.
        prctl(PR_SET_CHILD_SUBREAPER, 1, "PR_SET_CHILD_SUBREAPER")

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._pending.append(signum)  # record only: no logging, no locks

    @property
    def stopping(self) -> bool:
        return bool(self._pending)

    def run(self) -> int:
        """Starts MMS (retrying a failed start), then supervises it until it exits or we are told to
        stop."""
        try:
            return self._run()
        except BaseException:
            # Whatever went wrong here, leave no MMS, warm process or worker behind us.
            self._kill_group(signal.SIGKILL)
            raise

    def _run(self) -> int:
        try:
            self._start_with_retry()
        except StartError as exc:
            if self.stopping:
                return self._stop()
            logger.error("MMS did not start after %d attempts: %s", self.config.start_attempts, exc)
            self._kill_group(signal.SIGKILL)
            self._wait_for_group(KILL_WAIT_SECONDS)
            return EXIT_BOOT
        if self.stopping:
            return self._stop()
        logger.info("MMS is serving on port %d", self.config.port)
        janitor = Janitor(self.config.runtime_dir, self.config.port)
        scaler = Scaler(self.config.runtime_dir, self.config.port, gpu_count())
        next_metrics_sweep = 0.0
        while not self.stopping:
            janitor.sweep()
            scaler.sweep()
            if self.model_metrics is not None and time.monotonic() >= next_metrics_sweep:
                self._sweep_metrics(self.model_metrics)
                next_metrics_sweep = time.monotonic() + METRICS_SWEEP_SECONDS
            self._reap()
            if self.exit_status is not None:
                logger.error("MMS exited on its own with status %d", self.exit_status)
                self._kill_group(signal.SIGKILL)
                return self.exit_status or EXIT_BOOT
            time.sleep(POLL_SECONDS)
        return self._stop()

    @staticmethod
    def _sweep_metrics(model_metrics: ModelMetrics) -> None:
        try:
            model_metrics.sweep()
        except Exception:  # noqa: BLE001
            # metrics must never stop the server; the sweep runs again in a second
            logger.exception("metrics sweep failed")

    def _start_with_retry(self) -> None:
        attempts = self.config.start_attempts

        def retry_unless_stopping(exc: BaseException) -> bool:
            if isinstance(exc, StartError) and not self.stopping:
                logger.warning("MMS start failed, retrying: %s", exc)
                return True
            return False

        start = retry(
            stop_max_attempt_number=attempts,
            wait_fixed=2000,
            retry_on_exception=retry_unless_stopping,
        )(self._start_once)
        start()

    def _start_once(self) -> None:
        if self.group is not None:
            self._kill_group(signal.SIGKILL)
            self._wait_for_group(KILL_WAIT_SECONDS)
        self.exit_status = None
        # One process group holds the warm process, MMS and every model process: one group to
        # signal. Both start at once (the warm process imports torch while the JVM starts); a
        # model MMS starts before the warm process accepts waits for it (``STARTING_FILE``).
        warm = self._start_warm_process()
        self.group = warm.pid
        logger.info("starting MMS: %s", " ".join(self.command))
        try:
            self.process = start_program(self.command, self.env, self.cwd, group=self.group)
        except BaseException:  # no java, say: no stub is to wait for a warm process either
            (self.config.warm_socket.parent / STARTING_FILE).unlink(missing_ok=True)
            raise
        self._wait_for_warm_process(warm)
        self._wait_until_ready()

    def _start_warm_process(self) -> subprocess.Popen[bytes]:
        """Starts the warm process, which leads a new process group."""
        socket_path = self.config.warm_socket
        socket_path.unlink(missing_ok=True)
        (socket_path.parent / STARTING_FILE).touch()
        # A new process group (not session: MMS must be able to join the group, which needs the same
        # session).
        self.warm_process = start_program(self.warm_command, self.env, self.cwd, group=0)
        return self.warm_process

    def _wait_for_warm_process(self, warm: subprocess.Popen[bytes]) -> None:
        """Until the warm process accepts; the start fails (and is tried again) if it does not."""
        socket_path = self.config.warm_socket
        deadline = time.monotonic() + WARM_START_SECONDS
        try:
            while time.monotonic() < deadline and not self.stopping:
                if warm.poll() is not None:
                    break
                if _accepts(socket_path):
                    return
                time.sleep(POLL_SECONDS / 4)
        finally:
            (socket_path.parent / STARTING_FILE).unlink(missing_ok=True)
        if warm.poll() is None:
            warm.kill()
        raise StartError(
            f"the warm process did not accept on {socket_path} within {WARM_START_SECONDS:.0f} s"
        )

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_seconds
        url = f"http://127.0.0.1:{self.config.port}/ping"
        while time.monotonic() < deadline:
            if self.stopping:
                raise StartError("stop requested during start")
            self._reap()
            if self.exit_status is not None:
                raise StartError(
                    f"MMS exited with status {self.exit_status} before answering /ping"
                )
            if _ping(url):
                return
            time.sleep(POLL_SECONDS)
        raise StartError(f"MMS did not answer {url} within {self.config.startup_timeout_seconds} s")

    def _stop(self) -> int:
        signum = self._pending[0] if self._pending else signal.SIGTERM
        logger.info("received %s: stopping MMS and its workers", signal.Signals(signum).name)
        self._kill_group(signal.SIGTERM)
        if not self._wait_for_group(self.config.stop_grace_seconds):
            logger.warning(
                "MMS did not stop within %d s: killing it", self.config.stop_grace_seconds
            )
            self._kill_group(signal.SIGKILL)
            self._wait_for_group(KILL_WAIT_SECONDS)
        logger.info("MMS stopped")
        return EXIT_OK

    def _kill_group(self, signum: int) -> None:
        if self.group is None:
            return
        try:
            os.killpg(self.group, signum)
        except ProcessLookupError:
            pass

    def _wait_for_group(self, timeout: float) -> bool:
        """Waits until no process of the MMS group is left (reaping as we go); True if they all
        ended."""
        if self.group is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reap()
            if not _group_alive(self.group):
                return True
            time.sleep(POLL_SECONDS / 2)
        self._reap()
        return not _group_alive(self.group)

    def _reap(self) -> None:
        """Collects every exited child: MMS itself and orphans re-parented to us (waitpid until 0 or
        ECHILD)."""
        for pid, code in exited_children():
            if self.process is not None and pid == self.process.pid:
                self.exit_status = code
                self.process.returncode = code
            elif self.warm_process is not None and pid == self.warm_process.pid:
                self.warm_process.returncode = code
                if not self.stopping:
                    logger.warning(
                        "warm process exited (%d): models cannot load until it is back",
                        self.warm_process.returncode,
                    )


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _accepts(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _ping(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False
