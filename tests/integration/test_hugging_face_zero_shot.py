"""Zero-shot classification and table question answering served with no code, through the real frontend: 16
concurrent clients with mixed labels, ``multi_label`` and tables each get what transformers' own pipeline answers
their request alone (within 1e-4), their pairs sharing batched passes; bad requests are their own 400, CSV is refused
as the AWS Hugging Face container refuses it, and a classifier with no entailment label fails its LOAD."""

from __future__ import annotations

import copy
import functools
import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hf_models
import hf_zero_shot_models
import pytest
import requests
from serving import RunningServer, batch_passes, borrowed, wait_until

ZERO_SHOT = "zero-shot-classification"
TABLES = "table-question-answering"
LABEL_SETS = (["good", "bad movie", "capital"], "paris, berlin", ["story"], ["film", "germany", "france", "the turn"])
BATCHED = "batch_size=16\nmax_batch_delay=50\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zero-shot-models")
    hf_zero_shot_models.nli_bert(root / "nli")
    hf_zero_shot_models.tapas(root / "tapas")
    hf_models.bert(root / "not-nli", "text-classification")
    return root


@pytest.fixture(scope="module")
def server(shared_server: RunningServer, built: Path) -> Iterator[RunningServer]:
    with borrowed(shared_server) as running:
        shutil.copytree(built / "nli", running.models / "nli")
        (running.models / "nli" / "serving.properties").write_text(f"task={ZERO_SHOT}\n{BATCHED}")
        shutil.copytree(built / "tapas", running.models / "tapas")  # its task from its architecture
        (running.models / "tapas" / "serving.properties").write_text(BATCHED)
        running.load_all(["nli", "tapas"])
        yield running


close = hf_models.answers_close


@functools.cache
def reference(model_dir: Path, task: str) -> Any:
    import transformers

    return transformers.pipeline(task, model=str(model_dir))


def pipeline_answer(model_dir: Path, task: str, body: dict[str, Any]) -> Any:
    """What transformers' own pipeline answers the request alone, through JSON as a client receives it (the
    table pipeline turns the request's tables into DataFrames in place: it gets a copy)."""
    answer = reference(model_dir, task)(copy.deepcopy(body["inputs"]), **body.get("parameters", {}))
    return json.loads(json.dumps(answer))


def invoke(server: RunningServer, name: str, body: Any) -> requests.Response:
    return server.invoke(name, json.dumps(body))


def ask_all(server: RunningServer, name: str, bodies: list[dict[str, Any]]) -> list[Any]:
    """Every body from 16 clients at once; each answer must be 200."""

    def ask(body: dict[str, Any]) -> Any:
        response = invoke(server, name, body)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(16) as clients:
        return list(clients.map(ask, bodies))


def zero_shot_body(seed: int) -> dict[str, Any]:
    texts = [hf_models.text_of_tokens(3 + (seed * 7 + index * 5) % 30, seed * 10 + index) for index in range(3)]
    parameters: dict[str, Any] = {"candidate_labels": LABEL_SETS[seed % len(LABEL_SETS)]}
    if seed % 3:
        parameters["multi_label"] = seed % 3 == 1
    if seed % 5 == 4:
        parameters["hypothesis_template"] = "this text is about {}"
    return {"inputs": texts[0] if seed % 2 else texts[: 1 + seed % 3], "parameters": parameters}


def table_body(seed: int) -> dict[str, Any]:
    queries = ["how many stars", "who lives in paris", "total age of the actors", "which city is largest"]
    table = {
        f"{hf_zero_shot_models.TABLE_WORDS[(seed + column * 11) % 40]} {column}": [
            f"{hf_zero_shot_models.TABLE_WORDS[(seed * 3 + row * 7 + column) % 50]} {(seed * 13 + row) % 97}"
            for row in range(2 + seed % 3)
        ]
        for column in range(1 + seed % 3)
    }
    if seed % 4 == 3:
        return {"inputs": [{"query": queries[seed % 4], "table": table}, {"query": queries[0], "table": table}]}
    return {"inputs": {"query": queries[seed % 4] if seed % 2 else queries[:2], "table": table}}


def test_sixteen_zero_shot_clients_with_mixed_labels_each_get_the_pipelines_answer(
    server: RunningServer, built: Path
) -> None:
    bodies = [zero_shot_body(seed) for seed in range(48)]
    answers = ask_all(server, "nli", bodies)
    for body, answer in zip(bodies, answers, strict=True):
        assert close(answer, pipeline_answer(built / "nli", ZERO_SHOT, body)), body
    passes, batched = batch_passes(server, "nli")
    assert batched == len(bodies) and passes < len(bodies), (passes, batched)  # clients' pairs shared passes


