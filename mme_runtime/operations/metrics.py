"""Prometheus values recorded in the model processes, for the entrypoint to expose
(``metrics_exporter.py``), and where their files live.

prometheus_client's multiprocess mode: each process keeps its values in files of its own under one
directory, and the exporter merges every file at each scrape. The warm process writes under
``metrics/container/<pid>/``. A device host writes its own under ``metrics/container/<host pid>/``,
and each model it serves has a directory of its own, ``metrics/models/<model>/<host pid>/``
(``start_hosted``): every thread the host runs for a model records into that model's series
(``bind``). A loader writes under ``metrics/models/<model>/<loader pid>/`` while it loads. When a
model goes (UNLOAD) or its loader ends, its directory moves to ``metrics/unloaded/``; the exporter
keeps the container's counters from it and deletes the rest, so an unloaded model's series go away
while the container's totals keep counting. Each directory is marked with its owner's start time, so
that a reused pid is never taken for its owner.

Everything here does nothing until ``start_model``, ``start_hosted`` or ``start_container`` ran
(metrics are off with ``MME_METRICS_PORT=0``), and a value that cannot be recorded is logged, never
raised into a request.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec

from prometheus_client import values

from mme_runtime.base.config import Config
from mme_runtime.operations.metric_series import DIRECTORY_VARIABLE, Series

logger = logging.getLogger(__name__)

# A server's directory holds this file: its process's start time, so a reused pid is not taken for
# the server.
OWNER_FILE = "owner"
# A hosted model's directory holds this file: its tensors' bytes in host memory (the host's PSS is
# every model's).
HOST_BYTES_FILE = "host_bytes"
# Touched whenever a process moves values files of another into a model's directory (a host that
# died, or handed its models over): the exporter's sweep then walks the models' directories.
MOVED_FILE = "moved"
MKDIR_ATTEMPTS = 3


def models_dir(metrics_dir: Path) -> Path:
    return metrics_dir / "models"


def scan(directory: Path, pattern: str) -> list[Path]:
    """The paths under ``directory`` that match ``pattern``, sorted. Processes remove directories at
    any time (a host lets a model go): one that goes mid-scan is skipped, where ``Path.glob`` raises
    FileNotFoundError."""
    return sorted(
        Path(path) for path in glob.glob(os.path.join(glob.escape(str(directory)), pattern))
    )


def unloaded_dir(metrics_dir: Path) -> Path:
    return metrics_dir / "unloaded"


def model_dir_name(model: str) -> str:
    return urllib.parse.quote(model, safe="")


def move_to_unloaded(metrics_dir: Path, server_dir: Path) -> None:
    """Hands a model server's values over to the exporter's fold (``OSError`` if another process did
    it first)."""
    target = unloaded_dir(metrics_dir) / f"{server_dir.parent.name}@{server_dir.name}"
    if target.exists():
        # a host that served this model before (an UNLOAD and a re-LOAD): not folded yet
        target = target.with_name(f"{target.name}.{time.monotonic_ns()}")
    target.parent.mkdir(parents=True, exist_ok=True)
    server_dir.rename(target)
    with contextlib.suppress(OSError):  # not empty: another server of this model runs
        server_dir.parent.rmdir()


def process_started(pid: int) -> float | None:
    """When process ``pid`` started, in clock ticks since boot (what ``OWNER_FILE`` holds), or None
    if there is no such process. Read from /proc: psutil's start times add the boot time, which a VM
    whose clock is stepped reports differently from one read to the next."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces and parentheses): state is the 3rd,
    # starttime the 22nd.
    return float(stat.rsplit(")", 1)[1].split()[19])


