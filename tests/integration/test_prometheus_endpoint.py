"""The Prometheus endpoint, scraped from a real server: every count is the one the test caused.

Each test parses ``/metrics`` with ``prometheus_client.parser`` and compares the values with what it did: LOADs
(good and failing), requests answered 200, 4xx and 5xx, a batching model's forward passes (as its ``predict_fn``
logged them), a killed executor, UNLOADs and the caches.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fake_nvidia_smi
import model_factory
import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from serving import RunningServer, alive, start_server, wait_until

pytestmark = pytest.mark.integration

ROW = json.dumps([[0.5] * model_factory.IN_FEATURES])
MIB = 1024 * 1024


def scrape(server: RunningServer) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of ``/metrics``, by name and labels."""
    response = requests.get(server.metrics_url, timeout=10)
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def models_in(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> set[str]:
    return {dict(labels)["model"] for _, labels in samples if "model" in dict(labels)}


def workers_ready(server: RunningServer, name: str, count: int) -> bool:
    workers = server.describe(name).json()["workers"]
    return len(workers) == count and all(worker["status"] == "READY" for worker in workers)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(tmp_path_factory.mktemp("metrics"), {"MME_TEST_PREDICT_SLEEP": "0.03"}) as running:
        yield running


def test_counts_are_exactly_what_the_requests_caused(server: RunningServer) -> None:
    before = scrape(server)
    assert value(before, "mme_models_loaded") == 0
    loads_before = value(before, "mme_model_load_duration_seconds_count", outcome="success")

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

    samples = scrape(server)
    assert value(samples, "mme_requests_total", model="plain", code="200") == 3
    assert value(samples, "mme_requests_total", model="plain", code="400") == 2
    assert value(samples, "mme_requests_total", model="errors", code="429") == 1
    assert value(samples, "mme_requests_total", model="errors", code="500") == 2
    assert value(samples, "mme_requests_total", model="errors", code="200") == 1
    assert value(samples, "mme_request_duration_seconds_count", model="plain") == 5
    # Requests that failed in input_fn never reach a forward pass; transform_fn requests each have their own.
    assert value(samples, "mme_predict_duration_seconds_count", model="plain") == 3
    assert value(samples, "mme_queue_duration_seconds_count", model="plain") == 3
    assert value(samples, "mme_predict_duration_seconds_count", model="errors") == 4
    assert value(samples, "mme_batch_size_bucket", model="plain", le="1.0") == 3
    assert value(samples, "mme_model_load_duration_seconds_count", outcome="success") == loads_before + 3
    assert value(samples, "mme_cache_lookups_total", cache="model", result="miss") == 1
    assert value(samples, "mme_cache_lookups_total", cache="model", result="hit") == 1
    assert value(samples, "mme_models_loaded") == 3
    assert value(samples, "mme_model_host_memory_bytes", model="plain") > 10 * MIB
    assert "broken" not in models_in(samples)

    # The failing LOAD's server is stopped by MMS; its outcome stays counted once its files are folded.
    assert wait_until(
        lambda: value(scrape(server), "mme_model_load_duration_seconds_count", outcome="failure") == 1, 20
    )


def test_unloaded_model_series_go_and_container_totals_stay(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("short-lived"))
    assert server.load("short-lived").status_code == 200
    for _ in range(2):
        assert server.invoke("short-lived", ROW).status_code == 200
    samples = scrape(server)
    assert value(samples, "mme_requests_total", model="short-lived", code="200") == 2
    loads = value(samples, "mme_model_load_duration_seconds_count", outcome="success")
    unloads = value(samples, "mme_model_unload_duration_seconds_count", outcome="success")

    assert server.unload("short-lived").status_code == 200
    assert wait_until(lambda: "short-lived" not in models_in(scrape(server)), 20)
    assert wait_until(
        lambda: value(scrape(server), "mme_model_unload_duration_seconds_count", outcome="success") == unloads + 1, 20
    )
    after = scrape(server)
    assert value(after, "mme_model_load_duration_seconds_count", outcome="success") == loads
    assert not any("short-lived" in path.name for path in (server.home / "run" / "metrics").rglob("*"))

    # A LOAD of the same name starts from zero.
    assert server.load("short-lived").status_code == 200
    assert server.invoke("short-lived", ROW).status_code == 200
    assert value(scrape(server), "mme_requests_total", model="short-lived", code="200") == 1
    assert server.unload("short-lived").status_code == 200


def test_killed_executor_counts_a_restart_and_keeps_its_counts(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("resilient"))
    assert server.load("resilient").status_code == 200
    assert server.invoke("resilient", ROW).status_code == 200
    backend = server.backend_server("resilient")
    assert backend is not None
    executors = alive(backend.children())
    assert len(executors) == 1
    executors[0].send_signal(signal.SIGKILL)
    executors[0].wait(10)

    # The frontend reconnects, and the server forks a new executor; until then MMS answers for itself.
    def served() -> bool:
        return server.invoke("resilient", ROW).status_code == 200

    assert wait_until(served, 30, 0.5)
    samples = scrape(server)
    assert value(samples, "mme_executor_restarts_total", model="resilient") == 1
    served_after_kill = value(samples, "mme_requests_total", model="resilient", code="200")
    assert served_after_kill >= 2  # the one before the kill is still counted
    assert value(samples, "mme_request_duration_seconds_count", model="resilient") == served_after_kill


def test_batch_sizes_match_the_forward_passes(server: RunningServer) -> None:
    model_dir = model_factory.batching_model(server.model_dir("batched"), batch_size=8)
    assert server.load("batched").status_code == 200
    assert wait_until(lambda: workers_ready(server, "batched", 8), 30)
    passes_at_load = len(model_factory.batches(model_dir))

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda _: server.invoke("batched", ROW).status_code, range(96)))
    assert statuses == [200] * 96

    passes = [forward.rows for forward in model_factory.batches(model_dir)[passes_at_load:]]
    samples = scrape(server)
    assert value(samples, "mme_batch_size_count", model="batched") == len(passes)
    assert value(samples, "mme_batch_size_sum", model="batched") == 96
    for size in range(1, 9):  # one bucket per size, cumulative
        expected = sum(1 for rows in passes if rows <= size)
        assert value(samples, "mme_batch_size_bucket", model="batched", le=f"{size}.0") == expected
    assert value(samples, "mme_queue_duration_seconds_count", model="batched") == 96
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
    requests.get(server.metrics_url, timeout=5).raise_for_status()
    assert time.monotonic() - started < 2
    assert loading.is_alive(), "the LOAD ended before the scrape: the test proved nothing"
    loading.join(60)
    assert answer == {"status": 200}


