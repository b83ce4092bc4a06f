"""Table question answering on its own (no server): the (table, query) pairs of several requests share one padded
pass and each answer is what transformers' pipeline answers alone, with the aggregation head and without; a
sequential (SQA) input runs as the pipeline runs it; bad tables and parameters are the client's 400."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import hf_zero_shot_models
import pytest
import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface import requests as hf_requests
from mme_runtime.huggingface.tasks import TaskRunner, shape

TASK = "table-question-answering"


def table(seed: int) -> dict[str, list[str]]:
    """A table of 1 to 3 columns and 2 to 4 rows, its cells words and numbers."""
    rng = random.Random(seed)
    words = hf_zero_shot_models.TABLE_WORDS
    rows = 2 + seed % 3
    return {
        f"{rng.choice(words)} {column}": [f"{rng.choice(words)} {rng.randint(1, 99)}" for _ in range(rows)]
        for column in range(1 + seed % 3)
    }


BODIES = [
    {"inputs": {"query": "how many stars", "table": table(0)}},
    {"inputs": {"query": ["how many stars", "who lives in paris"], "table": table(1)}},
    {"inputs": [{"query": "total age", "table": table(2)}, {"query": "name", "table": table(3)}]},
    {"inputs": [{"query": "total age", "table": table(4)}]},
    {"inputs": {"query": ["which city", "how many", "rome"], "table": table(5)}, "parameters": {"sequential": True}},
    {"inputs": {"query": "the year", "table": table(6)}, "parameters": {"truncation": True, "padding": "max_length"}},
]


@pytest.fixture(scope="module", params=[True, False], ids=["aggregation", "cells-only"])
def tapas_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_zero_shot_models.tapas(tmp_path_factory.mktemp("tapas") / "model", aggregation=request.param)


def decode(body: dict[str, Any]) -> hf_requests.TaskRequest:
    return hf_requests.decode(json.dumps(body), "application/json", TASK)


def test_pairs_share_a_pass_and_each_answer_is_the_pipelines(tapas_dir: Path) -> None:
    import transformers

    model = hf_loading.load(tapas_dir, TASK, trust_remote_code=False).place(torch.device("cpu"))
    runner = TaskRunner(model, torch.device("cpu"))
    passes: list[int] = []
    original = model.model.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        passes.append(int(kwargs["input_ids"].shape[0]))
        return original(*args, **kwargs)

    requests = [decode(body) for body in BODIES]
    model.model.forward = counting  # type: ignore[method-assign]
    try:
        answers = runner.run(requests)
    finally:
        del model.model.forward
    # The sequential input's three queries run one by one, in passes of their own; the other seven pairs share
    # passes grouped by length (tasks.py: the "max_length" pair, padded to 128 tokens, runs alone).
    assert sum(passes) == 3 + 7 and len(passes) <= 3 + 3 and max(passes) >= 5, passes
    pipe = transformers.pipeline(TASK, model=str(tapas_dir))
    first = 0
    for request, body in zip(requests, BODIES, strict=True):
        ours = shape(TASK, answers[first : first + request.rows], request)
        first += request.rows
        theirs = pipe(copy.deepcopy(body["inputs"]), **body.get("parameters", {}))  # it makes tables DataFrames
        assert json.loads(json.dumps(ours)) == json.loads(json.dumps(theirs)), body


def test_the_architecture_names_the_table_task(tapas_dir: Path) -> None:
    """TapasForQuestionAnswering ends as a text question-answering model's name does, but answers about tables."""
    assert hf_loading.resolve_task(tapas_dir, None, None) == TASK


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ({"table": {"a": ["1"]}}, "takes"),
        ({"query": "q"}, "takes"),
        ("a text", "takes"),
        ({"query": "", "table": {"a": ["1"]}}, "non-empty"),
        ({"query": ["q", 3], "table": {"a": ["1"]}}, "non-empty"),
        ({"query": "q", "table": {"a": ["1", "2"], "b": ["3"]}}, "one length"),
        ({"query": "q", "table": {"a": [1, 2]}}, "list of strings"),
        ({"query": "q", "table": {"a": "1"}}, "list of strings"),
        ({"query": "q", "table": {"a": []}}, "at least 1"),
        ({"query": "q", "table": {}}, "object of columns"),
        ({"query": "q", "table": [["a"]]}, "object of columns"),
    ],
)
def test_bad_tables_and_queries_are_the_clients_400(inputs: Any, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        decode({"inputs": inputs})


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [({"top_k": 2}, "not"), ({"sequential": "yes"}, "sequential"), ({"truncation": "cut"}, "truncation")],
)
def test_bad_parameters_are_the_clients_400(parameters: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        decode({"inputs": {"query": "q", "table": {"a": ["1"]}}, "parameters": parameters})


def test_csv_is_refused_as_the_aws_container_refuses_it() -> None:
    with pytest.raises(InvalidInput, match="not supported with table-question-answering"):
        hf_requests.decode(b"inputs\na\n", "text/csv", TASK)


def test_a_table_the_model_cannot_number_is_the_clients_400(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without truncation a table may need more positions than the model has: 400, not an index error in the pass
    that other requests share."""
    directory = hf_zero_shot_models.tapas(tmp_path_factory.mktemp("tapas-long") / "model", aggregation=False)
    model = hf_loading.load(directory, TASK, trust_remote_code=False).place(torch.device("cpu"))
    runner = TaskRunner(model, torch.device("cpu"))
    big = {"name": [f"paris {index}" for index in range(80)]}
    request = decode({"inputs": {"query": "q", "table": big}, "parameters": {"truncation": False}})
    with pytest.raises(InvalidInput, match="at most 128"):
        runner.run([request])
    assert isinstance(runner.run([decode({"inputs": {"query": "q", "table": big}})])[0], dict)  # rows dropped to fit


@pytest.mark.parametrize("sequential", [False, True], ids=["batched", "sequential"])
def test_a_table_with_no_text_is_its_clients_400_and_fails_no_other_request(tapas_dir: Path, sequential: bool) -> None:
    """A table whose cells and column names are all empty gives the pipeline's postprocessing no cell to answer from
    (it fails with an UnboundLocalError): the request at fault is a 400, so that the batcher retries the others
    without it, never a 500 for every request of its batch."""
    model = hf_loading.load(tapas_dir, TASK, trust_remote_code=False).place(torch.device("cpu"))
    runner = TaskRunner(model, torch.device("cpu"))
    parameters = {"sequential": True} if sequential else {}
    empty = decode({"inputs": {"query": ["q", "r"], "table": {"": ["", ""]}}, "parameters": parameters})
    with pytest.raises(InvalidInput, match="no answer"):
        runner.run([decode(BODIES[0]), empty])
    assert len(runner.run([decode(BODIES[0])])) == 1


def test_a_request_tokenizes_at_most_max_cells_and_characters_of_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """TAPAS's tokenizer is pure Python (about 2,000 cells or 50,000 characters a second here) and reads the whole
    table once per query, inside the pass its batch waits on: a 6 MB table was minutes of it, retried in halves."""
    from mme_runtime.huggingface import tables as hf_tables

    monkeypatch.setattr(hf_tables, "MAX_CELLS", 16)  # a column name counts as a cell
    monkeypatch.setattr(hf_tables, "MAX_CHARACTERS", 100)
    grid = {"a": ["1", "2", "3"], "b": ["4", "5", "6"]}
    assert decode({"inputs": [{"query": ["q", "r"], "table": grid}]}).rows == 1
    with pytest.raises(InvalidInput, match="cells"):
        decode({"inputs": [{"query": ["q", "r"], "table": grid}, {"query": "q", "table": grid}]})
    with pytest.raises(InvalidInput, match="characters"):
        decode({"inputs": {"query": "q", "table": {"a": ["x" * 101]}}})
    with pytest.raises(InvalidInput, match="characters"):
        decode({"inputs": {"query": "q" * 101, "table": {"a": ["x"]}}})
