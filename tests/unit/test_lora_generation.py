"""LoRA adapters for generation, in process (no server): the adapters of one base and the base itself decode in one
continuous batch, each row with its own adapter in every wrapped layer, and each client's greedy tokens are exactly
what PEFT's generate gives its adapter alone, whatever the ranks, targets and scalings mixed in the batch; seeded
sampling does not depend on the rows beside it; an adapter unloaded mid-answer fails only its own rows; adapters this
server cannot serve are refused at LOAD with the reason."""

from __future__ import annotations

import json
import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hf_models
import lora_models
import pytest
import torch

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface.defaults import HuggingFaceDefaults
from mme_runtime.huggingface.generation import GenerationLimits, GenerationRunner, SharedGeneration
from mme_runtime.huggingface.requests import TaskRequest
from mme_runtime.huggingface.scheduler import ModelUnloaded
from mme_runtime.models import lora, lora_layers
from mme_runtime.models.serving_properties import read_settings

CPU = torch.device("cpu")
# name -> (rank, targets, options): ranks 4 to 64 in one batch, attention only or all linear layers, rsLoRA, an
# lm_head of its own (PEFT's modules_to_save)
ADAPTERS: dict[str, tuple[int, tuple[str, ...], dict[str, Any]]] = {
    "r4-attention": (4, lora_models.ATTENTION, {}),
    "r16-all": (16, lora_models.ALL_LINEAR, {}),
    "r64-rslora": (64, lora_models.ALL_LINEAR, {"use_rslora": True, "lora_alpha": 16}),
    "r8-alpha": (8, ("q_proj", "v_proj", "down_proj"), {"lora_alpha": 3}),
    "r8-head": (8, lora_models.ATTENTION, {"modules_to_save": ["lm_head"]}),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-generation")
    base = lora_models.causal_base(root / "base")
    adapters = {
        name: lora_models.causal_adapter(base, root / name, seed=seed, rank=rank, targets=targets, **options)
        for seed, (name, (rank, targets, options)) in enumerate(ADAPTERS.items())
    }
    return base, adapters


def served(base: Path, adapters: dict[str, Path]) -> tuple[Any, dict[str, GenerationRunner]]:
    """The base placed once with every adapter attached, and a runner per model (the base's own as ``base``)."""
    model = hf_loading.load(base, "text-generation", trust_remote_code=False).place(CPU)
    for name, directory in adapters.items():
        lora_layers.attach(model, model.model, name, lora.read_adapter(directory))
    limits = GenerationLimits(max_rows=16)
    runners = {name: GenerationRunner(model, CPU, limits, name) for name in [*adapters, "base"]}
    return model, runners


def ask(runner: GenerationRunner, text: str, **parameters: Any) -> str:
    answer = runner.run([TaskRequest([text], parameters, single=True)])
    return str(answer[0][0]["generated_text"])


def test_sixteen_clients_over_five_adapters_and_the_base_get_peft_generate_exactly(
    made: tuple[Path, dict[str, Path]],
) -> None:
    """Two requests per client, prompts of 1 to 30 words and 1 to 16 new tokens: rows of every adapter and of the base
    join and leave one batch, and each answer has the tokens PEFT's generate gives its adapter alone."""
    base, adapters = made
    model, runners = served(base, adapters)
    names = [*adapters, "base"]
    rng = random.Random(3)
    cases = [
        (names[index % len(names)], hf_models.text_of_tokens(rng.randint(1, 30), index), rng.randint(1, 16))
        for index in range(32)
    ]
    # one scheduler, pipeline and tokenizer copies for all: per adapter, only its tensors are more
    assert {id(runner._shared) for runner in runners.values()} == {id(model.generation)}
    mixed: list[set[str | None]] = []
    step = model.generation.scheduler.batch.step

    def recording_step() -> None:
        mixed.append({row.model for row in model.generation.scheduler.batch.live})
        step()

    model.generation.scheduler.batch.step = recording_step
    got: list[str | None] = [None] * len(cases)

    def client(first: int) -> None:
        for index in (first, first + 16):
            name, text, new_tokens = cases[index]
            got[index] = ask(runners[name], text, max_new_tokens=new_tokens, do_sample=False)

    hf_models.in_threads(client, range(16))
    for runner in runners.values():
        runner.close()

    wanted = [
        lora_models.peft_text(base, None if name == "base" else adapters[name], text, new_tokens)
        for name, text, new_tokens in cases
    ]
    assert got == wanted
    assert len({answer for answer in wanted}) > len(names)  # the adapters answer differently
    assert max(len(models) for models in mixed) >= 3, mixed  # rows of several models shared steps


def test_beam_searches_over_adapters_and_the_base_share_steps_and_get_peft_generate_exactly(
    made: tuple[Path, dict[str, Path]],
) -> None:
    """Beam groups of 2 to 4 rows and greedy rows of three adapters and the base in one batch: each beam row goes
    through its request's adapter, and each answer has the tokens PEFT's generate gives with those beams alone."""
    base, adapters = made
    model, runners = served(base, adapters)
    names = ["r16-all", "r64-rslora", "r8-head", "base"]
    widths = [2, 1, 3, 4, 2, 1]  # num_beams of each request in turn (1: greedy)
    cases = [
        (names[index % len(names)], hf_models.text_of_tokens(2 + index, index), 4 + index % 9, widths[index % 6])
        for index in range(16)
    ]
    mixed: list[tuple[int, int]] = []  # (models, beam groups) of each step
    step = model.generation.scheduler.batch.step

    def recording_step() -> None:
        live = model.generation.scheduler.batch.live
        mixed.append((len({row.model for row in live}), len({id(row.group) for row in live if row.group is not None})))
        step()

    model.generation.scheduler.batch.step = recording_step
    got: list[str | None] = [None] * len(cases)

    def client(index: int) -> None:
        name, text, new_tokens, beams = cases[index]
        got[index] = ask(runners[name], text, max_new_tokens=new_tokens, num_beams=beams, do_sample=False)

    hf_models.in_threads(client, range(len(cases)))
    for runner in runners.values():
        runner.close()
    wanted = [
        lora_models.peft_text(base, None if name == "base" else adapters[name], text, new_tokens, num_beams=beams)
        for name, text, new_tokens, beams in cases
    ]
    assert got == wanted
    assert any(models >= 3 and groups >= 2 for models, groups in mixed), mixed


def test_seeded_sampling_gives_the_same_tokens_whatever_rows_are_beside_it(made: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = made
    _, runners = served(base, adapters)
    sampled = {"do_sample": True, "seed": 11, "max_new_tokens": 12, "top_k": 0}
    alone = ask(runners["r16-all"], "the weather today", **sampled)
    beside: list[str] = []

    def other(name: str) -> None:
        ask(runners[name], hf_models.text_of_tokens(20, 5), max_new_tokens=16, do_sample=False)

    threads = [threading.Thread(target=other, args=(name,)) for name in ("r4-attention", "base", "r64-rslora")]
    for thread in threads:
        thread.start()
    beside.append(ask(runners["r16-all"], "the weather today", **sampled))
    for thread in threads:
        thread.join()
    for runner in runners.values():
        runner.close()
    assert beside == [alone]


def test_an_adapter_unloaded_mid_answer_fails_its_own_rows_only(made: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = made
    model, runners = served(base, adapters)
    failures: list[BaseException] = []
    answers: list[str] = []
    started = threading.Event()
    step = model.generation.scheduler.batch.step

    def slow_step() -> None:
        started.set()
        step()

    model.generation.scheduler.batch.step = slow_step

    def leaving() -> None:
        try:
            ask(
                runners["r8-alpha"],
                hf_models.text_of_tokens(10, 1),
                max_new_tokens=200,
                min_new_tokens=200,
                do_sample=False,
            )
        except ModelUnloaded as exc:
            failures.append(exc)

    def staying() -> None:
        answers.append(ask(runners["r16-all"], "a short one", max_new_tokens=40, do_sample=False))

    threads = [threading.Thread(target=leaving), threading.Thread(target=staying)]
    for thread in threads:
        thread.start()
    assert started.wait(30)
    runners["r8-alpha"].close()
    model.adapters.remove("r8-alpha")
    for thread in threads:
        thread.join()
    assert len(failures) == 1 and "r8-alpha" in str(failures[0])
    assert answers == [lora_models.peft_text(base, adapters["r16-all"], "a short one", 40)]
    assert model.generation is not None and {runner.name for runner in model.generation.users} == {
        *adapters,
        "base",
    } - {"r8-alpha"}
    for name, runner in runners.items():
        if name != "r8-alpha":
            runner.close()
    assert model.generation is None  # the last model's close ends it


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"use_dora": True}, "use_dora=True is not served"),
        ({"target_modules": ["embed_tokens"]}, "an embedding: LoRA is served on Linear layers only"),
    ],
)
def test_an_adapter_this_server_cannot_serve_is_refused_with_the_reason(
    made: tuple[Path, dict[str, Path]], tmp_path: Path, changes: dict[str, Any], reason: str
) -> None:
    base, _ = made
    options = {key: value for key, value in changes.items() if key != "target_modules"}
    targets = tuple(changes.get("target_modules", lora_models.ATTENTION))
    directory = lora_models.causal_adapter(base, tmp_path / "refused", seed=1, targets=targets, **options)
    model = hf_loading.load(base, "text-generation", trust_remote_code=False).place(CPU)
    with pytest.raises(ModelLoadError, match=reason) as refused:
        lora_layers.attach(model, model.model, "refused", lora.read_adapter(directory))
    assert refused.value.status == 400


