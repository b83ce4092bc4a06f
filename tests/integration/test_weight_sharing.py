"""Fine-tunes of one base through the real frontend: each holds only what differs from the base, each answers as
itself under concurrent clients, the metrics count a shared tensor once, an UNLOAD of the model that brought the
base leaves the others whole, a write in place stays in the model that made it, and ``share_weights=false`` opts out."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import hf_models
import pytest
import torch
from serving import (
    RunningServer,
    answers_as_expected_under_clients,
    host_memory_bytes,
    label_scores,
    start_server,
    wait_until,
)

FINE_TUNES = 4
TEXTS = ["good movie", "a terrible story that nobody liked", "paris is the capital of france", "berlin"]


READER = textwrap.dedent(
    """\
    import torch

    def model_fn(model_dir):
        model = torch.nn.Linear(64, 64)
        model.load_state_dict(torch.load(f"{model_dir}/model.pth"))
        return model

    def predict_fn(data, model):
        with torch.no_grad():
            return model(data)
    """
)
WRITER = READER.replace("        return model(data)", "        model.weight.mul_(2.0)\n        return model(data)")
assert WRITER != READER


def expected_scores(model_dir: Path, text: str) -> list[float]:
    import transformers

    pipe = transformers.pipeline("text-classification", model=str(model_dir), top_k=None)
    return sorted_scores(pipe(text))


def sorted_scores(answers: list) -> list[float]:
    """The labels' scores, from one text's answer (nested one deeper by some versions)."""
    if answers and isinstance(answers[0], list):
        (answers,) = answers
    return sorted(answer["score"] for answer in answers)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # Its own server, not the shared one: host memory counts a tensor for the first model that brought it, and there
    # another module's models (kept since their UNLOAD) may hold identical tensors (an 8 KiB one did).
    with start_server(tmp_path_factory.mktemp("sharing")) as running:
        base = hf_models.bert(tmp_path_factory.mktemp("base") / "base", hidden=128)
        for index in range(FINE_TUNES):
            hf_models.fine_tune(base, running.models / f"tune-{index}", seed=index + 1)
        opted_out = hf_models.fine_tune(base, running.models / "own-copy", seed=99)
        (opted_out / "serving.properties").write_text("share_weights=false\n")
        running.load_all([*(f"tune-{index}" for index in range(FINE_TUNES)), "own-copy"])
        yield running


def test_each_fine_tune_answers_as_itself_under_sixteen_clients(server: RunningServer) -> None:
    names = [f"tune-{index}" for index in range(FINE_TUNES)]
    expected = {(name, text): expected_scores(server.model_dir(name), text) for name in names for text in TEXTS}
    assert len({tuple(expected[(name, TEXTS[0])]) for name in names}) == FINE_TUNES  # the heads differ
    answers_as_expected_under_clients(server, expected)


def test_a_fine_tune_holds_only_what_differs_from_the_base(server: RunningServer) -> None:
    log = server.log_text()
    assert log.count("are held once for several models") >= FINE_TUNES - 1, log[-3000:]
    assert wait_until(lambda: len(host_memory_bytes(server)) >= FINE_TUNES + 1, timeout=30)
    memory = host_memory_bytes(server)
    whole = memory["own-copy"]  # opted out: every tensor its own
    assert memory["tune-0"] == pytest.approx(whole, rel=0.01)  # it brought the base: the base counts for it
    for index in range(1, FINE_TUNES):
        assert memory[f"tune-{index}"] < 0.1 * whole, memory  # its head and the tensors under 1 KiB


def test_fine_tunes_with_the_base_s_tokenizer_files_share_one_tokenizer_per_host(server: RunningServer) -> None:
    # Five models with the same tokenizer files over the CPU's two device hosts: the first on each brings one.
    hosts = 2
    assert server.log_text().count("a tokenizer equal to one a model here holds") >= FINE_TUNES + 1 - hosts


def test_unloading_the_model_that_brought_the_base_leaves_the_others_whole(server: RunningServer) -> None:
    before = {text: label_scores(server, "tune-1", text) for text in TEXTS}
    assert server.unload("tune-0").status_code == 200
    for text in TEXTS:
        assert label_scores(server, "tune-1", text) == before[text]
    response = server.load("tune-0")  # back, now borrowing the base from tune-1's file
    assert response.status_code == 200, response.text
    assert label_scores(server, "tune-0", TEXTS[0]) == pytest.approx(
        expected_scores(server.model_dir("tune-0"), TEXTS[0])
    )


def test_a_write_in_place_stays_in_the_model_that_made_it(server: RunningServer) -> None:
    """Two models with the same weights; one's predict_fn scales them in place on every request (copy-on-write)."""
    torch.manual_seed(5)
    weights = torch.nn.Linear(64, 64).state_dict()
    for name, code in (("reader", READER), ("writer", WRITER)):
        directory = server.models / name
        (directory / "code").mkdir(parents=True)
        torch.save(weights, directory / "model.pth")
        (directory / "code" / "inference.py").write_text(code)
        assert server.load(name).status_code == 200, server.log_text()[-3000:]
    body = json.dumps([[1.0] * 64])
    reader_before = server.invoke("reader", body).json()
    writer_first, writer_second = server.invoke("writer", body).json(), server.invoke("writer", body).json()
    assert writer_first != writer_second  # it really writes to its weights
    assert server.invoke("reader", body).json() == reader_before