def test_gpu_memory_per_model_and_device(tmp_path: Path) -> None:
    """With (fake) GPUs, nvidia-smi's per-process memory is summed per model and GPU."""
    apps = tmp_path / "apps.csv"
    env = {
        **fake_nvidia_smi.install(tmp_path / "bin", gpus=2),
        fake_nvidia_smi.APPS_VARIABLE: str(apps),
        "SAGEMAKER_MODEL_SERVER_WORKERS": "2",
    }
    with start_server(tmp_path, env) as server:
        model_factory.torchscript_model(server.model_dir("on-gpus"))
        assert server.load("on-gpus").status_code == 200
        assert server.invoke("on-gpus", ROW).status_code == 200
        backend = server.backend_server("on-gpus")
        assert backend is not None
        assert wait_until(lambda: len(alive(backend.children())) == 2, 30)
        first, second = sorted(process.pid for process in alive(backend.children()))
        apps.write_text(f"{first}, GPU-fake-0, 300\n{second}, GPU-fake-1, 500\n{os.getpid()}, GPU-fake-1, 999\n")
        samples = scrape(server)
        assert value(samples, "mme_model_gpu_memory_bytes", model="on-gpus", gpu="0") == 300 * MIB
        assert value(samples, "mme_model_gpu_memory_bytes", model="on-gpus", gpu="1") == 500 * MIB


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
