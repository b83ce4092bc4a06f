"""The default collation of a dynamic batch: signatures, joining along the first dimension, splitting back."""

from __future__ import annotations

import pytest
import torch

from mme_runtime.serving.batcher import SplitError, collate, rows, signature, split


def test_tensors_with_the_same_trailing_shape_and_dtype_share_a_signature() -> None:
    assert signature(torch.zeros(1, 4)) == signature(torch.ones(3, 4))
    assert signature(torch.zeros(1, 4)) != signature(torch.zeros(1, 5))
    assert signature(torch.zeros(1, 4)) != signature(torch.zeros(1, 4, dtype=torch.float64))


@pytest.mark.parametrize(
    "data",
    [torch.tensor(1.0), torch.zeros(0, 4), "text", {"a": torch.zeros(2, 1), "b": torch.zeros(3, 1)}, [1, 2], {}],
    ids=["scalar", "no rows", "string", "ragged dict", "plain list", "empty dict"],
)
def test_inputs_that_cannot_be_joined_have_no_signature(data: object) -> None:
    assert signature(data) is None


def test_dicts_and_tuples_of_tensors_collate_per_entry_and_split_back() -> None:
    inputs = [{"ids": torch.full((count, 3), float(count)), "mask": torch.ones(count, 3)} for count in (1, 2)]
    assert signature(inputs[0]) == signature(inputs[1])
    assert [rows(item) for item in inputs] == [1, 2]
    joined = collate(inputs)
    assert joined["ids"].shape == (3, 3)
    parts = split({"logits": joined["ids"] * 2}, [1, 2])
    assert torch.equal(parts[1]["logits"], torch.full((2, 3), 4.0))
    pair = split((torch.arange(3), torch.arange(3) + 10), [2, 1])
    assert isinstance(pair[0], tuple) and pair[1][1].tolist() == [12]


def test_a_prediction_as_a_list_of_rows_splits_by_row() -> None:
    assert split([[0.1], [0.2], [0.3]], [1, 2]) == [[[0.1]], [[0.2], [0.3]]]


@pytest.mark.parametrize(
    ("prediction", "words"),
    [
        (torch.zeros(2, 3), "returned 2 rows for a batch of 3 rows from 2 requests"),
        (torch.tensor(1.0), "returned a scalar"),
        ("label", "returned a str"),
        ([1, 2], "returned a list of 2 entries for a batch of 3 rows"),
    ],
)
def test_a_prediction_that_does_not_add_up_names_the_cause(prediction: object, words: str) -> None:
    with pytest.raises(SplitError, match=words) as raised:
        split(prediction, [1, 2])
    assert raised.value.status == 500


def test_a_lone_request_gets_the_prediction_as_it_is() -> None:
    prediction = {"label": "cat"}
    assert split(prediction, [5]) == [prediction]


@pytest.mark.parametrize(
    "prediction",
    [(torch.zeros(2, 2), torch.tensor(0.5)), [torch.zeros(2, 2), None]],
    ids=["logits and a scalar", "logits and None"],
)
def test_outputs_that_are_not_all_batched_are_refused_not_cut_by_position(prediction: object) -> None:
    """Two lone rows and a (logits, aux) pair: cut by position, the first request would get both requests' logits."""
    with pytest.raises(SplitError, match="for a batch of 2 rows"):
        split(prediction, [1, 1])