def server_alive(server_dir: Path) -> bool:
    """Whether the model server that owns ``server_dir`` still runs (not merely a process with its
    pid)."""
    try:
        recorded = float((server_dir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return process_started(int(server_dir.name)) is not None  # being created: trust the pid
    return process_started(int(server_dir.name)) == recorded


def carry_over(directory: Path) -> None:
    """Moves the files of this model's hosts that died into ``directory``: the exporter folds them
    as an ended process's (counters and histograms kept, gauges dropped)."""
    for sibling in directory.parent.iterdir():
        if sibling == directory or not sibling.name.isdigit() or server_alive(sibling):
            continue
        if not (sibling / HOST_BYTES_FILE).exists():
            continue  # a loader's or a server's: nothing of the model's own to keep
        _move_values(sibling, directory)


def _move_values(source: Path, target: Path) -> None:
    """The values files of ``source`` into ``target``; the exporter reads them there by their
    process's pid, which their names hold, and its next sweep folds them (``MOVED_FILE``)."""
    for path in scan(source, "*.db"):
        with contextlib.suppress(OSError):
            path.rename(target / path.name)
    with contextlib.suppress(OSError):
        (target.parent.parent.parent / MOVED_FILE).touch()  # metrics/models/<model>/<pid>


def claim(metrics_dir: Path, directory: Path) -> None:
    """Marks ``directory`` as this process's. Processes of this model that died without stopping (a
    crash, or an UNLOAD and a quick re-LOAD) end here: this one's counts start from zero, as after
    any restart."""
    (directory / OWNER_FILE).write_text(str(process_started(os.getpid())))
    for sibling in directory.parent.iterdir():
        if sibling != directory and sibling.name.isdigit() and not server_alive(sibling):
            with contextlib.suppress(OSError):
                move_to_unloaded(metrics_dir, sibling)


def make_directory(directory: Path) -> bool:
    for attempt in range(MKDIR_ATTEMPTS):
        # the exporter may remove an empty parent at the same moment
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return True
        except OSError as exc:
            if attempt == MKDIR_ATTEMPTS - 1:
                logger.warning("metrics off here: cannot create %s: %s", directory, exc)
    return False


P = ParamSpec("P")

_metrics: Series | None = None
_bound = threading.local()  # in a device host: the series of the model a thread works for


def start_model(config: Config, model: str, server_pid: int) -> None:
    """Sends this process's values to the model's directory: a loader's, while it loads."""
    if _metrics is not None and _metrics.model == model:
        # forked from the server: its objects already write here, to files of this process's own
        return
    directory = models_dir(config.metrics_dir) / model_dir_name(model) / str(server_pid)
    if _start(config, model, directory) and server_pid == os.getpid():
        claim(config.metrics_dir, directory)


def start_hosted(config: Config, model: str, restart: bool = False) -> Series | None:
    """A device host's model: its series, writing to a directory of its own; None with metrics off.
    ``restart``: a host that died served it, and its counts carry on here (in this host's
    directory)."""
    directory = models_dir(config.metrics_dir) / model_dir_name(model) / str(os.getpid())
    if _metrics is None or not make_directory(directory):
        return None  # metrics are off (the host's own series, start_container, is made first)
    try:
        # a hosted model's directory, before the exporter reads it
        (directory / HOST_BYTES_FILE).write_text("0")
        if restart:
            carry_over(directory)
        claim(config.metrics_dir, directory)
        return Series(model, directory, hosted=True)
    except OSError as exc:
        logger.warning("model=%s metrics off in this host: %s", model, exc)
        return None


def stop_hosted(config: Config, series: Series | None) -> None:
    """The host lets the model go: its series go away as a stopped server's do (its files are closed
    by ``Series.close`` once its threads have ended)."""
    if series is None:
        return
    try:
        move_to_unloaded(config.metrics_dir, series.directory)
    except OSError as exc:
        logger.warning("metrics of %s left in place: %s", series.directory, exc)


def hand_over(config: Config, series: Series | None, successor: int) -> None:
    """The host's model moved to host ``successor`` (``host_recycling.py``): its counts go into
    that host's directory for it, as a dead host's do (``carry_over``: counters and histograms kept,
    gauges dropped once this process ends), and its own directory goes."""
    if series is None:
        return
    target = series.directory.parent / str(successor)
    if not target.is_dir():  # metrics off there: the counts end as an UNLOAD's do
        stop_hosted(config, series)
        return
    _move_values(series.directory, target)
    shutil.rmtree(series.directory, ignore_errors=True)


def record_host_bytes(series: Series | None, host_bytes: int) -> None:
    """A hosted model's tensors in host memory, for the exporter's
    ``mme_model_host_memory_bytes``."""
    if series is not None:
        with contextlib.suppress(OSError):
            (series.directory / HOST_BYTES_FILE).write_text(str(host_bytes))


def bind(series: Series | None) -> None:
    """Records made by this thread go to ``series`` (a device host's thread working for one
    model)."""
    _bound.series = series


def current() -> Series | None:
    """The series this thread records into: for threads it starts on the model's behalf (a
    batcher's)."""
    return getattr(_bound, "series", None) or _metrics


def start_container(config: Config) -> None:
    """For processes that serve no model of their own (the warm process, a device host)."""
    _start(config, None, config.metrics_dir / "container" / str(os.getpid()))


def _start(config: Config, model: str | None, directory: Path) -> bool:
    global _metrics
    if config.metrics_port == 0 or not make_directory(directory):
        return False
    os.environ[DIRECTORY_VARIABLE] = str(directory)
    values.ValueClass = values.MultiProcessValue()
    _metrics = Series(model, directory)
    return True


def _recorder(function: Callable[P, None]) -> Callable[P, None]:
    """Runs only with metrics on; a failure to record is logged, never raised into the caller's
    work."""

    @functools.wraps(function)
    def record(*args: P.args, **kwargs: P.kwargs) -> None:
        if current() is None:
            return
        try:
            function(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a metric must never fail a request or a LOAD
            logger.warning("metric %s not recorded: %s", function.__name__, exc)

    return record


def _live() -> Series:
    series = current()
    assert series is not None  # _recorder checked
    return series


@_recorder
def record_requests(statuses: Callable[[], Sequence[int]], seconds: float) -> None:
    """One message from the frontend, answered: each request's status (read only with metrics on),
    and the time the backend took."""
    metrics = _live()
    answers = metrics.answers
    for status in statuses():
        (answers.requests.get(str(status)) or metrics.request_count(status)).inc()
        answers.request_seconds.observe(seconds)


@_recorder
def record_pass(waits: Sequence[float], seconds: float, batch_size: int) -> None:
    """One forward pass: how long each of its requests waited for it, how long it took, and how many
    it served."""
    metrics = _live()
    answers = metrics.answers
    for wait in waits:
        answers.queue_seconds.observe(wait)
    answers.predict_seconds.observe(seconds)
    (answers.batch_sizes or metrics.batch_size_histogram(batch_size)).observe(len(waits))
    _record_gpu_memory(metrics)


@_recorder
def watch_gpu_memory(gpu: str) -> None:
    """Called by a host whose model is on GPU ``gpu`` (the frontend's id): its memory is reported
    from now on, and after every forward pass."""
    metrics = _live()
    metrics.gpu = gpu
    _record_gpu_memory(metrics)


def record_device_bytes(gpu: str, device_bytes: int) -> None:
    """A hosted model's own tensors on GPU ``gpu``: its memory gauge, instead of the host's whole
    pool."""
    metrics = current()
    if metrics is not None:
        metrics.device_bytes = device_bytes
        watch_gpu_memory(gpu)


def _record_gpu_memory(metrics: Series) -> None:
    if metrics.gpu is not None:
        import torch  # only device hosts watch a GPU, and they have torch loaded

        used = (
            metrics.device_bytes
            if metrics.device_bytes is not None
            else torch.cuda.memory_reserved()
        )
        metrics.child(metrics.gpu_memory, metrics.model, metrics.gpu).set(used)


@_recorder
def record_restart() -> None:
    """The model is loaded again after the host that served it ended."""
    metrics = _live()
    for restarts in (metrics.restarts, metrics.executor_restarts):
        metrics.child(restarts, metrics.model).inc()


@_recorder
def record_load(succeeded: bool, seconds: float) -> None:
    metrics = _live()
    metrics.child(metrics.loads, "success" if succeeded else "failure").observe(seconds)


@_recorder
def record_model_load(seconds: float) -> None:
    """The bound model's LOAD, ready here after ``seconds`` (``mme_model_load_seconds``, per
    model)."""
    metrics = _live()
    metrics.child(metrics.load_seconds, metrics.model).set(seconds)


@_recorder
def record_unload(clean: bool, seconds: float) -> None:
    metrics = _live()
    metrics.child(metrics.unloads, "success" if clean else "killed").observe(seconds)


@_recorder
def record_quarantine(model: str) -> None:
    metrics = _live()
    metrics.child(metrics.quarantines, model).inc()


@_recorder
def record_cache_lookup(cache: str, hit: bool) -> None:
    metrics = _live()
    metrics.child(metrics.cache_lookups, cache, "hit" if hit else "miss").inc()


def stop_model(config: Config) -> None:
    """The loader stops: its model's series go away (the exporter folds the container's
    counters)."""
    global _metrics
    if _metrics is None or _metrics.model is None:
        return
    directory, _metrics = _metrics.directory, None
    try:
        move_to_unloaded(config.metrics_dir, directory)
    except OSError as exc:
        logger.warning("metrics of %s left in place: %s", directory, exc)
