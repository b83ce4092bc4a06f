"""GPU-safe preload of an isolated model (MME_SHARE_DEVICE=false: its own server), proven on the CPU through the
same code path: one model_fn, one executor serving every worker connection of its device (here the CPU). The device
host's side of the same promises is in test_device_host.py."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

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


def test_model_fn_runs_once_and_one_executor_serves_every_worker(server: RunningServer) -> None:
    model_dir = model_factory.counting_model(server.model_dir("once"))
    assert server.load("once").status_code == 200

    answers = invoke_many(server, "once")

    calls = model_factory.model_fn_calls(model_dir)
    assert len(calls) == 1
    backend = server.backend_server("once")
    assert backend is not None and calls == [backend.pid]  # loaded in the server, before fork
    pids = {int(str(a["pid"])) for a in answers}
    assert pids == server.worker_pids("once")
    assert len(pids) == 1  # 3 workers, 1 device: one executor holds the one copy of the weights
    assert {a["device"] for a in answers} == {"cpu"}
    assert {a["gpu_id"] for a in answers} == {None}  # no GPU here: the same path runs with the CPU
    # The server loads single-threaded (fork_safety); its executor gets torch's default back.
    assert {a["threads"] for a in answers} == {torch.get_num_threads()}
    description = server.describe("once").json()
    assert len(description["workers"]) == WORKERS  # every frontend worker connected, to that one executor


def test_killed_executor_is_replaced_without_a_second_model_fn(server: RunningServer) -> None:
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


def test_unload_leaves_no_process_of_the_model(server: RunningServer) -> None:
    model_factory.counting_model(server.model_dir("gone"))
    assert server.load("gone").status_code == 200
    processes = server.backend_processes("gone")
    assert len(processes) == 2  # the server and its one executor

    assert server.unload("gone").status_code == 200

    assert wait_until(lambda: not alive(processes), 10)
    assert server.backend_processes("gone") == []


def test_model_fn_that_initialises_cuda_falls_back_to_loading_in_each_executor(server: RunningServer) -> None:
    """On this CPU-only machine, CUDA initialisation is simulated by a test double of the CUDA probe that the
    model's own model_fn installs (see model_factory.COUNTING_SCRIPT); on a GPU it is a real ``.to("cuda")``."""
    model_dir = model_factory.counting_model(server.model_dir("cuda_in_parent"), fake_cuda_init=True)
    assert server.load("cuda_in_parent").status_code == 200

    answers = invoke_many(server, "cuda_in_parent")

    assert model_factory.loaded_in_each_executor(model_dir, answers, 1)
    assert "preload off for this model: model_fn initialised CUDA" in server.log_text()


def test_poisoned_forks_keep_preload_where_no_gpu_is_assigned(server: RunningServer) -> None:
    """A CUDA build of torch on a CPU host poisons forks at any ``is_available()`` (NVML is missing too); workers
    that are handed no GPU never touch CUDA, so the model stays preloaded. The bad-fork flag is a test double."""
    model_dir = model_factory.counting_model(server.model_dir("cpu_host"), fake_poisoned_fork=True)
    assert server.load("cpu_host").status_code == 200

    answers = invoke_many(server, "cpu_host")

    assert len({a["pid"] for a in answers}) == 1
    assert len(model_factory.model_fn_calls(model_dir)) == 1
    assert "refused CUDA" not in server.log_text()


def wide_rows() -> str:
    return json.dumps([[0.001 * i] * model_factory.WIDE_FEATURES for i in range(64)])


def test_model_fn_running_parallel_cpu_ops_leaves_workers_that_can_too(server: RunningServer) -> None:
    """GNU OpenMP's thread pool does not survive fork: a worker forked after the server ran a parallel region
    (``load_state_dict`` copying a large tensor, a warm-up pass) would wait forever at its own first one. The
    server runs model_fn single-threaded, so the model stays preloaded."""
    model_dir = model_factory.wide_model(server.model_dir("wide"))
    assert server.load("wide").status_code == 200

    answers = serving.invoke_many(server, "wide", wide_rows(), 4 * WORKERS, clients=WORKERS * 2)

    assert all(len(rows) == 64 for rows in answers)
    assert len(model_factory.model_fn_calls(model_dir)) == 1


def test_model_fn_that_sets_its_own_threads_falls_back_instead_of_hanging_workers(server: RunningServer) -> None:
    model_dir = model_factory.wide_model(server.model_dir("threads"), threads=2)
    assert server.load("threads").status_code == 200

    serving.invoke_many(server, "threads", wide_rows(), 4 * WORKERS, clients=WORKERS * 2)

    assert len(model_factory.model_fn_calls(model_dir)) == 1 + 1  # the server's, then its executor's
    assert "preload off for this model: a forked child hung at its first parallel CPU op" in server.log_text()


def test_spawn_start_method_loads_in_a_fresh_executor(tmp_path_factory: pytest.TempPathFactory) -> None:
    env = {"SAGEMAKER_MODEL_SERVER_WORKERS": "2", "MME_START_METHOD": "spawn"}
    with start_server(tmp_path_factory.mktemp("spawn"), env) as server:
        model_dir = model_factory.counting_model(server.model_dir("spawned"))
        assert server.load("spawned").status_code == 200
        answers = serving.invoke_many(server, "spawned", ROWS, 20, clients=4)
        pids = {a["pid"] for a in answers}
        assert len(pids) == 1
        assert sorted(model_factory.model_fn_calls(model_dir)) == sorted(pids)  # the spawned executor loaded once
