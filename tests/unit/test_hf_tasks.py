"""The Hugging Face task runner on its own (no server): padded batches answer as the unbatched pipeline does, each
thread's tokenizer is its own, and question-answering answers as the AWS container's transformers 4 pipeline did."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import hf_models
import pytest
import torch

from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface.requests import TaskRequest
from mme_runtime.huggingface.tasks import TaskRunner, shape

RESOURCES = Path(__file__).resolve().parents[1] / "resources"


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> TaskRunner:
    directory = hf_models.bert(tmp_path_factory.mktemp("cls") / "model", "text-classification")
    model = hf_loading.load(directory, "text-classification", trust_remote_code=False)
    return TaskRunner(model.place(torch.device("cpu")), torch.device("cpu"))


def test_sixteen_threads_with_different_truncation_each_get_their_own_answer(classifier: TaskRunner) -> None:
    """tokenizers 0.23 no longer raises "Already borrowed" on a shared tokenizer: it silently hands one thread
    another's truncation. Each thread must get exactly what it gets alone."""
    cases = [
        (hf_models.text_of_tokens(20 + seed * 7, seed), {"truncation": True, "max_length": 8 + seed})
        for seed in range(16)
    ]
    expected = [classifier.run([TaskRequest([text], parameters)]) for text, parameters in cases]
    got: list[Any] = [None] * len(cases)
    start = threading.Barrier(len(cases))

    def work(index: int) -> None:
        start.wait()
        text, parameters = cases[index]
        got[index] = [classifier.run([TaskRequest([text], parameters)]) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, answers in enumerate(got):
        assert all(answer == expected[index] for answer in answers), index


def test_the_text_classifiers_answer_is_wrapped_as_the_pipeline_wraps_it() -> None:
    one = TaskRequest(["a"])
    assert shape("text-classification", [{"label": "x"}], one) == [{"label": "x"}]
    assert shape("text-classification", [[{"label": "x"}]], TaskRequest(["a"], {"top_k": None})) == [{"label": "x"}]
    assert shape("fill-mask", [["m"]], TaskRequest(["a"], single=False)) == ["m"]
    assert shape("token-classification", [[1], [2]], TaskRequest(["a", "b"], single=False)) == [[1], [2]]


def test_question_answering_answers_as_the_transformers_4_pipeline_did(tmp_path: Path) -> None:
    """Recorded with transformers 4.57.6's question-answering pipeline (the AWS Hugging Face container's) on this
    model: windows, top_k, spans found in two windows and the empty answer included (tests/resources)."""
    directory = hf_models.bert(tmp_path / "qa", "question-answering", tokenizer_from=RESOURCES / "qa-tokenizer")
    model = hf_loading.load(directory, "question-answering", trust_remote_code=False)
    runner = TaskRunner(model.place(torch.device("cpu")), torch.device("cpu"))
    recorded = json.loads((RESOURCES / "question_answering_transformers_4.json").read_text())
    requests = [TaskRequest([case["inputs"]], case["parameters"]) for case in recorded]
    answers = runner.run(requests)
    for case, request, answer in zip(recorded, requests, answers, strict=True):
        ours = shape("question-answering", [answer], request)
        assert _rounded(ours) == _rounded(case["answer"]), case


def _rounded(value: Any) -> Any:
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return {key: round(item, 6) if isinstance(item, float) else item for key, item in value.items()}


def test_a_sentence_transformers_directory_answers_one_normalized_mean_vector_per_text(tmp_path: Path) -> None:
    """Its 1_Pooling/config.json and Normalize module say how: the mean of the text's own tokens (padding in a
    batch must not count), scaled to length 1; pooling=none in serving.properties gives every token's vector."""
    import transformers

    directory = hf_models.bert(tmp_path / "st", "feature-extraction")
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (directory / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Normalize"}]))
    model = hf_loading.load(directory, "feature-extraction", trust_remote_code=False)
    assert (model.pooling, model.normalize) == ("mean", True)
    runner = TaskRunner(model.place(torch.device("cpu")), torch.device("cpu"))
    texts = ["paris", hf_models.text_of_tokens(40, 2)]
    vectors = runner.run([TaskRequest([texts[0]]), TaskRequest([texts[1]])])  # one padded pass
    tokens = transformers.pipeline("feature-extraction", model=str(directory))
    for text, vector in zip(texts, vectors, strict=True):
        expected = torch.nn.functional.normalize(torch.tensor(tokens(text)[0]).mean(dim=0), dim=0)
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-5)
    unpooled = hf_loading.load(directory, "feature-extraction", trust_remote_code=False, pooling="none")
    assert unpooled.pooling is None


def test_a_task_whose_head_the_weights_lack_fails_the_load(tmp_path: Path) -> None:
    """HF_TASK=text-classification left over from a single-model setup must not serve a token classifier's
    directory with a random head."""
    directory = hf_models.bert(tmp_path / "ner", "token-classification")
    with pytest.raises(hf_loading.ModelLoadError, match="lack what text-classification needs"):
        hf_loading.load(directory, "text-classification", trust_remote_code=False)
    masked = hf_models.bert(tmp_path / "mlm", "fill-mask")
    assert hf_loading.load(masked, "feature-extraction", trust_remote_code=False).pooling is None  # no pooler: fine


def test_left_padding_tokenizers_and_ones_without_a_pad_token_batch_as_they_answer_alone(tmp_path: Path) -> None:
    directory = hf_models.bert(tmp_path / "left", "text-classification")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left"}))
    model = hf_loading.load(directory, "text-classification", trust_remote_code=False)
    runner = TaskRunner(model.place(torch.device("cpu")), torch.device("cpu"))
    texts = [hf_models.text_of_tokens(n, n) for n in (3, 20, 21, 60)]
    parameters = {"function_to_apply": "none", "top_k": None}
    alone = [runner.run([TaskRequest([text], parameters)])[0] for text in texts]
    together = runner.run([TaskRequest([text], parameters) for text in texts])
    model.tokenizer.pad_token = None  # a decoder's tokenizer: nothing to pad with
    without_pad = runner.run([TaskRequest([text], parameters) for text in texts])
    for one, batched, unpadded in zip(alone, together, without_pad, strict=True):
        for a, b, c in zip(one, batched, unpadded, strict=True):
            assert abs(a["score"] - b["score"]) < 1e-4 and abs(a["score"] - c["score"]) < 1e-4
