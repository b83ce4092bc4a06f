"""Generative Hugging Face models served with no code, through the real frontend: 16 concurrent clients with mixed
prompts and max_new_tokens each get what transformers' generate gives their input alone (greedy: the exact text),
their rows share decoding steps (so do a Mistral's and a Gemma 3's), a long generation does not hold short ones back,
bad parameters answer 400 for the request at fault only, and a generation past its time limit answers what it has
with a warning."""

from __future__ import annotations

import functools
import json
import random
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hf_models
import pytest
import requests
from serving import RunningServer, batch_passes, borrowed, wait_until

# name -> (builder, serving.properties, prefix the task puts before the text, key of the answer)
MODELS = {
    "writer": ("gpt2", "task=text-generation\nbatch_size=16\n", None, "generated_text"),
    "summarizer": ("t5", "task=summarization\nbatch_size=16\n", "summarize: ", "summary_text"),
    "rewriter": ("bart", "task=text2text-generation\nbatch_size=16\n", "", "generated_text"),
    "translator": ("marian", "task=translation\nbatch_size=16\n", "", "translation_text"),
    "hasty": (
        "gpt2",
        "task=text-generation\nbatch_size=4\nmax_generation_seconds=0.05\nmax_new_tokens=400\n",
        None,
        "",
    ),
}
GREEDY = {"do_sample": False, "num_beams": 1}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generative-models")
    return {kind: getattr(hf_models, kind)(root / kind) for kind in ("gpt2", "t5", "bart", "marian")}


@pytest.fixture(scope="module")
def server(shared_server: RunningServer, sources: dict[str, Path]) -> Iterator[RunningServer]:
    with borrowed(shared_server) as running:
        for name, (kind, properties, _, _) in MODELS.items():
            shutil.copytree(sources[kind], running.models / name)
            (running.models / name / "serving.properties").write_text(properties)
        running.load_all(MODELS)
        for name, (_, properties, _, _) in MODELS.items():
            size = int(properties.split("batch_size=")[1].split("\n")[0])
            assert wait_until(lambda name=name, size=size: _workers_ready(running, name, size), 60), name
        yield running


def _workers_ready(server: RunningServer, name: str, count: int) -> bool:
    workers = server.describe(name).json()["workers"]
    return len(workers) == count and all(worker["status"] == "READY" for worker in workers)


def generate(server: RunningServer, name: str, inputs: Any, **parameters: Any) -> requests.Response:
    return server.invoke(name, json.dumps({"inputs": inputs, "parameters": parameters}))


def alone(source: Path, kind: str, prefix: str | None, key: str, text: str, **parameters: Any) -> Any:
    """transformers' own answer for ``text`` alone: its pipeline, or generate on the prefixed text (transformers 5 has
    no text-to-text pipeline), decoded as transformers 4.57's pipelines did."""
    if prefix is None:
        return reference(source)(text, **parameters)
    tokenizer, model = reference(source, seq2seq=True)
    output = model.generate(**tokenizer(prefix + text, return_tensors="pt"), **parameters)
    return [{key: tokenizer.decode(output[0], skip_special_tokens=True)}]


@functools.cache
def reference(source: Path, seq2seq: bool = False) -> Any:
    """The model read once: a text-generation pipeline, or a seq2seq model's (tokenizer, model)."""
    import transformers

    if not seq2seq:
        return transformers.pipeline("text-generation", model=str(source))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(source)
    return transformers.AutoTokenizer.from_pretrained(source), model


