"""The KV cache of a batch of generations (``decoding.py``), edited by rows: self-attention layers
grow in place (``GrowingLayer``, where transformers' ``DynamicLayer`` concatenates the whole cache),
a row is written into a place another left (``write_row``), rows are appended (``join``) or kept
(``select``), each with one copy, or copied over others (``copy_rows``: beam search). Rows sit
right-aligned in the self-attention cache (padded on the left) and left-aligned in the
cross-attention one (padded on the right).
"""

from __future__ import annotations

from typing import Any

import torch

ROOM = 64  # tokens of room a buffer gets beyond what it holds when it is made


def _dynamic_layer() -> Any:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def growing_layer(keys: torch.Tensor, values: torch.Tensor) -> Any:
    """A ``DynamicLayer`` that holds ``keys`` and ``values`` in buffers with room for ``ROOM`` more
    tokens."""
    layer = _growing_class()()
    layer.hold(keys, values, keys.shape[-2] + ROOM)
    return layer


_GROWING: Any = None


def _growing_class() -> Any:
    """``GrowingLayer``, made once transformers is imported (this module is imported before it
    is)."""
    global _GROWING
    if _GROWING is None:

        class GrowingLayer(_dynamic_layer()):  # type: ignore[misc]
            """Keys and values are views of buffers with room: ``update`` writes the new tokens in
            place."""

            def hold(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
                self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
                length = keys.shape[-2]
                shape = (*keys.shape[:2], capacity, keys.shape[-1])
                self._keys, self._values = keys.new_empty(shape), values.new_empty(shape)
                self._keys[:, :, :length], self._values[:, :, :length] = keys, values
                self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

            def update(
                self,
                key_states: torch.Tensor,
                value_states: torch.Tensor,
                *args: Any,
                **kwargs: Any,
            ) -> Any:
                length, added = self.keys.shape[-2], key_states.shape[-2]
                if length + added > self._keys.shape[-2]:
                    self.hold(self.keys, self.values, 2 * (length + added))
                self._keys[:, :, length : length + added] = key_states
                self._values[:, :, length : length + added] = value_states
                self.keys, self.values = (
                    self._keys[:, :, : length + added],
                    self._values[:, :, : length + added],
                )
                return self.keys, self.values

        _GROWING = GrowingLayer
    return _GROWING


def self_layers(cache: Any) -> list[Any]:
    return list(
        (cache.self_attention_cache if hasattr(cache, "self_attention_cache") else cache).layers
    )


def cross_layers(cache: Any) -> list[Any]:
    return (
        list(cache.cross_attention_cache.layers) if hasattr(cache, "cross_attention_cache") else []
    )


def regrow(cache: Any) -> None:
    """The cache's self-attention layers as ``GrowingLayer`` s holding what they hold now (one
    copy)."""
    holder = cache.self_attention_cache if hasattr(cache, "self_attention_cache") else cache
    holder.layers = [growing_layer(layer.keys, layer.values) for layer in holder.layers]


def all_plain(cache: Any) -> bool:
    """Every layer is a plain full-attention one (no sliding window, no linear attention): safe to
    pad together."""
    return all(
        type(layer).__name__ == "DynamicLayer"
        for layer in [*self_layers(cache), *cross_layers(cache)]
    )


def write_row(
    cache: Any, slot: int, source: Any, row: int, tokens: int, length: int, source_tokens: int = 0
) -> None:
    """Row ``row`` of ``source`` (a prefill's cache) into row ``slot`` of ``cache``: its last
    ``tokens`` self-attention tokens right-aligned at ``length``, and its first ``source_tokens``
    cross-attention ones at the start."""
    for into, out in zip(self_layers(cache), self_layers(source), strict=True):
        into.keys[slot, :, length - tokens :] = out.keys[row, :, out.keys.shape[-2] - tokens :]
        into.values[slot, :, length - tokens :] = out.values[
            row, :, out.values.shape[-2] - tokens :
        ]
    for into, out in zip(cross_layers(cache), cross_layers(source), strict=True):
        into.keys[slot, :, :source_tokens] = out.keys[row, :, :source_tokens]
        into.values[slot, :, :source_tokens] = out.values[row, :, :source_tokens]


def copy_rows(cache: Any, into: torch.Tensor, source: torch.Tensor) -> None:
    """Self-attention rows ``source`` copied over rows ``into``, in place: a beam goes on from its
    parent's cache. Cross-attention rows are left: a beam group's rows hold one encoder output."""
    for layer in self_layers(cache):
        layer.keys[into] = layer.keys[source]
        layer.values[into] = layer.values[source]


def join(cache: Any, new: Any, rows: torch.Tensor, length: int, source: int) -> None:
    """Rows ``rows`` of ``new`` appended to ``cache``: self-attention padded on the left to
    ``length``, cross-attention on the right to ``source`` (one copy of everything)."""
    for old, add in zip(self_layers(cache), self_layers(new), strict=True):
        old.keys = torch.cat(
            [pad(old.keys, length, 2, left=True), pad(add.keys[rows], length, 2, left=True)]
        )
        old.values = torch.cat(
            [pad(old.values, length, 2, left=True), pad(add.values[rows], length, 2, left=True)]
        )
    for old, add in zip(cross_layers(cache), cross_layers(new), strict=True):
        old.keys = torch.cat([pad(old.keys, source, 2), pad(add.keys[rows], source, 2)])
        old.values = torch.cat([pad(old.values, source, 2), pad(add.values[rows], source, 2)])
    regrow(cache)


def select(cache: Any, rows: torch.Tensor, first: int, end: int | None) -> None:
    """Only ``rows`` kept, self-attention from column ``first``, cross-attention up to ``end`` (one
    copy)."""
    for layer in self_layers(cache):
        layer.keys, layer.values = layer.keys[rows, :, first:], layer.values[rows, :, first:]
    for layer in cross_layers(cache):
        layer.keys, layer.values = layer.keys[rows, :, :end], layer.values[rows, :, :end]
    regrow(cache)


def pad(tensor: torch.Tensor, length: int, dim: int, left: bool = False) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    zeros = tensor.new_zeros(shape)
    return torch.cat([zeros, tensor] if left else [tensor, zeros], dim=dim)
