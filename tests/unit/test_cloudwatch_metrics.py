"""The CloudWatch lines (``operations/cloudwatch_metrics.py``): each one an EMF document by the specification's schema,
counts reported once across intervals, UNLOADs and files left out of a merge, and the setting that turns them on."""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from emf_schema import EMF_SCHEMA, check_emf
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ConfigError
from mme_runtime.operations import cloudwatch_metrics, metrics
from mme_runtime.operations.cloudwatch_metrics import CloudWatchMetrics, EmfLines, emf_line, quantile
from mme_runtime.operations.metrics_exporter import ModelMetrics

NOW_MS = 1_700_000_000_000
LATENCY_BUCKETS = ("0.01", "0.1", "1.0", "+Inf")


def requests(counts: dict[str, dict[str, float]]) -> Metric:
    """``mme_requests_total``: model -> HTTP status -> count."""
    family = CounterMetricFamily("mme_requests", "", labels=["model", "code"])
    for model, codes in counts.items():
        for code, count in codes.items():
            family.add_metric([model, code], count)
    return family


def latency(model: str, per_bucket: tuple[float, ...], total_seconds: float) -> Metric:
    """``mme_request_duration_seconds`` of ``model``: how many requests fell in each of ``LATENCY_BUCKETS``."""
    family = HistogramMetricFamily("mme_request_duration_seconds", "", labels=["model"])
    cumulative = [sum(per_bucket[: i + 1]) for i in range(len(per_bucket))]
    family.add_metric([model], buckets=list(zip(LATENCY_BUCKETS, cumulative, strict=True)), sum_value=total_seconds)
    return family


