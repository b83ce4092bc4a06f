"""The KV cache of a generative model's decoding batch is bounded: a token's size comes from the model's config, rows
that do not fit wait for room (every answer still generate's own), the batch never holds more than the bound, a row
that waits too long is passed by no later one, and an input that could never fit answers 400 naming the numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hf_models
import lora_models
import pytest
import torch

from mme_runtime.base.config import Config
from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface import kv_cache
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface.defaults import generation_limits
from mme_runtime.huggingface.generation import GenerationLimits, GenerationRunner
from mme_runtime.huggingface.kv_cache import KvBudget
from mme_runtime.huggingface.requests import TaskRequest
from mme_runtime.models.serving_properties import read_settings

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lora_models.causal_base(tmp_path_factory.mktemp("kv") / "llama")


def runner(base: Path, budget_tokens: int | None) -> GenerationRunner:
    model = hf_loading.load(base, "text-generation", trust_remote_code=False).place(CPU)
    generator = GenerationRunner(model, CPU, GenerationLimits(max_rows=16), "llama")
    if budget_tokens is not None:
        generator._scheduler.budget = KvBudget(budget_tokens, 512, "a test's bound")
    return generator


def ask(generator: GenerationRunner, text: str, new_tokens: int) -> str:
    request = TaskRequest([text], {"max_new_tokens": new_tokens, "do_sample": False}, single=True)
    return str(generator.run([request])[0][0]["generated_text"])


def test_a_token_takes_every_layer_s_key_and_value(base: Path) -> None:
    model = hf_loading.load(base, "text-generation", trust_remote_code=False).place(CPU)
    # 2 layers x 2 key-value heads (grouped-query attention) x 16 dimensions x float32, keys and values
    assert kv_cache.token_bytes(model.model) == 2 * 2 * 2 * 16 * 4
    budget = kv_cache.budget_for(model.model, CPU, 3, "kv_cache_mb in serving.properties")
    assert budget == KvBudget(3 * 1024 * 1024 // 512, 512, "kv_cache_mb in serving.properties")
    assert kv_cache.budget_for(model.model, CPU, None, "").source.startswith("half the free memory of cpu")


def test_rows_that_do_not_fit_wait_for_room_and_get_generate_s_tokens(base: Path) -> None:
    """Room for two rows of 20 new tokens: eight clients at once are answered two by two, each exactly."""
    texts = [hf_models.text_of_tokens(8, seed) for seed in range(8)]
    one_row = KvBudget.footprint(1, 9 + 20)  # at most 9 prompt tokens
    generator = runner(base, 2 * one_row + one_row // 2)
    rows_held: list[int] = []
    step = generator._scheduler.batch.step

    def counting_step() -> None:
        batch = generator._scheduler.batch
        longest = max(len(row.prompt) + row.max_new_tokens for row in batch.live)
        rows_held.append(KvBudget.footprint(len(batch.rows), longest))
        step()

    generator._scheduler.batch.step = counting_step
    got: list[str | None] = [None] * len(texts)

    def client(index: int) -> None:
        got[index] = ask(generator, texts[index], 20)

    hf_models.in_threads(client, range(len(texts)))
    generator.close()
    assert got == [lora_models.peft_text(base, None, text, 20) for text in texts]
    assert max(rows_held) <= 2 * one_row + one_row // 2
    assert max(rows_held) > one_row  # two rows did share steps


def test_beam_groups_wait_for_room_as_a_whole_and_get_generate_s_beams(base: Path) -> None:
    """Room for five rows of 16 new tokens: groups of three beams and greedy rows from eight clients at once join only
    whole, the batch holds no more than the bound, and each answer is generate's with those beams."""
    texts = [hf_models.text_of_tokens(8, seed) for seed in range(8)]
    widths = [3, 1, 3, 1, 3, 3, 1, 3]
    one_row = KvBudget.footprint(1, 9 + 16)  # at most 9 prompt tokens
    generator = runner(base, 5 * one_row)
    held: list[int] = []
    partial: list[int] = []
    step = generator._scheduler.batch.step

    def counting_step() -> None:
        batch = generator._scheduler.batch
        held.append(KvBudget.footprint(len(batch.rows), max(len(r.prompt) + r.max_new_tokens for r in batch.live)))
        groups = {id(row.group): row.group for row in batch.live if row.group is not None}
        partial.extend(id(g) for g in groups.values() if any(row not in batch.live for row in g.rows))
        step()

    generator._scheduler.batch.step = counting_step
    got: list[str | None] = [None] * len(texts)

    def client(index: int) -> None:
        request = TaskRequest([texts[index]], {"max_new_tokens": 16, "do_sample": False, "num_beams": widths[index]})
        got[index] = str(generator.run([request])[0][0]["generated_text"])

    hf_models.in_threads(client, range(len(texts)))
    generator.close()
    assert got == [
        lora_models.peft_text(base, None, text, 16, num_beams=beams) for text, beams in zip(texts, widths, strict=True)
    ]
    assert max(held) <= 5 * one_row and not partial
    assert max(held) > 3 * one_row  # a group shared steps with other rows


