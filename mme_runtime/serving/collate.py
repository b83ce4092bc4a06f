"""The default collation of a dynamic batch: what ``input_fn`` returned for each request, joined along the first
dimension for one ``predict_fn`` call, and the prediction split back by each request's row count.

Tensors, and dicts, lists or tuples of tensors, collate; their trailing shapes, dtypes and structure form a
``signature``, and only requests with equal signatures share a batch. An input that collates itself (a
``Collatable``: a Hugging Face request, whose texts are padded together) gives its own signature and rows. Anything
else (a string, an image object) has no signature and runs on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from mme_runtime.base.errors import ContainerError

# (structure, key or None, trailing shape, dtype) per tensor: hashable, equal for collatable inputs.
Signature = tuple[Any, ...]


class SplitError(ContainerError):
    """A batched prediction that cannot be handed back row by row: 500, naming the cause."""


@runtime_checkable
class Collatable(Protocol):
    """An input that knows how it batches: ``join`` makes one input of several with equal signatures; the
    prediction for it must hold one entry per row, in order (``split`` hands each its own)."""

    rows: int

    def batch_signature(self) -> Signature | None: ...

    @staticmethod
    def join(inputs: Sequence[Any]) -> Any: ...


def signature(data: Any) -> Signature | None:
    """What a request's decoded input must share with others to be batched with them, or None when it cannot be."""
    if isinstance(data, Collatable):
        return data.batch_signature()
    if isinstance(data, torch.Tensor):
        if data.dim() == 0 or data.shape[0] == 0:
            return None
        return ("tensor", tuple(data.shape[1:]), data.dtype, data.device)
    if isinstance(data, dict) and data and all(isinstance(key, str) for key in data):
        keys = sorted(data)
        return _structure("dict", [data[key] for key in keys], tuple(keys))
    if isinstance(data, (list, tuple)) and data:
        return _structure(type(data).__name__, list(data), None)
    return None


def _structure(kind: str, values: list[Any], keys: tuple[str, ...] | None) -> Signature | None:
    """Several tensors with one first dimension (their rows) collate together; anything else does not."""
    parts = [signature(value) if isinstance(value, torch.Tensor) else None for value in values]
    if any(part is None for part in parts) or len({int(value.shape[0]) for value in values}) != 1:
        return None
    return (kind, keys, *parts)


def rows(data: Any) -> int:
    """How many rows an input with a signature holds: its first dimension."""
    if isinstance(data, Collatable):
        return data.rows
    if isinstance(data, torch.Tensor):
        return int(data.shape[0])
    first = next(iter(data.values())) if isinstance(data, dict) else data[0]
    return int(first.shape[0])


def collate(inputs: Sequence[Any]) -> Any:
    """Joins inputs of one signature along the first dimension."""
    first = inputs[0]
    if len(inputs) == 1:
        return first
    if isinstance(first, Collatable):
        return first.join(inputs)
    if isinstance(first, torch.Tensor):
        return torch.cat(list(inputs))
    if isinstance(first, dict):
        return {key: torch.cat([item[key] for item in inputs]) for key in first}
    joined = [torch.cat([item[index] for item in inputs]) for index in range(len(first))]
    return tuple(joined) if isinstance(first, tuple) else joined


def split(prediction: Any, counts: Sequence[int]) -> list[Any]:
    """Hands a batched prediction back: one part per request, ``counts[i]`` rows each.

    Raises ``SplitError`` naming the cause when the prediction's first dimension does not add up.
    """
    if len(counts) == 1:
        return [prediction]
    total = sum(counts)
    if isinstance(prediction, torch.Tensor):
        if prediction.dim() == 0 or prediction.shape[0] != total:
            got = "a scalar" if prediction.dim() == 0 else f"{prediction.shape[0]} rows"
            raise SplitError(
                f"predict_fn returned {got} for a batch of {total} rows from {len(counts)} requests; "
                "with batching on, predict_fn must answer one row per input row"
            )
        return list(torch.split(prediction, list(counts)))
    if isinstance(prediction, dict):
        parts = {key: split(value, counts) for key, value in prediction.items()}
        return [{key: parts[key][index] for key in prediction} for index in range(len(counts))]
    if isinstance(prediction, (list, tuple)):
        batched = [isinstance(p, torch.Tensor) and p.dim() > 0 and p.shape[0] == total for p in prediction]
        if prediction and all(batched):  # several outputs, each with the batch's rows
            columns = [split(value, counts) for value in prediction]
            return [type(prediction)(column[index] for column in columns) for index in range(len(counts))]
        # One entry per row (a list made by .tolist(), say); a tuple is always several outputs, and a list holding a
        # batched tensor is not rows either: cut by position, it would hand one request another's rows.
        if isinstance(prediction, list) and len(prediction) == total and not any(batched):
            offsets = [sum(counts[:index]) for index in range(len(counts) + 1)]
            return [prediction[offsets[i] : offsets[i + 1]] for i in range(len(counts))]
        raise SplitError(
            f"predict_fn returned a {type(prediction).__name__} of {len(prediction)} entries for a batch of {total} "
            f"rows from {len(counts)} requests; with batching on, it must answer one row per input row, or a tuple "
            "of tensors with one row per input row each"
        )
    raise SplitError(
        f"predict_fn returned a {type(prediction).__name__} for a batch of {len(counts)} requests; with batching on "
        "it must return a tensor, or a dict, list or tuple of tensors, with one row per input row"
    )
