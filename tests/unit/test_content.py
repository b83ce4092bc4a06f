from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from serving import npy

from mme_runtime.base.errors import InvalidInput, UnsupportedAccept, UnsupportedContentType
from mme_runtime.serving import content


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        (None, "application/json"),
        ("", "application/json"),
        ("*/*", "application/json"),
        ("text/csv", "text/csv"),
        ("Application/X-NPY", "application/x-npy"),
        ("text/csv;q=0.2, application/x-npy;q=0.8", "application/x-npy"),
        ("application/xml, text/*;q=0.5", "text/csv"),
        ("application/json; charset=utf-8", "application/json"),
        ("application/xml, */*;q=0.1", "application/json"),
    ],
)
def test_negotiate_picks_the_best_supported_type(accept: str | None, chosen: str) -> None:
    assert content.negotiate(accept, "application/json") == chosen


def test_negotiate_uses_the_configured_default_for_any() -> None:
    assert content.negotiate("*/*", "text/csv") == "text/csv"


@pytest.mark.parametrize("accept", ["application/xml", "text/csv;q=0", "image/*"])
def test_negotiate_refuses_what_it_cannot_produce(accept: str) -> None:
    with pytest.raises(UnsupportedAccept) as error:
        content.negotiate(accept, "application/json")
    assert error.value.status_code == 406 and "application/json" in str(error.value)


def test_decode_json_csv_npy_to_float_tensors() -> None:
    rows = [[1, 2], [3, 4]]
    assert content.decode(json.dumps(rows), "application/json").dtype == torch.float32
    assert content.decode(b'{"instances": [[1, 2]]}', "application/json").shape == (1, 2)
    assert torch.equal(content.decode("1,2\n3,4\n", "text/csv"), torch.tensor(rows, dtype=torch.float32))
    decoded = content.decode(npy(np.array(rows, dtype=np.int64)), "application/x-npy")
    assert decoded.dtype == torch.int64  # NPY keeps its dtype


@pytest.mark.parametrize(
    ("body", "content_type", "error"),
    [
        (b"[1, 2", "application/json", InvalidInput),
        (b"[[1, 2], [3]]", "application/json", InvalidInput),
        (b'["a", "b"]', "application/json", InvalidInput),
        (b'{"x": 1}', "application/json", InvalidInput),
        (b"1,2\n3", "text/csv", InvalidInput),
        (b"1,zwei", "text/csv", InvalidInput),
        (b"not numpy", "application/x-npy", InvalidInput),
        (b"", "application/json", InvalidInput),
        (b"\xff\xfe", "application/json", InvalidInput),
        (b"[1]", None, UnsupportedContentType),
        (b"[1]", "image/png", UnsupportedContentType),
    ],
)
def test_decode_refuses_bad_payloads_with_the_right_status(
    body: bytes, content_type: str | None, error: type[Exception]
) -> None:
    with pytest.raises(error):
        content.decode(body, content_type)


def test_npy_with_pickled_objects_is_refused() -> None:
    with pytest.raises(InvalidInput):
        content.decode(npy(np.array([{"a": 1}], dtype=object), allow_pickle=True), "application/x-npy")


def test_encode_each_format() -> None:
    prediction = torch.tensor([[0.5, 0.25]])
    assert json.loads(content.encode(prediction, "application/json")) == [[0.5, 0.25]]
    assert content.encode(prediction, "text/csv").decode().strip() == "0.5,0.25"
    assert np.load(io.BytesIO(content.encode(prediction, "application/x-npy"))).tolist() == [[0.5, 0.25]]
    assert json.loads(content.encode({"a": torch.tensor([1])}, "application/json")) == {"a": [1]}
