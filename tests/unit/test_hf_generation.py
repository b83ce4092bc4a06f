"""Generative tasks with no code, in process (no server): under 16 concurrent clients each answer is what
transformers' own generate gives that input alone (greedy and beam search: the exact tokens), sampled answers with a
seed are the pipeline's after ``torch.manual_seed``, stop sequences, the cap on new tokens, the time limit and bad
parameters."""

from __future__ import annotations

import functools
import random
import threading
from pathlib import Path
from typing import Any

import hf_models
import pytest
import torch

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ConfigError, InvalidInput
from mme_runtime.huggingface import decoding as hf_decoding
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface.defaults import generation_limits
from mme_runtime.huggingface.generation import GenerationLimits, GenerationRunner, shape
from mme_runtime.huggingface.requests import TaskRequest
from mme_runtime.models.serving_properties import read_settings

# (model, task, prefix the task puts before the text, key of the answer)
CASES = [
    ("gpt2", "text-generation", None, "generated_text"),
    ("t5", "summarization", "summarize: ", "summary_text"),
    ("t5", "translation_en_to_de", "translate English to German: ", "translation_text"),
    ("bart", "text2text-generation", "", "generated_text"),
    ("marian", "translation", "", "translation_text"),
]
GREEDY = {"do_sample": False, "num_beams": 1}
BEAM_CASES = [CASES[0], *CASES[2:]]  # one task of T5's
# Greedy rows and beam groups of one batch: widths 2 to 5, length penalties, early_stopping's three values, several
# answers per input, n-grams refused.
BEAMS = [
    GREEDY,
    {"do_sample": False, "num_beams": 4},
    {"do_sample": False, "num_beams": 3, "length_penalty": 0.5, "early_stopping": True, "num_return_sequences": 2},
    {"do_sample": False, "num_beams": 2, "early_stopping": "never", "no_repeat_ngram_size": 2},
    {"do_sample": False, "num_beams": 5, "length_penalty": 2.0},
    {"do_sample": False, "num_beams": 4, "length_penalty": -1.0, "early_stopping": "never", "num_return_sequences": 4},
]


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generative")
    return {name: getattr(hf_models, name)(root / name) for name in ("gpt2", "t5", "bart", "marian")}


def runner(directory: Path, task: str, **limits: Any) -> GenerationRunner:
    model = hf_loading.load(directory, task, trust_remote_code=False).place(torch.device("cpu"))
    return GenerationRunner(model, torch.device("cpu"), GenerationLimits(**{"max_rows": 16, **limits}), "test")


def ask(generator: GenerationRunner, text: str | list[str], **parameters: Any) -> Any:
    request = TaskRequest([text] if isinstance(text, str) else text, parameters, single=isinstance(text, str))
    return shape(generator.model.task, generator.run([request]), request)


def generated_alone(directory: Path, task: str, prefix: str | None, key: str, text: str, **parameters: Any) -> Any:
    """What transformers answers for ``text`` alone: its text-generation pipeline, or for the text-to-text tasks
    (which transformers 5 dropped) generate on the prefixed text, decoded as transformers 4.57's pipeline did."""
    if prefix is None:
        return reference(directory, task)(text, **parameters)
    tokenizer, model = reference(directory, "")
    output = model.generate(**tokenizer(prefix + text, return_tensors="pt"), **parameters)
    return [{key: tokenizer.decode(sequence, skip_special_tokens=True)} for sequence in output]


@functools.cache
def reference(directory: Path, task: str) -> Any:
    """The model read once: a pipeline for ``task``, or (no task) a seq2seq model's tokenizer and model."""
    import transformers

    if task:
        return transformers.pipeline(task, model=str(directory))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory), model


