"""Per-model CloudWatch metrics where nothing scrapes ``/metrics`` (SageMaker): every
``MME_CLOUDWATCH_METRICS_SECONDS`` the entrypoint prints one Embedded Metric Format (EMF) line per
model, and one for the container, to stdout. SageMaker sends stdout to CloudWatch Logs, which turns
each such line into metrics.

The values are the ones ``/metrics`` shows (``ModelMetrics.snapshot``). Counts are what happened
since the previous lines: what a model counted before its UNLOAD is reported once, by the next
lines, from its stopped server's series, so an UNLOAD and a re-LOAD never give a negative or a
repeated count. Latency is the interval's average and its 99th percentile interpolated in the
histogram's buckets (as Prometheus's ``histogram_quantile``: only as fine as they are). Memory is
the current value. A model's LOAD time is reported once, by the first lines after its LOAD; the LOAD
and UNLOAD counts are the container's, as on ``/metrics``.

The JSON is written here, not with AWS's ``aws-embedded-metrics``: importing that package imports
aiohttp and asyncio for sinks we do not use (230 ms and 23 MiB more in the entrypoint, 9 more
packages in the image), and it reads ``AWS_EMF_*`` variables. Our lines hold a few fixed keys, which
the tests check against the specification's schema.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Iterable
from typing import TextIO

from prometheus_client.core import Metric

from mme_runtime.base.config import Config
from mme_runtime.operations.metrics_exporter import ADDITIVE_KINDS, ModelMetrics, release_heap

logger = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]  # (sample name, labels less the model) -> value
Datum = tuple[str, float, str]  # metric name, value, CloudWatch unit
CONTAINER = ""  # the series with no model label
LATENCY_QUANTILE = 0.99
MAX_DIMENSION_VALUE = 1024  # CloudWatch's longest dimension value; ASCII only
STOP_SECONDS = 10.0
LOAD = "mme_model_load_duration_seconds"
LATENCY = "mme_request_duration_seconds"


def emf_line(
    namespace: str,
    dimensions: dict[str, str],
    data: list[Datum],
    properties: dict[str, object],
    timestamp_ms: int,
) -> str:
    """One EMF document on one line: each datum under ``dimensions`` (none: a metric of the
    namespace alone)."""
    directive = {
        "Namespace": namespace,
        "Dimensions": [list(dimensions)],
        "Metrics": [{"Name": name, "Unit": unit} for name, _, unit in data],
    }
    document: dict[str, object] = {
        "_aws": {"Timestamp": timestamp_ms, "CloudWatchMetrics": [directive]}
    }
    document.update(properties)
    document.update(dimensions)
    document.update(
        {
            name: int(value) if float(value).is_integer() else round(value, 3)
            for name, value, _ in data
        }
    )
    return json.dumps(document, separators=(",", ":"), allow_nan=False)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile`` on cumulative ``(upper bound, count)`` pairs, ``+Inf``
    last."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > below:
            if bound == float("inf"):
                return lower  # above the highest finite bound: that bound, as Prometheus answers
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def by_model(families: Iterable[Metric], additive: bool) -> dict[str, Samples]:
    """The samples of the counters and histograms (``additive``) or of the gauges, by model."""
    grouped: dict[str, Samples] = {}
    for family in families:
        if (family.type in ADDITIVE_KINDS) != additive:
            continue
        for sample in family.samples:
            labels = dict(sample.labels)
            model = labels.pop("model", CONTAINER)
            key = (sample.name, tuple(sorted(labels.items())))
            samples = grouped.setdefault(model, {})
            samples[key] = samples.get(key, 0.0) + sample.value
    return grouped


def named(samples: Samples, name: str) -> dict[Labels, float]:
    return {labels: value for (sample, labels), value in samples.items() if sample == name}


class EmfLines:
    """Makes each interval's lines from a snapshot, remembering the counts the previous lines
    reported."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._seen: dict[str, Samples] = {}  # model -> the counts as of the previous lines
        self._refused: set[str] = set()  # names CloudWatch takes no dimension of, told once
        # model -> its LOAD's seconds, reported once per LOAD
        self._load_seconds: dict[str, float] = {}

    def lines(self, families: list[Metric], stopped: list[Metric], timestamp_ms: int) -> list[str]:
        """``families`` and ``stopped`` as ``ModelMetrics.snapshot`` gives them."""
        counts, gauges = by_model(families, additive=True), by_model(families, additive=False)
        gone = by_model(stopped, additive=True)
        # the container's part of a stopped server counts on, in ``families``
        gone.pop(CONTAINER, None)
        deltas = {
            model: self._deltas(model, counts.get(model, {}), gone.get(model, {}))
            for model in counts | gone
        }
        self._seen = {model: seen for model, seen in self._seen.items() if model in counts}
        self._load_seconds = {
            model: seconds for model, seconds in self._load_seconds.items() if model in gauges
        }
        lines = [
            self._container_line(deltas.get(CONTAINER, {}), gauges.get(CONTAINER, {}), timestamp_ms)
        ]
        for model in sorted((deltas.keys() | gauges.keys()) - {CONTAINER}):
            if model not in counts and model not in gauges and not any(deltas[model].values()):
                # gone with nothing to report: a LOAD that failed is no model of CloudWatch's
                continue
            if model.isascii() and len(model) <= MAX_DIMENSION_VALUE:
                lines.append(
                    self._model_line(
                        model, deltas.get(model, {}), gauges.get(model, {}), timestamp_ms
                    )
                )
            elif model not in self._refused:
                self._refused.add(model)
                logger.warning(
                    "model=%r has no CloudWatch metrics: a dimension must be ASCII, 1024 at most",
                    model,
                )
        return lines

    def _deltas(self, model: str, now: Samples, gone: Samples) -> Samples:
        """Each count since the previous lines: now, plus what a stopped server took away, less what
        was reported."""
        seen = self._seen.get(model, {})
        deltas = {
            key: max(0.0, now.get(key, 0.0) + gone.get(key, 0.0) - seen.get(key, 0.0))
            for key in now | gone
        }
        # A count lower than reported with no stop behind it (a file left out of this merge) keeps
        # its mark, so that its values are not reported again when the file is back.
        self._seen[model] = {
            key: max(value, seen.get(key, 0.0) - gone.get(key, 0.0)) for key, value in now.items()
        }
        return deltas

    def _model_line(self, model: str, deltas: Samples, gauges: Samples, timestamp_ms: int) -> str:
        codes = {
            dict(labels)["code"]: value
            for labels, value in named(deltas, "mme_requests_total").items()
        }
        data: list[Datum] = [
            ("Invocations", sum(codes.values()), "Count"),
            (
                "Invocation4XXErrors",
                sum(value for code, value in codes.items() if code.startswith("4")),
                "Count",
            ),
            (
                "Invocation5XXErrors",
                sum(value for code, value in codes.items() if code.startswith("5")),
                "Count",
            ),
        ]
        requests = deltas.get((f"{LATENCY}_count", ()), 0.0)
        if requests > 0:
            data.append(
                (
                    "ModelLatency",
                    1000 * deltas.get((f"{LATENCY}_sum", ()), 0.0) / requests,
                    "Milliseconds",
                )
            )
            buckets = sorted(
                (float(dict(labels)["le"]), n)
                for labels, n in named(deltas, f"{LATENCY}_bucket").items()
            )
            if (tail := quantile(LATENCY_QUANTILE, buckets)) is not None:
                data.append(("ModelLatencyP99", 1000 * tail, "Milliseconds"))
        loaded = gauges.get(("mme_model_load_seconds", ()))
        if loaded is not None and self._load_seconds.get(model) != loaded:
            # a new LOAD (a gauge repeats its value)
            self._load_seconds[model] = loaded
            data.append(("LoadTime", loaded, "Seconds"))
        if (host := gauges.get(("mme_model_host_memory_bytes", ()))) is not None:
            data.append(("HostMemory", host, "Bytes"))
        if gpus := named(gauges, "mme_model_gpu_memory_bytes"):
            data.append(("GPUMemory", sum(gpus.values()), "Bytes"))
        statuses = {code: int(value) for code, value in sorted(codes.items()) if value}
        return emf_line(
            self.namespace, {"ModelName": model}, data, {"StatusCodes": statuses}, timestamp_ms
        )

    def _container_line(self, deltas: Samples, gauges: Samples, timestamp_ms: int) -> str:
        loads = {
            dict(labels)["outcome"]: value
            for labels, value in named(deltas, f"{LOAD}_count").items()
        }
        data: list[Datum] = [
            ("ModelLoads", loads.get("success", 0.0), "Count"),
            ("ModelLoadFailures", loads.get("failure", 0.0), "Count"),
        ]
        if loads.get("success", 0.0) > 0:
            seconds = deltas.get((f"{LOAD}_sum", (("outcome", "success"),)), 0.0)
            data.append(("ModelLoadTime", seconds / loads["success"], "Seconds"))
        data.append(
            (
                "ModelUnloads",
                sum(named(deltas, "mme_model_unload_duration_seconds_count").values()),
                "Count",
            )
        )
        data.append(("ModelsLoaded", gauges.get(("mme_models_loaded", ()), 0.0), "Count"))
        return emf_line(self.namespace, {}, data, {}, timestamp_ms)


