"""Prometheus values recorded in the model processes, for the entrypoint to expose (``metrics_exporter.py``).

prometheus_client's multiprocess mode: each process keeps its values in files of its own under one directory, and
the exporter merges every file at each scrape. A model's backend server and its executors write under
``metrics/models/<model>/<server pid>/``: the series labelled with the model, and their share of the container's
counters (LOADs, UNLOADs, caches). When the server stops (UNLOAD), it moves that directory to ``metrics/unloaded/``;
the exporter keeps the container's counters from it and deletes the rest, so an unloaded model's series go away
while the container's totals keep counting. The warm process writes under ``metrics/container/<pid>/``.

Everything here does nothing until ``start_model`` or ``start_container`` ran (metrics are off with
``MME_METRICS_PORT=0``), and a value that cannot be recorded is logged, never raised into a request.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec

from prometheus_client import Counter, Gauge, Histogram, values

from mme_runtime.config import Config

logger = logging.getLogger(__name__)

P = ParamSpec("P")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Up to this batch size every size has its own bucket; above it, powers of two and the batch size itself.
MAX_EXACT_BATCH_BUCKETS = 64
# A server's directory holds this file: its process's start time, so a reused pid is not taken for the server.
OWNER_FILE = "owner"
MKDIR_ATTEMPTS = 3


def models_dir(metrics_dir: Path) -> Path:
    return metrics_dir / "models"


def unloaded_dir(metrics_dir: Path) -> Path:
    return metrics_dir / "unloaded"


def model_dir_name(model: str) -> str:
    return urllib.parse.quote(model, safe="")


def move_to_unloaded(metrics_dir: Path, server_dir: Path) -> None:
    """Hands a model server's values over to the exporter's fold (``OSError`` if another process did it first)."""
    target = unloaded_dir(metrics_dir) / f"{server_dir.parent.name}@{server_dir.name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    server_dir.rename(target)
    with contextlib.suppress(OSError):  # not empty: another server of this model runs
        server_dir.parent.rmdir()


def process_started(pid: int) -> float | None:
    """When process ``pid`` started, in clock ticks since boot (what ``OWNER_FILE`` holds), or None if there is no
    such process. Read from /proc: psutil's start times add the boot time, which a VM whose clock is stepped reports
    differently from one read to the next."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces and parentheses): state is the 3rd, starttime the 22nd.
    return float(stat.rsplit(")", 1)[1].split()[19])


