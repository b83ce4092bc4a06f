"""The Prometheus endpoint: ``GET /metrics`` on ``MME_METRICS_PORT``, served from a thread of the
entrypoint.

Each scrape merges the files the model processes wrote (``metrics.py``) with prometheus_client's own
multiprocess reader, and adds what is read live: the model servers running and the host memory of
each model's processes. The HTTP thread runs beside MMS, so it answers while a model loads. Only
``mme_`` series are shown: a library in a model process that makes prometheus_client metrics of its
own writes them to the same files. ``snapshot`` gives the same to the CloudWatch lines
(``cloudwatch_metrics.py``).

Files of processes that ended are folded: their counters and histograms are added to a file this
process owns, and their gauges dropped. A stopped model server's directory (``metrics/unloaded/``)
folds into ``metrics/retired/``, keeping only the container's series, so the model's own go away and
the container's totals never step back; the files of an executor that ended fold into its server's
directory. Only this process writes those files, under one lock shared by the scrape thread and the
supervisor's sweep; a directory or file is moved aside before its values are added, so a fold that
fails halfway is never counted twice.
"""

from __future__ import annotations

import gc
import http.client
import json
import logging
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import psutil
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from mme_runtime.base.child_processes import trim_heap
from mme_runtime.base.config import Config
from mme_runtime.base.janitor import REQUEST_TIMEOUT_SECONDS
from mme_runtime.operations.metrics import (
    HOST_BYTES_FILE,
    MOVED_FILE,
    models_dir,
    move_to_unloaded,
    process_started,
    scan,
    server_alive,
    unloaded_dir,
)

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

logger = logging.getLogger(__name__)

PREFIX = "mme_"
ADDITIVE_KINDS = ("counter", "histogram")  # what folds add up; gauges end with their process
FOLDING_SUFFIX = ".folding"  # a file or directory being folded: out of every merge
EXITED = "exited"  # the pid part of the files that hold what a server's ended executors counted
# Reading a process's proportional set size makes the kernel walk its page tables (8 ms for a torch
# process here): each process's value is read at most this often, so frequent scrapes cost the
# models' cores nothing noticeable.
HOST_MEMORY_SECONDS = 10.0
# The sweep walks every model's directory at least this often, for a process it could not watch
# (a loader that crashed between walks): its files are still read by scrapes meanwhile.
WALK_SECONDS = 60.0