def test_an_adapter_of_another_base_is_refused_naming_the_shapes(
    made: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    base, _ = made
    wider = lora_models.causal_base(tmp_path / "wider", hidden=96)
    directory = lora_models.causal_adapter(wider, tmp_path / "of-wider", seed=2)
    model = hf_loading.load(base, "text-generation", trust_remote_code=False).place(CPU)
    with pytest.raises(ModelLoadError, match="trained on another base") as refused:
        lora_layers.attach(model, model.model, "of-wider", lora.read_adapter(directory))
    assert refused.value.status == 400
    # nothing of it stays on the base: no layer wrapped for it
    assert not [layer for layer in model.model.modules() if isinstance(layer, lora_layers.LoraLinear)]


def defaults_for(adapter_dir: Path) -> HuggingFaceDefaults:
    config = Config(allow_any_model_location=True)
    return HuggingFaceDefaults(adapter_dir, read_settings(adapter_dir, config), config)


def test_a_generation_adapter_over_a_classifier_is_refused_naming_both(
    made: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    lora_models.base(tmp_path / "classifier")
    directory = Path(shutil.copytree(made[1]["r16-all"], tmp_path / "over-a-classifier"))
    (directory / "serving.properties").write_text("base_model=../classifier\n")
    with pytest.raises(
        ModelLoadError, match="is a model for text-classification: a generative adapter needs"
    ) as refused:
        defaults_for(directory)
    assert refused.value.status == 400


def test_an_adapter_with_a_tokenizer_of_its_own_is_refused_and_one_with_its_base_s_served(
    made: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    base, adapters = made
    directory = Path(shutil.copytree(adapters["r4-attention"], tmp_path / "own-tokenizer"))
    (directory / "serving.properties").write_text(f"base_model={base}\n")
    shutil.copy(base / "tokenizer.json", directory / "tokenizer.json")  # the base's own: served
    assert defaults_for(directory).task == "text-generation"
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["a-token-of-its-own"] = len(tokenizer["model"]["vocab"])
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelLoadError, match=r"ships a tokenizer of its own \(tokenizer.json\)") as refused:
        defaults_for(directory)
    assert refused.value.status == 400


def test_passes_on_another_thread_use_the_adapter_greedy_and_with_beams(made: tuple[Path, dict[str, Path]]) -> None:
    """A GPU's passes run on its pass threads, not the caller's: each pass still uses its row's adapter, in the batch
    (greedy rows, a beam group) and in a generate alone (prompt lookup, which gives greedy's tokens)."""
    base, adapters = made
    model = hf_loading.load(base, "text-generation", trust_remote_code=False).place(CPU)
    lora_layers.attach(model, model.model, "r16-all", lora.read_adapter(adapters["r16-all"]))
    with ThreadPoolExecutor(1) as pass_thread:
        generator = GenerationRunner(
            model, CPU, GenerationLimits(max_rows=16), "r16-all", lambda run: pass_thread.submit(run).result()
        )
        text = hf_models.text_of_tokens(12, 4)
        assert ask(generator, text, max_new_tokens=10, do_sample=False) == lora_models.peft_text(
            base, adapters["r16-all"], text, 10
        )
        beams = ask(generator, text, max_new_tokens=10, do_sample=False, num_beams=3)
        alone = ask(generator, text, max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3)
        generator.close()
    assert alone == lora_models.peft_text(base, adapters["r16-all"], text, 10)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base))
    reference = lora_models.peft_causal(base, adapters["r16-all"])
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.inference_mode():
        output = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, num_beams=3)
    full = tokenizer.decode(output[0], skip_special_tokens=True)
    assert beams == text + full[len(tokenizer.decode(ids[0], skip_special_tokens=True)) :]


