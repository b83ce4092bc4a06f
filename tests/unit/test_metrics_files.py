"""The metrics files' life: written by model processes, merged by the exporter, folded when a model goes away.

Model processes are forked children here, as in the server; the exporter is this test's process.
"""

from __future__ import annotations

import gc
import http.client
import http.server
import multiprocessing
import os
import shutil
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from mme_runtime.base.config import Config
from mme_runtime.operations import metric_series, metrics, metrics_exporter
from mme_runtime.operations.metrics_exporter import ModelMetrics

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


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample's value, or None when the series is not there at all."""
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return Config(runtime_dir=tmp_path, metrics_port=9999)


@pytest.fixture
def exporter(config: Config) -> Iterator[Callable[[int], ModelMetrics]]:
    """Makes exporters of the test's metrics directory, asking the management API on the port given (1: nothing
    answers); closed after the test."""
    made: list[ModelMetrics] = []

    def make(port: int = 1) -> ModelMetrics:
        made.append(ModelMetrics(config.metrics_dir, port=port))
        return made[-1]

    yield make


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
        metrics.record_requests(lambda: [200] * requests, 0.01)
        metrics.record_pass([0.001] * requests, 0.005, batch_size=4)

    def server() -> None:
        metrics.start_model(config, model, os.getpid())
        metrics.record_cache_lookup("code", hit=False)
        in_child(executor)
        metrics.record_load(True, 1.5)
        if unload:
            metrics.record_unload(True, 0.2)
            metrics.stop_model(config)

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
    assert value(samples, "mme_model_restarts_total", model="a") == 0


def test_an_unloaded_model_leaves_only_the_container_counters(config: Config, exporter: Exporter) -> None:
    in_child(model_server(config, "gone", requests=4, unload=True))
    in_child(model_server(config, "kept", requests=1, unload=False))
    collector = exporter()
    samples = scrape(collector)
    assert value(samples, "mme_requests_total", model="gone", code="200") is None
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
    assert value(samples, "mme_requests_total", model="crashed", code="200") is None
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
        metrics.record_requests(lambda: [200], 0.01)
        metrics.stop_model(config)

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
    assert metric_series.batch_size_buckets(batch_size) == buckets


def test_user_metrics_in_a_model_process_stay_out(config: Config, exporter: Exporter) -> None:
    """A library that makes prometheus_client metrics of its own in a model process writes them to our files."""

    def server() -> None:
        metrics.start_model(config, "m", os.getpid())
        Counter("user_requests", "a user's own counter", registry=None).inc(7)
        metrics.record_cache_lookup("code", hit=True)
        metrics.stop_model(config)

    in_child(server)
    samples = scrape(exporter())
    assert not any(name.startswith("user_") for name, _ in samples)
    assert value(samples, "mme_cache_lookups_total", cache="code", result="hit") == 1
    retired = (config.metrics_dir / "retired" / "counter_retired.db").read_bytes()
    assert b"user_requests" not in retired


def test_a_fold_that_meets_a_bad_file_counts_the_rest_once(config: Config, exporter: Exporter) -> None:
    in_child(model_server(config, "gone", requests=1, unload=True))
    [unloaded] = list(metrics.unloaded_dir(config.metrics_dir).iterdir())
    (unloaded / "histogram_999.db").write_bytes(b"")  # a writer killed between creating and sizing its file
    collector = exporter()
    for _ in range(3):
        assert value(scrape(collector), "mme_cache_lookups_total", cache="code", result="miss") == 1
    assert not any(metrics.unloaded_dir(config.metrics_dir).iterdir())


