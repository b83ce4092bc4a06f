"""GPU memory per model and card on ``/metrics``, on real CUDA devices (skipped where nvidia-smi lists none).

Each executor reports what PyTorch's allocator holds on its card; nvidia-smi's per-process list cannot be used for
this inside a container (it names host pids), so the value comes from the executor itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import model_factory
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families
from serving import start_server, wait_until

from mme_runtime.base.nvidia import gpu_count

WIDTH = 2048  # 16 MiB of float32 weights in the first layer


def gpu_memory(metrics_url: str, model: str) -> dict[str, float]:
    """``gpu -> bytes`` of ``mme_model_gpu_memory_bytes`` for ``model``."""
    text = requests.get(metrics_url, timeout=10).text
    return {
        sample.labels["gpu"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mme_model_gpu_memory_bytes" and sample.labels["model"] == model
    }


def test_each_card_reports_the_memory_of_its_copy_and_unload_clears_it(tmp_path: Path) -> None:
    gpus = gpu_count()
    with start_server(tmp_path, {"SAGEMAKER_MODEL_SERVER_WORKERS": str(gpus)}) as server:
        model_dir = server.model_dir("wide")
        model_factory.torchscript_model(model_dir)
        torch.manual_seed(0)
        wide = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 3)).eval()
        torch.jit.script(wide).save(str(model_dir / "model.pt"))
        assert server.load("wide").status_code == 200
        row = json.dumps([[0.1] * WIDTH])
        assert all(server.invoke("wide", row).status_code == 200 for _ in range(4 * gpus))

        weights = sum(p.numel() * p.element_size() for p in wide.parameters())
        assert wait_until(lambda: len(gpu_memory(server.metrics_url, "wide")) == gpus, 10)
        reported = gpu_memory(server.metrics_url, "wide")
        assert sorted(reported) == [str(gpu) for gpu in range(gpus)]
        assert all(weights <= used < 4 * weights + (64 << 20) for used in reported.values()), reported

        assert server.unload("wide").status_code == 200
        assert wait_until(lambda: gpu_memory(server.metrics_url, "wide") == {}, 20)
