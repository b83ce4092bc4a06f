"""PEFT LoRA adapters served with no code through the real frontend: each adapter is a model of its own over one base
loaded once, 16 clients over several adapters get what PEFT's merged model answers for their own adapter (their rows
sharing passes over the base), a base shipped inside the adapter's directory or named in its adapter_config.json is
found, and an adapter whose base is missing fails its LOAD with 400 and the cause in the log."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hf_models
import lora_models
import pytest
import torch
from serving import (
    RunningServer,
    answers_as_expected_under_clients,
    batch_passes,
    host_memory_bytes,
    label_scores,
    start_server,
    wait_until,
)

ADAPTERS = 4
TEXTS = ["good movie", "a terrible story that nobody liked", "paris is the capital of france", "berlin"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # Its own server, not the shared one: host memory counts a tensor for the first model that brought it, and there
    # another module's models (kept since their UNLOAD) may hold identical tensors (an 8 KiB one did).
    with start_server(tmp_path_factory.mktemp("lora")) as running:
        base = lora_models.base(running.models / "base")
        for index in range(ADAPTERS):
            directory = lora_models.adapter(base, running.models / f"adapter-{index}", seed=index)
            (directory / "serving.properties").write_text("base_model=../base\nbatch_size=8\nmax_batch_delay=20\n")
        running.load_all(f"adapter-{index}" for index in range(ADAPTERS))
        yield running


def expected(server: RunningServer, adapter: str, text: str) -> list[float]:
    """PEFT's merged model on the text, as scores sorted by label."""
    import transformers

    model = lora_models.merged(server.models / "base", server.model_dir(adapter))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(server.models / "base"))
    with torch.inference_mode():
        logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
    return sorted(torch.softmax(logits, dim=-1).tolist())


def test_sixteen_clients_over_four_adapters_each_get_their_adapters_answer(server: RunningServer) -> None:
    names = [f"adapter-{index}" for index in range(ADAPTERS)]
    wanted = {(name, text): expected(server, name, text) for name in names for text in TEXTS}
    assert len({tuple(wanted[(name, TEXTS[1])]) for name in names}) == ADAPTERS  # the adapters differ
    answers_as_expected_under_clients(server, wanted)
    # One queue for every adapter of the base: every request of the 64 went through one batcher (it records into
    # the series of the adapter that started it), in fewer passes than requests.
    passes = {name: batch_passes(server, name) for name in names}
    assert sum(requests for _, requests in passes.values()) == len(wanted) * 4, passes
    assert sum(1 for _, requests in passes.values() if requests) == 1, passes
    assert sum(count for count, _ in passes.values()) < len(wanted) * 4, passes


def test_the_base_is_loaded_once(server: RunningServer) -> None:
    log = server.log_text()
    assert log.count("shares its package") >= ADAPTERS - 1, log[-3000:]  # no model_fn run for the others' base


def test_the_base_counts_once_and_each_adapter_its_own_tensors(server: RunningServer) -> None:
    from safetensors.torch import load_file

    assert wait_until(lambda: len(host_memory_bytes(server)) >= ADAPTERS, timeout=30)
    memory = host_memory_bytes(server)
    adapter_bytes = sum(
        t.nbytes for t in load_file(str(server.model_dir("adapter-1") / "adapter_model.safetensors")).values()
    )
    counted = sorted(memory[f"adapter-{index}"] for index in range(ADAPTERS))
    assert counted[0] == counted[ADAPTERS - 2] == pytest.approx(adapter_bytes, rel=0.01), memory  # all but one
    assert counted[-1] > 5 * adapter_bytes  # the one that brought the base counts it


def test_a_base_shipped_inside_the_adapter_is_found(server: RunningServer) -> None:
    shipped = Path(shutil.copytree(server.model_dir("adapter-0"), server.models / "shipped"))
    (shipped / "serving.properties").unlink()
    lora_models.ship_base_inside(server.models / "base", shipped)
    response = server.load("shipped")
    assert response.status_code == 200, server.log_text()[-3000:]
    assert label_scores(server, "shipped", TEXTS[0]) == pytest.approx(expected(server, "adapter-0", TEXTS[0]), abs=1e-4)