class LiveServer:
    """A model server that stays up and forks executors when asked (``executor``); ``stop`` ends it."""

    def __init__(self, config: Config, model: str) -> None:
        self.context = multiprocessing.get_context("fork")
        self.commands, self.replies = self.context.Queue(), self.context.Queue()
        self.process = self.context.Process(target=self._run, args=(config, model))
        self.process.start()

    def _run(self, config: Config, model: str) -> None:
        metrics.start_model(config, model, os.getpid())
        running = None
        while (command := self.commands.get()) is not None:
            if command == "end" and running is not None:
                running.terminate()
                running.join()
                self.replies.put(running.pid)
                continue
            count, keep_alive = command
            recorded = self.context.Event()
            child = self.context.Process(target=self._executor, args=(model, count, recorded, keep_alive))
            child.start()
            recorded.wait(10)
            if keep_alive:
                running = child
            else:
                child.join()
            self.replies.put(child.pid)

    @staticmethod
    def _executor(model: str, count: int, recorded: Any, keep_alive: bool) -> None:
        metrics.record_requests(lambda: [200] * count, 0.01)
        series = metrics._live()
        series.child(series.gpu_memory, model, "0").set(1000)  # as watch_gpu_memory would, without CUDA
        recorded.set()
        if keep_alive:
            time.sleep(60)

    def executor(self, count: int, keep_alive: bool = False) -> int:
        """Forks an executor that answers ``count`` requests, then ends (or runs until ``end_executor``)."""
        self.commands.put((count, keep_alive))
        return int(self.replies.get(timeout=30))

    def end_executor(self) -> int:
        self.commands.put("end")
        return int(self.replies.get(timeout=30))

    def stop(self) -> None:
        self.commands.put(None)
        self.process.join(10)


def test_an_ended_executor_folds_into_its_server_and_its_gauges_go(config: Config, exporter: Exporter) -> None:
    server = LiveServer(config, "m")
    try:
        collector = exporter()
        server.executor(2, keep_alive=True)
        samples = scrape(collector)
        assert value(samples, "mme_model_gpu_memory_bytes", model="m", gpu="0") == 1000
        server.end_executor()
        for _ in range(3):
            server.executor(1)  # an executor that crashes again and again
        server_dir = metrics.models_dir(config.metrics_dir) / "m" / str(server.process.pid)
        collector.sweep()
        samples = scrape(collector)
        assert value(samples, "mme_requests_total", model="m", code="200") == 5
        assert value(samples, "mme_model_gpu_memory_bytes", model="m", gpu="0") is None
        pid = server.process.pid
        names = sorted(path.name for path in server_dir.glob("*.db"))
        assert names == [f"counter_{pid}.db", "counter_exited.db", "histogram_exited.db"]  # the server's own, and one
    finally:
        server.stop()


def counting_walks(collector: ModelMetrics) -> list[int]:
    """Counts the sweep's walks of every model's directory."""
    walks = [0]
    walk = collector._walk

    def counted() -> None:
        walks[0] += 1
        walk()

    collector._walk = counted  # type: ignore[method-assign]
    return walks


def test_a_sweep_walks_the_models_only_when_a_process_writing_there_ended(config: Config, exporter: Exporter) -> None:
    server = LiveServer(config, "m")
    try:
        collector = exporter()
        walks = counting_walks(collector)
        server.executor(2, keep_alive=True)
        collector.sweep()  # the first walks: it knows no process yet
        collector.sweep()
        collector.sweep()
        assert walks[0] == 1  # nothing ended: flat in the models loaded

        server.end_executor()  # a process that the walk saw writing ends
        collector.sweep()
        assert walks[0] == 2
        server_dir = metrics.models_dir(config.metrics_dir) / "m" / str(server.process.pid)
        assert (server_dir / "counter_exited.db").exists()  # folded by that sweep
        assert value(scrape(collector), "mme_requests_total", model="m", code="200") == 2
        collector.sweep()
        assert walks[0] == 2
    finally:
        server.stop()


