"""The GPU assignment path on a CPU-only machine, through a test double of nvidia-smi (tests/fake_nvidia_smi.py).

The MMS frontend counts GPUs with nvidia-smi, so with the double listing two it hands each worker a GPU id; the warm
process hands each worker's connection to the device host for that GPU (here, with ``MME_SHARE_DEVICE=false``, the
model's own host per card), which binds ``CUDA_VISIBLE_DEVICES`` to it and tells user code, exactly as on a GPU host.
torch finds no CUDA here, so the models still run on the CPU: what a real card adds is in tests/gpu/.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import fake_nvidia_smi
import model_factory
import pytest
import serving
from serving import RunningServer, start_server

GPUS = 2
WORKERS = 4
ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])


@pytest.fixture(scope="module")
def fake_gpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fake-nvidia-smi")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, fake_gpus: Path) -> Iterator[RunningServer]:
    env = {
        **fake_nvidia_smi.install(fake_gpus, GPUS),
        "SAGEMAKER_MODEL_SERVER_WORKERS": str(WORKERS),
        "MME_TEST_PREDICT_SLEEP": "0.05",
        "MME_SHARE_DEVICE": "false",  # a host per model and card; the shared hosts' side is in test_device_host.py
    }
    with start_server(tmp_path_factory.mktemp("gpu-assignment"), env) as running:
        yield running


def invoke_many(server: RunningServer, name: str, count: int = 40) -> list[dict[str, object]]:
    return serving.invoke_many(server, name, ROWS, count, clients=WORKERS * 2)


def test_one_host_per_gpu_serves_the_workers_the_frontend_assigned_it(server: RunningServer, fake_gpus: Path) -> None:
    model_dir = model_factory.counting_model(server.model_dir("assigned"))
    assert server.load("assigned").status_code == 200

    answers = invoke_many(server, "assigned")

    pids = {a["pid"] for a in answers}
    assert len(pids) == GPUS  # 4 workers, one process (and copy of the weights) per card
    assert pids == server.worker_pids("assigned")
    assert len(model_factory.model_fn_calls(model_dir)) == 1  # still preloaded once
    assert {a["gpu_id"] for a in answers} == set(range(GPUS))  # round-robin over both cards
    for answer in answers:
        assert answer["cuda_visible_devices"] == str(answer["gpu_id"])
        assert answer["system_gpu_id"] == 0  # the one card this worker sees is its cuda:0
        assert answer["device"] == "cpu"  # torch finds no CUDA on this machine
    calls = fake_nvidia_smi.calls(fake_gpus)
    assert "--query-gpu=index --format=csv" in calls  # how the frontend counted the GPUs
    memory_checks = {call.split()[0] for call in calls if "--query-gpu=memory.free" in call}
    assert memory_checks == {f"--id={gpu}" for gpu in range(GPUS)}  # each host checked its own card


def test_toolkit_style_script_gets_a_gpu_id_valid_inside_its_worker(server: RunningServer) -> None:
    """Scripts written for the AWS containers build ``cuda:{gpu_id}`` themselves; in a worker that sees one GPU,
    only ``cuda:0`` exists, so that is what ``system_properties["gpu_id"]`` must say, whichever card it is."""
    model_factory.toolkit_style_model(server.model_dir("toolkit"))
    assert server.load("toolkit").status_code == 200

    answers = invoke_many(server, "toolkit")

    assert {a["gpu_id"] for a in answers} == set(range(GPUS))
    assert {a["system_gpu_id"] for a in answers} == {0}
