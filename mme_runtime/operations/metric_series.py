"""The Prometheus series one model process writes (``metrics.py`` records into them), and the values
behind them.

A process that serves one model writes every value to its directory (``PROMETHEUS_MULTIPROC_DIR``,
set once). A device host serves many: each of its models' ``Series`` owns a value class of its own,
and every value is made with that class and its model's directory in force (prometheus_client reads
both when a value is made, never after, in a process that does not fork), so each model's files land
in its own directory and go with it on UNLOAD.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, mmap_dict, values

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Up to this batch size every size has its own bucket; above it, powers of two and the batch size
# itself.
MAX_EXACT_BATCH_BUCKETS = 64
DIRECTORY_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
# Held while a hosted model's values are made: the value class and the directory are process-wide.
_MAKING_VALUES = threading.Lock()
# Value classes of closed series, with their cleanups: a new series takes one (a class per model
# would be garbage that only a full collection frees).
_SPARE_CLASSES: list[tuple[Any, Any]] = []

# prometheus_client makes each value file 64 KiB at once, and the pages mapped with its first value
# stay resident: 192 KiB for each model of a device host (three files), where one model's values
# take about 11 KiB. Started at a page, a file doubles as values are added (``MmapedDict`` grows it
# itself).
mmap_dict._INITIAL_MMAP_SIZE = mmap.PAGESIZE


class MappedFile(mmap_dict.MmapedDict):
    """prometheus_client's value file, holding one descriptor instead of two: the mapping keeps one
    of its own (CPython duplicates it), so the file object ``MmapedDict`` keeps open besides is a
    second descriptor per file, three per model in a device host, which would reach the process's
    limit long before its memory at thousands of models. The file is opened again for the moment
    it grows."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        super().__init__(filename, read_mode)  # type: ignore[no-untyped-call]
        self._f.close()
        self._f: Any = None

    def _init_value(self, key: str) -> None:
        with open(self._fname, "a+b") as self._f:  # growing maps the file anew
            super()._init_value(key)  # type: ignore[no-untyped-call]
        self._f = None

    def close(self) -> None:
        if self._m is not None:
            self._m.close()
            self._m: Any = None


values.MmapedDict = MappedFile  # type: ignore[attr-defined]  # what every value class made from now on opens its files with


def batch_size_buckets(batch_size: int) -> list[float]:
    if batch_size <= MAX_EXACT_BATCH_BUCKETS:
        return [float(size) for size in range(1, batch_size + 1)]
    sizes = {2**power for power in range(batch_size.bit_length()) if 2**power < batch_size}
    return [float(size) for size in sorted(sizes | {batch_size})]