def test_a_crash_no_walk_saw_is_folded_by_the_next_walk_and_counted_till_then(
    config: Config, exporter: Exporter, not_found_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = exporter(not_found_port)
    walks = counting_walks(collector)
    collector.sweep()
    in_child(model_server(config, "crashed", requests=2, unload=False))  # a loader that died between walks
    collector.sweep()
    assert walks[0] == 1
    assert value(scrape(collector), "mme_requests_total", model="crashed", code="200") == 2  # no count lost

    now = time.monotonic
    monkeypatch.setattr(metrics_exporter.time, "monotonic", lambda: now() + metrics_exporter.WALK_SECONDS)
    collector.sweep()  # the next walk is due
    assert walks[0] == 2
    assert value(scrape(collector), "mme_requests_total", model="crashed", code="200") is None
    assert value(scrape(collector), "mme_model_load_duration_seconds_count", outcome="success") == 1


def test_a_host_that_starts_makes_the_next_sweep_walk(config: Config, exporter: Exporter) -> None:
    (config.metrics_dir / "container" / str(os.getpid())).mkdir(parents=True)  # the warm process's
    collector = exporter()
    walks = counting_walks(collector)
    collector.sweep()
    collector.sweep()
    assert walks[0] == 1
    (config.metrics_dir / "container" / "123").mkdir()  # a device host started
    collector.sweep()
    assert walks[0] == 2


def test_a_host_that_ends_before_any_walk_saw_its_models_makes_the_next_sweep_walk(
    config: Config, exporter: Exporter
) -> None:
    host = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    host.start()
    try:
        (config.metrics_dir / "container" / str(host.pid)).mkdir(parents=True)
        collector = exporter()
        walks = counting_walks(collector)
        collector.sweep()
        collector.sweep()
        assert walks[0] == 1
    finally:
        host.kill()
        host.join()
    collector.sweep()
    assert walks[0] == 2


def test_values_moved_into_a_model_directory_make_the_next_sweep_fold_them(config: Config, exporter: Exporter) -> None:
    server = LiveServer(config, "m")
    try:
        collector = exporter()
        walks = counting_walks(collector)
        collector.sweep()
        dead = in_child(lambda: None)  # a host that died: its files carried over after the walk
        models = metrics.models_dir(config.metrics_dir) / "m"
        (models / str(dead)).mkdir()
        (models / str(dead) / metrics.HOST_BYTES_FILE).write_text("0")
        counter = next((models / str(server.process.pid)).glob("counter_*.db"))
        shutil.copy(counter, models / str(dead) / f"counter_{dead}.db")
        metrics.carry_over(models / str(server.process.pid))
        collector.sweep()
        assert walks[0] == 2
        assert not (models / str(server.process.pid) / f"counter_{dead}.db").exists()  # folded
    finally:
        server.stop()


def test_a_dead_server_whose_model_mms_has_is_asked_about_again_without_a_walk(
    config: Config, exporter: Exporter
) -> None:
    in_child(model_server(config, "crashed", requests=2, unload=False))
    collector = exporter()
    walks = counting_walks(collector)
    answers = iter([True, None, False])
    collector._registered = lambda quoted_model: next(answers)  # type: ignore[method-assign]
    collector.sweep()  # MMS has it: its series stay
    collector.sweep()  # MMS did not answer
    assert value(scrape(collector), "mme_requests_total", model="crashed", code="200") == 2
    collector.sweep()  # MMS no longer has it
    assert walks[0] == 1
    assert value(scrape(collector), "mme_requests_total", model="crashed", code="200") is None


def test_a_directory_gone_since_the_walk_is_not_asked_about(config: Config, exporter: Exporter) -> None:
    in_child(model_server(config, "crashed", requests=2, unload=False))
    collector = exporter()
    asked: list[str] = []
    collector._registered = lambda quoted_model: asked.append(quoted_model) or True  # type: ignore[method-assign]
    collector.sweep()
    assert asked == ["crashed"]
    metrics.move_to_unloaded(config.metrics_dir, next(metrics.models_dir(config.metrics_dir).glob("*/*")))
    collector.sweep()
    collector.sweep()
    assert asked == ["crashed"]


def descriptors_into(directory: Path) -> int:
    """This process's open descriptors on files in ``directory``."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return sum(1 for target in targets if target.startswith(f"{directory}/"))


def test_a_hosted_model_s_files_grow_from_a_page_and_go_with_it(config: Config, exporter: Exporter) -> None:
    # prometheus_client would make each file 64 KiB, resident once mapped: 192 KiB for every model of a device host.
    from prometheus_client import values

    def host() -> None:
        metrics.start_container(config)
        cleanups = len(values._multi_process_cleanups)
        gc.disable()  # what a closed series leaves must go without a full collection
        for model, requests in (("small", 1), ("wide", 60)):
            series = metrics.start_hosted(config, model)
            assert series is not None
            metrics.bind(series)
            metrics.record_requests(lambda requests=requests: [200] * requests, 0.01)  # type: ignore[misc]
            metrics.record_pass([0.001] * requests, 0.005, batch_size=64)  # 64 buckets: its file has to grow
            # the request histogram's values were made before the batch sizes' grew their file: written after it
            metrics.record_requests(lambda: [200], 0.01)
            # Each value keeps its place in its file, not its key (about 200 bytes, dozens a model).
            assert all(not opened._positions for opened in series._files._files.values())  # type: ignore[union-attr]
            metrics.bind(None)
            # No descriptor on its files, after growing too (prometheus_client's file object and the mapping's
            # duplicate would be two per file): at thousands of models a host's descriptors are its limit.
            files = sorted(series.directory.glob("*.db"))
            assert files and descriptors_into(series.directory) == 0
            if model == "small":
                sizes = {path.name: path.stat().st_size for path in series.directory.glob("*.db")}
                assert sizes and all(size < 65536 for size in sizes.values()), sizes  # 32 KiB for 64 buckets
                series.close()
                assert len(values._multi_process_cleanups) == cleanups  # nothing of it stays in the process
                metrics.stop_hosted(config, series)
                # No reference cycle: a class per model (prometheus_client's) would be garbage that only a full
                # collection frees, and a host's full collection stalls every model it serves (issue #37).
                left = weakref.ref(series._files)
                del series
                assert left() is None
        gc.enable()

    in_child(host)
    samples = scrape(exporter())
    assert value(samples, "mme_requests_total", model="wide", code="200") == 61
    assert value(samples, "mme_request_duration_seconds_count", model="wide") == 61
    assert value(samples, "mme_request_duration_seconds_bucket", model="wide", le="0.01") == 61
    assert value(samples, "mme_batch_size_bucket", model="wide", le="60.0") == 1
    assert value(samples, "mme_batch_size_bucket", model="wide", le="59.0") == 0
    assert value(samples, "mme_requests_total", model="small", code="200") is None


def test_a_model_directory_removed_mid_scan_is_skipped_and_the_rest_merged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A host removes an unloaded model's directory whenever it likes; a scrape or sweep listing it meanwhile raised
    # FileNotFoundError, and every model's values were lost for that interval (issue #37).
    collector = ModelMetrics(tmp_path, port=1)
    for model, pid in (("gone", "101"), ("kept", "202")):
        (tmp_path / "models" / model / pid).mkdir(parents=True)
        (tmp_path / "models" / model / pid / "counter_202.db").write_bytes(b"")
    real = os.scandir

    def vanishing(path: Any = ".") -> Any:
        if "models/gone" in str(path):
            raise FileNotFoundError(path)
        return real(path)

    monkeypatch.setattr(os, "scandir", vanishing)
    assert collector._live_files() == [str(tmp_path / "models" / "kept" / "202" / "counter_202.db")]
    assert [path.parent.name for path in collector._server_dirs()] == ["kept"]


def test_closed_series_files_open_no_file_again(tmp_path: Path) -> None:
    # A value made as its model's UNLOAD closes the files would open one that the next LOAD of that name (same host,
    # same directory) maps too, each writing over the other's entries.
    files = metric_series.SeriesFiles(tmp_path)
    with files.lock:
        files.file("counter")
    files.close()
    with files.lock, pytest.raises(RuntimeError, match="closed"):
        files.file("counter")


def test_a_model_loaded_again_under_its_name_counts_anew_in_its_own_files(config: Config, exporter: Exporter) -> None:
    # The families are templates every series of a process shares: the values a series made stay its own, so a model
    # loaded again under its name (same host) gets new values, not the closed ones of its last LOAD.
    def host() -> None:
        metrics.start_container(config)
        for requests in (3, 1):
            series = metrics.start_hosted(config, "again")
            assert series is not None
            metrics.bind(series)
            metrics.record_requests(lambda requests=requests: [200] * requests, 0.01)  # type: ignore[misc]
            metrics.record_pass([0.001] * requests, 0.005, batch_size=4)
            metrics.record_model_load(0.25 * requests)
            metrics.record_restart()
            metrics.bind(None)
            if requests == 3:
                series.close()
                metrics.stop_hosted(config, series)
        families = [family for family in vars(metric_series.Series).values() if hasattr(family, "_metrics")]
        families.append(metric_series._batch_size_family(4))
        assert len(families) == 13 and not any(family._metrics for family in families)

    in_child(host)
    samples = scrape(exporter())
    # what the exporter reads from the files: a counter, a histogram's buckets and sum, a gauge
    assert value(samples, "mme_requests_total", model="again", code="200") == 1
    assert value(samples, "mme_batch_size_bucket", model="again", le="1.0") == 1
    assert value(samples, "mme_batch_size_bucket", model="again", le="+Inf") == 1
    assert value(samples, "mme_request_duration_seconds_sum", model="again") == pytest.approx(0.01)
    assert value(samples, "mme_model_load_seconds", model="again") == 0.25
    assert value(samples, "mme_model_restarts_total", model="again") == 1


def test_a_hosted_model_s_metrics_cost_their_values_places_alone(tmp_path: Path) -> None:
    # A set of families a model (12, about 7.6 KiB) and prometheus_client's child objects (a histogram's 17 values each
    # an object) made an answering model's metrics about 20 KiB: at thousands of models, most of a host's heap, which
    # keeps its high-water mark after they go (issue #37).
    import tracemalloc

    def answering(index: int) -> metric_series.Series:
        (tmp_path / f"m{index}").mkdir()
        series = metric_series.Series(f"m{index}", tmp_path / f"m{index}", hosted=True)
        answers = series.answers
        for histogram in (answers.request_seconds, answers.queue_seconds, answers.predict_seconds):
            histogram.observe(0.01)
        series.request_count(200).inc()
        series.batch_size_histogram(4).observe(1)
        series.child(series.load_seconds, series.model).set(0.2)
        return series

    answering(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        made = [answering(index) for index in range(1, 21)]
        each = (tracemalloc.get_traced_memory()[0] - before) / len(made)
    finally:
        tracemalloc.stop()
    for series in made:
        series.close()
    assert each < 10 * 1024, each  # 6.7 KiB on Python 3.11: its files, and 8 metrics of 1 to 17 values


def test_a_hosted_metric_refuses_what_prometheus_client_refuses(tmp_path: Path) -> None:
    series = metric_series.Series("m", tmp_path, hosted=True)
    histogram = series.child(series.request_seconds, "m")
    histogram.observe(float("nan"))  # in the sum, in no bucket: the count stays as prometheus_client keeps it
    histogram.observe(0.002)
    with pytest.raises(ValueError, match="only goes up"):
        series.child(series.requests, "m", "200").inc(-1)
    newest = Gauge("newest", "A gauge whose samples carry their time.", ["model"], multiprocess_mode="mostrecent")
    with pytest.raises(ValueError, match="most-recent"):
        series.child(newest, "m")
    series.close()
    files = [str(tmp_path / f"histogram_{os.getpid()}.db")]
    samples = MultiProcessCollector._read_metrics(files)["mme_request_duration_seconds"].samples
    buckets = {dict(sample.labels)["le"]: sample.value for sample in samples if sample.name.endswith("_bucket")}
    assert buckets["0.0025"] == 1 and sum(buckets.values()) == 1


def test_a_scrape_over_http_answers_then_gives_its_memory_back(
    config: Config, exporter: Exporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    releases: list[int] = []
    monkeypatch.setattr(metrics_exporter, "release_heap", lambda: releases.append(1))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter())
    server = metrics_exporter._serve(0, registry)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
        for _ in range(2):
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            assert response.status == 200
            assert b"mme_models_loaded 0.0" in response.read()
        connection.close()
    finally:
        server.shutdown()
        server.server_close()
    assert releases == [1, 1]  # each made before its answer was sent


def test_releasing_the_heap_empties_the_free_lists_that_hold_a_scrape_s_arenas() -> None:
    if not sys.getallocatedblocks():
        pytest.skip("Python's own allocator counts its blocks; this one does not")
    gc.collect()
    before = sys.getallocatedblocks()
    garbage = [tuple(range(n % 19 + 1)) for n in range(40_000)]  # a scrape's labels and samples
    del garbage
    kept = sys.getallocatedblocks() - before  # freed, but kept by the tuples' free lists
    metrics_exporter.release_heap()
    assert kept > 10_000
    assert sys.getallocatedblocks() - before < kept / 10


def test_a_frontend_that_answers_no_http_is_a_frontend_that_did_not_answer(exporter: Exporter) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def garble() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(1024)
            connection.sendall(b"not http at all\r\n\r\n")

    thread = threading.Thread(target=garble, daemon=True)
    thread.start()
    try:
        assert exporter(listener.getsockname()[1])._registered("m") is None  # asked again at the next sweep
    finally:
        thread.join(10)
        listener.close()