def test_seq_2_seq_adapters_of_a_t5_decode_together_as_peft_generates_each_alone(tmp_path: Path) -> None:
    """SEQ_2_SEQ_LM adapters over a T5 (text2text-generation): their rows share steps, each answered with PEFT's
    greedy tokens for its adapter alone, beside the base's."""
    import peft
    import transformers

    base = hf_models.t5(tmp_path / "t5")
    adapters = {
        f"t5-{rank}": lora_models.causal_adapter(
            base, tmp_path / f"t5-{rank}", seed=rank, rank=rank, targets=("q", "v", "wo"), task_type="SEQ_2_SEQ_LM"
        )
        for rank in (4, 16)
    }
    model = hf_loading.load(base, "text2text-generation", trust_remote_code=False).place(CPU)
    for name, directory in adapters.items():
        lora_layers.attach(model, model.model, name, lora.read_adapter(directory))
    runners = {name: GenerationRunner(model, CPU, GenerationLimits(max_rows=16), name) for name in [*adapters, "t5"]}
    cases = [
        (name, hf_models.text_of_tokens(4 + 3 * index, index), 6 + index) for index, name in enumerate(runners)
    ] * 2
    got: list[Any] = [None] * len(cases)

    def client(index: int) -> None:
        name, text, new_tokens = cases[index]
        got[index] = ask(runners[name], text, max_new_tokens=new_tokens, do_sample=False, num_beams=1)

    hf_models.in_threads(client, range(len(cases)))
    for runner in runners.values():
        runner.close()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base))
    references = {name: transformers.AutoModelForSeq2SeqLM.from_pretrained(str(base)).eval() for name in runners}
    references = {
        name: reference if name == "t5" else peft.PeftModel.from_pretrained(reference, str(adapters[name])).eval()
        for name, reference in references.items()
    }
    wanted = []
    for name, text, new_tokens in cases:
        with torch.inference_mode():
            output = references[name].generate(
                **tokenizer(text, return_tensors="pt"), max_new_tokens=new_tokens, num_beams=1
            )
        wanted.append(tokenizer.decode(output[0], skip_special_tokens=True))
    assert got == wanted
    assert len(set(wanted[: len(runners)])) == len(runners)  # the adapters answer otherwise than the base