def server_alive(server_dir: Path) -> bool:
    """Whether the model server that owns ``server_dir`` still runs (not merely a process with its pid)."""
    try:
        recorded = float((server_dir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return process_started(int(server_dir.name)) is not None  # being created: trust the pid
    return process_started(int(server_dir.name)) == recorded


def batch_size_buckets(batch_size: int) -> list[float]:
    if batch_size <= MAX_EXACT_BATCH_BUCKETS:
        return [float(size) for size in range(1, batch_size + 1)]
    sizes = {2**power for power in range(batch_size.bit_length()) if 2**power < batch_size}
    return [float(size) for size in sorted(sizes | {batch_size})]


class _Metrics:
    """This process's metric objects, made once its values go to files (they read ``values.ValueClass`` when made)."""

    def __init__(self, model: str | None, directory: Path) -> None:
        self.model = model
        self.directory = directory
        self.gpu: str | None = None  # the executor's card, once it reports its GPU memory
        self.batch_sizes: Histogram | None = None
        # registry=None: the exporter reads the files; nothing in a model process exposes a registry.
        self.requests = Counter(
            "mme_requests", "Requests answered by the model, by HTTP status code.", ["model", "code"], registry=None
        )
        self.request_seconds = Histogram(
            "mme_request_duration_seconds",
            "Time in the model's backend from a request's arrival to its answer.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.queue_seconds = Histogram(
            "mme_queue_duration_seconds",
            "Time a decoded request waited for its forward pass.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.predict_seconds = Histogram(
            "mme_predict_duration_seconds",
            "Time of one forward pass (predict_fn on a batch, or transform_fn), per pass.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.executor_restarts = Counter(
            "mme_executor_restarts", "Executors started again after one that served ended.", ["model"], registry=None
        )
        # livesum: the exporter leaves out the files of processes that ended, so a dead executor's memory goes.
        self.gpu_memory = Gauge(
            "mme_model_gpu_memory_bytes",
            "GPU memory reserved by PyTorch in the model's executor, per card (the CUDA context not included).",
            ["model", "gpu"],
            multiprocess_mode="livesum",
            registry=None,
        )
        self.loads = Histogram(
            "mme_model_load_duration_seconds",
            "LOADs that reached a model server, from its start to its first answer, by outcome.",
            ["outcome"],
            buckets=LOAD_BUCKETS,
            registry=None,
        )
        self.unloads = Histogram(
            "mme_model_unload_duration_seconds",
            "UNLOADs of loaded models, from the stop request to every executor ended, by outcome.",
            ["outcome"],
            buckets=LOAD_BUCKETS,
            registry=None,
        )
        self.cache_lookups = Counter(
            "mme_cache_lookups", "Cache lookups, by cache and result (hit or miss).", ["cache", "result"], registry=None
        )
        if model is not None:
            self.executor_restarts.labels(model)  # shown as 0 from the start, not only after the first restart


_metrics: _Metrics | None = None


def start_model(config: Config, model: str, server_pid: int) -> None:
    """Sends this process's values to the model server's directory; the server and its executors call it."""
    if _metrics is not None and _metrics.model == model:
        return  # forked from the server: its objects already write here, to files of this process's own
    model_dir = models_dir(config.metrics_dir) / model_dir_name(model)
    directory = model_dir / str(server_pid)
    if _start(config, model, directory) and server_pid == os.getpid():
        (directory / OWNER_FILE).write_text(str(process_started(server_pid)))
        # Servers of this model that died without stopping (a crash, or an UNLOAD and a quick re-LOAD) end here:
        # this server's counts start from zero, as after any restart.
        for sibling in model_dir.iterdir():
            if sibling != directory and sibling.name.isdigit() and not server_alive(sibling):
                with contextlib.suppress(OSError):
                    move_to_unloaded(config.metrics_dir, sibling)


def start_container(config: Config) -> None:
    """For processes that serve no model (the warm process)."""
    _start(config, None, config.metrics_dir / "container" / str(os.getpid()))


def _start(config: Config, model: str | None, directory: Path) -> bool:
    global _metrics
    if config.metrics_port == 0:
        return False
    for attempt in range(MKDIR_ATTEMPTS):  # the exporter may remove an empty parent at the same moment
        try:
            directory.mkdir(parents=True, exist_ok=True)
            break
        except OSError as exc:
            if attempt == MKDIR_ATTEMPTS - 1:
                logger.warning("metrics off in this process: cannot create %s: %s", directory, exc)
                return False
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    values.ValueClass = values.MultiProcessValue()
    _metrics = _Metrics(model, directory)
    return True


def _recorder(function: Callable[P, None]) -> Callable[P, None]:
    """Runs only with metrics on; a failure to record is logged, never raised into the caller's work."""

    @functools.wraps(function)
    def record(*args: P.args, **kwargs: P.kwargs) -> None:
        if _metrics is None:
            return
        try:
            function(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a metric must never fail a request or a LOAD
            logger.warning("metric %s not recorded: %s", function.__name__, exc)

    return record


def _live() -> _Metrics:
    assert _metrics is not None  # _recorder checked
    return _metrics


@_recorder
def record_requests(statuses: Callable[[], Sequence[int]], seconds: float) -> None:
    """One message from the frontend, answered: each request's status (read only with metrics on), and the time the
    backend took."""
    metrics = _live()
    for status in statuses():
        metrics.requests.labels(metrics.model, str(status)).inc()
        metrics.request_seconds.labels(metrics.model).observe(seconds)


@_recorder
def record_pass(waits: Sequence[float], seconds: float, batch_size: int) -> None:
    """One forward pass: how long each of its requests waited for it, how long it took, and how many it served."""
    metrics = _live()
    for wait in waits:
        metrics.queue_seconds.labels(metrics.model).observe(wait)
    metrics.predict_seconds.labels(metrics.model).observe(seconds)
    if metrics.batch_sizes is None:
        metrics.batch_sizes = Histogram(
            "mme_batch_size",
            "Requests per forward pass.",
            ["model"],
            buckets=batch_size_buckets(batch_size),
            registry=None,
        )
    metrics.batch_sizes.labels(metrics.model).observe(len(waits))
    _record_gpu_memory(metrics)


@_recorder
def watch_gpu_memory(gpu: str) -> None:
    """Called by an executor whose model is on GPU ``gpu`` (the frontend's id): its memory is reported from now on,
    and after every forward pass."""
    metrics = _live()
    metrics.gpu = gpu
    _record_gpu_memory(metrics)


def _record_gpu_memory(metrics: _Metrics) -> None:
    if metrics.gpu is not None:
        import torch  # only executors watch a GPU, and they have torch loaded

        metrics.gpu_memory.labels(metrics.model, metrics.gpu).set(torch.cuda.memory_reserved())


@_recorder
def record_executor_restart() -> None:
    metrics = _live()
    metrics.executor_restarts.labels(metrics.model).inc()


@_recorder
def record_load(succeeded: bool, seconds: float) -> None:
    _live().loads.labels("success" if succeeded else "failure").observe(seconds)


@_recorder
def record_unload(clean: bool, seconds: float) -> None:
    _live().unloads.labels("success" if clean else "killed").observe(seconds)


@_recorder
def record_cache_lookup(cache: str, hit: bool) -> None:
    _live().cache_lookups.labels(cache, "hit" if hit else "miss").inc()


def stop_model(config: Config) -> None:
    """The model server stops: its model's series go away (the exporter folds the container's counters)."""
    global _metrics
    if _metrics is None or _metrics.model is None:
        return
    directory, _metrics = _metrics.directory, None
    try:
        move_to_unloaded(config.metrics_dir, directory)
    except OSError as exc:
        logger.warning("metrics of %s left in place: %s", directory, exc)
