"""Load and soak (marked slow, still part of `make test`): bounded, loopback only, figures printed for the record."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import model_factory
import psutil
import pytest
import requests
from serving import RunningServer, alive, pss_mib, start_server, wait_until

pytestmark = pytest.mark.slow

CLIENTS = 64
REQUESTS_PER_CLIENT = 20
CYCLES = 30
ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(tmp_path_factory.mktemp("soak")) as running:
        yield running


def tree_pss_mib(server: RunningServer) -> float:
    return pss_mib([psutil.Process(server.process.pid), *server.descendants()])


def test_64_clients_across_3_models_without_a_failure(server: RunningServer) -> None:
    names = ["m0", "m1", "m2"]
    for name in names:
        model_factory.torchscript_model(server.model_dir(name))
        assert server.load(name).status_code == 200

    def client(index: int) -> list[tuple[int, float]]:
        session = requests.Session()
        results = []
        for request in range(REQUESTS_PER_CLIENT):
            name = names[(index + request) % len(names)]
            started = time.perf_counter()
            response = session.post(
                f"{server.url}/models/{name}/invoke",
                data=ROWS,
                headers={"Content-Type": "application/json"},
                timeout=60,
            )
            results.append((response.status_code, time.perf_counter() - started))
        return results

    started = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = [r for batch in pool.map(client, range(CLIENTS)) for r in batch]
    elapsed = time.perf_counter() - started
    latencies = sorted(seconds * 1000 for _, seconds in results)
    failures = [status for status, _ in results if status != 200]
    print(
        f"\n{len(results)} requests from {CLIENTS} clients over {len(names)} models in {elapsed:.1f} s: "
        f"{len(failures)} failed, p50 {statistics.median(latencies):.1f} ms, "
        f"p99 {latencies[int(len(latencies) * 0.99)]:.1f} ms, {len(results) / elapsed:.0f} req/s"
    )
    assert failures == []
    for name in names:
        assert server.unload(name).status_code == 200


def test_load_unload_cycles_leave_no_process_and_give_memory_back(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("cycled"))
    baseline = None
    figures = []
    for cycle in range(1, CYCLES + 1):
        assert server.load("cycled").status_code == 200
        assert server.invoke("cycled", ROWS).status_code == 200
        processes = server.backend_processes("cycled")
        assert server.unload("cycled").status_code == 200
        assert wait_until(lambda gone=processes: not alive(gone), 10)
        memory = tree_pss_mib(server)
        figures.append(memory)
        if cycle == 1:
            baseline = memory
    assert baseline is not None
    print(
        f"\nserver PSS after cycle 1: {baseline:.0f} MiB; after cycle {CYCLES}: {figures[-1]:.0f} MiB; "
        f"max {max(figures):.0f} MiB"
    )
    assert figures[-1] <= baseline * 1.10
    assert server.backend_processes("cycled") == []
