"""The Prometheus series one model process writes (``metrics.py`` records into them), and the values
behind them.

A process's own values go to its directory (``PROMETHEUS_MULTIPROC_DIR``, set once), made by
prometheus_client. A device host serves many models: each model's ``Series`` owns its files
(``SeriesFiles``), and its metrics are ``HostedMetric``s, the places of their values in those files,
written in prometheus_client's format. So each model's files land in its own directory and go with
it on UNLOAD, a model's metrics cost 150 to 300 bytes each, and nothing of a model is left for a
full collection to find (prometheus_client's value class is a class per directory, a reference
cycle per model).
"""

from __future__ import annotations

import array
import bisect
import ctypes
import functools
import mmap
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, mmap_dict, values
from prometheus_client.utils import floatToGoString

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
# Held while a series makes a metric: each is made once (a key made twice in a file would be two
# entries, counted twice).
_MAKING_VALUES = threading.Lock()
_MAKING_BATCH_SIZES = threading.Lock()  # a model's batch-size values, made once at its first pass

# prometheus_client makes each value file 64 KiB at once, and the pages mapped with its first value
# stay resident: 192 KiB for each model of a device host (three files), where one model's values
# take about 11 KiB. Started at a page, a file doubles as values are added (``MmapedDict`` grows it
# itself).
mmap_dict._INITIAL_MMAP_SIZE = mmap.PAGESIZE
# Where CPython 3.11 and 3.12 keep an ``mmap``'s descriptor: after the object's header (16 bytes)
# and its data pointer, size, position, offset and export count.
_MMAP_FD_OFFSET = 56


class MappedFile(mmap_dict.MmapedDict):
    """prometheus_client's value file, holding no descriptor: ``MmapedDict`` keeps its file object
    open, and CPython's mapping keeps a duplicate of its own, two descriptors per file and six per
    model of a device host, which would reach the process's limit long before its memory at
    thousands of models. The mapping alone stays; the file is opened again for the moment it
    grows."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        super().__init__(filename, read_mode)  # type: ignore[no-untyped-call]
        self._f.close()
        self._f: Any = None
        _let_go_of_descriptor(self._m, filename)

    def _init_value(self, key: str) -> None:
        with open(self._fname, "a+b") as self._f:  # growing maps the file anew
            super()._init_value(key)  # type: ignore[no-untyped-call]
        self._f = None
        _let_go_of_descriptor(self._m, self._fname)

    def place(self, key: str) -> int:
        """Where ``key``'s value is in the file (added if new). The caller keeps the place and reads
        and writes there; the key (about 200 bytes: the metric's help text is in each), dozens a
        model, is in the file only. Each key's place is taken once per file (``Series.child``): one
        made again would be a second entry of the key, counted twice."""
        self.read_value(key)  # type: ignore[no-untyped-call]
        return int(self._positions.pop(key))

    def add_at(self, position: int, amount: float) -> None:
        value, _ = mmap_dict._unpack_two_doubles(self._m, position)
        mmap_dict._pack_two_doubles(self._m, position, value + amount, 0.0)

    def write_at(self, position: int, value: float) -> None:
        mmap_dict._pack_two_doubles(self._m, position, value, 0.0)

    def close(self) -> None:
        if self._m is not None:
            self._m.close()
            self._m: Any = None


def _let_go_of_descriptor(mapping: mmap.mmap, filename: str) -> None:
    """Closes the duplicate descriptor CPython's ``mmap`` keeps of its file (Python 3.13's
    ``trackfd=False``, for 3.11 and 3.12): the mapping works on without it, and ``close`` still
    unmaps. The field is read where those versions keep it and changed only when it holds a
    descriptor of this very file; anywhere else the mapping keeps its descriptor."""
    if sys.version_info[:2] not in ((3, 11), (3, 12)):
        return
    field = ctypes.c_int.from_address(id(mapping) + _MMAP_FD_OFFSET)
    descriptor = field.value
    if descriptor < 0:  # let go of already: the file did not grow
        return
    try:
        if not os.path.samestat(os.fstat(descriptor), os.stat(filename)):
            return
    except OSError:
        return
    field.value = -1
    os.close(descriptor)


values.MmapedDict = MappedFile  # type: ignore[attr-defined]  # what every value class made from now on opens its files with


class SeriesFiles:
    """A hosted model's value files, one per value type, each opened when its first value is
    made. Its values write under one lock, as prometheus_client's values of one class do."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.lock = threading.Lock()
        self._files: dict[str, MappedFile] = {}
        self._closed = False  # a value made now would open a file its model's next LOAD may map

    def file(self, kind: str) -> MappedFile:
        """The file of values of ``kind`` (``counter``, ``gauge_livesum``, ...); caller holds
        ``lock``."""
        if self._closed:
            raise RuntimeError(f"the metrics files in {self.directory} are closed")
        opened = self._files.get(kind)
        if opened is None:
            path = self.directory / f"{kind}_{os.getpid()}.db"  # the name the exporter reads
            opened = self._files[kind] = MappedFile(str(path))
        return opened

    def close(self) -> None:
        with self.lock:
            self._closed = True
            for opened in self._files.values():
                opened.close()
            self._files.clear()


