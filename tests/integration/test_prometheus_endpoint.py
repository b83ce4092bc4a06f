"""The Prometheus endpoint, scraped from a real server: every count is the one the test caused.

Each test parses ``/metrics`` with ``prometheus_client.parser`` and compares the values with what it did: LOADs
(good and failing), requests answered 200, 4xx and 5xx, a batching model's forward passes (as its ``predict_fn``
logged them), a killed device host, UNLOADs and the caches.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import model_factory
import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from serving import RunningServer, start_server, wait_until

pytestmark = pytest.mark.integration

ROW = json.dumps([[0.5] * model_factory.IN_FEATURES])
MIB = 1024 * 1024


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: RunningServer) -> Samples:
    """Every sample of ``/metrics``, by name and labels."""
    response = requests.get(server.metrics_url, timeout=10)
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample's value, or None when the series is not there at all."""
    return samples.get((name, frozenset(labels.items())))


def settled(server: RunningServer, expected: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> Samples:
    """Scrapes until every expected series has its value (the exporter reads the model processes' files as they are
    written), then returns that scrape; the caller's assertions report what differs if it never gets there."""
    samples: Samples = {}

    def matches() -> bool:
        nonlocal samples
        samples = scrape(server)
        return all(value(samples, name, **dict(labels)) == want for (name, labels), want in expected.items())

    wait_until(matches, 10)
    return samples


def models_in(samples: Samples) -> set[str]:
    return {dict(labels)["model"] for _, labels in samples if "model" in dict(labels)}


def workers_ready(server: RunningServer, name: str, count: int) -> bool:
    workers = server.describe(name).json()["workers"]
    return len(workers) == count and all(worker["status"] == "READY" for worker in workers)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(tmp_path_factory.mktemp("metrics"), {"MME_TEST_PREDICT_SLEEP": "0.03"}) as running:
        yield running


def series(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, tuple(sorted(labels.items())))


def test_counts_are_exactly_what_the_requests_caused(server: RunningServer) -> None:
    before = scrape(server)
    assert value(before, "mme_models_loaded") == 0
    loads_before = value(before, "mme_model_load_duration_seconds_count", outcome="success") or 0

    model_factory.torchscript_model(server.model_dir("plain"))
    model_factory.user_error_model(server.model_dir("errors"))
    model_factory.failing_model(server.model_dir("broken"))
    assert server.load("plain").status_code == 200
    assert server.load("errors").status_code == 200
    assert server.load("broken").status_code >= 400
    # The same artifacts under a second name: the warm process's model cache answers it.
    assert server.load("plain-again", server.model_dir("plain")).status_code == 200

    statuses = [server.invoke("plain", ROW).status_code for _ in range(3)]
    statuses += [server.invoke("plain", "{not json").status_code for _ in range(2)]
    statuses += [server.invoke("errors", json.dumps({"raise": "quota"})).status_code]
    statuses += [server.invoke("errors", json.dumps({"raise": "bug"})).status_code for _ in range(2)]
    statuses += [server.invoke("errors", json.dumps({})).status_code]
    assert statuses == [200, 200, 200, 400, 400, 429, 500, 500, 200]

    expected = {
        series("mme_requests_total", model="plain", code="200"): 3,
        series("mme_requests_total", model="plain", code="400"): 2,
        series("mme_requests_total", model="errors", code="429"): 1,
        series("mme_requests_total", model="errors", code="500"): 2,
        series("mme_requests_total", model="errors", code="200"): 1,
        series("mme_request_duration_seconds_count", model="plain"): 5,
        # Requests that failed in input_fn never reach a forward pass; transform_fn requests each have their own.
        series("mme_predict_duration_seconds_count", model="plain"): 3,
        series("mme_queue_duration_seconds_count", model="plain"): 3,
        series("mme_predict_duration_seconds_count", model="errors"): 4,
        series("mme_batch_size_bucket", model="plain", le="1.0"): 3,
        series("mme_model_restarts_total", model="plain"): 0,
        series("mme_model_load_duration_seconds_count", outcome="success"): loads_before + 3,
        # The failing LOAD's server is stopped by MMS; its outcome stays counted once its files are folded.
        series("mme_model_load_duration_seconds_count", outcome="failure"): 1,
        # Every LOAD looks for a package: the same artifacts' (plain-again's hit), or its own kept since an UNLOAD.
        series("mme_cache_lookups_total", cache="model", result="miss"): 3,
        series("mme_cache_lookups_total", cache="model", result="hit"): 1,
        series("mme_models_loaded"): 3,
    }
    samples = settled(server, expected)
    for (name, labels), want in expected.items():
        assert value(samples, name, **dict(labels)) == want, (name, labels)
    # A model that shares its device host is charged its own tensors in host memory, not the host's whole PSS.
    tiny_net_bytes = sum(p.numel() * p.element_size() for p in model_factory.tiny_net().parameters())
    assert value(samples, "mme_model_host_memory_bytes", model="plain") == tiny_net_bytes
    assert value(samples, "mme_requests_total", model="plain", code="500") is None
    assert "broken" not in models_in(samples)
    assert value(samples, "mme_model_unload_duration_seconds_count", outcome="success") is None  # none yet


FAILS_IN_THE_HOST = """
import os


def model_fn(model_dir):
    tried = os.path.join(model_dir, "tried_in_the_loader")
    if not os.path.exists(tried):  # in the loader: as if it had initialised CUDA, so that the host runs it again
        open(tried, "w").close()
        import mme_runtime.base.devices
        mme_runtime.base.devices.cuda_initialized = lambda: True
        raise RuntimeError("no GPU in the loader")
    raise RuntimeError("broken in the device host too")
"""


def test_a_load_that_fails_in_the_device_host_is_no_unload(tmp_path: Path) -> None:
    """A model_fn that must run in the device host, and fails there: MMS gives the model up, no UNLOAD happened."""
    with start_server(tmp_path) as server:
        model_factory.write_code(server.model_dir("broken"), FAILS_IN_THE_HOST)
        assert server.load("broken").status_code >= 400
        expected = {
            series("mme_model_load_duration_seconds_count", outcome="failure"): 1,
            series("mme_models_loaded"): 0,
        }
        samples = settled(server, expected)
        for (name, labels), want in expected.items():
            assert value(samples, name, **dict(labels)) == want, (name, labels)
        # The server stops once MMS has given up on the LOAD; its series go with it.
        assert wait_until(lambda: models_in(scrape(server)) == set(), 10)
        samples = scrape(server)
        assert value(samples, "mme_model_load_duration_seconds_count", outcome="failure") == 1
        assert value(samples, "mme_model_unload_duration_seconds_count", outcome="success") is None
        assert value(samples, "mme_model_load_duration_seconds_count", outcome="success") is None


def test_unloaded_model_series_go_and_container_totals_stay(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("short-lived"))
    assert server.load("short-lived").status_code == 200
    for _ in range(2):
        assert server.invoke("short-lived", ROW).status_code == 200
    samples = settled(server, {series("mme_requests_total", model="short-lived", code="200"): 2})
    assert value(samples, "mme_requests_total", model="short-lived", code="200") == 2
    loads = value(samples, "mme_model_load_duration_seconds_count", outcome="success")
    unloads = value(samples, "mme_model_unload_duration_seconds_count", outcome="success") or 0

    assert server.unload("short-lived").status_code == 200
    assert wait_until(lambda: "short-lived" not in models_in(scrape(server)), 20)
    after = settled(server, {series("mme_model_unload_duration_seconds_count", outcome="success"): unloads + 1})
    assert value(after, "mme_model_unload_duration_seconds_count", outcome="success") == unloads + 1
    assert value(after, "mme_model_load_duration_seconds_count", outcome="success") == loads
    metrics_dir = server.home / "run" / "metrics"
    assert wait_until(lambda: not any("short-lived" in path.name for path in metrics_dir.rglob("*")), 10)

    # A LOAD of the same name starts from zero.
    assert server.load("short-lived").status_code == 200
    assert server.invoke("short-lived", ROW).status_code == 200
    samples = settled(server, {series("mme_requests_total", model="short-lived", code="200"): 1})
    assert value(samples, "mme_requests_total", model="short-lived", code="200") == 1
    assert server.unload("short-lived").status_code == 200


def test_killed_host_counts_a_restart_and_keeps_its_counts(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("resilient"))
    assert server.load("resilient").status_code == 200
    assert server.invoke("resilient", ROW).status_code == 200
    [serving] = [psutil.Process(pid) for pid in server.worker_pids("resilient")]  # its device host
    serving.send_signal(signal.SIGKILL)
    serving.wait(10)

    # The frontend reconnects and a new host takes the model; until then MMS answers for itself (5xx), and those
    # answers never reached a backend: only the 200s are the model's.
    served = 1
    deadline = time.monotonic() + 30
    while served < 4 and time.monotonic() < deadline:
        served += server.invoke("resilient", ROW).status_code == 200
    assert served == 4
    expected = {
        series("mme_model_restarts_total", model="resilient"): 1,
        series("mme_executor_restarts_total", model="resilient"): 1,  # its old name, for one release
        series("mme_requests_total", model="resilient", code="200"): served,  # the one before the kill included
        series("mme_request_duration_seconds_count", model="resilient"): served,
    }
    samples = settled(server, expected)
    for (name, labels), want in expected.items():
        assert value(samples, name, **dict(labels)) == want, (name, labels)
    # The killed host's files are folded into the new host's directory for the model (a crash loop adds nothing).
    [host] = server.worker_pids("resilient")
    model_dir = server.home / "run" / "metrics" / "models" / "resilient" / str(host)
    assert wait_until(lambda: not any(str(serving.pid) in path.name for path in model_dir.iterdir()), 10)
    assert value(scrape(server), "mme_requests_total", model="resilient", code="200") == served


def test_batch_sizes_match_the_forward_passes(server: RunningServer) -> None:
    model_dir = model_factory.batching_model(server.model_dir("batched"), batch_size=8)
    assert server.load("batched").status_code == 200
    assert wait_until(lambda: workers_ready(server, "batched", 8), 30)
    passes_at_load = len(model_factory.batches(model_dir))

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda _: server.invoke("batched", ROW).status_code, range(96)))
    assert statuses == [200] * 96

    passes = [forward.rows for forward in model_factory.batches(model_dir)[passes_at_load:]]
    expected = {
        series("mme_batch_size_count", model="batched"): len(passes),
        series("mme_batch_size_sum", model="batched"): 96,
        series("mme_queue_duration_seconds_count", model="batched"): 96,
    }
    for size in range(1, 9):  # one bucket per size, cumulative
        expected[series("mme_batch_size_bucket", model="batched", le=f"{size}.0")] = sum(1 for n in passes if n <= size)
    samples = settled(server, expected)
    for (name, labels), want in expected.items():
        assert value(samples, name, **dict(labels)) == want, (name, labels)
    assert max(passes) > 1, "no batch formed: the histogram was not put to the test"


