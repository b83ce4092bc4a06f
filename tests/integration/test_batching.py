"""Dynamic batching on one executor per device, through the real MMS frontend over HTTP.

The models come from ``model_factory.batching_model``: the tiny TorchScript net with the defaults for input_fn and
output_fn, and a row-wise predict_fn that logs every forward pass, so the tests see the batches that formed. A short
sleep in predict_fn (``MME_TEST_PREDICT_SLEEP``) keeps a pass running long enough for concurrent requests to gather.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import model_factory
import numpy as np
import pytest
import requests
import torch
from serving import RunningServer, alive, is_stub, npy, start_server, wait_until

BATCH_SIZE = 8
CLIENTS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # One worker per model by default, as on any CPU host: the batching models' serving.properties raise it.
    env = {"MME_TEST_PREDICT_SLEEP": "0.03"}
    with start_server(tmp_path_factory.mktemp("batching"), env) as running:
        yield running


def expected(rows: list[list[float]], seed: int = 0) -> np.ndarray:
    with torch.inference_mode():
        return model_factory.tiny_net(seed)(torch.tensor(rows, dtype=torch.float32)).numpy()


def random_rows(generator: random.Random) -> list[list[float]]:
    return [
        [generator.uniform(-3, 3) for _ in range(model_factory.IN_FEATURES)] for _ in range(generator.randint(1, 3))
    ]


def load_batching(server: RunningServer, name: str, **kwargs: object) -> None:
    model_factory.batching_model(server.model_dir(name), **kwargs)  # type: ignore[arg-type]
    response = server.load(name)
    assert response.status_code == 200, response.text


def all_workers_ready(server: RunningServer, name: str, count: int) -> bool:
    workers = server.describe(name).json()["workers"]
    return len(workers) == count and all(worker["status"] == "READY" for worker in workers)


def at_once(calls: list[object], function: object) -> list[requests.Response]:
    """Runs ``function(call)`` for every call from its own thread, released together."""
    barrier = threading.Barrier(len(calls))

    def run(call: object) -> requests.Response:
        barrier.wait()
        return function(call)  # type: ignore[operator,no-any-return]

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def test_batch_size_in_serving_properties_gets_the_connections_that_fill_it(server: RunningServer) -> None:
    load_batching(server, "filled", batch_size=BATCH_SIZE)

    # This server opens a batch's connections at LOAD (MME_BATCH_CONNECTIONS_AT_LOAD, as the tests' servers do): the
    # executor asked for batch_size workers per device; the entrypoint scaled the model once its LOAD completed.
    assert wait_until(lambda: all_workers_ready(server, "filled", BATCH_SIZE), 30)
    assert len(server.worker_pids("filled")) == 1  # 8 connections, one process, one copy of the weights
    # Its idle OpenMP threads sleep: the setting reaches every process the entrypoint starts (MMS passes it on).
    [frontend] = [process for process in server.descendants() if process.name() == "java"]
    assert frontend.environ()["OMP_WAIT_POLICY"] == "PASSIVE"
    assert frontend.environ()["MALLOC_ARENA_MAX"] == "2"  # each arena keeps what its threads freed
    assert "model=filled scaled to 8 workers to fill its batches" in server.log_text()


def test_by_default_a_batch_s_connections_open_when_its_requests_overlap(tmp_path: Path) -> None:
    env = {"MME_TEST_PREDICT_SLEEP": "0.03", "MME_BATCH_CONNECTIONS_AT_LOAD": ""}  # the container's default: 2
    with start_server(tmp_path, env) as fresh:
        load_batching(fresh, "grows", batch_size=BATCH_SIZE)
        assert wait_until(lambda: all_workers_ready(fresh, "grows", 2), 30)
        generator = random.Random(5)
        for _ in range(20):  # one client, one request at a time: two connections are plenty
            rows = random_rows(generator)
            response = fresh.invoke("grows", json.dumps(rows))
            np.testing.assert_allclose(np.array(response.json()), expected(rows), rtol=1e-5, atol=1e-6)
        time.sleep(1)
        assert all_workers_ready(fresh, "grows", 2)

        bodies = [random_rows(generator) for _ in range(CLIENTS * 4)]
        responses = at_once(bodies, lambda rows: fresh.invoke("grows", json.dumps(rows)))
        for rows, response in zip(bodies, responses, strict=True):
            assert response.status_code == 200, response.text
            np.testing.assert_allclose(np.array(response.json()), expected(rows), rtol=1e-5, atol=1e-6)
        assert wait_until(lambda: all_workers_ready(fresh, "grows", BATCH_SIZE), 30)
        assert len(fresh.worker_pids("grows")) == 1
        assert "model=grows scaled to 8 workers to fill its batches" in fresh.log_text()


def test_concurrent_clients_each_get_exactly_their_own_rows(server: RunningServer) -> None:
    load_batching(server, "rows", batch_size=BATCH_SIZE)
    assert wait_until(lambda: all_workers_ready(server, "rows", BATCH_SIZE), 30)
    generator = random.Random(12)
    bodies = [random_rows(generator) for _ in range(CLIENTS * 6)]

    with ThreadPoolExecutor(CLIENTS) as pool:
        responses = list(pool.map(lambda rows: server.invoke("rows", json.dumps(rows)), bodies))

    for rows, response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(np.array(response.json()), expected(rows), rtol=1e-5, atol=1e-6)
    passes = model_factory.batches(server.model_dir("rows"))
    assert sum(p.rows for p in passes) == sum(len(rows) for rows in bodies)  # every row ran exactly once
    assert len(passes) < len(bodies) / 2  # requests shared forward passes
    assert {p.batch_size for p in passes} == {BATCH_SIZE}  # context.batch_size reports the configured size
    assert len({p.pid for p in passes}) == 1


def test_json_csv_and_npy_requests_with_their_own_accept_share_a_batch(server: RunningServer) -> None:
    load_batching(server, "mixed", batch_size=BATCH_SIZE)
    assert wait_until(lambda: all_workers_ready(server, "mixed", BATCH_SIZE), 30)
    generator = random.Random(3)
    formats = ["application/json", "text/csv", "application/x-npy"]
    calls = []
    for index in range(BATCH_SIZE):
        rows = random_rows(generator)
        content_type, accept = formats[index % 3], formats[(index + 1) % 3]
        if content_type == "application/json":
            body: bytes | str = json.dumps(rows)
        elif content_type == "text/csv":
            body = "\n".join(",".join(repr(value) for value in row) for row in rows)
        else:
            body = npy(np.array(rows, dtype=np.float32))
        calls.append((rows, body, content_type, accept))

    responses = at_once(calls, lambda call: server.invoke("mixed", call[1], content_type=call[2], accept=call[3]))

    for (rows, _, _, accept), response in zip(calls, responses, strict=True):
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"].startswith(accept)
        if accept == "application/json":
            answer = np.array(response.json())
        elif accept == "text/csv":
            answer = np.loadtxt(io.StringIO(response.text), delimiter=",", ndmin=2)
        else:
            answer = np.load(io.BytesIO(response.content))
        np.testing.assert_allclose(answer, expected(rows), rtol=1e-5, atol=1e-6)
    assert max(p.rows for p in model_factory.batches(server.model_dir("mixed"))) > 3  # several requests


def test_a_malformed_request_answers_its_own_4xx_and_its_neighbours_200(server: RunningServer) -> None:
    load_batching(server, "neighbours", batch_size=BATCH_SIZE, code=False)  # the defaults, batched
    assert wait_until(lambda: all_workers_ready(server, "neighbours", BATCH_SIZE), 30)
    good = [[0.5, 1.0, 2.0, 3.0]]
    bodies = [json.dumps(good)] * 6 + ["[[1, 2", json.dumps([[1.0, 2.0, 3.0, 4.0, 5.0]])]

    responses = at_once(bodies, lambda body: server.invoke("neighbours", body))

    statuses = [response.status_code for response in responses]
    assert statuses == [200] * 6 + [400, 400], [r.text for r in responses]
    assert "malformed JSON" in responses[6].json()["message"]
    assert "rejected an input of shape (1, 5)" in responses[7].json()["message"]
    for response in responses[:6]:
        np.testing.assert_allclose(np.array(response.json()), expected(good), rtol=1e-5)


def test_predict_fn_answering_the_wrong_number_of_rows_fails_its_batch_with_the_cause(server: RunningServer) -> None:
    model_dir = model_factory.batching_model(server.model_dir("short"), batch_size=BATCH_SIZE)
    (model_dir / "drop_a_row").touch()  # predict_fn drops the last row of any pass of more than one row
    assert server.load("short").status_code == 200
    assert wait_until(lambda: all_workers_ready(server, "short", BATCH_SIZE), 30)

    responses = at_once([[[1.0, 2.0, 3.0, 4.0]]] * BATCH_SIZE, lambda rows: server.invoke("short", json.dumps(rows)))

    failed = [response for response in responses if response.status_code != 200]
    assert failed, "no batch formed"
    for response in failed:
        assert response.status_code == 500
        error = response.json()
        assert error["type"] == "SplitError"
        assert "predict_fn returned" in error["message"] and "one row per input row" in error["message"]
    assert "Traceback" not in " ".join(response.text for response in responses)


def test_out_of_memory_splits_the_batch_and_retries_before_any_request_answers_507(server: RunningServer) -> None:
    model_dir = model_factory.batching_model(server.model_dir("tight"), batch_size=BATCH_SIZE)
    (model_dir / "out_of_memory_above").write_text("2")  # more than 2 rows in one pass: CUDA's out-of-memory error
    assert server.load("tight").status_code == 200
    assert wait_until(lambda: all_workers_ready(server, "tight", BATCH_SIZE), 30)
    rows = [[[float(index), 0.5, -0.5, 1.0]] for index in range(BATCH_SIZE)]

    responses = at_once(rows, lambda request: server.invoke("tight", json.dumps(request)))

    assert [response.status_code for response in responses] == [200] * BATCH_SIZE, [r.text for r in responses]
    for request, response in zip(rows, responses, strict=True):
        np.testing.assert_allclose(np.array(response.json()), expected(request), rtol=1e-5)
    assert max(p.rows for p in model_factory.batches(model_dir)) > 2  # a batch did fail, and was split
    # One request too large on its own still answers 507, so SageMaker can make room.
    too_large = server.invoke("tight", json.dumps([[1.0, 2.0, 3.0, 4.0]] * 3))
    assert too_large.status_code == 507
    assert too_large.json()["type"] == "InsufficientMemory"


def test_a_lone_client_is_not_delayed_by_max_batch_delay(server: RunningServer) -> None:
    load_batching(server, "lone", batch_size=BATCH_SIZE, max_batch_delay_ms=3000)
    assert wait_until(lambda: all_workers_ready(server, "lone", BATCH_SIZE), 30)
    body = json.dumps([[1.0, 2.0, 3.0, 4.0]])
    assert server.invoke("lone", body).status_code == 200

    seconds = []
    for _ in range(5):
        started = time.monotonic()
        assert server.invoke("lone", body).status_code == 200
        seconds.append(time.monotonic() - started)

    # Each request is dispatched at once, whichever of the 8 connections carries it: far below the 3 s delay.
    assert max(seconds) < 1.5, seconds


def test_load_body_batch_size_reaches_the_executor(server: RunningServer) -> None:
    """MMS batches for itself when LOAD carries batch_size, and tells each worker; those batches go through the
    same collation, and no extra connections are asked for."""
    model_dir = model_factory.batching_model(server.model_dir("by_load"), batch_size=None)
    response = server.load("by_load", batch_size=4, max_batch_delay=50, initial_workers=2)
    assert response.status_code == 200, response.text
    rows = [[[float(index), 1.0, 1.0, 1.0]] for index in range(8)]

    responses = at_once(rows, lambda request: server.invoke("by_load", json.dumps(request)))

    for request, response in zip(rows, responses, strict=True):
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(np.array(response.json()), expected(request), rtol=1e-5)
    passes = model_factory.batches(model_dir)
    assert {p.batch_size for p in passes} == {4}
    assert max(p.rows for p in passes) > 1
    assert len(server.describe("by_load").json()["workers"]) == 2


@pytest.mark.parametrize(
    ("name", "properties", "cause"),
    [
        ("word", "batch_size=eight\n", "batch_size='eight' is not an integer"),
        ("zero", "batch_size=0\n", "batch_size='0' must be at least 1"),
        ("negative", "max_batch_delay=-5\n", "max_batch_delay='-5' must be at least 0"),
        ("no_value", "batch_size\n", "line 1: 'batch_size' is not key=value"),
    ],
)
def test_malformed_serving_properties_fails_the_load_with_the_cause_in_the_log(
    server: RunningServer, name: str, properties: str, cause: str
) -> None:
    model_dir = model_factory.batching_model(server.model_dir(name))
    (model_dir / "serving.properties").write_text(properties)

    response = server.load(name)

    assert response.status_code == 500
    assert wait_until(lambda: f"serving.properties is malformed: {cause}" in server.log_text(), 5)
    # Nothing left registered, so the name can be loaded again (MMS unregisters it a moment after it answered).
    assert wait_until(lambda: server.describe(name).status_code == 404, 10)


def test_executor_killed_mid_batch_answers_in_flight_requests_fast_then_serves(server: RunningServer) -> None:
    model_dir = model_factory.batching_model(server.model_dir("killed"), batch_size=BATCH_SIZE)
    assert server.load("killed").status_code == 200
    assert wait_until(lambda: all_workers_ready(server, "killed", BATCH_SIZE), 30)
    [executor] = server.worker_pids("killed")
    (model_dir / "sleep_seconds").write_text("2")  # every request is still in flight when the executor dies
    results: list[tuple[int, float]] = []

    def call(_: object) -> requests.Response:
        started = time.monotonic()
        response = server.invoke("killed", json.dumps([[1.0, 2.0, 3.0, 4.0]]))
        results.append((response.status_code, time.monotonic() - started))
        return response

    with ThreadPoolExecutor(BATCH_SIZE) as pool:
        futures = [pool.submit(call, None) for _ in range(BATCH_SIZE)]
        time.sleep(0.5)
        os.kill(executor, signal.SIGKILL)
        for future in futures:
            future.result(timeout=30)

    assert all(status == 200 or 500 <= status < 600 for status, _ in results)
    assert any(status >= 500 for status, _ in results)
    assert max(seconds for _, seconds in results) < 10  # answered at once, not at the 60 s response timeout
    (model_dir / "sleep_seconds").write_text("0")
    assert wait_until(lambda: server.invoke("killed", json.dumps([[1.0, 2.0, 3.0, 4.0]])).status_code == 200, 30)
    assert executor not in server.worker_pids("killed")
    assert "killed by SIGKILL" in server.log_text()
    # The new executor was forked from the preloaded server: model_fn (the default here) did not run again.
    assert server.log_text().count("model=killed loaded seconds=") == 1


def test_unload_leaves_no_process_of_a_batching_model(server: RunningServer) -> None:
    load_batching(server, "unloaded", batch_size=BATCH_SIZE)
    assert wait_until(lambda: all_workers_ready(server, "unloaded", BATCH_SIZE), 30)
    processes = server.backend_processes("unloaded")
    assert [is_stub(process) for process in processes] == [True]  # its one process: the device host serves it

    assert server.unload("unloaded").status_code == 200

    assert wait_until(lambda: not alive(processes), 10)