class HostedMetric:
    """A hosted model's counter, gauge or histogram, made from its family (``Series.child``): the
    places of its values in the series' files, written as prometheus_client's multiprocess values
    are (so the exporter reads them alike), under the files' lock. It keeps no value object: a
    write adds to (or sets) the value at its place. 150 to 300 bytes, where prometheus_client's
    child and its value objects took about 2 KiB (a histogram's 17 values each an object)."""

    __slots__ = ("_files", "_file", "_places", "_bounds")

    def __init__(self, family: Any, labels: tuple[str, ...], files: SeriesFiles) -> None:
        kind, name, label_names = family._type, family._name, list(family._labelnames)
        # (sample, its label names, its label values), as prometheus_client names them
        samples = [(f"{name}_total" if kind == "counter" else name, label_names, list(labels))]
        self._bounds: list[float] = []
        if kind == "histogram":
            self._bounds = family._upper_bounds  # the family's, never changed
            samples = [(f"{name}_sum", label_names, list(labels))] + [
                (f"{name}_bucket", [*label_names, "le"], [*labels, floatToGoString(bound)])
                for bound in self._bounds
            ]
        if kind == "gauge" and "mostrecent" in family._multiprocess_mode:
            # their values carry the time they were set, which ``set`` does not write
            raise ValueError(f"{name}: a most-recent gauge is not served to hosted models")
        self._files = files
        with files.lock:
            self._file = files.file(
                f"gauge_{family._multiprocess_mode}" if kind == "gauge" else kind
            )
            keys = [mmap_dict.mmap_key(name, *sample, family._documentation) for sample in samples]
            self._places = array.array("q", [self._file.place(key) for key in keys])

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")  # as prometheus_client's
        with self._files.lock:
            self._file.add_at(self._places[0], amount)

    def set(self, value: float) -> None:
        with self._files.lock:
            self._file.write_at(self._places[0], float(value))

    def observe(self, amount: float) -> None:
        """Adds ``amount`` to the sum and one to the first bucket whose bound it does not pass (none
        for NaN, as prometheus_client's)."""
        with self._files.lock:
            self._file.add_at(self._places[0], amount)
            if amount == amount:
                self._file.add_at(self._places[1 + bisect.bisect_left(self._bounds, amount)], 1.0)


def batch_size_buckets(batch_size: int) -> list[float]:
    if batch_size <= MAX_EXACT_BATCH_BUCKETS:
        return [float(size) for size in range(1, batch_size + 1)]
    sizes = {2**power for power in range(batch_size.bit_length()) if 2**power < batch_size}
    return [float(size) for size in sorted(sizes | {batch_size})]


@functools.cache
def _batch_size_family(batch_size: int) -> Histogram:
    """The batch-size family of the models of one ``batch_size``: its buckets are theirs."""
    return Histogram(
        "mme_batch_size",
        "Requests per forward pass.",
        ["model"],
        buckets=batch_size_buckets(batch_size),
        registry=None,
    )