class CloudWatchMetrics:
    """The thread that prints the lines; ``stop`` prints the last ones, for what happened since."""

    def __init__(
        self, collector: ModelMetrics, seconds: int, namespace: str, stream: TextIO | None = None
    ) -> None:
        self.collector = collector
        self.seconds = seconds
        self.emf = EmfLines(namespace)
        self.stream = stream or sys.stdout
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cloudwatch-metrics", daemon=True)

    def start(self) -> None:
        # from now on, what stopped servers counted is kept for the next lines
        self.collector.snapshot()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(STOP_SECONDS)

    def write(self) -> None:
        """This interval's lines, each written whole: MMS writes to the same stdout."""
        try:
            families, stopped = self.collector.snapshot()
            for line in self.emf.lines(families, stopped, int(time.time() * 1000)):
                self.stream.write(line + "\n")
                self.stream.flush()
        except Exception:  # noqa: BLE001
            # metrics must never stop the server; the next interval tries again
            logger.exception("CloudWatch metrics not written")
        release_heap()

    def _run(self) -> None:
        while not self._stopped.wait(self.seconds):
            self.write()
        self.write()


def start(config: Config, collector: ModelMetrics | None) -> CloudWatchMetrics | None:
    """Prints the lines every ``cloudwatch_metrics_seconds``; None when that is 0 or metrics are
    off."""
    if config.cloudwatch_metrics_seconds == 0:
        return None
    if collector is None:
        logger.warning(
            "CloudWatch metrics off: MME_METRICS_PORT=0 turns off the values they report"
        )
        return None
    seconds, namespace = config.cloudwatch_metrics_seconds, config.cloudwatch_namespace
    emitter = CloudWatchMetrics(collector, seconds, namespace)
    emitter.start()
    logger.info(
        "CloudWatch metrics (EMF lines, namespace %s) on stdout every %d s", namespace, seconds
    )
    return emitter