def test_metrics_answer_while_a_model_loads(server: RunningServer) -> None:
    model_dir = server.model_dir("slow")
    model_factory.torchscript_model(model_dir)
    model_factory.write_code(
        model_dir,
        "import time, torch\n\ndef model_fn(model_dir):\n"
        "    time.sleep(6)\n    return torch.jit.load(model_dir + '/model.pt')\n",
    )
    answer: dict[str, int] = {}
    loading = threading.Thread(target=lambda: answer.update(status=server.load("slow").status_code))
    loading.start()
    time.sleep(1.5)
    started = time.monotonic()
    samples = scrape(server)
    assert time.monotonic() - started < 2
    assert loading.is_alive(), "the LOAD ended before the scrape: the test proved nothing"
    assert value(samples, "mme_model_restarts_total", model="slow") == 0  # its server is up, and counted
    loading.join(60)
    assert answer == {"status": 200}


def test_port_zero_turns_metrics_off(tmp_path: Path) -> None:
    with start_server(tmp_path, {"MME_METRICS_PORT": "0"}) as server:
        model_factory.torchscript_model(server.model_dir("quiet"))
        assert server.load("quiet").status_code == 200
        assert server.invoke("quiet", ROW).status_code == 200
        entrypoint = psutil.Process(server.process.pid)
        listening = [c for c in entrypoint.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert listening == []
        assert not (server.home / "run" / "metrics").exists()
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", 9090)) != 0 or _listener_is_not_ours(server)


def _listener_is_not_ours(server: RunningServer) -> bool:
    """Something else on this machine may hold 9090: then it must not be a process of this server."""
    ours = {server.process.pid, *(process.pid for process in server.descendants())}
    holders = {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == 9090}
    return not holders & ours