def peft_files_only(server: RunningServer, adapter: str, name: str, recorded_base: str) -> Path:
    """A copy of ``adapter`` as PEFT's ``save_pretrained`` leaves it, recording ``recorded_base`` as its base."""
    directory = Path(shutil.copytree(server.model_dir(adapter), server.models / name))
    (directory / "serving.properties").unlink()
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": recorded_base}))
    assert sorted(path.name for path in directory.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    return directory


def test_an_adapter_with_only_peft_s_files_takes_the_base_its_config_names_beside_it(server: RunningServer) -> None:
    peft_files_only(server, "adapter-2", "peft-only", "base")  # saved by a run that loaded the base from ./base
    response = server.load("peft-only")
    assert response.status_code == 200, server.log_text()[-3000:]
    wanted = expected(server, "adapter-2", TEXTS[1])
    assert label_scores(server, "peft-only", TEXTS[1]) == pytest.approx(wanted, abs=1e-4)
    assert "model=peft-only shares its package" in server.log_text()  # the base the others loaded


def test_an_adapter_whose_base_is_missing_fails_its_load_with_400_and_the_cause(server: RunningServer) -> None:
    orphan = Path(shutil.copytree(server.model_dir("adapter-1"), server.models / "orphan"))
    (orphan / "serving.properties").write_text("base_model=../no-such-base\n")
    assert server.load("orphan").status_code == 400
    assert wait_until(lambda: "base_model=../no-such-base: no model there" in server.log_text(), 5)
    # A hub id PEFT recorded is never downloaded: the log says where the name was looked for and how to name the base.
    peft_files_only(server, "adapter-1", "hub-id", "meta-llama/Llama-3-8B")
    response = server.load("hub-id")
    assert response.status_code == 400, response.text  # MMS 1.1.11 carries our status, never our message
    cause = "base_model_name_or_path in its adapter_config.json is 'meta-llama/Llama-3-8B', which names no model here"
    assert wait_until(lambda: cause in server.log_text(), 5), server.log_text()[-3000:]
    assert "Set base_model=<directory or s3://...tar.gz> in the adapter's serving.properties" in server.log_text()
    # Answered with our status, MMS leaves the name registered with no worker: the janitor unregisters it.
    assert wait_until(lambda: server.describe("hub-id").status_code == 404, 10)
    assert label_scores(server, "adapter-1", TEXTS[0]) == pytest.approx(
        expected(server, "adapter-1", TEXTS[0]), abs=1e-4
    )


def test_adapters_of_a_plain_pytorch_module_share_its_passes_and_answer_as_peft_merged(server: RunningServer) -> None:
    base = lora_models.mlp_base(server.models / "mlp")
    names = [f"mlp-adapter-{index}" for index in range(ADAPTERS)]
    for index, name in enumerate(names):
        directory = lora_models.mlp_adapter(base, server.models / name, seed=index)
        (directory / "serving.properties").write_text("base_model=../mlp\nbatch_size=8\nmax_batch_delay=20\n")
        response = server.load(name)
        assert response.status_code == 200, server.log_text()[-3000:]
    torch.manual_seed(3)
    inputs = [torch.randn(2, 16) for _ in range(4)]
    with torch.inference_mode():
        wanted = {
            (name, index): lora_models.mlp_merged(base, server.model_dir(name))(x)
            for name in names
            for index, x in enumerate(inputs)
        }
    calls = [(name, index) for _ in range(4) for name in names for index in range(len(inputs))]

    def answer(call: tuple[str, int]) -> list[list[float]]:
        response = server.invoke(call[0], json.dumps(inputs[call[1]].tolist()))
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(answer, calls))
    for call, got in zip(calls, answers, strict=True):
        torch.testing.assert_close(torch.tensor(got), wanted[call], atol=1e-4, rtol=0)
    assert server.log_text().count("model=mlp-adapter-") and "shares its package" in server.log_text()


def test_sixteen_clients_over_eight_generation_adapters_and_the_base_get_peft_generate_exactly(
    server: RunningServer,
) -> None:
    """CAUSAL_LM adapters of ranks 4 to 64, on attention or all linear layers, LOADed as models of their own over one
    base, and the base LOADed as a model too: 16 clients, 54 requests of mixed prompts and lengths, each answered with
    PEFT's greedy tokens for its adapter alone (the base's: generate's), their rows decoding in the steps of one
    scheduler."""
    base = lora_models.causal_base(server.models / "llama")
    names = [f"writer-{index}" for index in range(8)]
    for index, name in enumerate(names):
        rank, targets = (4, 16, 64, 8)[index % 4], (lora_models.ATTENTION, lora_models.ALL_LINEAR)[index % 2]
        directory = lora_models.causal_adapter(base, server.models / name, seed=index, rank=rank, targets=targets)
        (directory / "serving.properties").write_text("base_model=../llama\nbatch_size=16\n")
    server.load_all([*names, "llama"])
    assert "model=llama shares its package" in server.log_text()  # the one its adapters loaded
    rng = random.Random(5)
    models = [*names, "llama"]
    calls = [
        (models[index % 9], hf_models.text_of_tokens(rng.randint(1, 30), index), rng.randint(1, 24))
        for index in range(54)
    ]
    before = {name: batch_passes(server, name) for name in models}

    def answer(call: tuple[str, str, int]) -> str:
        body = {"inputs": call[1], "parameters": {"max_new_tokens": call[2], "do_sample": False}}
        response = server.invoke(call[0], json.dumps(body))
        assert response.status_code == 200, response.text
        return str(response.json()[0]["generated_text"])

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(answer, calls))
    for (name, text, new_tokens), got in zip(calls, answers, strict=True):
        adapter = None if name == "llama" else server.model_dir(name)
        assert got == lora_models.peft_text(base, adapter, text, new_tokens), name
    # Each model's series records the steps its rows were in, with its own rows: every one of the nine has some.
    after = {name: batch_passes(server, name) for name in models}
    assert all(after[name][1] > before[name][1] for name in models), (before, after)