class Series:
    """One model's metric values (or the container's, with no model). ``hosted``: a device host's
    model, whose values go to ``directory`` while the process's own go to the process's.

    The families are made once per process and shared by every series as templates: a series keeps
    the values it made from them (``child``), and no family keeps any, so a model's metrics cost
    its values alone (about 7.6 KiB a model less than a set of families each)."""

    # registry=None: the exporter reads the files; nothing in a model process exposes a registry.
    requests = Counter(
        "mme_requests",
        "Requests answered by the model, by HTTP status code.",
        ["model", "code"],
        registry=None,
    )
    request_seconds = Histogram(
        "mme_request_duration_seconds",
        "Time in the model's backend from a request's arrival to its answer.",
        ["model"],
        buckets=LATENCY_BUCKETS,
        registry=None,
    )
    queue_seconds = Histogram(
        "mme_queue_duration_seconds",
        "Time a decoded request waited for its forward pass.",
        ["model"],
        buckets=LATENCY_BUCKETS,
        registry=None,
    )
    predict_seconds = Histogram(
        "mme_predict_duration_seconds",
        "Time of one forward pass (predict_fn on a batch, or transform_fn), per pass.",
        ["model"],
        buckets=LATENCY_BUCKETS,
        registry=None,
    )
    restarts = Counter(
        "mme_model_restarts",
        "Times the model was loaded again after the device host that served it ended (a crash, "
        "an OOM kill).",
        ["model"],
        registry=None,
    )
    # The same count under the name of the design before device hosts: kept for one release
    # (docs/metrics.md).
    executor_restarts = Counter(
        "mme_executor_restarts",
        "Deprecated: mme_model_restarts_total.",
        ["model"],
        registry=None,
    )
    # livesum: the exporter leaves out the files of processes that ended, so a dead host's memory
    # goes.
    gpu_memory = Gauge(
        "mme_model_gpu_memory_bytes",
        "GPU memory the model's own tensors take on each card (the host's pool and CUDA context "
        "not included).",
        ["model", "gpu"],
        multiprocess_mode="livesum",
        registry=None,
    )
    # livemax: on GPUs each card's host loads the model; the slowest is when it was ready
    # everywhere.
    load_seconds = Gauge(
        "mme_model_load_seconds",
        "Seconds the model's LOAD took, from its start in the warm process to the model ready on "
        "its device.",
        ["model"],
        multiprocess_mode="livemax",
        registry=None,
    )
    loads = Histogram(
        "mme_model_load_duration_seconds",
        "LOADs that reached the warm process, from their start to the first answer, by outcome.",
        ["outcome"],
        buckets=LOAD_BUCKETS,
        registry=None,
    )
    unloads = Histogram(
        "mme_model_unload_duration_seconds",
        "UNLOADs of loaded models, from the stop request to the model let go of, by outcome.",
        ["outcome"],
        buckets=LOAD_BUCKETS,
        registry=None,
    )
    quarantines = Counter(
        "mme_model_quarantines",
        "Models moved out of their shared device host to one of their own after crashing it twice.",
        ["model"],
        registry=None,
    )
    cache_lookups = Counter(
        "mme_cache_lookups",
        "Cache lookups, by cache and result (hit or miss).",
        ["cache", "result"],
        registry=None,
    )

    def __init__(self, model: str | None, directory: Path, hosted: bool = False) -> None:
        self.model = model
        self.directory = directory
        # a hosted model's files (None: the process's own series, written to its directory)
        self._files = SeriesFiles(directory) if hosted else None
        self._closed = False
        self._children: dict[tuple[Any, tuple[Any, ...]], Any] = {}
        # a hosted model's own tensors on its GPU (not the process's pool)
        self.device_bytes: int | None = None
        self.gpu: str | None = None  # the host's card, once it reports its GPU memory
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
        """The model's passes by size, bucketed for its ``batch_size`` (known at its first pass):
        made once, whichever of its dispatchers' first passes asks first."""
        with _MAKING_BATCH_SIZES:
            if self.answers.batch_sizes is None:
                family = _batch_size_family(batch_size)
                self.answers.batch_sizes = self.child(family, self.model)
        return self.answers.batch_sizes

    def child(self, family: Any, *labels: Any) -> Any:
        """The metric of ``family`` with ``labels``: a hosted model's ``HostedMetric``, or the
        process's own prometheus_client child, made once."""
        key = (family, labels)
        made = self._children.get(key)
        if made is None:
            with _MAKING_VALUES:
                made = self._children.get(key)
                if made is None:
                    made = self._children[key] = self._make(family, labels)
        return made

    def _make(self, family: Any, labels: tuple[Any, ...]) -> Any:
        if self._closed:
            raise RuntimeError(f"the metrics of {self.model} are closed")
        texts = tuple(str(label) for label in labels)  # as prometheus_client keys them
        if self._files is not None:
            return HostedMetric(family, texts, self._files)
        made = family.labels(*labels)
        # The family is a template every series shares: it keeps no value (its public remove
        # warns in multiprocess mode).
        with family._lock:
            family._metrics.pop(texts, None)
        return made

    def close(self) -> None:
        """Closes a hosted model's files (its directory is handed to the exporter next)."""
        self._closed = True
        if self._files is not None:
            self._files.close()


@dataclass
class AnswerValues:
    """A model's values of the families its requests and passes record into: held, not looked up
    per request."""

    request_seconds: Any
    queue_seconds: Any
    predict_seconds: Any
    requests: dict[str, Any] = field(default_factory=dict)  # by status code
    batch_sizes: Any = None
