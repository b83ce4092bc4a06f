"""Running out of memory on a real card (skipped where nvidia-smi lists none): a LOAD and a request that ask the card
for more than it has answer 507 with the card's numbers, and the model keeps serving."""

from __future__ import annotations

import re
from pathlib import Path

import model_factory
from serving import start_server, wait_until

GPU_NUMBERS = r"\(GPU memory: \d+ MiB free of \d+ MiB; this process: \d+ MiB allocated, \d+ MiB reserved\)"

SCRIPT = """
import torch


def model_fn(model_dir, context):
    return torch.nn.Linear(4, 3).to(context.device)


def input_fn(body, content_type):
    return body.decode() if isinstance(body, (bytes, bytearray)) else str(body)


def predict_fn(text, model):
    if text == "huge":  # far more than any card holds
        torch.empty(1 << 44, dtype=torch.uint8, device=next(model.parameters()).device)
    return model(torch.ones(1, 4, device=next(model.parameters()).device)).tolist()
"""

HUGE_MODEL_FN = """
import torch


def model_fn(model_dir):
    return torch.empty(1 << 44, dtype=torch.uint8, device="cuda")


def transform_fn(model, body, content_type, accept):
    return "{}"
"""


def test_out_of_gpu_memory_answers_507_with_the_card_s_numbers(tmp_path: Path) -> None:
    with start_server(tmp_path, {"CUDA_VISIBLE_DEVICES": "0"}) as server:
        model_factory.write_code(server.model_dir("greedy"), SCRIPT)
        assert server.load("greedy").status_code == 200
        response = server.invoke("greedy", "huge", "text/plain")
        assert response.status_code == 507
        message = response.json()["message"]
        assert re.fullmatch(
            rf"out of GPU memory in predict_fn: CUDA out of memory\. Tried to allocate .+ {GPU_NUMBERS}", message
        )
        assert server.invoke("greedy", "fine", "text/plain").status_code == 200  # the model keeps serving

        model_factory.write_code(server.model_dir("too_big"), HUGE_MODEL_FN)
        assert server.load("too_big").status_code == 507
        pattern = rf"model=too_big gpu=\S+ load failed status=507: out of GPU memory in model_fn: .+ {GPU_NUMBERS}"
        assert wait_until(lambda: re.search(pattern, server.log_text()) is not None, 10)
        assert server.invoke("greedy", "fine", "text/plain").status_code == 200