@pytest.mark.parametrize(("name", "task", "prefix", "key"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_sixteen_clients_each_get_what_generate_gives_their_input_alone(
    directories: Path, name: str, task: str, prefix: str | None, key: str
) -> None:
    """Prompts of 1 to 40 words and 1 to 20 new tokens, two requests per client: rows join and leave the batch between
    steps (into places finished rows left, added, the batch compacted), and every answer has generate's exact tokens
    for that input alone."""
    rng = random.Random(7)
    cases = [(hf_models.text_of_tokens(rng.randint(1, 40), seed), rng.randint(1, 20)) for seed in range(32)]
    generator = runner(directories[name], task)
    got: list[Any] = [None] * len(cases)

    def client(first: int) -> None:
        for index in (first, first + 16):
            text, new_tokens = cases[index]
            got[index] = ask(generator, text, max_new_tokens=new_tokens, **GREEDY)

    threads = [threading.Thread(target=client, args=(index,)) for index in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    generator.close()
    for (text, new_tokens), answer in zip(cases, got, strict=True):
        expected = generated_alone(directories[name], task, prefix, key, text, max_new_tokens=new_tokens, **GREEDY)
        assert answer == expected, (text, new_tokens)


def test_a_seeded_sample_is_the_pipelines_after_manual_seed_whatever_runs_beside_it(directories: Path) -> None:
    import transformers

    pipe = transformers.pipeline("text-generation", model=str(directories["gpt2"]))
    sampling = {"do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "max_new_tokens": 24}
    texts = [hf_models.text_of_tokens(3 + seed, seed) for seed in range(8)]
    expected = []
    for seed, text in enumerate(texts):
        torch.manual_seed(seed)
        expected.append(pipe(text, **sampling))
    generator = runner(directories["gpt2"], "text-generation")
    got: list[Any] = [None] * len(texts)
    threads = [
        threading.Thread(target=lambda i: got.__setitem__(i, ask(generator, texts[i], seed=i, **sampling)), args=(i,))
        for i in range(len(texts))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    several = ask(generator, texts[0], seed=3, num_return_sequences=3, **sampling)
    generator.close()
    assert got == expected
    assert len(several) == 3 and len({answer["generated_text"] for answer in several}) == 3


def test_a_stop_sequence_ends_the_answer_with_the_token_that_completes_it(directories: Path) -> None:
    generator = runner(directories["gpt2"], "text-generation")
    text = hf_models.text_of_tokens(6, 1)
    full = ask(generator, text, max_new_tokens=30, return_full_text=False, **GREEDY)[0]["generated_text"]
    stop = full[12:15]
    cut = ask(generator, text, max_new_tokens=30, return_full_text=False, stop=[stop, "never there"], **GREEDY)
    generator.close()
    answer = cut[0]["generated_text"]
    assert stop in answer and full.startswith(answer) and len(answer) < len(full)


def test_max_new_tokens_over_the_cap_is_refused_and_a_default_over_it_lowered(directories: Path) -> None:
    generator = runner(directories["gpt2"], "text-generation", max_new_tokens=8)
    text = hf_models.text_of_tokens(5, 2)
    with pytest.raises(InvalidInput, match="over this model's limit of 8"):
        ask(generator, text, max_new_tokens=9)
    lowered = ask(generator, text, do_sample=False)  # the pipeline's default is 256 new tokens
    generator.close()
    expected = generated_alone(directories["gpt2"], "text-generation", None, "", text, max_new_tokens=8, **GREEDY)
    assert lowered == expected


def test_the_cap_is_the_models_own_else_the_containers(tmp_path: Path) -> None:
    container = Config.from_env({"MME_MAX_NEW_TOKENS": "64"})
    assert generation_limits(read_settings(tmp_path, Config()), Config()).max_new_tokens == 1024
    assert generation_limits(read_settings(tmp_path, container), container).max_new_tokens == 64
    (tmp_path / "serving.properties").write_text("max_new_tokens=8\n")
    assert generation_limits(read_settings(tmp_path, container), container).max_new_tokens == 8
    with pytest.raises(ConfigError, match="MME_MAX_NEW_TOKENS"):
        Config.from_env({"MME_MAX_NEW_TOKENS": "0"})


def test_a_prompt_longer_than_the_models_positions_is_refused(directories: Path) -> None:
    generator = runner(directories["gpt2"], "text-generation")
    with pytest.raises(InvalidInput, match="takes at most 512"):
        ask(generator, hf_models.text_of_tokens(600, 3), max_new_tokens=4)
    with pytest.raises(InvalidInput, match="does not fit"):
        ask(generator, hf_models.text_of_tokens(20, 3), max_new_tokens=1000)
    generator.close()


def test_a_generation_past_the_time_limit_answers_what_it_has_with_a_warning(directories: Path) -> None:
    generator = runner(directories["gpt2"], "text-generation", seconds=0.05)
    answer = ask(generator, "the model", max_new_tokens=480, min_new_tokens=480, return_full_text=False, **GREEDY)
    generator.close()
    assert "time limit" in answer[0]["warning"] and answer[0]["generated_text"]


@pytest.mark.parametrize(("name", "task", "prefix", "key"), BEAM_CASES, ids=[f"{c[0]}-{c[1]}" for c in BEAM_CASES])
def test_beam_groups_decode_beside_greedy_rows_and_get_what_generate_gives_their_input_alone(
    directories: Path, name: str, task: str, prefix: str | None, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 clients, 32 requests: greedy rows and beam searches of 2 to 5 beams (length penalties, early_stopping True,
    False and "never", no_repeat_ngram_size, several answers) share steps, the batch compacted and its columns cut
    often, and every answer has generate's exact tokens for that input alone, with the same parameters."""
    monkeypatch.setattr(hf_decoding, "TRIM_COLUMNS", 4)
    shared: list[tuple[int, int]] = []  # (beam groups, greedy rows) of each step
    step = hf_decoding.DecodingBatch.step

    def counted(batch: hf_decoding.DecodingBatch) -> None:
        groups = {id(row.group) for row in batch.live if row.group is not None}
        shared.append((len(groups), sum(row.group is None for row in batch.live)))
        step(batch)

    monkeypatch.setattr(hf_decoding.DecodingBatch, "step", counted)
    # Not 3: there T5 has two hypotheses whose scores tie exactly for one input alone, and float rounding in the batch
    # picks either (docs/hugging-face.md).
    rng = random.Random(5)
    cases = [(hf_models.text_of_tokens(rng.randint(1, 30), seed), rng.randint(1, 20)) for seed in range(32)]
    generator = runner(directories[name], task)
    got: list[Any] = [None] * len(cases)

    def client(first: int) -> None:
        for index in (first, first + 16):
            text, new_tokens = cases[index]
            got[index] = ask(generator, text, max_new_tokens=new_tokens, **BEAMS[index % len(BEAMS)])

    threads = [threading.Thread(target=client, args=(index,)) for index in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    generator.close()
    assert any(groups >= 2 and greedy for groups, greedy in shared)  # beam groups and greedy rows in one step
    for index, ((text, new_tokens), answer) in enumerate(zip(cases, got, strict=True)):
        parameters = BEAMS[index % len(BEAMS)]
        expected = generated_alone(directories[name], task, prefix, key, text, max_new_tokens=new_tokens, **parameters)
        assert answer == expected, (text, new_tokens, parameters)


def test_the_text_to_text_default_of_four_beams_is_batched_with_generates_answer(directories: Path) -> None:
    """The text-to-text tasks default to 4 beams, as transformers 4.57's pipelines did; a group wider than the batch
    runs once the batch is empty."""
    generator = runner(directories["t5"], "summarization", max_rows=2)
    text = hf_models.text_of_tokens(12, 4)
    answer = ask(generator, [text, text], max_new_tokens=6)
    generator.close()
    expected = generated_alone(
        directories["t5"], "summarization", "summarize: ", "summary_text", text, max_new_tokens=6, num_beams=4
    )
    assert answer == expected * 2


def test_a_beam_search_ends_at_a_stop_sequence_as_generate_with_stop_strings(directories: Path) -> None:
    import transformers

    generator = runner(directories["gpt2"], "text-generation")
    text, beams = hf_models.text_of_tokens(6, 1), {"max_new_tokens": 30, "num_beams": 3, "do_sample": False}
    full = ask(generator, text, return_full_text=False, **beams)[0]["generated_text"]
    stop = full[12:14]
    cut = ask(generator, text, return_full_text=False, stop=stop, **beams)[0]["generated_text"]
    generator.close()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directories["gpt2"])
    model = transformers.AutoModelForCausalLM.from_pretrained(directories["gpt2"])
    ids = tokenizer(text, return_tensors="pt")
    output = model.generate(**ids, stop_strings=[stop], tokenizer=tokenizer, **beams)
    assert cut == tokenizer.decode(output[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert stop in cut and len(cut) < len(full)


def test_a_seeded_beam_sample_is_the_pipelines_after_manual_seed(directories: Path) -> None:
    sampling = {"do_sample": True, "num_beams": 3, "temperature": 0.9, "top_k": 40, "max_new_tokens": 16}
    text = hf_models.text_of_tokens(5, 2)
    generator = runner(directories["gpt2"], "text-generation")
    got = ask(generator, text, seed=5, **sampling)
    generator.close()
    torch.manual_seed(5)
    assert got == reference(directories["gpt2"], "text-generation")(text, **sampling)


def test_a_beam_search_past_the_time_limit_answers_its_best_beam_with_a_warning(directories: Path) -> None:
    generator = runner(directories["gpt2"], "text-generation", seconds=0.05)
    answer = ask(generator, "the model", max_new_tokens=480, min_new_tokens=480, num_beams=2, return_full_text=False)
    generator.close()
    assert "time limit" in answer[0]["warning"] and answer[0]["generated_text"]


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({"temperature": 0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": "ten"}, "max_new_tokens"),
        ({"do_sample": "yes"}, "do_sample"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a"] * 17}, "stop sequences"),
        ({"seed": -1}, "seed"),
        ({"num_return_sequences": 2, "do_sample": False}, "num_return_sequences"),
        ({"not_a_parameter": 1}, "not_a_parameter"),
        ({"return_tensors": True}, "return_tensors"),
        ({"cache_implementation": "static", "max_cache_len": 10**6}, "cache_implementation"),
        ({"eos_token_id": 10**6}, "outside the model's"),
        ({"bad_words_ids": [[1], [-2]]}, "outside the model's"),
        ({"num_beams": 2, "forced_bos_token_id": 10**6}, "outside the model's"),
        ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5}, "group beam search is not served"),
        ({"penalty_alpha": 0.6, "top_k": 4, "do_sample": False}, "contrastive search is not served"),
        ({"num_beams": 2, "force_words_ids": [[5]]}, "constrained beam search is not served"),
    ],
)
def test_bad_parameters_are_the_clients_400(directories: Path, parameters: dict[str, Any], fragment: str) -> None:
    generator = runner(directories["gpt2"], "text-generation")
    try:
        with pytest.raises(InvalidInput, match=fragment):
            ask(generator, "the model", **parameters)
    finally:
        generator.close()


def test_text_to_text_refuses_text_generations_parameters(directories: Path) -> None:
    generator = runner(directories["bart"], "text2text-generation")
    try:
        with pytest.raises(InvalidInput, match="return_full_text"):
            ask(generator, "the model", return_full_text=False)
    finally:
        generator.close()


def test_generate_alone_beside_batched_rows_of_a_model_with_absolute_positions(directories: Path) -> None:
    """BART's decoder positions come per row from a hook while the batch steps; a mode still run by generate alone
    (prompt lookup, an assisted generation) on another thread at the same time must get its own."""
    generator = runner(directories["bart"], "text2text-generation")
    texts = [hf_models.text_of_tokens(5 + seed, seed) for seed in range(8)]
    lookup = {**GREEDY, "prompt_lookup_num_tokens": 3}
    parameters = [[GREEDY, lookup, {"num_beams": 2}][index % 3] for index in range(len(texts))]
    got: list[Any] = [None] * len(texts)

    def client(index: int) -> None:
        got[index] = ask(generator, texts[index], max_new_tokens=24, **parameters[index])

    threads = [threading.Thread(target=client, args=(index,)) for index in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    generator.close()
    for text, chosen, answer in zip(texts, parameters, got, strict=True):
        expected = generated_alone(directories["bart"], "", "", "generated_text", text, max_new_tokens=24, **chosen)
        assert answer == expected, (text, chosen)