class Series:
    """One model's metric objects (or the container's, with no model). With ``home`` (the process's
    own directory), a device host's model: its values go to ``directory``, the process's other
    values to ``home``."""

    def __init__(self, model: str | None, directory: Path, home: Path | None = None) -> None:
        self.model = model
        self.directory = directory
        self._home = home  # the process's own directory, when this series is a hosted model's
        self._value_class: Any = None
        self._close_files: Any = None
        self._closed = False  # its value class may serve another series now
        if home is not None:
            with _MAKING_VALUES:  # no other series' class between the two lines
                if _SPARE_CLASSES:  # a closed series': its files closed, its values forgotten
                    self._value_class, self._close_files = _SPARE_CLASSES.pop()
                    values._multi_process_cleanups.append(self._close_files)
                else:
                    self._value_class = values.MultiProcessValue()
                    # prometheus_client keeps each value class's cleanup (it closes the class's
                    # files) last in this list.
                    self._close_files = values._multi_process_cleanups[-1]
        self._children: dict[tuple[int, tuple[Any, ...]], Any] = {}
        # a hosted model's own tensors on its GPU (not the process's pool)
        self.device_bytes: int | None = None
        self.gpu: str | None = None  # the host's card, once it reports its GPU memory
        # registry=None: the exporter reads the files; nothing in a model process exposes a
        # registry.
        self.requests = Counter(
            "mme_requests",
            "Requests answered by the model, by HTTP status code.",
            ["model", "code"],
            registry=None,
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
        self.restarts = Counter(
            "mme_model_restarts",
            "Times the model was loaded again after the device host that served it ended (a crash, "
            "an OOM kill).",
            ["model"],
            registry=None,
        )
        # The same count under the name of the design before device hosts: kept for one release
        # (docs/metrics.md).
        self.executor_restarts = Counter(
            "mme_executor_restarts",
            "Deprecated: mme_model_restarts_total.",
            ["model"],
            registry=None,
        )
        # livesum: the exporter leaves out the files of processes that ended, so a dead host's
        # memory goes.
        self.gpu_memory = Gauge(
            "mme_model_gpu_memory_bytes",
            "GPU memory the model's own tensors take on each card (the host's pool and CUDA "
            "context not included).",
            ["model", "gpu"],
            multiprocess_mode="livesum",
            registry=None,
        )
        # livemax: on GPUs each card's host loads the model; the slowest is when it was ready
        # everywhere.
        self.load_seconds = Gauge(
            "mme_model_load_seconds",
            "Seconds the model's LOAD took, from its start in the warm process to the model ready "
            "on its device.",
            ["model"],
            multiprocess_mode="livemax",
            registry=None,
        )
        self.loads = Histogram(
            "mme_model_load_duration_seconds",
            "LOADs that reached the warm process, from their start to the first answer, by "
            "outcome.",
            ["outcome"],
            buckets=LOAD_BUCKETS,
            registry=None,
        )
        self.unloads = Histogram(
            "mme_model_unload_duration_seconds",
            "UNLOADs of loaded models, from the stop request to the model let go of, by outcome.",
            ["outcome"],
            buckets=LOAD_BUCKETS,
            registry=None,
        )
        self.quarantines = Counter(
            "mme_model_quarantines",
            "Models moved out of their shared device host to one of their own after crashing it "
            "twice.",
            ["model"],
            registry=None,
        )
        self.cache_lookups = Counter(
            "mme_cache_lookups",
            "Cache lookups, by cache and result (hit or miss).",
            ["cache", "result"],
            registry=None,
        )
        if model is not None:
            for restarts in (self.restarts, self.executor_restarts):
                # 0 from the start, not after the first restart
                self.child(restarts, model)

    @functools.cached_property
    def answers(self) -> AnswerValues:
        """The model's values that every request and pass records into, made at its first request
        (a model that never answers writes none); read as a plain attribute after."""
        return AnswerValues(
            self.child(self.request_seconds, self.model),
            self.child(self.queue_seconds, self.model),
            self.child(self.predict_seconds, self.model),
        )

    def request_count(self, status: int) -> Any:
        """The model's count of requests answered ``status``."""
        code = str(status)
        self.answers.requests[code] = made = self.child(self.requests, self.model, code)
        return made

    def batch_size_histogram(self, batch_size: int) -> Any:
        """The model's passes by size, bucketed for its ``batch_size`` (known at its first pass)."""
        family = Histogram(
            "mme_batch_size",
            "Requests per forward pass.",
            ["model"],
            buckets=batch_size_buckets(batch_size),
            registry=None,
        )
        self.answers.batch_sizes = made = self.child(family, self.model)
        return made

    def child(self, family: Any, *labels: Any) -> Any:
        """``family.labels(*labels)``, its values made in this series' directory."""
        key = (id(family), labels)
        made = self._children.get(key)
        if made is None:
            if self._closed:
                raise RuntimeError(f"the metrics of {self.model} are closed")
            with self._making_values():
                made = self._children[key] = family.labels(*labels)
        return made

    def close(self) -> None:
        """Closes a hosted model's files (its directory is handed to the exporter next)."""
        self._closed = True
        if self._close_files is not None:
            self._close_files()
            # The cleanup would stay in prometheus_client's list (and its value class with it) for
            # good.
            with contextlib.suppress(ValueError):
                values._multi_process_cleanups.remove(self._close_files)
            # A class is a reference cycle: only a full collection frees one, which stalls every
            # model of the host (``MemoryRelease``). The next series takes it instead.
            with _MAKING_VALUES:
                _SPARE_CLASSES.append((self._value_class, self._close_files))
            self._close_files = None

    @contextmanager
    def _making_values(self) -> Iterator[None]:
        if self._value_class is None or self._home is None:
            yield
            return
        with _MAKING_VALUES:
            saved_class = values.ValueClass
            values.ValueClass, os.environ[DIRECTORY_VARIABLE] = (
                self._value_class,
                str(self.directory),
            )
            try:
                yield
            finally:
                values.ValueClass, os.environ[DIRECTORY_VARIABLE] = saved_class, str(self._home)


@dataclass
class AnswerValues:
    """A model's values of the families its requests and passes record into: held, not looked up
    per request."""

    request_seconds: Any
    queue_seconds: Any
    predict_seconds: Any
    requests: dict[str, Any] = field(default_factory=dict)  # by status code
    batch_sizes: Any = None
