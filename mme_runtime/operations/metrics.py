"""Prometheus values recorded in the model processes, for the entrypoint to expose (``metrics_exporter.py``).

prometheus_client's multiprocess mode: each process keeps its values in files of its own under one directory, and
the exporter merges every file at each scrape (the layout: ``metric_directories.py``). A model's loader writes under
``metrics/models/<model>/<loader pid>/``: the series labelled with the model, and their
share of the container's counters (LOADs, UNLOADs, caches). When the server stops (UNLOAD), it moves that directory
to ``metrics/unloaded/``; the exporter keeps the container's counters from it and deletes the rest, so an unloaded
model's series go away while the container's totals keep counting. The warm process writes under
``metrics/container/<pid>/``.

A device host serves many models: each has a directory of its own, ``metrics/models/<model>/<host pid>/``
(``start_hosted``), and every thread the host runs for a model records into that model's series (``bind``).

Everything here does nothing until ``start_model``, ``start_hosted`` or ``start_container`` ran (metrics are off
with ``MME_METRICS_PORT=0``), and a value that cannot be recorded is logged, never raised into a request.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec

from prometheus_client import Histogram, values

from mme_runtime.base.config import Config
from mme_runtime.operations.metric_directories import (
    HOST_BYTES_FILE,
    carry_over,
    claim,
    make_directory,
    model_dir_name,
    models_dir,
    move_to_unloaded,
)
from mme_runtime.operations.metric_series import DIRECTORY_VARIABLE, Series, batch_size_buckets

logger = logging.getLogger(__name__)

P = ParamSpec("P")

_metrics: Series | None = None
_bound = threading.local()  # in a device host: the series of the model a thread works for


def start_model(config: Config, model: str, server_pid: int) -> None:
    """Sends this process's values to the model's directory: a loader's, while it loads."""
    if _metrics is not None and _metrics.model == model:
        return  # forked from the server: its objects already write here, to files of this process's own
    directory = models_dir(config.metrics_dir) / model_dir_name(model) / str(server_pid)
    if _start(config, model, directory) and server_pid == os.getpid():
        claim(config.metrics_dir, directory)


def start_hosted(config: Config, model: str, restart: bool = False) -> Series | None:
    """A device host's model: its series, writing to a directory of its own; None with metrics off. ``restart``: a
    host that died served it, and its counts carry on here (in this host's directory)."""
    directory = models_dir(config.metrics_dir) / model_dir_name(model) / str(os.getpid())
    if _metrics is None or not make_directory(directory):
        return None  # metrics are off (the host's own series, start_container, is made first)
    try:
        (directory / HOST_BYTES_FILE).write_text("0")  # a hosted model's directory, before the exporter reads it
        if restart:
            carry_over(directory)
        claim(config.metrics_dir, directory)
        return Series(model, directory, home=_metrics.directory)
    except OSError as exc:
        logger.warning("model=%s metrics off in this host: %s", model, exc)
        return None


def stop_hosted(config: Config, series: Series | None) -> None:
    """The host lets the model go: its series go away as a stopped server's do (its files are closed by
    ``Series.close`` once its threads have ended)."""
    if series is None:
        return
    try:
        move_to_unloaded(config.metrics_dir, series.directory)
    except OSError as exc:
        logger.warning("metrics of %s left in place: %s", series.directory, exc)


def record_host_bytes(series: Series | None, host_bytes: int) -> None:
    """A hosted model's tensors in host memory, for the exporter's ``mme_model_host_memory_bytes``."""
    if series is not None:
        with contextlib.suppress(OSError):
            (series.directory / HOST_BYTES_FILE).write_text(str(host_bytes))


def bind(series: Series | None) -> None:
    """Records made by this thread go to ``series`` (a device host's thread working for one model)."""
    _bound.series = series


def current() -> Series | None:
    """The series this thread records into: for threads it starts on the model's behalf (a batcher's)."""
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
    """Runs only with metrics on; a failure to record is logged, never raised into the caller's work."""

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
    """One message from the frontend, answered: each request's status (read only with metrics on), and the time the
    backend took."""
    metrics = _live()
    for status in statuses():
        metrics.child(metrics.requests, metrics.model, str(status)).inc()
        metrics.child(metrics.request_seconds, metrics.model).observe(seconds)


@_recorder
def record_pass(waits: Sequence[float], seconds: float, batch_size: int) -> None:
    """One forward pass: how long each of its requests waited for it, how long it took, and how many it served."""
    metrics = _live()
    for wait in waits:
        metrics.child(metrics.queue_seconds, metrics.model).observe(wait)
    metrics.child(metrics.predict_seconds, metrics.model).observe(seconds)
    if metrics.batch_sizes is None:
        metrics.batch_sizes = Histogram(
            "mme_batch_size",
            "Requests per forward pass.",
            ["model"],
            buckets=batch_size_buckets(batch_size),
            registry=None,
        )
    metrics.child(metrics.batch_sizes, metrics.model).observe(len(waits))
    _record_gpu_memory(metrics)


@_recorder
def watch_gpu_memory(gpu: str) -> None:
    """Called by a host whose model is on GPU ``gpu`` (the frontend's id): its memory is reported from now on,
    and after every forward pass."""
    metrics = _live()
    metrics.gpu = gpu
    _record_gpu_memory(metrics)


def record_device_bytes(gpu: str, device_bytes: int) -> None:
    """A hosted model's own tensors on GPU ``gpu``: its memory gauge, instead of the host's whole pool."""
    metrics = current()
    if metrics is not None:
        metrics.device_bytes = device_bytes
        watch_gpu_memory(gpu)


def _record_gpu_memory(metrics: Series) -> None:
    if metrics.gpu is not None:
        import torch  # only device hosts watch a GPU, and they have torch loaded

        used = metrics.device_bytes if metrics.device_bytes is not None else torch.cuda.memory_reserved()
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
    """The bound model's LOAD, ready here after ``seconds`` (``mme_model_load_seconds``, per model)."""
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
    """The loader stops: its model's series go away (the exporter folds the container's counters)."""
    global _metrics
    if _metrics is None or _metrics.model is None:
        return
    directory, _metrics = _metrics.directory, None
    try:
        move_to_unloaded(config.metrics_dir, directory)
    except OSError as exc:
        logger.warning("metrics of %s left in place: %s", directory, exc)