def test_sixteen_clients_each_get_what_generate_gives_their_input_alone(
    server: RunningServer, sources: dict[str, Path]
) -> None:
    """64 requests from 16 clients over the four models, prompts of 1 to 40 words and 1 to 40 new tokens: every answer
    is transformers' for that input alone, exactly, and the rows of each model shared decoding steps."""
    rng = random.Random(3)
    names = ["writer", "summarizer", "rewriter", "translator"]
    calls = [
        (names[index % 4], hf_models.text_of_tokens(rng.randint(1, 40), index), rng.randint(1, 40))
        for index in range(64)
    ]
    before = {name: batch_passes(server, name) for name in names}

    def call(case: tuple[str, str, int]) -> Any:
        response = generate(server, case[0], case[1], max_new_tokens=case[2], **GREEDY)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(16) as clients:
        answers = list(clients.map(call, calls))
    for (name, text, new_tokens), answer in zip(calls, answers, strict=True):
        kind, _, prefix, key = MODELS[name]
        assert answer == alone(sources[kind], kind, prefix, key, text, max_new_tokens=new_tokens, **GREEDY), name
    for name in names:
        passes, rows = (now - then for now, then in zip(batch_passes(server, name), before[name], strict=True))
        assert rows > passes, (name, passes, rows)  # steps decoded several rows at once


def test_beam_searches_share_steps_with_greedy_rows_and_get_generates_answers(
    server: RunningServer, sources: dict[str, Path]
) -> None:
    """32 requests from 16 clients to the summarizer and the rewriter: the text-to-text default of 4 beams, 3 beams
    with a length penalty and early stopping, and greedy ones beside them; every answer is generate's for that input
    alone with those beams, and each model's rows shared steps."""
    rng = random.Random(5)
    beams = [{}, {"num_beams": 3, "length_penalty": 0.8, "early_stopping": True, "do_sample": False}, GREEDY]
    calls = [
        (["summarizer", "rewriter"][index % 2], hf_models.text_of_tokens(rng.randint(1, 30), index), rng.randint(1, 16))
        for index in range(32)
    ]
    chosen = [beams[index % 3] for index in range(len(calls))]
    before = {name: batch_passes(server, name) for name in ("summarizer", "rewriter")}

    def call(index: int) -> Any:
        name, text, new_tokens = calls[index]
        response = generate(server, name, text, max_new_tokens=new_tokens, **chosen[index])
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(16) as clients:
        answers = list(clients.map(call, range(len(calls))))
    for (name, text, new_tokens), parameters, answer in zip(calls, chosen, answers, strict=True):
        kind, _, prefix, key = MODELS[name]
        expected = alone(
            sources[kind], kind, prefix, key, text, max_new_tokens=new_tokens, **{"num_beams": 4, **parameters}
        )
        assert answer == expected, (name, text, parameters)
    for name, then in before.items():
        passes, rows = (now - old for now, old in zip(batch_passes(server, name), then, strict=True))
        assert rows > passes, (name, passes, rows)


def test_sixteen_clients_of_the_decoder_families_get_generates_tokens_alone(
    server: RunningServer, tmp_path: Path
) -> None:
    """A Mistral from a bfloat16 checkpoint (sliding windows in every layer, untied embeddings) and a Gemma 3 from a
    float32 one (sliding and full layers, tied embeddings), 16 clients with prompts and max_new_tokens past the window:
    every answer is the pipeline's for that text alone, exactly, with the model as the CPU serves it (float32)."""
    import torch
    import transformers

    sources = {"mistral": hf_models.decoder(tmp_path / "mistral", "mistral", "bfloat16")}
    sources["gemma3"] = hf_models.decoder(tmp_path / "gemma3", "gemma3", "float32")
    for name, source in sources.items():
        shutil.copytree(source, server.models / name)
        (server.models / name / "serving.properties").write_text("task=text-generation\nbatch_size=8\n")
        assert server.load(name).status_code == 200, server.log_text()[-3000:]
    for name in sources:
        assert wait_until(lambda name=name: _workers_ready(server, name, 8), 60), name
    rng = random.Random(8)
    calls = [
        (name, hf_models.text_of_tokens(rng.randint(1, 24), index), rng.randint(1, 24))
        for index, name in enumerate(["mistral", "gemma3"] * 8)
    ]
    before = {name: batch_passes(server, name) for name in sources}

    def call(case: tuple[str, str, int]) -> Any:
        response = generate(server, case[0], case[1], max_new_tokens=case[2], **GREEDY)
        assert response.status_code == 200, response.text
        return response.json()

    try:
        with ThreadPoolExecutor(16) as clients:
            answers = list(clients.map(call, calls))
        for name in sources:
            passes, rows = (now - then for now, then in zip(batch_passes(server, name), before[name], strict=True))
            assert rows > passes, (name, passes, rows)  # steps decoded several rows at once
    finally:
        for name in sources:
            server.unload(name)
    pipelines = {
        name: transformers.pipeline("text-generation", model=str(source), dtype=torch.float32)
        for name, source in sources.items()
    }
    for (name, text, new_tokens), answer in zip(calls, answers, strict=True):
        assert answer == pipelines[name](text, max_new_tokens=new_tokens, **GREEDY), (name, text, new_tokens)


