"""The metrics files' life: written by model processes, merged by the exporter, folded when a model goes away.

Model processes are forked children here, as in the server; the exporter is this test's process.
"""

from __future__ import annotations

import http.server
import multiprocessing
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mme_runtime import metrics
from mme_runtime.config import Config
from mme_runtime.metrics_exporter import ModelMetrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
Exporter = Callable[..., ModelMetrics]


def in_child(work: Callable[[], None]) -> int:
    """Runs ``work`` in a forked process (a model server, say) and returns that process's pid."""
    process = multiprocessing.get_context("fork").Process(target=work)
    process.start()
    process.join(30)
    assert process.exitcode == 0
    assert process.pid is not None
    return process.pid


def scrape(collector: ModelMetrics) -> Samples:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    samples: Samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return Config(runtime_dir=tmp_path, metrics_port=9999)


@pytest.fixture
def exporter(config: Config) -> Iterator[Callable[[int], ModelMetrics]]:
    """Makes exporters of the test's metrics directory, asking the management API on the port given (1: nothing
    answers); closed after the test."""
    made: list[ModelMetrics] = []

    def make(port: int = 1) -> ModelMetrics:
        made.append(ModelMetrics(config.metrics_dir, port=port, gpus=0))
        return made[-1]

    yield make
    for collector in made:
        collector.close()


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self.send_error(404, "model not found")

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def not_found_port() -> Iterator[int]:
    """A management API that knows no model (every GET answers 404)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def model_server(config: Config, model: str, requests: int, unload: bool) -> Callable[[], None]:
    """A model server that loads, forks an executor which answers ``requests`` 200s, and (``unload``) stops."""

    def executor() -> None:
        metrics.start_model(config, model, multiprocessing.parent_process().pid)  # type: ignore[union-attr]
        metrics.record_requests([200] * requests, 0.01)
        metrics.record_pass([0.001] * requests, 0.005, batch_size=4)

    def server() -> None:
        metrics.start_model(config, model, os.getpid())
        metrics.record_cache_lookup("code", hit=False)
        in_child(executor)
        metrics.record_load(True, 1.5)
        if unload:
            metrics.record_unload(True, 0.2)
            metrics.retire(config)

    return server


def test_values_from_every_process_of_a_model_add_up(config: Config, exporter: Exporter) -> None:
    in_child(model_server(config, "a", requests=3, unload=False))
    in_child(model_server(config, "b", requests=2, unload=False))
    samples = scrape(exporter())
    assert value(samples, "mme_requests_total", model="a", code="200") == 3
    assert value(samples, "mme_requests_total", model="b", code="200") == 2
    assert value(samples, "mme_batch_size_bucket", model="a", le="3.0") == 1
    assert value(samples, "mme_batch_size_bucket", model="a", le="2.0") == 0
    assert value(samples, "mme_model_load_duration_seconds_count", outcome="success") == 2
    assert value(samples, "mme_cache_lookups_total", cache="code", result="miss") == 2
    assert value(samples, "mme_executor_restarts_total", model="a") == 0


def test_an_unloaded_model_leaves_only_the_container_counters(config: Config, exporter: Exporter) -> None:
    in_child(model_server(config, "gone", requests=4, unload=True))
    in_child(model_server(config, "kept", requests=1, unload=False))
    collector = exporter()
    samples = scrape(collector)
    assert value(samples, "mme_requests_total", model="gone", code="200") == 0
    assert not any(dict(labels).get("model") == "gone" for _, labels in samples)
    assert value(samples, "mme_requests_total", model="kept", code="200") == 1
    assert value(samples, "mme_model_load_duration_seconds_count", outcome="success") == 2
    assert value(samples, "mme_model_unload_duration_seconds_count", outcome="success") == 1
    assert value(samples, "mme_cache_lookups_total", cache="code", result="miss") == 2
    assert not (config.metrics_dir / "unloaded").exists() or not any((config.metrics_dir / "unloaded").iterdir())

    # The same name again starts from zero, and the folded totals keep adding up across scrapes.
    in_child(model_server(config, "gone", requests=1, unload=False))
    again = scrape(collector)
    assert value(again, "mme_requests_total", model="gone", code="200") == 1
    assert value(again, "mme_model_load_duration_seconds_count", outcome="success") == 3
    assert value(scrape(collector), "mme_cache_lookups_total", cache="code", result="miss") == 3


def test_sweep_retires_a_dead_server_only_once_mms_forgot_its_model(
    config: Config, exporter: Exporter, not_found_port: int
) -> None:
    in_child(model_server(config, "crashed", requests=2, unload=False))  # exits without retiring, like a SIGKILL
    unanswered = exporter()  # nothing listens: MMS's answer is unknown
    unanswered.sweep()
    assert value(scrape(unanswered), "mme_requests_total", model="crashed", code="200") == 2

    collector = exporter(not_found_port)
    collector.sweep()
    samples = scrape(collector)
    assert value(samples, "mme_requests_total", model="crashed", code="200") == 0
    assert value(samples, "mme_model_load_duration_seconds_count", outcome="success") == 1
    assert not any(metrics.models_dir(config.metrics_dir).iterdir())


def test_live_gauges_count_models_with_a_running_server(config: Config, exporter: Exporter) -> None:
    metrics.models_dir(config.metrics_dir).joinpath("dead", "999999999").mkdir(parents=True)
    metrics.models_dir(config.metrics_dir).joinpath("alive%2Fone", str(os.getpid())).mkdir(parents=True)
    samples = scrape(exporter())
    assert value(samples, "mme_models_loaded") == 1
    assert value(samples, "mme_model_host_memory_bytes", model="alive/one") > 1024 * 1024


def test_metrics_off_records_nothing(tmp_path: Path) -> None:
    config = Config(runtime_dir=tmp_path, metrics_port=0)

    def server() -> None:
        metrics.start_model(config, "quiet", 1)
        metrics.record_requests([200], 0.01)
        metrics.retire(config)

    in_child(server)
    assert not config.metrics_dir.exists()


def test_a_failure_to_record_never_reaches_the_caller(config: Config) -> None:
    def server() -> None:
        metrics.start_model(config, "m", os.getpid())
        shutil.rmtree(config.metrics_dir)  # a new value's file cannot be created any more
        metrics.record_cache_lookup("requirements", hit=True)
        metrics.record_pass([0.0], 0.1, batch_size=2)

    in_child(server)


@pytest.mark.parametrize(
    ("batch_size", "buckets"),
    [(1, [1.0]), (4, [1.0, 2.0, 3.0, 4.0]), (100, [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 100.0])],
)
def test_batch_size_buckets(batch_size: int, buckets: list[float]) -> None:
    assert metrics.batch_size_buckets(batch_size) == buckets