class ModelMetrics:
    """The collector behind ``/metrics``; ``sweep`` is called by the supervisor's loop."""

    def __init__(self, metrics_dir: Path, port: int) -> None:
        self.metrics_dir = metrics_dir
        self.models_url = f"http://127.0.0.1:{port}/models/"
        self._lock = threading.Lock()
        # (pid, start) -> (read at, bytes)
        self._host_memory: dict[tuple[int, float], tuple[float, int]] = {}
        # what folded servers recorded, once a snapshot asks for it
        self._folded: list[Metric] | None = None
        # the sweep's: when it next walks every directory, the processes writing there (pid ->
        # start time) and the directories the last walk left to look at again
        self._next_walk = 0.0
        self._writers: dict[int, float | None] = {}
        self._unsettled: set[Path] = set()
        self._changed: list[int | None] = []  # ``_asked_to_walk``'s last reading

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # scrapes may come concurrently; the sweep folds too
            families = self._families()
        yield from families

    def snapshot(self) -> tuple[list[Metric], list[Metric]]:
        """What a scrape shows, and what the servers folded since the last snapshot had recorded
        (their model series, gone from a scrape; kept from the first call on):
        ``cloudwatch_metrics`` reports what stopped models counted."""
        with self._lock:
            families = self._families()
            folded, self._folded = self._folded or [], []
        return families, folded

    def _families(self) -> list[Metric]:
        self._fold_unloaded()
        merged = [
            family for family in self._merge(self._live_files()) if family.name.startswith(PREFIX)
        ]
        return merged + list(self._live_gauges())

    def sweep(self) -> None:
        """Folds what ended: servers that died without stopping (once MMS no longer has their
        model), and executors that ended inside running servers. A failure is logged and tried again
        at the next sweep.

        Flat in the models loaded: the model directories are walked only when a process that
        writes there (or a host) has ended, a host has started, another process's values were moved
        into a model's directory (``_asked_to_walk``), or ``WALK_SECONDS`` after the last walk (for
        a writer no walk saw: a loader that crashed); between walks a sweep reads only those
        processes' start times. A walk every second read every model's directory and the ``/proc``
        entries of its processes: 12% of a core with 2,000 idle models."""
        asked = self._asked_to_walk()
        if time.monotonic() >= self._next_walk or asked or self._a_writer_ended():
            self._walk()
        for server_dir in sorted(self._unsettled):
            if self._settle(server_dir):
                self._unsettled.discard(server_dir)
        with self._lock:
            self._fold_unloaded()

    def _walk(self) -> None:
        """Every model's directory to settle; the processes writing there, as it finds them."""
        self._next_walk = time.monotonic() + WALK_SECONDS
        self._writers = {}
        self._watch_containers()
        self._unsettled = set(self._server_dirs())

    def _settle(self, server_dir: Path) -> bool:
        """Folds what ended in ``server_dir`` and watches the processes still writing there; False
        while there is more to do (a dead server whose model MMS still has, or did not say)."""
        try:
            if not server_dir.is_dir():
                return True  # moved since the walk: a loader's at its end, a model's at its UNLOAD
            if server_alive(server_dir):
                with self._lock:
                    writers = self._fold_exited_executors(server_dir)
                for pid in {int(server_dir.name), *writers}:
                    self._writers.setdefault(pid, process_started(pid))
                return True
            if self._registered(server_dir.parent.name) is False:
                move_to_unloaded(self.metrics_dir, server_dir)
                return True
            return False
        except (OSError, ValueError) as exc:
            # it moved or ended meanwhile: the next walk sees where it is now
            logger.debug("metrics sweep of %s: %s", server_dir, exc)
            return not server_dir.is_dir()

    def _a_writer_ended(self) -> bool:
        """Whether a process the last walk saw writing has ended (or had, as it was seen)."""
        return any(
            started is None or process_started(pid) != started
            for pid, started in self._writers.items()
        )

    def _asked_to_walk(self) -> bool:
        """Whether, since the last call, a process made its directory under ``metrics/container/``
        (a host started: its models' directories follow) or moved another's values files into a
        model's directory (``MOVED_FILE``: a host that died, or handed its models over)."""
        changed: list[int | None] = []
        for path in (self.metrics_dir / "container", self.metrics_dir / MOVED_FILE):
            try:
                changed.append(path.stat().st_mtime_ns)
            except OSError:
                changed.append(None)
        seen, self._changed = self._changed, changed
        return changed != seen

    def _watch_containers(self) -> None:
        """The processes with a directory under ``metrics/container/`` (the warm process and the
        hosts) are watched too, so that a host that ends before any walk saw its models' directories
        makes the next sweep walk."""
        for directory in scan(self.metrics_dir / "container", "*"):
            if directory.name.isdigit() and (started := process_started(int(directory.name))):
                self._writers.setdefault(int(directory.name), started)

    def _server_dirs(self) -> list[Path]:
        return [path for path in scan(models_dir(self.metrics_dir), "*/*") if path.name.isdigit()]

    def _merge(self, files: list[str]) -> list[Metric]:
        """The files merged; one another process moved or cut short is left out."""
        skipped: set[str] = set()
        while True:
            try:
                return list(
                    MultiProcessCollector.merge(
                        [f for f in files if f not in skipped], accumulate=True
                    )
                )
            except Exception as exc:  # noqa: BLE001
                # a file being written or moved: find it, leave it out
                bad = [f for f in files if f not in skipped and not _readable(f)]
                if not bad:
                    raise
                logger.debug("metrics: leaving out %s: %s", bad, exc)
                skipped.update(bad)

    def _live_files(self) -> list[str]:
        paths = [
            *scan(self.metrics_dir, "models/*/*/*.db"),
            *scan(self.metrics_dir, "container/*/*.db"),
            *scan(self.metrics_dir, "retired/*.db"),
        ]
        return sorted(str(path) for path in paths if not _of_ended_process(path))

    def _fold_unloaded(self) -> None:
        """Adds the container's counters of each stopped server to retired/, then deletes its
        directory."""
        for directory in scan(unloaded_dir(self.metrics_dir), "*"):
            if directory.name.endswith(FOLDING_SUFFIX):
                # added already, by a fold that then failed to delete
                shutil.rmtree(directory, ignore_errors=True)
                continue
            files = scan(directory, "*.db")
            values = _read_values(files, keep=lambda labels: "model" not in labels)
            stopped = [] if self._folded is None else self._merge(sorted(map(str, files)))
            folding = directory.with_name(directory.name + FOLDING_SUFFIX)
            try:
                directory.rename(folding)
            except OSError as exc:
                logger.warning("metrics of %s not folded yet: %s", directory, exc)
                continue
            if self._folded is not None:
                self._folded.extend(stopped)
            _add_values(values, lambda kind: self.metrics_dir / "retired" / f"{kind}_retired.db")
            shutil.rmtree(folding, ignore_errors=True)

    def _fold_exited_executors(self, server_dir: Path) -> set[int]:
        """Adds the counts of the server's executors that ended to the server's ``exited`` files,
        removing theirs: an executor crashing again and again adds nothing to scrape. Returns the
        pids of the other files there (processes still running)."""
        files = scan(server_dir, "*.db")
        ended = [path for path in files if _of_ended_process(path, gauges_only=False)]
        running = {int(pid) for path in files if (pid := _writer(path)) and path not in ended}
        if not ended:
            return running
        values = _read_values(ended, keep=lambda labels: True)
        folding = [path.rename(path.with_name(path.name + FOLDING_SUFFIX)) for path in ended]
        _add_values(values, lambda kind: server_dir / f"{kind}_{EXITED}.db")
        for path in folding:
            path.unlink(missing_ok=True)
        return running

    def _live_gauges(self) -> Iterator[Metric]:
        servers: dict[str, list[psutil.Process]] = {}
        # a device host's models: their own tensors (the host's PSS is all of them)
        hosted: dict[str, int] = {}
        for directory in self._server_dirs():
            if not server_alive(directory):
                continue
            model = urllib.parse.unquote(directory.parent.name)
            try:
                hosted[model] = hosted.get(model, 0) + int(
                    (directory / HOST_BYTES_FILE).read_text()
                )
                servers.setdefault(model, [])
                continue
            except (OSError, ValueError):
                pass  # a loader's directory: its process's memory is the model's while it loads
            try:
                server = psutil.Process(int(directory.name))
            except psutil.Error:
                continue
            try:
                children = server.children(recursive=True)
            except psutil.Error:
                # an executor ending at this moment: the server still counts, its memory next time
                children = []
            processes = [server, *children]
            servers.setdefault(model, []).extend(processes)
        running = GaugeMetricFamily(
            "mme_models_loaded", "Models whose model server runs (loading, or loaded)."
        )
        running.add_metric([], len(servers))
        yield running
        host = GaugeMetricFamily(
            "mme_model_host_memory_bytes",
            "Host memory of a model's processes (proportional set size: shared pages counted "
            "once).",
            labels=["model"],
        )
        now = time.monotonic()
        readings = {}
        for model, processes in sorted(servers.items()):
            total = hosted.get(model, 0)
            for process in processes:
                key = (process.pid, process_started(process.pid) or 0.0)
                read_at, value = self._host_memory.get(key, (-HOST_MEMORY_SECONDS, 0))
                if now - read_at >= HOST_MEMORY_SECONDS:
                    read_at, value = now, _host_memory(process)
                readings[key] = (read_at, value)
                total += value
            host.add_metric([model], total)
        self._host_memory = readings  # processes that ended are forgotten
        yield host

    def _registered(self, quoted_model: str) -> bool | None:
        """Whether MMS has the model; None when MMS does not answer."""
        try:
            with urllib.request.urlopen(
                self.models_url + quoted_model, timeout=REQUEST_TIMEOUT_SECONDS
            ):
                return True
        except urllib.error.HTTPError as exc:
            exc.close()
            return False if exc.code == 404 else None
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return None  # not answering, or not in HTTP (a frontend stopping mid-answer)


