"""A CPU host drained by UNLOADs hands the models it has left to a fresh host and ends (``host_recycling.py``), over
the real MMS frontend: every request answered, by the right model, during the move too; the model's counts go with
it; UNLOAD and LOAD work after."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import model_factory
import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from serving import RunningServer, start_server, wait_until

# model_fn's result is picklable (the loader packs it); each answer says which model and which process gave it
WHO_SCRIPT = """
import json
import os
import time


def model_fn(model_dir):
    return {"name": os.path.basename(model_dir)}


def transform_fn(model, body, content_type, accept):
    time.sleep(float(body))
    return json.dumps({"model": model["name"], "pid": os.getpid()}), "application/json"
"""
PEAK = 16  # models the host holds before the drain: one left is a sixteenth


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    env = {"MME_CPU_HOSTS": "1", "MME_RECYCLE_PEAK_MODELS": str(PEAK), "MME_TEST_PREDICT_SLEEP": "0"}
    with start_server(tmp_path_factory.mktemp("recycling"), env) as running:
        yield running


def successes(server: RunningServer, model: str) -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "mme_requests")
    return sum(
        s.value
        for s in family.samples
        if s.name.endswith("_total") and s.labels["model"] == model and s.labels["code"] == "200"
    )


def load_seconds(server: RunningServer, model: str) -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "mme_model_load_seconds")
    [value] = [s.value for s in family.samples if s.labels["model"] == model]
    return value


def fill_host(server: RunningServer, stays: str, prefix: str) -> list[str]:
    """LOADs ``stays`` (WHO_SCRIPT) unless it is loaded already, and beside it PEAK - 1 tiny models named ``prefix``
    and a number, all in the one host: their names."""
    if not server.model_dir(stays).exists():
        model_factory.write_code(server.model_dir(stays), WHO_SCRIPT)
        assert server.load(stays).status_code == 200
    names = [f"{prefix}{index}" for index in range(PEAK - 1)]
    for index, name in enumerate(names):
        model_factory.torchscript_model(server.model_dir(name), seed=index)
        assert server.load(name).status_code == 200
    return names


def started_workers(server: RunningServer, model: str) -> set[tuple[str, str]]:
    """MMS's ready workers of ``model``, each with when it started: one that lost its connection starts again."""
    workers = server.describe(model).json()["workers"]
    return {(worker["id"], worker["startTime"]) for worker in workers if worker["status"] == "READY"}


def test_a_drained_host_hands_its_last_model_to_a_fresh_one_with_no_request_lost(server: RunningServer) -> None:
    drained = fill_host(server, "stays", "drained")
    [old] = server.hosts_of("stays")
    workers = started_workers(server, "stays")
    answered: Counter[int] = Counter()  # by the pid that answered
    failures: list[str] = []
    stop = threading.Event()

    def client(pause: str) -> None:
        with requests.Session() as session:
            while not stop.is_set():
                response = session.post(f"{server.url}/models/stays/invoke", data=pause, timeout=30)
                if response.status_code != 200 or response.json()["model"] != "stays":
                    failures.append(f"{response.status_code} {response.text[:200]}")
                else:
                    answered[response.json()["pid"]] += 1

    # answers of 0.1 s: a call is under way when the hand-over comes, most likely
    clients = [threading.Thread(target=client, args=(pause,)) for pause in ("0.1", "0.1", "0")]
    for thread in clients:
        thread.start()
    try:
        for name in drained:
            assert server.unload(name).status_code == 200
        assert wait_until(lambda: len(answered) == 2, 30), (answered, failures)
        assert wait_until(lambda: not psutil.pid_exists(old) or psutil.Process(old).status() == "zombie", 10)
        time.sleep(0.5)  # and the new host answers on
    finally:
        stop.set()
        for thread in clients:
            thread.join(30)
    assert failures == []
    assert started_workers(server, "stays") == workers  # MMS's worker kept its connection
    [new] = set(answered) - {old}
    assert server.hosts_of("stays") == {new}
    log = server.log_text()
    assert f"holds 1 of its {PEAK} models: they move to pid={new}" in log
    assert f"model=stays handed over to device host pid={new}" in log
    assert "ERROR" not in log
    # its LOAD's time stays in its metrics, and its counts moved with it: none lost, none twice
    assert load_seconds(server, "stays") > 0
    assert wait_until(lambda: successes(server, "stays") == sum(answered.values()), 10), (
        successes(server, "stays"),
        answered,
    )
    assert server.unload("stays").status_code == 200
    assert server.load("stays").status_code == 200
    response = server.invoke("stays", "0", "text/plain")
    assert response.status_code == 200 and response.json()["model"] == "stays"


def test_a_host_left_more_than_a_sixteenth_of_its_models_stays(server: RunningServer) -> None:
    others = fill_host(server, "stays", "other")
    [host] = server.hosts_of("stays")
    for name in others[1:]:  # 2 of 16 left
        assert server.unload(name).status_code == 200
    time.sleep(4)  # past the quiet time after an UNLOAD
    assert server.hosts_of("stays") == {host}
    assert "move to pid" not in server.log_text()
    assert server.invoke("stays", "0", "text/plain").json()["pid"] == host


def test_a_model_with_more_connections_than_one_message_carries_moves_with_all_of_them(server: RunningServer) -> None:
    # A batching model holds a connection per row of its batch (the tests' servers open them at LOAD): 70 are more
    # than the 64 descriptors of one hand-over message (warm_protocol.MAX_FDS).
    connections = 70
    model_factory.batching_model(server.model_dir("wide"), batch_size=connections)
    assert server.load("wide").status_code == 200

    assert wait_until(lambda: len(started_workers(server, "wide")) == connections, 60)
    workers = started_workers(server, "wide")
    drained = fill_host(server, "wide", "drained")
    [old] = server.hosts_of("wide")
    for name in drained:
        assert server.unload(name).status_code == 200
    assert wait_until(lambda: server.hosts_of("wide") not in (set(), {old}), 30)
    assert wait_until(lambda: not psutil.pid_exists(old) or psutil.Process(old).status() == "zombie", 10)
    # every connection answers from the new host: as many requests at once as there are connections
    barrier = threading.Barrier(connections)

    def call(_: int) -> requests.Response:
        barrier.wait()
        return server.invoke("wide", json.dumps([[1.0, 2.0, 3.0, 4.0]]))

    with ThreadPoolExecutor(connections) as pool:
        responses = list(pool.map(call, range(connections)))
    assert [response.status_code for response in responses] == [200] * connections
    time.sleep(1)
    assert started_workers(server, "wide") == workers  # none of MMS's workers lost its connection and started again
    assert "ERROR" not in server.log_text()
