"""The decoder families people serve, as tiny models built here: Llama, Mistral, Qwen2 and Gemma 1 to 3 (grouped-query
attention, rotary positions, tied and untied embeddings, sliding windows shorter than the rows), from float32 and
bfloat16 checkpoints. Rows joining and leaving one batch get generate's greedy tokens for their prompt alone, exactly;
under concurrent clients a seeded sample is what generate draws after ``torch.manual_seed``, whatever runs beside it.
A bfloat16 checkpoint loads as bfloat16 and computes in float32 on the CPU."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hf_models
import pytest
import torch

from mme_runtime.huggingface import decoding as hf_decoding
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface.decoding import DecodingBatch, Row
from mme_runtime.huggingface.generation import GenerationLimits, GenerationRunner, shape
from mme_runtime.huggingface.kv_cache import decoder_cache
from mme_runtime.huggingface.requests import TaskRequest

DTYPES = ("float32", "bfloat16")
CASES = [(family, dtype) for family in hf_models.DECODER_FAMILIES for dtype in DTYPES]
IDS = [f"{family}-{dtype}" for family, dtype in CASES]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """Each (family, dtype)'s model directory, built once for the module."""
    root = tmp_path_factory.mktemp("decoder-families")
    made: dict[tuple[str, str], Path] = {}

    def build(family: str, dtype: str) -> Path:
        if (family, dtype) not in made:
            made[family, dtype] = hf_models.decoder(root / f"{family}-{dtype}", family, dtype)
        return made[family, dtype]

    return build


def served(directory: Path) -> hf_loading.HuggingFaceModel:
    """The model as a device host serves it: loaded for text-generation, placed on the CPU."""
    return hf_loading.load(directory, "text-generation", trust_remote_code=False).place(CPU)


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=IDS)
def test_rows_joining_and_leaving_get_generates_tokens_alone(
    built: Callable[[str, str], Path], family: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_decoding, "TRIM_COLUMNS", 4)  # cut unused columns often
    model: Any = served(built(family, dtype)).model
    rng = random.Random(11)
    bos, vocabulary = model.config.bos_token_id, model.config.vocab_size
    cases = [
        ([bos] + [rng.randrange(3, vocabulary) for _ in range(rng.randint(1, 20))], rng.randint(1, 20))
        for _ in range(10)
    ]
    rows = [Row(prompt, new_tokens, frozenset({model.generation_config.eos_token_id})) for prompt, new_tokens in cases]
    arrivals = sorted((rng.randint(0, 12), index) for index in range(len(rows)))
    batch = DecodingBatch(model)
    assert batch.joinable
    widest, step = 0, 0
    with torch.inference_mode():
        while arrivals or batch.rows:
            joining = [rows[index] for at, index in arrivals if at <= step]
            arrivals = [(at, index) for at, index in arrivals if at > step]
            if joining:
                batch.admit(joining)
            batch.drop([row for row in batch.live if row.finish is not None])
            if batch.rows:
                widest = max(widest, len(batch.rows))
                batch.step()
                batch.drop([row for row in batch.live if row.finish is not None])
            step += 1
    batch.close()
    assert widest > 3 and batch.joinable  # rows shared steps, and joined a running batch
    assert max(len(row.tokens) for row in rows) > 2 * hf_models.SLIDING_WINDOW  # windows cut
    for (prompt, new_tokens), row in zip(cases, rows, strict=True):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        assert row.tokens == expected[0].tolist(), (prompt, new_tokens)


# each family once, from checkpoints of either dtype in turn (the rows test above takes both of every family)
ALTERNATING = [(family, DTYPES[index % 2]) for index, family in enumerate(hf_models.DECODER_FAMILIES)]