Values = dict[str, dict[str, float]]  # file kind -> mmap key -> value


def _read_values(paths: list[Path], keep: Callable[[dict[str, str]], bool]) -> Values:
    """The additive ``mme_`` values of ``paths`` whose labels ``keep`` accepts; unreadable files are
    left out."""
    values: Values = {}
    for path in sorted(paths):
        kind = path.name.split("_")[0]
        if kind not in ADDITIVE_KINDS:
            continue
        try:
            entries = MmapedDict.read_all_values_from_file(str(path))
        except Exception as exc:  # noqa: BLE001
            # cut short by a writer killed mid-creation: nothing to keep
            logger.warning("metrics: cannot read %s (%s): its values are lost", path, exc)
            continue
        for key, value, _, _ in entries:
            metric_name, _, labels, _ = json.loads(key)
            if value and metric_name.startswith(PREFIX) and keep(labels):
                values.setdefault(kind, {})[key] = values.get(kind, {}).get(key, 0.0) + value
    return values


def _add_values(values: Values, store_for: Callable[[str], Path]) -> None:
    for kind, entries in values.items():
        path = store_for(kind)
        path.parent.mkdir(parents=True, exist_ok=True)
        store = MmapedDict(str(path))
        try:
            for key, value in entries.items():
                store.write_value(key, store.read_value(key)[0] + value, 0.0)
        finally:
            store.close()