def test_sixteen_table_clients_each_get_the_pipelines_answer(server: RunningServer, built: Path) -> None:
    bodies = [table_body(seed) for seed in range(32)]
    answers = ask_all(server, "tapas", bodies)
    for body, answer in zip(bodies, answers, strict=True):
        assert answer == pipeline_answer(built / "tapas", TABLES, body), body
    assert set(answers[1]) == {"answer", "coordinates", "cells", "aggregator"}
    chosen = [one["cells"] for answer in answers for one in (answer if isinstance(answer, list) else [answer])]
    assert sum(map(bool, chosen)) > len(chosen) // 2  # the answers compared chose cells: not empty alike
    passes, batched = batch_passes(server, "tapas")
    assert batched == len(bodies) and passes < len(bodies), (passes, batched)


def test_the_aws_containers_zero_shot_example_gets_an_answer_of_its_shape(server: RunningServer) -> None:
    body = {"inputs": "good movie, i would like a refund", "parameters": {"candidate_labels": ["refund", "legal"]}}
    answer = invoke(server, "nli", body).json()
    assert set(answer) == {"sequence", "labels", "scores"} and sorted(answer["labels"]) == ["legal", "refund"]


@pytest.mark.parametrize(
    ("model", "body", "fragment"),
    [
        ("nli", {"inputs": "a text"}, "candidate_labels"),
        ("nli", {"inputs": "a text", "parameters": {"candidate_labels": []}}, "no label"),
        ("nli", {"inputs": "a text", "parameters": {"candidate_labels": ["a"], "multi_label": "no"}}, "multi_label"),
        ("nli", {"inputs": {"text": "a"}, "parameters": {"candidate_labels": ["a"]}}, "string"),
        ("tapas", {"inputs": {"table": {"a": ["1"]}}}, "query"),
        ("tapas", {"inputs": {"query": "q", "table": {"a": ["1", "2"], "b": ["3"]}}}, "one length"),
        ("tapas", {"inputs": {"query": "q", "table": {"a": [1]}}}, "list of strings"),
        ("tapas", {"inputs": {"query": "q", "table": {"a": ["1"]}}, "parameters": {"sequential": 2}}, "sequential"),
        # The pipeline's postprocessing finds no cell in a table with no text: this request's 400, not the batch's 500.
        ("tapas", {"inputs": {"query": "q", "table": {"": ["", ""]}}}, "no answer"),
        ("nli", {"inputs": ["a"] * 3, "parameters": {"candidate_labels": ",".join("x" * 4000)}}, "pairs"),
    ],
)
def test_a_bad_request_is_its_own_400_while_others_are_answered(
    server: RunningServer, model: str, body: dict[str, Any], fragment: str
) -> None:
    good = zero_shot_body(1) if model == "nli" else table_body(1)
    with ThreadPoolExecutor(8) as clients:
        responses = list(clients.map(lambda index: invoke(server, model, body if index == 3 else good), range(8)))
    assert responses[3].status_code == 400, responses[3].text
    assert fragment in responses[3].json()["message"] and "Traceback" not in responses[3].text
    assert all(response.status_code == 200 for index, response in enumerate(responses) if index != 3)


@pytest.mark.parametrize("model", ["nli", "tapas"])
def test_csv_is_refused_and_other_types_are_415(server: RunningServer, model: str) -> None:
    csv = server.invoke(model, "inputs\na text\n", content_type="text/csv")
    assert csv.status_code == 400 and "not supported with" in csv.json()["message"], csv.text
    assert server.invoke(model, "a text", content_type="application/x-foo").status_code == 415
    image = server.invoke(model, hf_models.png(1), content_type="image/png")  # a table model answered 500
    assert image.status_code == 415 and "does not take" in image.json()["message"], image.text


def test_a_classifier_with_no_entailment_label_fails_its_zero_shot_load(server: RunningServer, built: Path) -> None:
    model = server.models / "not-nli"
    shutil.copytree(built / "not-nli", model)
    (model / "serving.properties").write_text(f"task={ZERO_SHOT}\n")
    response = server.load("not-nli")
    assert response.status_code >= 400, response.text
    assert wait_until(lambda: "names no entailment label" in server.log_text(), 10)
