"""The Prometheus endpoint: ``GET /metrics`` on ``MME_METRICS_PORT``, served from a thread of the entrypoint.

Each scrape merges the files the model processes wrote (``metrics.py``) with prometheus_client's own multiprocess
reader, and adds what is read live: the models loaded, and the host and GPU memory of each model's processes. The
HTTP thread runs beside MMS, so it answers while a model loads.

An unloaded model leaves its server's directory in ``metrics/unloaded/``: ``fold`` adds the container's counters in
it (LOADs, UNLOADs, caches: series without a ``model`` label) to ``metrics/retired/`` and deletes it, so the model's
own series go away and the container's totals never step back. Only this process writes ``retired/``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from mme_runtime import nvidia
from mme_runtime.config import Config
from mme_runtime.janitor import REQUEST_TIMEOUT_SECONDS
from mme_runtime.metrics import models_dir, unloaded_dir

logger = logging.getLogger(__name__)

ADDITIVE_TYPES = ("counter", "histogram")  # what the model processes write for the container; gauges are per model
MERGE_ATTEMPTS = 3


class ModelMetrics:
    """The collector behind ``/metrics``; ``sweep`` is called by the supervisor's loop."""

    def __init__(self, metrics_dir: Path, port: int, gpus: int) -> None:
        self.metrics_dir = metrics_dir
        self.models_url = f"http://127.0.0.1:{port}/models/"
        self.gpus = gpus
        self._lock = threading.Lock()  # the scrape thread and the supervisor's sweep both fold
        self._retired: dict[str, MmapedDict] = {}

    def collect(self) -> Iterator[Metric]:
        for attempt in range(MERGE_ATTEMPTS):
            # Listed before the fold: a directory moved to unloaded/ after this is missing below, and merged again.
            files = self._live_files()
            with self._lock:
                self._fold()
                try:
                    merged = MultiProcessCollector.merge(files + self._retired_files(), accumulate=True)
                    break
                except FileNotFoundError:
                    if attempt == MERGE_ATTEMPTS - 1:
                        raise
        yield from merged
        yield from self._live_gauges()

    def close(self) -> None:
        with self._lock:
            for store in self._retired.values():
                store.close()
            self._retired.clear()

    def sweep(self) -> None:
        """Retires the directories of model servers that died without stopping, once MMS no longer has the model."""
        for directory in self._server_dirs():
            if _alive(int(directory.name)) or self._registered(directory.parent.name) is not False:
                continue  # a server MMS will start again keeps its counts; an unknown answer changes nothing
            target = unloaded_dir(self.metrics_dir) / f"{directory.parent.name}@{directory.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            directory.rename(target)
        with self._lock:
            self._fold()
        for model_dir in models_dir(self.metrics_dir).glob("*"):
            if model_dir.is_dir() and not any(model_dir.iterdir()):
                model_dir.rmdir()

    def _server_dirs(self) -> list[Path]:
        return [path for path in models_dir(self.metrics_dir).glob("*/*") if path.name.isdigit()]

    def _live_files(self) -> list[str]:
        patterns = ("models/*/*/*.db", "container/*/*.db")
        return sorted(str(path) for pattern in patterns for path in self.metrics_dir.glob(pattern))

    def _retired_files(self) -> list[str]:
        return sorted(str(path) for path in (self.metrics_dir / "retired").glob("*.db"))

    def _fold(self) -> None:
        """Moves the container's counters out of unloaded servers' directories into retired/, then deletes them."""
        for directory in sorted(unloaded_dir(self.metrics_dir).glob("*")):
            for path in sorted(directory.glob("*.db")):
                kind = path.name.split("_")[0]
                if kind not in ADDITIVE_TYPES:
                    continue
                retired = self._retired_store(kind)
                for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):
                    _, _, labels, _ = json.loads(key)
                    if "model" not in labels and value:
                        retired.write_value(key, retired.read_value(key)[0] + value, 0.0)
            shutil.rmtree(directory, ignore_errors=True)

    def _retired_store(self, kind: str) -> MmapedDict:
        if kind not in self._retired:
            directory = self.metrics_dir / "retired"
            directory.mkdir(parents=True, exist_ok=True)
            self._retired[kind] = MmapedDict(str(directory / f"{kind}_retired.db"))
        return self._retired[kind]

    def _live_gauges(self) -> Iterator[Metric]:
        servers: dict[str, list[psutil.Process]] = {}
        for directory in self._server_dirs():
            try:
                server = psutil.Process(int(directory.name))
                processes = [server, *server.children(recursive=True)]
            except psutil.Error:
                continue
            servers.setdefault(urllib.parse.unquote(directory.parent.name), []).extend(processes)
        loaded = GaugeMetricFamily("mme_models_loaded", "Models with a running model server.")
        loaded.add_metric([], len(servers))
        yield loaded
        host = GaugeMetricFamily(
            "mme_model_host_memory_bytes",
            "Host memory of a model's processes (proportional set size: shared pages counted once).",
            labels=["model"],
        )
        for model, processes in sorted(servers.items()):
            host.add_metric([model], sum(_host_memory(process) for process in processes))
        yield host
        if self.gpus:
            yield self._gpu_memory(servers)

    def _gpu_memory(self, servers: dict[str, list[psutil.Process]]) -> Metric:
        gauge = GaugeMetricFamily(
            "mme_model_gpu_memory_bytes", "GPU memory a model's processes hold, per GPU.", labels=["model", "gpu"]
        )
        owners = {process.pid: model for model, processes in servers.items() for process in processes}
        totals: dict[tuple[str, str], int] = {}
        for pid, gpu, used in nvidia.compute_apps():  # asks nvidia-smi: never CUDA, in the entrypoint
            if pid in owners:
                totals[(owners[pid], gpu)] = totals.get((owners[pid], gpu), 0) + used
        for (model, gpu), used in sorted(totals.items()):
            gauge.add_metric([model, gpu], used)
        return gauge

    def _registered(self, quoted_model: str) -> bool | None:
        """Whether MMS has the model; None when MMS does not answer."""
        try:
            with urllib.request.urlopen(self.models_url + quoted_model, timeout=REQUEST_TIMEOUT_SECONDS):
                return True
        except urllib.error.HTTPError as exc:
            exc.close()
            return False if exc.code == 404 else None
        except (urllib.error.URLError, OSError):
            return None


def start(config: Config) -> ModelMetrics | None:
    """Clears what an earlier run left and serves ``/metrics``; None when metrics are off."""
    shutil.rmtree(config.metrics_dir, ignore_errors=True)
    if config.metrics_port == 0:
        logger.info("metrics off (MME_METRICS_PORT=0)")
        return None
    config.metrics_dir.mkdir(parents=True, exist_ok=True)
    collector = ModelMetrics(config.metrics_dir, config.port, nvidia.gpu_count())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        start_http_server(config.metrics_port, registry=registry)
    except OSError as exc:
        # Serving models matters more than their metrics: say so loudly and go on without them.
        # The collector is kept all the same: its sweep still clears what unloaded models leave behind.
        logger.error("metrics not served: cannot listen on port %d: %s", config.metrics_port, exc)
        return collector
    logger.info("Prometheus metrics on port %d at /metrics", config.metrics_port)
    return collector


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_memory(process: psutil.Process) -> int:
    try:
        return int(process.memory_full_info().pss)
    except (psutil.Error, AttributeError):
        try:
            return int(process.memory_info().rss)
        except psutil.Error:
            return 0
