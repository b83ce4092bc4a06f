"""NPY requests and answers of Hugging Face models: arrays of strings or numbers as the inputs, as the SageMaker SDK's
NumpySerializer writes them; pickled object arrays refused; numeric answers back as arrays."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface import requests as hf_requests
from mme_runtime.huggingface.requests import ACCEPTS, decode, encode

NPY = "application/x-npy"


def npy(value: Any, allow_pickle: bool = True) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(value) if not isinstance(value, np.ndarray) else value, allow_pickle=allow_pickle)
    return buffer.getvalue()


def test_an_array_of_strings_is_the_inputs_as_a_json_body_would_give_them() -> None:
    one = decode(npy("good movie"), NPY, "text-classification")
    assert (one.inputs, one.single) == (["good movie"], True)
    several = decode(npy(["good", "bad film"]), NPY, "text-classification")
    assert (several.inputs, several.single) == (["good", "bad film"], False)
    pairs = decode(npy([["q", "a passage"], ["q", "b"]]), NPY, "sentence-ranking")
    assert (pairs.inputs, pairs.single) == ([("q", "a passage"), ("q", "b")], False)
    assert decode(npy(np.array(["é".encode(), b"b"])), NPY, "fill-mask").inputs == ["é", "b"]  # UTF-8 bytes


def test_an_array_of_numbers_is_audio_samples_one_input_or_one_a_row() -> None:
    samples = hf_requests.npy_inputs(npy(np.linspace(-1, 1, 16, dtype=np.float32)))
    assert isinstance(samples, np.ndarray) and samples.shape == (16,)
    rows = hf_requests.npy_inputs(npy(np.zeros((3, 8), dtype=np.float32)))
    assert isinstance(rows, list) and len(rows) == 3 and rows[0].shape == (8,)
    with pytest.raises(InvalidInput, match="string"):  # a text task takes no samples
        decode(npy([1.0, 2.0]), NPY, "text-classification")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (npy({"inputs": "good"}), "pickle"),  # what NumpySerializer writes for a dict
        (npy(np.array(["a", 1], dtype=object)), "pickle"),
        (b"\x93NUMPY garbage", "not an NPY"),
        (b'{"inputs": "good"}', "not an NPY"),
        (npy(np.array([1 + 2j])), "strings or numbers"),
        (npy(np.array([1.0, np.nan])), "NaN"),
        (npy(np.array([b"\xff"])), "UTF-8"),
    ],
)
def test_what_is_not_an_array_of_strings_or_numbers_is_the_clients_400(body: bytes, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        decode(body, NPY, "text-classification")


def test_numeric_answers_come_back_as_arrays_that_load_without_pickle() -> None:
    assert NPY in ACCEPTS
    vectors = [[0.25, -1.5], [3.0, 4.0]]
    loaded = np.load(io.BytesIO(encode(vectors, NPY)), allow_pickle=False)
    assert loaded.dtype == np.float64 and loaded.tolist() == vectors
    assert encode(vectors, NPY) == npy(vectors)  # what the AWS toolkit's np.save writes for them
    embeddings = np.load(io.BytesIO(encode({"embeddings": vectors}, f"{NPY}; q=1")), allow_pickle=False)
    assert embeddings.tolist() == vectors
    assert np.load(io.BytesIO(encode({"scores": 0.5}, NPY))).tolist() == 0.5


@pytest.mark.parametrize(
    "answer",
    [[{"label": "POSITIVE", "score": 0.9}], {"score": 0.5, "answer": "paris"}, [[[1.0]], [[1.0], [2.0]]], ["text"]],
)
def test_records_text_and_ragged_answers_have_no_npy_form(answer: Any) -> None:
    with pytest.raises(InvalidInput, match="no NPY form"):
        encode(answer, NPY)