def test_an_input_that_could_never_fit_answers_400_naming_the_numbers(base: Path) -> None:
    generator = runner(base, 200)
    with pytest.raises(InvalidInput) as refused:
        ask(generator, "a prompt of a few words", 150)
    message = str(refused.value)
    assert "of KV cache" in message and "max_new_tokens=150" in message
    assert "holds at most 200 tokens (0.1 MiB) (a test's bound)" in message
    assert ask(generator, "a prompt of a few words", 20)  # a smaller one is served
    beams = TaskRequest(["a prompt of a few words"], {"max_new_tokens": 20, "num_beams": 4}, single=True)
    with pytest.raises(InvalidInput, match="max_new_tokens=20, 4 beams"):
        generator.run([beams])  # four rows of it could never fit together
    generator.close()


def test_a_row_waiting_past_its_patience_is_passed_by_no_later_row(base: Path, monkeypatch: Any) -> None:
    from mme_runtime.huggingface import scheduler as scheduler_module
    from mme_runtime.huggingface.decoding import Row

    generator = runner(base, KvBudget.footprint(2, 90) + 5)  # a second row as long as the decoding one
    scheduler = generator._scheduler
    generator.close()
    scheduler.batch.rows, scheduler.batch.mask = [Row([1] * 10, 80)], torch.ones(1, 10)  # a long row decoding
    big, small = Row([1] * 10, 150, joined_at=0.0), Row([1] * 2, 2, joined_at=1e12)
    scheduler._waiting.extend([big, small])
    monkeypatch.setattr(scheduler_module, "PATIENCE_SECONDS", 1e12)
    assert scheduler._joining(16) == [small]  # the big one does not fit beside the long row; the small one passes
    scheduler._waiting.appendleft(big)
    monkeypatch.setattr(scheduler_module, "PATIENCE_SECONDS", 0.0)
    assert scheduler._joining(16) == []  # it has waited long enough: nothing passes it


def test_the_bound_is_the_model_s_setting_else_the_container_s(tmp_path: Path) -> None:
    (tmp_path / "serving.properties").write_text("kv_cache_mb=64\n")
    limits = generation_limits(read_settings(tmp_path, Config()), Config(kv_cache_mb=8))
    assert (limits.kv_cache_mb, limits.kv_cache_from) == (64, "kv_cache_mb in serving.properties")
    limits = generation_limits(read_settings(tmp_path / "none", Config()), Config(kv_cache_mb=8))
    assert (limits.kv_cache_mb, limits.kv_cache_from) == (8, "MME_KV_CACHE_MB")
    assert generation_limits(read_settings(tmp_path / "none", Config()), Config()).kv_cache_mb is None


def test_an_encoder_decoder_row_reserves_its_input_apart_from_what_it_decodes(tmp_path: Path) -> None:
    """Cross-attention is padded to the longest input and self-attention to the longest output, apart: a long input
    beside a long output costs both, not the longer of their sums."""
    model = hf_loading.load(hf_models.t5(tmp_path / "t5"), "text2text-generation", trust_remote_code=False).place(CPU)
    generator = GenerationRunner(model, CPU, GenerationLimits(max_rows=16), "t5")
    scheduler = generator._scheduler
    assert scheduler.reserved(1000, 10) == (11, 1000) and scheduler.reserved(10, 1000) == (1001, 10)
    # the two rows together: 2 rows x (1001 decoder places with their room + 1000 input places)
    assert KvBudget.footprint(2, 1001, 1000) == 2 * (kv_cache.with_room(1001 + kv_cache.TRIM_COLUMNS) + 1000)
    generator.close()
