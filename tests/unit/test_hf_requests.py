"""Reading the AWS Hugging Face container's requests, writing its answers, and telling a model's task."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from mme_runtime.base.errors import InvalidInput, ModelLoadError, UnsupportedContentType
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface.requests import TaskBatch, TaskRequest, decode, encode
from mme_runtime.serving import batcher


def test_a_string_is_one_input_and_a_list_is_several() -> None:
    one = decode(b'{"inputs": "good", "parameters": {"top_k": 2}}', "application/json", "text-classification")
    assert (one.inputs, one.parameters, one.single) == (["good"], {"top_k": 2}, True)
    several = decode('{"inputs": ["a", "b"]}', "application/json; charset=utf-8", "text-classification")
    assert (several.inputs, several.single, several.rows) == (["a", "b"], False, 2)


def test_csv_reads_an_inputs_column_or_question_and_context() -> None:
    assert decode("inputs\na\nb\n", "text/csv", "text-classification").inputs == ["a", "b"]
    qa = decode("question,context\nwho,paris is\n", "text/csv", "question-answering")
    assert qa.inputs == [{"question": "who", "context": "paris is"}]


@pytest.mark.parametrize(
    ("body", "task", "fragment"),
    [
        ("not json", "text-classification", "not JSON"),
        ('["good"]', "text-classification", '"inputs"'),
        ('{"inputs": {"text": 3}}', "text-classification", "text pair"),
        ('{"inputs": [[1]]}', "fill-mask", "string"),
        ('{"inputs": "who"}', "question-answering", "question"),
        ('{"inputs": "not base64!"}', "image-classification", "base64"),
        ('{"inputs": "a", "parameters": [1]}', "fill-mask", '"parameters"'),
    ],
)
def test_bad_requests_name_what_is_wrong(body: str, task: str, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        decode(body, "application/json", task)


def test_a_csv_without_a_known_header_and_an_unknown_type_are_refused() -> None:
    with pytest.raises(InvalidInput, match="header"):
        decode("text\na\n", "text/csv", "text-classification")
    with pytest.raises(UnsupportedContentType, match="application/json"):
        decode(b"x", "application/octet-stream", "text-classification")


def test_an_image_comes_as_the_body_or_as_base64() -> None:
    import hf_models

    png = hf_models.png(1, size=8)
    assert decode(png, "image/png", "image-classification").inputs[0].size == (8, 8)
    encoded = json.dumps({"inputs": base64.b64encode(png).decode()})
    assert decode(encoded, "application/json", "image-classification").inputs[0].size == (8, 8)


def test_answers_are_compact_json_or_csv_records() -> None:
    import numpy as np

    assert encode([{"label": "A", "score": np.float32(0.5)}], "application/json") == b'[{"label":"A","score":0.5}]'
    assert encode([{"label": "A", "score": 0.5}], "text/csv") == b"label,score\r\nA,0.5\r\n"
    with pytest.raises(InvalidInput, match="CSV"):
        encode([[0.1, 0.2]], "text/csv")


def test_requests_collate_themselves_into_one_batch() -> None:
    requests = [TaskRequest(["a"]), TaskRequest(["b", "c"], single=False)]
    assert batcher.signature(requests[0]) == batcher.signature(requests[1]) is not None
    assert [batcher.rows(request) for request in requests] == [1, 2]
    batch = batcher.collate(requests)
    assert isinstance(batch, TaskBatch) and batch.requests == requests
    assert batcher.split([1, 2, 3], [1, 2]) == [[1], [2, 3]]


def _config(directory: Path, architectures: list[str], **extra: Any) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": architectures, **extra}))
    (directory / "model.safetensors").write_bytes(b"")
    return directory


@pytest.mark.parametrize(
    ("architectures", "task"),
    [
        (["BertForSequenceClassification"], "text-classification"),
        (["DistilBertForTokenClassification"], "token-classification"),
        (["RobertaForMaskedLM"], "fill-mask"),
        (["BertForQuestionAnswering"], "question-answering"),
        (["ViTForImageClassification"], "image-classification"),
        (["BertModel"], "feature-extraction"),
        (["GPT2LMHeadModel"], "text-generation"),
        (["LlamaForCausalLM"], "text-generation"),
        (["T5ForConditionalGeneration"], "text2text-generation"),
        (["MarianMTModel"], "text2text-generation"),
    ],
)
def test_the_architecture_tells_the_task_when_it_names_one(tmp_path: Path, architectures: list[str], task: str) -> None:
    seq_to_seq = architectures[0].endswith(("ForConditionalGeneration", "MTModel"))
    directory = _config(tmp_path / "model", architectures, **({"is_encoder_decoder": True} if seq_to_seq else {}))
    assert hf_loading.is_hugging_face_directory(directory)
    assert hf_loading.resolve_task(directory, None, None) == task


def test_serving_properties_win_over_hf_task_which_wins_over_the_architecture(tmp_path: Path) -> None:
    directory = _config(tmp_path / "model", ["BertForSequenceClassification"])
    assert hf_loading.resolve_task(directory, None, "fill-mask") == "fill-mask"
    assert hf_loading.resolve_task(directory, "ner", "fill-mask") == "token-classification"


def test_unknown_and_ambiguous_tasks_fail_naming_what_is_supported(tmp_path: Path) -> None:
    directory = _config(tmp_path / "model", ["GPT2LMHeadModel"])
    for task in ("summarize-please", "translation_en_de"):
        with pytest.raises(ModelLoadError, match="supported: text-classification.*translation_xx_to_yy"):
            hf_loading.resolve_task(directory, task, None)
    for task in ("text-generation", "summarization", "translation", "translation_en_to_de"):
        assert hf_loading.resolve_task(directory, task, None) == task
    assert hf_loading.base_task("translation_en_to_de") == "translation"
    mixed = _config(tmp_path / "mixed", ["BertForMaskedLM", "BertForSequenceClassification"])
    with pytest.raises(ModelLoadError, match="set task= in serving.properties or HF_TASK"):
        hf_loading.resolve_task(mixed, None, None)


def test_a_directory_without_weights_or_model_type_is_not_one(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    assert not hf_loading.is_hugging_face_directory(tmp_path)