def test_a_long_generation_does_not_hold_short_ones_back(server: RunningServer) -> None:
    with ThreadPoolExecutor(9) as clients:
        started = time.monotonic()
        long = clients.submit(generate, server, "writer", "the model", max_new_tokens=400, min_new_tokens=400, **GREEDY)
        time.sleep(0.2)
        shorts = [clients.submit(generate, server, "writer", f"a client {i}", max_new_tokens=3) for i in range(8)]
        short_seconds = []
        for short in shorts:
            assert short.result().status_code == 200
            short_seconds.append(time.monotonic() - started)
        assert long.result().status_code == 200
        long_seconds = time.monotonic() - started
    assert max(short_seconds) < long_seconds, (short_seconds, long_seconds)


def test_bad_parameters_answer_400_for_the_request_at_fault_only(server: RunningServer) -> None:
    bad = [{"temperature": 0}, {"top_p": 2}, {"max_new_tokens": 5000}, {"stop": 3}, {"not_a_parameter": True}]
    with ThreadPoolExecutor(10) as clients:
        faulty = [clients.submit(generate, server, "writer", "the model", **parameters) for parameters in bad]
        good = [clients.submit(generate, server, "writer", "the model", max_new_tokens=8) for _ in range(5)]
        for response in faulty:
            assert response.result().status_code == 400, response.result().text
            assert "Traceback" not in response.result().text and response.result().json()["message"]
        assert all(response.result().status_code == 200 for response in good)
    refused = generate(server, "writer", "a", max_new_tokens=5000).json()["message"]
    assert "over this model's limit of 1024 (MME_MAX_NEW_TOKENS)" in refused  # the container's default, named so


def test_a_generation_past_its_time_limit_answers_what_it_has_with_a_warning(server: RunningServer) -> None:
    response = generate(server, "hasty", "the model", max_new_tokens=400, min_new_tokens=400, return_full_text=False)
    assert response.status_code == 200, response.text
    [answer] = response.json()
    assert "time limit" in answer["warning"] and answer["generated_text"]
    own = generate(server, "hasty", "the model", max_new_tokens=401)
    assert own.status_code == 400 and "limit of 400 (max_new_tokens in serving.properties)" in own.json()["message"]


def test_answers_have_the_aws_containers_shapes(server: RunningServer) -> None:
    one = generate(server, "writer", "the model", max_new_tokens=4).json()
    several = generate(server, "writer", ["the model", "a client"], max_new_tokens=4).json()
    assert list(one[0]) == ["generated_text"] and len(several) == 2 and list(several[1][0]) == ["generated_text"]
    summaries = generate(server, "summarizer", ["the model", "a client"], max_new_tokens=4, **GREEDY).json()
    assert [list(summary) for summary in summaries] == [["summary_text"], ["summary_text"]]
    assert list(generate(server, "translator", "the model", max_new_tokens=4).json()[0]) == ["translation_text"]
    assert all(server.shares_device_host(name) for name in MODELS)
