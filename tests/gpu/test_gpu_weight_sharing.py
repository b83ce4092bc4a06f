"""Shared weights on a real card (skipped where nvidia-smi lists none): one copy of a base on the card for ten LoRA
adapters, and for ten fine-tunes that differ only in their head; each answers as itself; a write in place to a shared
weight is undone and refused."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import lora_models
import numpy as np
import torch
from serving import start_server

MODELS = 10
SLACK = 64 << 20  # the card's own rounding and the allocator's blocks


def card_used_bytes() -> int:
    command = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"]
    return int(subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()[0]) << 20


def test_ten_adapters_hold_one_base_on_the_card(tmp_path: Path) -> None:
    with start_server(tmp_path, {"CUDA_VISIBLE_DEVICES": "0"}) as server:
        base = lora_models.base(server.models / "base", hidden=1024)  # about 60 MiB of weights
        base_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
        body = json.dumps({"inputs": "good movie", "parameters": {"top_k": None}})
        used = []
        for index in range(MODELS):
            adapter = lora_models.adapter(base, server.models / f"adapter-{index}", seed=index)
            (adapter / "serving.properties").write_text("base_model=../base\nbatch_size=8\n")
            assert server.load(f"adapter-{index}").status_code == 200, server.log_text()[-3000:]
            assert server.invoke(f"adapter-{index}", body).status_code == 200
            used.append(card_used_bytes())
        assert used[-1] - used[0] < min(SLACK, base_bytes // 2), used  # nine more adapters: no second base


def test_ten_fine_tunes_hold_one_backbone_and_a_write_to_it_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    backbone = torch.nn.Linear(4096, 4096).state_dict()  # 64 MiB
    script = textwrap.dedent(
        """\
        import torch

        def model_fn(model_dir):
            model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 2))
            model.load_state_dict(torch.load(f"{model_dir}/model.pth"))
            return model
        """
    )
    with start_server(tmp_path, {"CUDA_VISIBLE_DEVICES": "0"}) as server:
        used = []
        for index in range(MODELS):
            directory = server.models / f"tune-{index}"
            (directory / "code").mkdir(parents=True)
            torch.manual_seed(index + 1)
            head = torch.nn.Linear(4096, 2).state_dict()
            weights = {**{f"0.{k}": v for k, v in backbone.items()}, **{f"1.{k}": v for k, v in head.items()}}
            torch.save(weights, directory / "model.pth")
            writes = index == MODELS - 1
            predict = textwrap.dedent(
                """
                def predict_fn(data, model):
                    with torch.no_grad():
                        model[0].weight.mul_(2.0)
                        return model(data.to(model[0].weight.device))
                """
            )
            (directory / "code" / "inference.py").write_text(script + (predict if writes else ""))
            assert server.load(f"tune-{index}").status_code == 200, server.log_text()[-3000:]
            used.append(card_used_bytes())
        assert used[-1] - used[0] < SLACK, used  # one backbone on the card for all ten
        row = json.dumps([[0.01] * 4096])
        before = server.invoke("tune-0", row).json()
        refused = server.invoke(f"tune-{MODELS - 1}", row)
        assert refused.status_code == 500 and "shares with other models" in refused.text
        assert np.allclose(server.invoke("tune-0", row).json(), before)  # the write was undone