def _writer(path: Path) -> str:
    """The pid of the process other than its server's that wrote ``path`` (``<kind>_<pid>.db``,
    ``gauge_<mode>_<pid>.db``); "" for the server's own and for folded files ("retired", "exited"),
    which belong to no process."""
    pid = path.stem.split("_")[-1]
    return pid if pid.isdigit() and pid != path.parent.name else ""


def _of_ended_process(path: Path, gauges_only: bool = True) -> bool:
    """Whether ``path`` belongs to a process other than its server's that ended: its gauges end
    with it (``gauges_only``), its other values are folded by a sweep."""
    if gauges_only and not path.name.startswith("gauge"):
        return False
    return bool(pid := _writer(path)) and process_started(int(pid)) is None


def _readable(path: str) -> bool:
    try:
        MmapedDict.read_all_values_from_file(path)
    except Exception:  # noqa: BLE001 - any reason it cannot be read is a reason to leave it out
        return False
    return True


def start(config: Config) -> ModelMetrics | None:
    """Clears what an earlier run left and serves ``/metrics``; None when metrics are off."""
    shutil.rmtree(config.metrics_dir, ignore_errors=True)
    if config.metrics_port == 0:
        logger.info("metrics off (MME_METRICS_PORT=0)")
        return None
    config.metrics_dir.mkdir(parents=True, exist_ok=True)
    collector = ModelMetrics(config.metrics_dir, config.port)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        _serve(config.metrics_port, registry)
    except OSError as exc:
        # Serving models matters more than their metrics: say so loudly and go on without them. The
        # collector is kept all the same: its sweep still clears what unloaded models leave behind.
        logger.error("metrics not served: cannot listen on port %d: %s", config.metrics_port, exc)
        return collector
    logger.info("Prometheus metrics on port %d at /metrics", config.metrics_port)
    return collector


def release_heap() -> None:
    """Gives back what a scrape or a CloudWatch write used: at 1,000 models that answered requests
    one merges about 62,000 samples (74 MB at its peak, for a 3.7 MB answer). Python's free lists
    keep thousands of the objects freed, scattered over that heap, until a full collection empties
    them (about 2 ms: this process holds few objects); the trim then hands the heap back. The
    entrypoint runs on glibc's allocator for this (``Config.entrypoint_environment``): on Python's,
    the few objects outliving each scrape keep its arenas, 1.7 MB more a scrape for good (glibc's
    costs a scrape about 1.5 times the time)."""
    gc.collect()
    trim_heap()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """A scrape is not worth a log line."""


def _serve(port: int, registry: CollectorRegistry) -> ThreadingWSGIServer:
    """prometheus_client's answer to ``/metrics`` on ``port``, from a thread per request, with the
    scrape's memory released after each."""
    answer = make_wsgi_app(registry)

    def scrape(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        try:
            body: Iterable[bytes] = answer(environ, start_response)  # all made by now
            return body
        finally:
            release_heap()

    server = make_server("0.0.0.0", port, scrape, ThreadingWSGIServer, _QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def _host_memory(process: psutil.Process) -> int:
    try:
        return int(process.memory_full_info().pss)
    except (psutil.Error, AttributeError):
        try:
            return int(process.memory_info().rss)
        except psutil.Error:
            return 0
