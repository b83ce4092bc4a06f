"""GPU-safe preload on real CUDA devices: run where nvidia-smi lists a GPU (skipped elsewhere by conftest).

Checks what only a GPU can show: no worker dies after fork, each worker's weights sit on its assigned card,
and the preload server itself never holds a CUDA context.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import model_factory
import pytest
from serving import RunningServer, start_server

from mme_runtime.nvidia import gpu_count

ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])


def gpu_processes() -> set[int]:
    """PIDs holding a CUDA context, as the driver reports them."""
    output = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout
    return {int(line) for line in output.split() if line.strip().isdigit()}


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}-workers")
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunningServer]:
    env = {"SAGEMAKER_MODEL_SERVER_WORKERS": str(request.param)}
    with start_server(tmp_path, env) as running:
        running.workers = request.param  # type: ignore[attr-defined]
        yield running


def serve_concurrently(server: RunningServer, name: str, count: int) -> list[dict[str, object]]:
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: server.invoke(name, ROWS), range(count)))
    assert [r.status_code for r in responses] == [200] * count, [r.text for r in responses if r.status_code != 200]
    return [dict(r.json()) for r in responses]


def test_every_worker_serves_on_its_gpu_and_none_dies(server: RunningServer) -> None:
    workers = server.workers  # type: ignore[attr-defined]
    model_dir = model_factory.counting_model(server.model_dir("gpu"))
    assert server.load("gpu").status_code == 200

    answers = serve_concurrently(server, "gpu", 20 * workers)

    assert len({a["pid"] for a in answers}) == workers
    assert len(model_factory.model_fn_calls(model_dir)) == 1
    for answer in answers:
        assert answer["device"] == "cuda:0" and answer["parameter_device"] == "cuda:0"
        assert answer["cuda_visible_devices"] == str(answer["gpu_id"])  # bound to the frontend's assignment
    gpus = gpu_count()
    assert {a["gpu_id"] for a in answers} == set(range(min(gpus, workers)))
    backend = server.backend_server("gpu")
    assert backend is not None
    holders = gpu_processes()
    assert backend.pid not in holders  # the preload server stays CUDA-free
    assert {int(str(a["pid"])) for a in answers} <= holders
    log = server.log_text()
    assert "Cannot re-initialize CUDA" not in log and "killed by" not in log


def test_aws_style_model_fn_that_moves_to_cuda_still_serves_on_every_gpu(server: RunningServer) -> None:
    workers = server.workers  # type: ignore[attr-defined]
    model_factory.state_dict_model(server.model_dir("aws"))
    assert server.load("aws").status_code == 200
    with ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(lambda _: server.invoke("aws", json.dumps({"inputs": [[1, 2, 3, 4]]})), range(10 * workers))
        )
    assert [r.status_code for r in responses] == [200] * (10 * workers)
    assert "preload off for this model: model_fn initialised CUDA" in server.log_text()
    backend = server.backend_server("aws")
    assert backend is not None and len(backend.children()) == workers
