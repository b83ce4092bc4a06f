"""One executor per GPU with dynamic batching, on real CUDA devices (skipped where nvidia-smi lists none).

What only a GPU can show: eight connections per card hold one copy of the weights (``torch.cuda.memory_allocated``
inside the executor, and one process per card in nvidia-smi), forward passes gather several requests, and every
client still gets exactly its own rows back.
"""

from __future__ import annotations

import json
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import model_factory
import numpy as np
import torch
from serving import start_server, wait_until

from mme_runtime.base.nvidia import gpu_count

CONNECTIONS_PER_GPU = 8
WIDTH = 2048  # a 2048x2048 float32 layer: 16 MiB of weights, easy to tell from eight copies of it
# torch's allocator holds cuBLAS's workspace too (32 MiB on an H100 with torch 2.11), one per thread that ran a
# product: the loading thread's and a pass thread's.
CUBLAS_WORKSPACES = 64 << 20


def compute_apps() -> dict[int, int]:
    """pid -> MiB of GPU memory, for every process holding a CUDA context."""
    output = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    apps = {}
    for line in output.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit():
            apps[int(pid)] = int(used.strip() or 0)
    return apps


def wide_torchscript(model_dir: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 8)).eval()
    model_factory.batching_model(model_dir, batch_size=CONNECTIONS_PER_GPU)
    torch.jit.script(model).save(str(model_dir / "model.pt"))  # in place of the tiny net
    return model


def test_eight_connections_per_gpu_share_one_copy_of_the_weights_and_forward_passes(tmp_path: Path) -> None:
    gpus = gpu_count()
    env = {"MME_TEST_PREDICT_SLEEP": "0.02"}
    with start_server(tmp_path, env) as server:
        model_dir = server.model_dir("shared")
        model = wide_torchscript(model_dir)
        assert server.load("shared").status_code == 200
        assert wait_until(lambda: len(server.describe("shared").json()["workers"]) == CONNECTIONS_PER_GPU * gpus, 60)
        generator = random.Random(0)
        bodies = [
            [[generator.uniform(-1, 1) for _ in range(WIDTH)] for _ in range(generator.randint(1, 3))]
            for _ in range(32 * gpus)
        ]

        with ThreadPoolExecutor(CONNECTIONS_PER_GPU * gpus * 2) as pool:
            responses = list(pool.map(lambda rows: server.invoke("shared", json.dumps(rows)), bodies))

        with torch.inference_mode():
            for rows, response in zip(bodies, responses, strict=True):
                assert response.status_code == 200, response.text
                expected = model(torch.tensor(rows, dtype=torch.float32)).numpy()
                np.testing.assert_allclose(np.array(response.json()), expected, rtol=1e-3, atol=1e-4)
        executors = server.worker_pids("shared")
        apps = compute_apps()
        backend = server.backend_server("shared")
        print(f"executors {sorted(executors)}; nvidia-smi compute apps (pid: MiB) {apps}")

    passes = model_factory.batches(model_dir)
    print(f"forward passes: {len(passes)} for {len(bodies)} requests; rows per pass {[p.rows for p in passes]}")
    assert len(executors) == gpus  # one process per card, however many connections
    assert executors <= apps.keys() and backend is not None and backend.pid not in apps
    weights = sum(parameter.numel() * 4 for parameter in model.parameters())
    for executor in executors:
        allocated = max(p.cuda_bytes for p in passes if p.pid == executor)
        mib, weights_mib = allocated / 2**20, weights / 2**20
        print(f"executor {executor}: torch.cuda.memory_allocated {mib:.1f} MiB, weights {weights_mib:.1f} MiB")
        assert allocated < 2 * weights + CUBLAS_WORKSPACES  # one copy (plus activations), not eight
    assert max(p.rows for p in passes) > 3  # requests shared forward passes
    assert sum(p.rows for p in passes) == sum(len(rows) for rows in bodies)