@pytest.mark.parametrize(("family", "dtype"), ALTERNATING, ids=[f"{family}-{dtype}" for family, dtype in ALTERNATING])
def test_concurrent_clients_get_generates_greedy_tokens_and_seeded_samples(
    built: Callable[[str, str], Path], family: str, dtype: str
) -> None:
    """Eight clients at once through the scheduler, half greedy and half sampling with a seed: each answer is the
    pipeline's for that text alone (a sample: after ``torch.manual_seed(seed)``)."""
    import transformers

    model = served(built(family, dtype))
    sampling = {"do_sample": True, "temperature": 0.8, "top_k": 20, "max_new_tokens": 12}
    calls = [
        (hf_models.text_of_tokens(2 + 3 * index, index), {"do_sample": False, "max_new_tokens": 4 + 2 * index})
        if index % 2
        else (hf_models.text_of_tokens(2 + 3 * index, index), {**sampling, "seed": index})
        for index in range(8)
    ]
    generator = GenerationRunner(model, CPU, GenerationLimits(max_rows=8), "test")
    got: list[Any] = [None] * len(calls)

    def client(index: int) -> None:
        text, parameters = calls[index]
        request = TaskRequest([text], parameters, single=True)
        got[index] = shape("text-generation", generator.run([request]), request)

    threads = [threading.Thread(target=client, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    generator.close()
    pipeline = transformers.pipeline("text-generation", model=model.model, tokenizer=model.tokenizer)
    for (text, parameters), answer in zip(calls, got, strict=True):
        parameters = dict(parameters)
        torch.manual_seed(parameters.pop("seed", 0))
        assert answer == pipeline(text, **parameters), (text, parameters)


@pytest.mark.parametrize(("family", "dtype"), ALTERNATING, ids=[f"{family}-{dtype}" for family, dtype in ALTERNATING])
def test_beam_groups_beside_greedy_rows_get_generates_beams(
    built: Callable[[str, str], Path], family: str, dtype: str
) -> None:
    """Eight clients at once, beam searches of 2 to 4 beams past the sliding window beside greedy rows: each answer is
    the pipeline's for that text alone with the same beams."""
    import transformers

    model = served(built(family, dtype))
    calls = [
        (
            hf_models.text_of_tokens(2 + 3 * index, index),
            {"do_sample": False, "num_beams": [1, 2, 3, 4][index % 4], "max_new_tokens": 6 + 2 * index},
        )
        for index in range(8)
    ]
    generator = GenerationRunner(model, CPU, GenerationLimits(max_rows=16), "test")
    got: list[Any] = [None] * len(calls)

    def client(index: int) -> None:
        text, parameters = calls[index]
        request = TaskRequest([text], parameters, single=True)
        got[index] = shape("text-generation", generator.run([request]), request)

    threads = [threading.Thread(target=client, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    generator.close()
    pipeline = transformers.pipeline("text-generation", model=model.model, tokenizer=model.tokenizer)
    for (text, parameters), answer in zip(calls, got, strict=True):
        assert answer == pipeline(text, **parameters), (text, parameters)


def test_a_bfloat16_checkpoint_loads_as_bfloat16_and_computes_in_float32_on_the_cpu(
    built: Callable[[str, str], Path], tmp_path: Path
) -> None:
    directory = built("llama", "bfloat16")
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = hf_loading.load(directory, "text-generation", trust_remote_code=False)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16  # transformers 5 reads dtype="auto"
    assert {parameter.dtype for parameter in loaded.place(CPU).model.parameters()} == {torch.float32}
    # transformers 4's key, as older checkpoints have it, is honoured too
    older = hf_models.decoder(tmp_path / "older", "llama", "bfloat16")
    config = json.loads((older / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype")
    (older / "config.json").write_text(json.dumps(config))
    assert next(hf_loading.load(older, "text-generation", False).model.parameters()).dtype == torch.bfloat16


def test_no_room_for_the_float32_copy_answers_507_naming_the_sizes(
    built: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its LOAD counted the checkpoint's bfloat16 bytes: the float32 copy made when it is placed is checked apart."""
    from mme_runtime.base.errors import InsufficientMemory

    loaded = hf_loading.load(built("llama", "bfloat16"), "text-generation", trust_remote_code=False)
    monkeypatch.setattr(hf_loading, "available_bytes", lambda: (1 << 10, "on the host"))
    with pytest.raises(
        InsufficientMemory, match=r"takes a float32 copy of the weights, \d+ MiB, and 0 MiB are available on the host"
    ) as refused:
        loaded.place(CPU)
    assert refused.value.status == 507


def test_sliding_windows_get_plain_cache_layers_and_chunked_attention_keeps_the_models() -> None:
    import transformers

    windowed = [
        transformers.MistralConfig(sliding_window=8),
        transformers.Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1),
        transformers.Gemma2Config(sliding_window=8),
        transformers.Gemma3TextConfig(sliding_window=8),
    ]
    for config in windowed:
        assert decoder_cache(config).layers == [], config  # made plain as the prefill reaches them
    chunked = transformers.Llama4TextConfig(attention_chunk_size=8, num_hidden_layers=2)
    assert decoder_cache(chunked).layers  # the model's own
