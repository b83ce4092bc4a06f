"""How a worker binds its GPU and names it to user code, and the fork probe the preload server relies on."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import fake_nvidia_smi
import pytest
import torch

from mme_runtime.base import devices
from mme_runtime.base.config import Config
from mme_runtime.models.loading import LoadFailure, ModelSpec, check_memory
from mme_runtime.serving.contract import InferenceContext


@pytest.mark.parametrize(
    ("gpu_id", "visible", "card"),
    [
        (1, None, "1"),
        (1, "", "1"),
        (1, "3,5", "5"),
        (2, "3,5", "3"),  # the frontend counts every card nvidia-smi lists; ids wrap onto those allowed
        (0, " GPU-aa , GPU-bb ", "GPU-aa"),
    ],
)
def test_visible_gpu_maps_the_frontends_id_onto_the_allowed_cards(gpu_id: int, visible: str | None, card: str) -> None:
    assert devices.visible_gpu(gpu_id, visible) == card


def test_bind_gpu_leaves_only_the_assigned_card_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devices.CUDA_VISIBLE_DEVICES, "3,5")
    assert devices.bind_gpu(1, "3,5") == 0
    assert os.environ[devices.CUDA_VISIBLE_DEVICES] == "5"


def test_bind_gpu_without_an_assignment_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devices.CUDA_VISIBLE_DEVICES, "3,5")
    assert devices.bind_gpu(None, "3,5") is None
    assert os.environ[devices.CUDA_VISIBLE_DEVICES] == "3,5"


def test_context_names_the_assigned_gpu_and_system_properties_the_ordinal() -> None:
    properties: dict[str, object] = {"model_dir": "/m"}
    devices.record_gpu(properties, assigned=1, ordinal=0)
    context = InferenceContext(SimpleNamespace(system_properties=properties), torch.device("cpu"))
    assert (context.gpu_id, context.system_properties["gpu_id"]) == (1, 0)


def test_context_under_stock_mms_reads_gpu_id() -> None:
    context = InferenceContext(SimpleNamespace(system_properties={"gpu_id": 2}), torch.device("cpu"))
    assert context.gpu_id == 2


def test_worker_device_is_the_cpu_without_cuda() -> None:
    assert devices.worker_device(None) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert devices.worker_device(0) == torch.device("cpu")


def test_gpu_memory_is_checked_on_the_physical_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in fake_nvidia_smi.install(tmp_path / "bin", gpus=8).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(fake_nvidia_smi.FREE_VARIABLE, "1")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    with open(model_dir / "model.pt", "wb") as weights:
        weights.truncate(2 * 1024 * 1024)  # 2 MiB against 1 MiB free
    config = Config.from_env({"CUDA_VISIBLE_DEVICES": "3,5", "MME_MEMORY_HEADROOM_MB": "0"})

    with pytest.raises(LoadFailure) as refused:
        check_memory(ModelSpec("m", str(model_dir), "h", str(tmp_path)), config, gpu=1, host=False)

    assert refused.value.status == 507
    assert "on GPU 5" in refused.value.message
    assert fake_nvidia_smi.calls(tmp_path / "bin") == ["--id=5 --query-gpu=memory.free --format=csv,noheader,nounits"]