def test_an_adapter_unloaded_while_idle_and_loaded_again_answers_as_itself(made: tuple[Path, dict[str, Path]]) -> None:
    """Its UNLOAD withdrew the rows of its old runner only: the new one's first request is served, with the adapter as
    it was attached again (a selection kept from before names the old slot, and is not reused)."""
    base, adapters = made
    model, runners = served(base, adapters)
    text = hf_models.text_of_tokens(9, 2)
    first = ask(runners["r8-alpha"], text, max_new_tokens=8, do_sample=False)
    runners["r8-alpha"].close()  # its UNLOAD: the scheduler idle, the other models still on it
    model.adapters.remove("r8-alpha")
    lora_layers.attach(model, model.model, "r8-alpha", lora.read_adapter(adapters["r8-alpha"]))
    again = GenerationRunner(model, CPU, GenerationLimits(max_rows=16), "r8-alpha")
    assert (
        ask(again, text, max_new_tokens=8, do_sample=False)
        == first
        == lora_models.peft_text(base, adapters["r8-alpha"], text, 8)
    )
    for runner in [again, *runners.values()]:
        runner.close()


def test_a_kept_step_selection_is_made_again_once_an_adapter_comes_or_goes(made: tuple[Path, dict[str, Path]]) -> None:
    from mme_runtime.huggingface.decoding import DecodingBatch, Row

    base, adapters = made
    model = hf_loading.load(base, "text-generation", trust_remote_code=False).place(CPU)
    lora_layers.attach(model, model.model, "r4-attention", lora.read_adapter(adapters["r4-attention"]))
    batch = DecodingBatch(model.model, model)
    rows = [Row([1, 2], 4, "r4-attention")]
    with batch._adapters(rows, steps=True):
        kept = model.adapters.current()
    with batch._adapters(rows, steps=True):
        assert model.adapters.current() is kept
    model.adapters.remove("r4-attention")
    lora_layers.attach(model, model.model, "r4-attention", lora.read_adapter(adapters["r4-attention"]))
    with batch._adapters(rows, steps=True):
        assert model.adapters.current() is not kept
        assert model.adapters.current().slots == [model.adapters.index["r4-attention"]] != kept.slots


