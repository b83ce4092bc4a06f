"""The KV cache of a batch of generations (``decoding.py``), edited by rows: self-attention layers
grow in place (``GrowingLayer``, where transformers' ``DynamicLayer`` concatenates the whole cache),
a row is written into a place another left (``write_row``), rows are appended (``join``) or kept
(``select``), each with one copy, or copied over others (``copy_rows``: beam search). Rows sit
right-aligned in the self-attention cache (padded on the left) and left-aligned in the
cross-attention one (padded on the right).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mme_runtime.base.parsing import MIB
from mme_runtime.operations.memory import available_bytes

ROOM = 64  # tokens of room a buffer gets beyond what it holds when it is made (or a quarter more)
# Leading columns no row attends to any more are cut off once there are this many (a copy of the
# cache: ``decoding.py``).
TRIM_COLUMNS = 32


def with_room(tokens: int) -> int:
    """The length of a buffer made to hold ``tokens``: room for ``ROOM`` or a quarter more."""
    return tokens + max(ROOM, tokens // 4)


@dataclass(frozen=True)
class KvBudget:
    """The KV cache one decoding batch may hold: ``tokens`` token places of one row, each holding
    ``token_bytes`` (every layer's key and value); ``source`` says who set it, for the answer that
    names it. The batch's cache is one padded block (its rows, finished places included, times its
    longest row and the columns not yet trimmed, with the room its buffers keep): ``footprint``."""

    tokens: int
    token_bytes: int
    source: str

    @staticmethod
    def footprint(rows: int, longest: int, source: int = 0) -> int:
        """Token places of ``rows`` rows whose longest decoder row is ``longest`` tokens (and an
        encoder-decoder's longest input ``source``: its cross-attention block, padded apart)."""
        return rows * (with_room(longest + TRIM_COLUMNS) + source)

    def describe(self, tokens: int) -> str:
        return f"{tokens} tokens ({tokens * self.token_bytes / MIB:.1f} MiB)"


def budget_for(model: Any, device: torch.device, mb: int | None, source: str) -> KvBudget | None:
    """The KV budget of ``model``'s decoding batch: ``mb`` MiB where set (by ``source``), else half
    of what ``device`` has free now. None where the model's config does not give a token's size."""
    size = token_bytes(model)
    if size is None:
        return None
    if mb is None:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = available_bytes()[0]
        total, source = free // 2, f"half the free memory of {device} when the model was placed"
    else:
        total = mb * MIB
    return KvBudget(max(1, total // size), size, source)


def token_bytes(model: Any) -> int | None:
    """The bytes one token takes in the KV cache of every decoder layer (keys and values), from the
    model's config and its dtype; None where the config does not say (no bound is kept then)."""
    config = model.config.get_text_config(decoder=True)

    def first(*names: str) -> int | None:
        values = (getattr(config, name, None) for name in names)
        return next((int(value) for value in values if isinstance(value, int) and value > 0), None)

    layers = first("num_hidden_layers", "num_decoder_layers", "decoder_layers", "n_layer")
    layers = layers or first("num_layers")
    heads = first("num_attention_heads", "decoder_attention_heads", "n_head", "num_heads")
    hidden = first("hidden_size", "d_model", "n_embd")
    kv_heads = first("num_key_value_heads") or heads
    head_dim = first("head_dim", "d_kv") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    itemsize: int = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * itemsize


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
                    self.hold(self.keys, self.values, with_room(length + added))
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


def decoder_cache(config: Any) -> Any:
    """An empty cache for a decoder-only model's prefill. Where every layer attends to all tokens
    or within a sliding window (Mistral, Qwen2, Gemma 2 and 3), its layers are all plain ones that
    keep every token: the model's mask applies the window in cache columns, where a row's tokens
    are adjacent, so rows pad together (transformers' sliding layers keep only the window, which
    the batch's padding mask cannot follow). Other layers (linear or chunked attention) keep the
    model's own cache."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    windowed = (_dynamic_layer(), DynamicSlidingWindowLayer)
    chunked = getattr(config, "attention_chunk_size", None) is not None
    if chunked or not all(type(layer) in windowed for layer in cache.layers):
        return cache
    return DynamicCache()  # its layers are made as the prefill reaches them, all plain


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
