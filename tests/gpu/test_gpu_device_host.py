"""The device host on a real card (skipped where nvidia-smi lists none): ten models, one CUDA context.

nvidia-smi lists the processes holding a context on each card: with ten models loaded there must be one of ours per
card, and each extra model must cost the card its weights (within 64 MiB), not a context of its own.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import model_factory
import torch
from serving import start_server

WIDTH = 2048  # 16 MiB of float32 weights per model
MODELS = 10
SLACK = 64 << 20


def query(what: str) -> list[str]:
    """``nvidia-smi --query-<what>`` on card 0, one value a line."""
    command = ["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits", "--id=0"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()


def card_used_bytes() -> int:
    return int(query("gpu=memory.used")[0]) << 20


def compute_processes() -> list[int]:
    return [int(pid) for pid in query("compute-apps=pid")]


def wide_model(model_dir: Path, seed: int) -> int:
    """A TorchScript MLP of about 16 MiB; returns its weight bytes."""
    model_factory.torchscript_model(model_dir)
    torch.manual_seed(seed)
    wide = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 3)).eval()
    torch.jit.script(wide).save(str(model_dir / "model.pt"))
    return sum(p.numel() * p.element_size() for p in wide.parameters())


def test_ten_models_share_one_context_and_each_costs_its_weights(tmp_path: Path) -> None:
    with start_server(tmp_path, {"CUDA_VISIBLE_DEVICES": "0"}) as server:
        row = json.dumps([[0.1] * WIDTH])
        used = []
        for index in range(MODELS):
            weights = wide_model(server.model_dir(f"wide{index}"), index)
            assert server.load(f"wide{index}").status_code == 200
            assert server.invoke(f"wide{index}", row).status_code == 200
            used.append(card_used_bytes())
        ours = [pid for pid in compute_processes() if pid in {p.pid for p in server.descendants()}]
        assert len(ours) == 1, compute_processes()  # one context on the card, however many models
        for before, after in zip(used, used[1:], strict=False):
            assert abs((after - before) - weights) <= SLACK, used
        for index in range(MODELS):
            assert server.unload(f"wide{index}").status_code == 200