def gauge(name: str, labels: dict[str, str], value: float) -> Metric:
    family = GaugeMetricFamily(name, "", labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def loads(success: float, failure: float, seconds: float) -> Metric:
    family = HistogramMetricFamily("mme_model_load_duration_seconds", "", labels=["outcome"])
    family.add_metric(["success"], buckets=[("+Inf", success)], sum_value=seconds)
    family.add_metric(["failure"], buckets=[("+Inf", failure)], sum_value=0.0)
    return family


def documents(emf: EmfLines, families: list[Metric], stopped: list[Metric] | None = None) -> dict[str, dict[str, Any]]:
    """One interval's lines, each checked against the specification, by model (the container's under "")."""
    lines = emf.lines(families, stopped or [], NOW_MS)
    return {document.get("ModelName", ""): document for document in map(check_emf, lines)}


def invocations(emf: EmfLines, families: list[Metric], stopped: list[Metric] | None = None) -> dict[str, float]:
    return {model: doc["Invocations"] for model, doc in documents(emf, families, stopped).items() if model}


def test_every_line_is_an_emf_document_with_the_models_values() -> None:
    families = [
        requests({"a": {"200": 3, "404": 1, "503": 2}, "b": {"200": 1}}),
        latency("a", (2, 3, 1, 0), total_seconds=0.6),
        gauge("mme_model_host_memory_bytes", {"model": "a"}, 60_000_000),
        gauge("mme_model_gpu_memory_bytes", {"model": "a", "gpu": "0"}, 1_000),
        gauge("mme_model_gpu_memory_bytes", {"model": "a", "gpu": "1"}, 2_000),
        gauge("mme_models_loaded", {}, 2),
        loads(success=2, failure=1, seconds=3.0),
    ]
    by_model = documents(EmfLines("mme-test"), families)

    a = by_model["a"]
    assert a["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["ModelName"]]
    assert a["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "mme-test"
    assert a["_aws"]["Timestamp"] == NOW_MS
    assert (a["Invocations"], a["Invocation4XXErrors"], a["Invocation5XXErrors"]) == (6, 1, 2)
    assert a["StatusCodes"] == {"200": 3, "404": 1, "503": 2}
    assert a["ModelLatency"] == 100.0  # 0.6 s over 6 requests
    assert a["ModelLatencyP99"] == pytest.approx(1000 * (0.1 + 0.9 * (5.94 - 5) / 1))  # in the (0.1, 1.0] bucket
    assert (a["HostMemory"], a["GPUMemory"]) == (60_000_000, 3_000)
    units = {metric["Name"]: metric["Unit"] for metric in a["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    assert units == {
        "Invocations": "Count",
        "Invocation4XXErrors": "Count",
        "Invocation5XXErrors": "Count",
        "ModelLatency": "Milliseconds",
        "ModelLatencyP99": "Milliseconds",
        "HostMemory": "Bytes",
        "GPUMemory": "Bytes",
    }
    assert "ModelLatency" not in by_model["b"]  # no latency series for b: nothing to average
    container = by_model[""]
    assert container["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [[]]
    assert (container["ModelLoads"], container["ModelLoadFailures"], container["ModelLoadTime"]) == (2, 1, 1.5)
    assert (container["ModelUnloads"], container["ModelsLoaded"]) == (0, 2)


def test_the_checks_reject_what_the_specification_forbids() -> None:
    good = emf_line("ns", {"ModelName": "a"}, [("Invocations", 1.0, "Count")], {}, NOW_MS)
    check_emf(good)
    jsonschema.Draft7Validator.check_schema(EMF_SCHEMA)
    document = json.loads(good)
    with pytest.raises(jsonschema.ValidationError):
        check_emf(json.dumps({**document, "_aws": {**document["_aws"], "Timestamp": "now"}}))
    directive = document["_aws"]["CloudWatchMetrics"][0]
    bad_unit = {**directive, "Metrics": [{"Name": "Invocations", "Unit": "Requests"}]}
    with pytest.raises(jsonschema.ValidationError):
        check_emf(json.dumps({**document, "_aws": {**document["_aws"], "CloudWatchMetrics": [bad_unit]}}))
    with pytest.raises(AssertionError, match="target member"):
        check_emf(json.dumps({key: value for key, value in document.items() if key != "Invocations"}))
    with pytest.raises(AssertionError, match="target member"):
        check_emf(json.dumps({**document, "ModelName": 7}))


def test_counts_are_reported_once_each() -> None:
    emf = EmfLines("ns")
    assert invocations(emf, [requests({"a": {"200": 3}})]) == {"a": 3}
    assert invocations(emf, [requests({"a": {"200": 3}})]) == {"a": 0}  # nothing new: a zero, not a repeat
    assert invocations(emf, [requests({"a": {"200": 5, "500": 1}})]) == {"a": 3}


def test_what_a_model_counted_before_its_unload_is_reported_once_and_a_reload_starts_from_zero() -> None:
    emf = EmfLines("ns")
    assert invocations(emf, [requests({"a": {"200": 3}})]) == {"a": 3}
    # UNLOADed after two more requests: its series are gone from the scrape, its server's come once.
    assert invocations(emf, [], stopped=[requests({"a": {"200": 5}})]) == {"a": 2}
    assert invocations(emf, []) == {}
    # LOADed again: its new server counts from zero.
    assert invocations(emf, [requests({"a": {"200": 1}})]) == {"a": 1}
    # UNLOADed and LOADed again within one interval: the old server's 3 last requests and the new server's 2.
    assert invocations(emf, [requests({"a": {"200": 2}})], stopped=[requests({"a": {"200": 4}})]) == {"a": 3 + 2}
    assert invocations(emf, [requests({"a": {"200": 2}})]) == {"a": 0}


def test_a_load_that_failed_makes_no_line_and_an_idle_loaded_model_reports_zero() -> None:
    # The failed LOAD's server stopped with its series empty: no CloudWatch metrics for a model that never loaded.
    emf = EmfLines("ns")
    never = [latency("broken", (0, 0, 0, 0), 0.0)]
    assert invocations(emf, [requests({"a": {"200": 1}})], stopped=never) == {"a": 1}
    assert invocations(emf, [requests({"a": {"200": 1}})]) == {"a": 0}


def test_a_count_that_steps_back_without_a_stop_is_not_reported_again() -> None:
    emf = EmfLines("ns")
    assert invocations(emf, [requests({"a": {"200": 5}})]) == {"a": 5}
    assert invocations(emf, [requests({"a": {"200": 3}})]) == {"a": 0}  # a file left out of this merge
    assert invocations(emf, [requests({"a": {"200": 6}})]) == {"a": 1}


def test_latency_is_the_intervals_own() -> None:
    emf = EmfLines("ns")
    first = documents(emf, [latency("a", (2, 0, 0, 0), total_seconds=0.01)])["a"]
    assert first["ModelLatency"] == 5.0
    second = documents(emf, [latency("a", (2, 0, 2, 0), total_seconds=1.01)])["a"]
    assert second["ModelLatency"] == 500.0  # the two new requests: 1.0 s together
    assert 100 < second["ModelLatencyP99"] <= 1000  # both in (0.1, 1.0]
    assert "ModelLatency" not in documents(emf, [latency("a", (2, 0, 2, 0), total_seconds=1.01)])["a"]


def test_a_models_load_time_is_reported_once_per_load() -> None:
    emf = EmfLines("ns")
    loaded = [gauge("mme_model_load_seconds", {"model": "a"}, 2.5)]
    assert documents(emf, loaded)["a"]["LoadTime"] == 2.5
    assert "LoadTime" not in documents(emf, loaded)["a"]  # the gauge stays; the LOAD was reported
    assert "a" not in documents(emf, [])  # UNLOADed: its series are gone
    assert documents(emf, loaded)["a"]["LoadTime"] == 2.5  # LOADed again, as long: a LOAD of its own


def test_quantile_interpolates_within_a_bucket_as_prometheus_does() -> None:
    assert quantile(0.5, [(1.0, 0.0), (2.0, 10.0), (float("inf"), 10.0)]) == 1.5
    assert quantile(0.99, [(1.0, 0.0), (2.0, 1.0), (float("inf"), 100.0)]) == 2.0  # past the last finite bound
    assert quantile(0.99, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    assert quantile(0.99, []) is None


def test_a_model_name_cloudwatch_cannot_take_is_left_out_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    emf = EmfLines("ns")
    with caplog.at_level(logging.WARNING):
        assert invocations(emf, [requests({"modèle": {"200": 1}, "a": {"200": 1}})]) == {"a": 1}
        assert invocations(emf, [requests({"modèle": {"200": 2}, "a": {"200": 1}})]) == {"a": 0}
    assert [record.getMessage() for record in caplog.records].count(
        "model='modèle' has no CloudWatch metrics: a dimension must be ASCII, 1024 at most"
    ) == 1


def in_child(work: Callable[[], None]) -> None:
    """Runs ``work`` in a forked process, as a model server runs beside the entrypoint."""
    process = multiprocessing.get_context("fork").Process(target=work)
    process.start()
    process.join(30)
    assert process.exitcode == 0


def test_a_stopped_servers_counts_reach_the_lines_once_through_the_exporter(tmp_path: Path) -> None:
    config = Config(runtime_dir=tmp_path, metrics_port=9999)
    collector = ModelMetrics(config.metrics_dir, port=1)
    stream = io.StringIO()
    emitter = CloudWatchMetrics(collector, 3600, "ns", stream)
    emitter.start()

    def server(requests_answered: int) -> Callable[[], None]:
        def serve() -> None:
            metrics.start_model(config, "a", os.getpid())
            metrics.record_requests(lambda: [200] * requests_answered, 0.01)
            metrics.record_load(True, 1.5)
            metrics.stop_model(config)  # an UNLOAD: the exporter folds its directory

        return serve

    in_child(server(3))
    in_child(server(2))  # LOADed again and UNLOADed again before the next lines
    emitter.write()
    emitter.stop()  # the last lines: nothing new
    lines = [check_emf(line) for line in stream.getvalue().splitlines()]
    model_lines = [line for line in lines if line.get("ModelName") == "a"]
    assert [line["Invocations"] for line in model_lines] == [5]
    assert [line["ModelLoads"] for line in lines if "ModelName" not in line] == [2, 0]


def test_the_setting_is_on_where_sagemaker_multi_model_is_set_unless_turned_off() -> None:
    assert Config.from_env({}).cloudwatch_metrics_seconds == 0
    assert Config.from_env({"SAGEMAKER_MULTI_MODEL": "true"}).cloudwatch_metrics_seconds == 60
    assert Config.from_env({"SAGEMAKER_MULTI_MODEL": "false"}).cloudwatch_metrics_seconds == 60
    off = {"SAGEMAKER_MULTI_MODEL": "true", "MME_CLOUDWATCH_METRICS_SECONDS": "0"}
    assert Config.from_env(off).cloudwatch_metrics_seconds == 0
    assert Config.from_env({"MME_CLOUDWATCH_METRICS_SECONDS": "5"}).cloudwatch_metrics_seconds == 5
    assert Config.from_env({"MME_CLOUDWATCH_NAMESPACE": "Team/Models"}).cloudwatch_namespace == "Team/Models"
    for bad in ({"MME_CLOUDWATCH_NAMESPACE": "AWS/SageMaker"}, {"MME_CLOUDWATCH_NAMESPACE": "my models"}):
        with pytest.raises(ConfigError, match="MME_CLOUDWATCH_NAMESPACE"):
            Config.from_env(bad)
    with pytest.raises(ConfigError, match="MME_CLOUDWATCH_METRICS_SECONDS"):
        Config.from_env({"MME_CLOUDWATCH_METRICS_SECONDS": "-1"})


def test_no_thread_starts_when_off_or_without_metrics(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    collector = ModelMetrics(tmp_path, port=1)
    assert cloudwatch_metrics.start(Config(cloudwatch_metrics_seconds=0), collector) is None
    with caplog.at_level(logging.WARNING):
        assert cloudwatch_metrics.start(Config(cloudwatch_metrics_seconds=60), None) is None
    assert "MME_METRICS_PORT=0" in caplog.text