def test_a_model_joining_its_base_s_batch_with_other_settings_is_told_whose_apply(
    made: tuple[Path, dict[str, Path]], caplog: pytest.LogCaptureFixture
) -> None:
    base, adapters = made
    model = hf_loading.load(base, "text-generation", trust_remote_code=False).place(CPU)
    first = GenerationRunner(model, CPU, GenerationLimits(max_rows=16), "base")
    same = GenerationRunner(model, CPU, GenerationLimits(max_rows=16), "same")
    assert "ignored" not in caplog.text
    other = GenerationRunner(model, CPU, GenerationLimits(max_rows=4, kv_cache_mb=64), "other")
    assert (
        "model=other batch_size=4 kv_cache_mb=64 ignored: its rows decode in its base's batch, whose batch_size=16 "
        "and kv_cache_mb=unset the first of its models set" in caplog.text
    )
    assert other._scheduler is first._scheduler and first._scheduler.max_rows == 16
    for runner in (other, same, first):
        runner.close()


def test_the_first_runners_of_two_bases_do_not_wait_for_each_other(
    made: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a base's models share (a pipeline, two tokenizer copies) is made under that base's lock: a first LOAD of
    # another base goes on, and another model of the same base waits for it and shares it.
    base, _ = made
    slow, quick = (hf_loading.load(base, "text-generation", trust_remote_code=False).place(CPU) for _ in range(2))
    making, go_on = threading.Event(), threading.Event()
    make = SharedGeneration.make

    def slow_make(model: Any, *arguments: Any) -> SharedGeneration:
        if model is slow:
            making.set()
            assert go_on.wait(60)
        return make(model, *arguments)

    monkeypatch.setattr(SharedGeneration, "make", staticmethod(slow_make))
    runners: dict[str, GenerationRunner] = {}

    def start(name: str, model: Any) -> threading.Thread:
        def run() -> None:
            runners[name] = GenerationRunner(model, CPU, GenerationLimits(max_rows=4), name)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    first = start("first", slow)
    assert making.wait(60)
    same_base, other_base = start("same base", slow), start("other base", quick)
    other_base.join(60)
    assert "other base" in runners  # made while the slow base's was being made
    assert same_base.is_alive() and "same base" not in runners
    go_on.set()
    for thread in (first, same_base):
        thread.join(60)
    assert runners["same base"]._scheduler is runners["first"]._scheduler is not runners["other base"]._scheduler
    for runner in runners.values():
        runner.close()
