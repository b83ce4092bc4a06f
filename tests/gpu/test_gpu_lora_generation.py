"""Generative LoRA adapters on a real card (skipped where nvidia-smi lists none): eight adapters of one base, of ranks
4 to 64, decode together in one continuous batch on the GPU, and each of 16 concurrent clients gets the greedy tokens
PEFT's generate gives its adapter alone on the same card."""

from __future__ import annotations

import random
from pathlib import Path

import hf_models
import lora_models
import torch

from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface.generation import GenerationLimits, GenerationRunner
from mme_runtime.huggingface.requests import TaskRequest
from mme_runtime.models import lora, lora_layers


def test_eight_adapters_decode_together_on_one_card_and_answer_as_peft_alone(tmp_path: Path) -> None:
    cuda = torch.device("cuda:0")
    base = lora_models.causal_base(tmp_path / "base", hidden=256, layers=4)
    names = [f"adapter-{index}" for index in range(8)]
    adapters = {
        name: lora_models.causal_adapter(base, tmp_path / name, seed=index, rank=(4, 16, 64, 8)[index % 4])
        for index, name in enumerate(names)
    }
    model = hf_loading.load(base, "text-generation", trust_remote_code=False).place(cuda)
    for name, directory in adapters.items():
        lora_layers.attach(model, model.model, name, lora.read_adapter(directory))
    runners = {name: GenerationRunner(model, cuda, GenerationLimits(max_rows=16), name) for name in names}
    rng = random.Random(9)
    calls = [
        (names[index % 8], hf_models.text_of_tokens(rng.randint(1, 30), index), rng.randint(4, 24))
        for index in range(32)
    ]
    rows_per_step: list[int] = []
    step = model.generation.scheduler.batch.step

    def counting_step() -> None:
        rows_per_step.append(len({row.model for row in model.generation.scheduler.batch.live}))
        step()

    model.generation.scheduler.batch.step = counting_step
    got: list[str | None] = [None] * len(calls)

    def client(first: int) -> None:
        for index in (first, first + 16):
            name, text, new_tokens = calls[index]
            request = TaskRequest([text], {"max_new_tokens": new_tokens, "do_sample": False}, single=True)
            got[index] = runners[name].run([request])[0][0]["generated_text"]

    hf_models.in_threads(client, range(16))
    for runner in runners.values():
        runner.close()
    wanted = [lora_models.peft_text(base, adapters[name], text, new, device=cuda) for name, text, new in calls]
    assert got == wanted
    assert max(rows_per_step) >= 4  # rows of several adapters shared steps on the card
