"""GPU-safe preload on real CUDA devices: run where nvidia-smi lists a GPU (skipped elsewhere by conftest).

Checks what only a GPU can show: no executor dies after fork, each executor's weights sit on its assigned card (one
executor per card, whatever the worker count), and the preload server itself never holds a CUDA context.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import model_factory
import pytest
import serving
from serving import RunningServer, start_server

from mme_runtime.base.nvidia import gpu_count

ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])


def gpu_processes() -> set[int]:
    """PIDs holding a CUDA context, as the driver reports them."""
    output = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout
    return {int(line) for line in output.split() if line.strip().isdigit()}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}-workers")
def workers(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def server(workers: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server per worker count; each test loads a model of its own name."""
    env = {"SAGEMAKER_MODEL_SERVER_WORKERS": str(workers)}
    with start_server(tmp_path_factory.mktemp(f"gpu-{workers}"), env) as running:
        yield running


def serve_concurrently(server: RunningServer, name: str, count: int) -> list[dict[str, object]]:
    return serving.invoke_many(server, name, ROWS, count)


def test_one_executor_per_gpu_serves_every_worker_and_none_dies(server: RunningServer, workers: int) -> None:
    model_dir = model_factory.counting_model(server.model_dir("gpu"))
    assert server.load("gpu").status_code == 200

    answers = serve_concurrently(server, "gpu", 20 * workers)

    assert len({a["pid"] for a in answers}) == min(gpu_count(), workers)
    assert len(model_factory.model_fn_calls(model_dir)) == 1
    for answer in answers:
        assert answer["device"] == "cuda:0" and answer["parameter_device"] == "cuda:0"
        assert answer["cuda_visible_devices"] == str(answer["gpu_id"])  # bound to the frontend's assignment
        assert answer["system_gpu_id"] == 0  # so cuda:{gpu_id} in existing scripts names that card
    gpus = gpu_count()
    assert {a["gpu_id"] for a in answers} == set(range(min(gpus, workers)))
    backend = server.backend_server("gpu")
    assert backend is not None
    holders = gpu_processes()
    assert backend.pid not in holders  # the preload server stays CUDA-free
    assert {int(str(a["pid"])) for a in answers} <= holders
    log = server.log_text()
    assert "Cannot re-initialize CUDA" not in log and "killed by" not in log


def test_aws_style_model_fn_that_moves_to_cuda_runs_in_the_device_host(server: RunningServer, workers: int) -> None:
    """The loader finds CUDA initialised after model_fn (a real ``.to("cuda")``): the model cannot travel from it,
    so the device host runs model_fn itself, on its card."""
    model_factory.state_dict_model(server.model_dir("aws"))
    assert server.load("aws").status_code == 200
    serving.invoke_many(server, "aws", json.dumps({"inputs": [[1, 2, 3, 4]]}), 10 * workers)
    assert "model=aws model_fn runs in the device host: model_fn initialised CUDA" in server.log_text()
    hosts = server.hosts_of("aws")
    assert len(hosts) == min(gpu_count(), workers) and hosts <= gpu_processes()


def test_toolkit_style_script_that_picks_cuda_gpu_id_serves_on_every_gpu(tmp_path: Path) -> None:
    """The AWS toolkit's own pattern, ``cuda:{gpu_id}`` in model_fn, in a host of its own on each card (it runs
    there with a GPU id): on a multi-GPU host, the frontend's id would name a card that a bound host cannot see."""
    workers = 2 * gpu_count()
    env = {"SAGEMAKER_MODEL_SERVER_WORKERS": str(workers), "MME_SHARE_DEVICE": "false"}
    with start_server(tmp_path, env) as server:
        model_factory.toolkit_style_model(server.model_dir("toolkit"))
        assert server.load("toolkit").status_code == 200

        answers = serve_concurrently(server, "toolkit", 10 * workers)

    assert len({a["pid"] for a in answers}) == gpu_count()
    assert {a["parameter_device"] for a in answers} == {"cuda:0"}
    assert {a["system_gpu_id"] for a in answers} == {0}
    assert {a["gpu_id"] for a in answers} == set(range(gpu_count()))


# What torch.cuda.is_available() runs without PYTORCH_NVML_BASED_CUDA_CHECK=1.
DEVICE_COUNT_QUERY = "    torch._C._cuda_getDeviceCount()\n"


def test_device_count_query_in_model_fn_poisons_only_the_loader(server: RunningServer, workers: int) -> None:
    """Asking the CUDA runtime for the device count poisons the forks of the process that asks, while
    ``torch.cuda.is_initialized()`` stays false: the loader that ran model_fn forks nothing and hands the weights
    over, and the device host (forked before, from the clean warm process) serves them on the card."""
    model_dir = model_factory.counting_model(server.model_dir("poison"))
    script = model_dir / "code" / "inference.py"
    signature = "def model_fn(model_dir, context):\n"
    script.write_text(script.read_text().replace(signature, signature + DEVICE_COUNT_QUERY))
    assert server.load("poison").status_code == 200

    answers = serve_concurrently(server, "poison", 10 * workers)

    assert len(model_factory.model_fn_calls(model_dir)) == 1  # in the loader alone
    assert {a["parameter_device"] for a in answers} == {"cuda:0"}
    assert {int(str(a["pid"])) for a in answers} == server.hosts_of("poison")
    assert "Cannot re-initialize CUDA" not in server.log_text()
