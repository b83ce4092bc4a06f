"""GPU-safe preload of an isolated model (MME_SHARE_DEVICE=false: a device host of its own), proven on the CPU
through the same code path: one model_fn, in a CUDA-free loader; one host serving every worker connection of its
device (here the CPU). The shared hosts' side of the same promises is in test_device_host.py."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import model_factory
import pytest
import serving
import torch
from serving import RunningServer, alive, start_server, wait_until

WORKERS = 3
ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    env = {
        "SAGEMAKER_MODEL_SERVER_WORKERS": str(WORKERS),
        "MME_TEST_PREDICT_SLEEP": "0.05",
        "MME_SHARE_DEVICE": "false",
    }
    with start_server(tmp_path_factory.mktemp("preload"), env) as running:
        yield running


def invoke_many(server: RunningServer, name: str, count: int = 30) -> list[dict[str, object]]:
    return serving.invoke_many(server, name, ROWS, count, clients=WORKERS * 2)


def test_model_fn_runs_once_and_one_host_serves_every_worker(server: RunningServer) -> None:
    model_dir = model_factory.counting_model(server.model_dir("once"))
    assert server.load("once").status_code == 200

    answers = invoke_many(server, "once")

    calls = model_factory.model_fn_calls(model_dir)
    assert len(calls) == 1  # in the loader, which has ended
    pids = {int(str(a["pid"])) for a in answers}
    assert pids == server.worker_pids("once") and calls[0] not in pids
    assert len(pids) == 1  # 3 workers, 1 device: one host holds the one copy of the weights
    assert {a["device"] for a in answers} == {"cpu"}
    assert {a["gpu_id"] for a in answers} == {None}  # no GPU here: the same path runs with the CPU
    # The loader runs single-threaded (forked from the warm process); the host gets torch's default back.
    assert {a["threads"] for a in answers} == {torch.get_num_threads()}
    description = server.describe("once").json()
    assert len(description["workers"]) == WORKERS  # every frontend worker connected, to that one host


def test_killed_host_is_replaced_without_a_second_model_fn(server: RunningServer) -> None:
    model_dir = model_factory.counting_model(server.model_dir("crash"))
    assert server.load("crash").status_code == 200
    [victim] = server.worker_pids("crash")

    os.kill(victim, signal.SIGKILL)

    assert wait_until(lambda: len(server.worker_pids("crash") - {victim}) == 1, 30)
    assert wait_until(lambda: server.invoke("crash", ROWS).status_code == 200, 30)
    answers = invoke_many(server, "crash")
    assert victim not in {a["pid"] for a in answers}
    assert len(model_factory.model_fn_calls(model_dir)) == 1
    assert "killed by SIGKILL" in server.log_text()


def test_a_crash_of_an_isolated_model_touches_no_other_model(server: RunningServer) -> None:
    for name in ("bystander", "victim"):
        model_factory.counting_model(server.model_dir(name))
        assert server.load(name).status_code == 200
    [bystander] = server.worker_pids("bystander")
    [victim] = server.worker_pids("victim")
    assert bystander != victim
    with ThreadPoolExecutor(4) as pool:  # the bystander is busy while its neighbour dies
        busy = [pool.submit(server.invoke, "bystander", ROWS) for _ in range(40)]
        os.kill(victim, signal.SIGKILL)
        assert [future.result().status_code for future in busy] == [200] * 40
    assert server.worker_pids("bystander") == {bystander}
    assert wait_until(lambda: server.invoke("victim", ROWS).status_code == 200, 30)
    for name in ("bystander", "victim"):
        assert server.unload(name).status_code == 200


def test_unload_leaves_no_process_of_the_model(server: RunningServer) -> None:
    model_factory.counting_model(server.model_dir("gone"))
    assert server.load("gone").status_code == 200
    processes = server.backend_processes("gone")
    assert len(processes) == 2  # its stub and its host

    assert server.unload("gone").status_code == 200

    assert wait_until(lambda: not alive(processes), 10)
    assert server.backend_processes("gone") == []


def test_model_fn_that_initialises_cuda_runs_in_its_host(server: RunningServer) -> None:
    """On this CPU-only machine, CUDA initialisation is simulated by a test double of the CUDA probe that the
    model's own model_fn installs (see model_factory.COUNTING_SCRIPT); on a GPU it is a real ``.to("cuda")``."""
    model_dir = model_factory.counting_model(server.model_dir("cuda_in_loader"), fake_cuda_init=True)
    assert server.load("cuda_in_loader").status_code == 200

    answers = invoke_many(server, "cuda_in_loader")

    [host] = {a["pid"] for a in answers}
    assert model_factory.model_fn_calls(model_dir)[1:] == [host]  # the loader's attempt, then its host's
    assert "model=cuda_in_loader model_fn runs in the device host: model_fn initialised CUDA" in server.log_text()


def wide_rows() -> str:
    return json.dumps([[0.001 * i] * model_factory.WIDE_FEATURES for i in range(64)])


def test_model_fn_running_parallel_cpu_ops_leaves_a_host_that_can_too(server: RunningServer) -> None:
    """GNU OpenMP's thread pool does not survive fork: a process forked after a parallel region (``load_state_dict``
    copying a large tensor, a warm-up pass) would wait forever at its own first one. model_fn runs in a loader that
    forks nothing; hosts are forked from the single-threaded warm process."""
    model_dir = model_factory.wide_model(server.model_dir("wide"))
    assert server.load("wide").status_code == 200

    answers = serving.invoke_many(server, "wide", wide_rows(), 4 * WORKERS, clients=WORKERS * 2)

    assert all(len(rows) == 64 for rows in answers)
    assert len(model_factory.model_fn_calls(model_dir)) == 1


def test_the_threads_model_fn_chose_are_its_own_host_s(server: RunningServer) -> None:
    model_dir = model_factory.wide_model(server.model_dir("threads"), threads=2)
    assert server.load("threads").status_code == 200

    serving.invoke_many(server, "threads", wide_rows(), 4 * WORKERS, clients=WORKERS * 2)

    assert len(model_factory.model_fn_calls(model_dir)) == 1
    assert "model=threads threads=2, as its model_fn chose" in server.log_text()  # in its own host
