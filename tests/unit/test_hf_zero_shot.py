"""Zero-shot classification on its own (no server): the (text, label) pairs of several requests share one forward
pass and each request gets what transformers' pipeline answers it alone; bad parameters and CSV bodies are the
client's 400 before a request joins a batch; a model without an entailment label fails its LOAD."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hf_models
import hf_zero_shot_models
import pytest
import torch

from mme_runtime.base.errors import InvalidInput, ModelLoadError
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface import requests as hf_requests
from mme_runtime.huggingface.tasks import TaskRunner, shape

TASK = "zero-shot-classification"


@pytest.fixture(scope="module")
def nli_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_zero_shot_models.nli_bert(tmp_path_factory.mktemp("nli") / "model")


@pytest.fixture(scope="module")
def runner(nli_dir: Path) -> TaskRunner:
    model = hf_loading.load(nli_dir, TASK, trust_remote_code=False)
    return TaskRunner(model.place(torch.device("cpu")), torch.device("cpu"))


close = hf_models.answers_close


def decode(body: dict[str, Any]) -> hf_requests.TaskRequest:
    return hf_requests.decode(json.dumps(body), "application/json", TASK)


BODIES = [
    {"inputs": "paris is the capital of france", "parameters": {"candidate_labels": ["good", "bad movie", "capital"]}},
    {"inputs": ["good movie", "berlin"], "parameters": {"candidate_labels": "good, bad", "multi_label": True}},
    {"inputs": ["the film"], "parameters": {"candidate_labels": ["story"], "hypothesis_template": "it is about {}"}},
    {
        "inputs": "a story",
        "parameters": {"candidate_labels": ["film", "capital", "germany", "bad"], "multi_label": False},
    },
]


def test_the_pairs_of_every_request_share_one_pass_and_each_answer_is_the_pipelines(
    runner: TaskRunner, nli_dir: Path
) -> None:
    import transformers

    passes: list[int] = []
    model = runner.model.model
    original = model.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        passes.append(int(kwargs["input_ids"].shape[0]))
        return original(*args, **kwargs)

    requests = [decode(body) for body in BODIES]
    model.forward = counting  # type: ignore[method-assign]
    try:
        answers = runner.run(requests)
    finally:
        del model.forward
    assert passes == [3 + 2 * 2 + 1 + 4], passes  # every (text, label) pair of the four requests, in one pass
    pipe = transformers.pipeline(TASK, model=str(nli_dir))
    first = 0
    for request, body in zip(requests, BODIES, strict=True):
        ours = shape(TASK, answers[first : first + request.rows], request)
        first += request.rows
        assert close(json.loads(json.dumps(ours)), pipe(body["inputs"], **body["parameters"])), body


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({}, "needs"),
        ({"candidate_labels": []}, "no label"),
        ({"candidate_labels": " , "}, "no label"),
        ({"candidate_labels": ["a", 3]}, "list of strings"),
        ({"candidate_labels": {"a": 1}}, "list of strings"),
        ({"candidate_labels": ["a"], "multi_label": "false"}, "multi_label"),
        ({"candidate_labels": ["a"], "hypothesis_template": "no slot"}, "no {}"),
        ({"candidate_labels": ["a"], "hypothesis_template": "{1}"}, "cannot be filled"),
        ({"candidate_labels": ["a"], "hypothesis_template": 7}, "must be a string"),
    ],
)
def test_bad_parameters_are_the_clients_400_before_the_batch(parameters: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        decode({"inputs": "a text", "parameters": parameters})


def test_csv_is_refused_as_the_aws_container_refuses_it() -> None:
    with pytest.raises(InvalidInput, match="not supported with zero-shot-classification"):
        hf_requests.decode(b"inputs\na text\n", "text/csv", TASK)


def test_inputs_must_be_texts() -> None:
    with pytest.raises(InvalidInput, match="string"):
        decode({"inputs": [1], "parameters": {"candidate_labels": ["a"]}})


def test_a_model_without_an_entailment_label_fails_its_load(tmp_path: Path, nli_dir: Path) -> None:
    import shutil

    model = shutil.copytree(nli_dir, tmp_path / "not-nli")
    config = json.loads((model / "config.json").read_text())
    config["id2label"] = {"0": "NEGATIVE", "1": "NEUTRAL", "2": "POSITIVE"}
    config["label2id"] = {"NEGATIVE": 0, "NEUTRAL": 1, "POSITIVE": 2}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="entailment"):
        hf_loading.load(model, TASK, trust_remote_code=False)


def test_zero_shot_is_named_by_its_task_not_its_architecture(nli_dir: Path) -> None:
    """A ...ForSequenceClassification is a text classifier unless task= or HF_TASK says zero-shot, as with AWS."""
    assert hf_loading.resolve_task(nli_dir, None, None) == "text-classification"
    assert hf_loading.resolve_task(nli_dir, None, TASK) == TASK
