"""The rows of a batched generation, decoded one token per step with one KV cache: rows join between steps (their
prompts prefilled together, their caches padded into the batch's) and leave when done (their cache rows dropped).

Each row's decoder tokens sit at the right of the batch's self-attention cache (padded on the left, the attention
mask hiding the padding) and its encoder's outputs at the left of the cross-attention cache (padded on the right).
Each row keeps its own positions: decoder-only models take ``position_ids``; an encoder-decoder whose decoder adds
absolute position embeddings (BART, Marian) gets each row's own through a hook on that module; T5's relative
positions need nothing. A row alone is prefilled and decoded with the arguments ``generate`` passes, so a lone
client's tokens are ``generate``'s; each row picks its tokens as ``generate`` would for it alone (``hf_rows.py``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from mme_runtime.serving.hf_rows import Row, pick_tokens, record


class DecodingBatch:
    """The rows being decoded together on one model, and their caches. Not thread-safe: one scheduler thread owns it."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache, EncoderDecoderCache

        self._caches = (DynamicCache, EncoderDecoderCache)
        self.model = model
        self.encoder_decoder = bool(model.config.is_encoder_decoder)
        self.device = next(model.parameters()).device
        parameters = set(inspect.signature(model.forward).parameters)
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        self.rows: list[Row] = []
        self._positions_module = _absolute_positions(model) if self.encoder_decoder else None
        self._override: torch.Tensor | None = None
        if self._positions_module is not None:
            self._hook = self._positions_module.register_forward_hook(self._own_positions)
        # Rows may join a running batch only where each keeps its own positions; otherwise only an empty one.
        self.joinable = "position_ids" in parameters if not self.encoder_decoder else _relative_or_hooked(model)
        self._reset()

    def _reset(self) -> None:
        self.rows = []
        self.cache: Any = None
        self.mask = self.positions = self.next = torch.empty(0)
        self.encoded = self.encoder_mask = torch.empty(0)

    def close(self) -> None:
        if self._positions_module is not None:
            self._hook.remove()
        self._reset()

    def fail_all(self) -> list[Row]:
        """Drops every row (a step failed): their caches go; the caller answers them."""
        rows = self.rows
        self._reset()
        return rows

    def consistent(self) -> bool:
        """Whether every row has its cache row (a failed merge may leave them apart)."""
        return not self.rows or self.mask.shape[0] == self.next.shape[0] == len(self.rows)

    def admit(self, rows: list[Row]) -> None:
        """Prefills ``rows`` together and adds them to the batch, each with its first token picked."""
        if self.encoder_decoder:
            outputs, mask, positions, encoded, encoder_mask = self._prefill_encoder_decoder(rows)
        else:
            outputs, mask, positions = self._prefill_decoder(rows)
            encoded = encoder_mask = torch.empty(0)
        tokens = pick_tokens(rows, outputs.logits[:, -1].to(copy=True, dtype=torch.float32), self.device)
        if not all(type(layer).__name__ == "DynamicLayer" for layer in _layers(outputs.past_key_values)):
            self.joinable = False  # sliding windows or linear attention: padding caches together is not safe
        self._merge(rows, outputs.past_key_values, mask, positions, tokens, encoded, encoder_mask)
        record(rows, tokens)

    def _prefill_decoder(self, rows: list[Row]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        lengths = [len(row.prompt) for row in rows]
        longest = max(lengths)
        ids = torch.tensor([[0] * (longest - len(row.prompt)) + row.prompt for row in rows], device=self.device)
        mask = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths], device=self.device)
        for row in rows:
            row.tokens = list(row.prompt)
        padded = bool((mask == 0).any())
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's, from the mask
        cache = self._caches[0](config=self.model.config.get_text_config(decoder=True))
        outputs = self.model(
            input_ids=ids,
            attention_mask=mask if padded else None,  # generate drops a mask of ones
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
            **self._keep,
        )
        return outputs, mask, torch.tensor(lengths, device=self.device)

    def _prefill_encoder_decoder(self, rows: list[Row]) -> tuple[Any, ...]:
        from transformers.modeling_outputs import BaseModelOutput

        lengths = [len(row.prompt) for row in rows]
        longest = max(lengths)
        pad = int(self.model.config.pad_token_id or 0)
        ids = torch.tensor([row.prompt + [pad] * (longest - len(row.prompt)) for row in rows], device=self.device)
        encoder_mask = torch.tensor([[1] * n + [0] * (longest - n) for n in lengths], device=self.device)
        encoded = self.model.get_encoder()(input_ids=ids, attention_mask=encoder_mask, return_dict=True)
        starts = [[row.tokens[0]] for row in rows]  # the decoder's start token, set by the planner
        config = self.model.config.get_text_config(decoder=True)
        cache = self._caches[1](self._caches[0](config=config), self._caches[0](config=config))
        outputs = self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=encoded.last_hidden_state),
            attention_mask=encoder_mask,
            decoder_input_ids=torch.tensor(starts, device=self.device),
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
            **self._keep,
        )
        ones = torch.ones(len(rows), 1, dtype=torch.long, device=self.device)
        return outputs, ones, ones[:, 0].clone(), encoded.last_hidden_state, encoder_mask

    def _merge(
        self,
        rows: list[Row],
        cache: Any,
        mask: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        encoded: torch.Tensor,
        encoder_mask: torch.Tensor,
    ) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.positions, self.next = list(rows), cache, mask, positions, tokens
            self.encoded, self.encoder_mask = encoded, encoder_mask
            return
        length = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(_layers(self._self_cache(self.cache)), _layers(self._self_cache(cache)), strict=True):
            old.keys = torch.cat([_pad(old.keys, length, 2, left=True), _pad(new.keys, length, 2, left=True)])
            old.values = torch.cat([_pad(old.values, length, 2, left=True), _pad(new.values, length, 2, left=True)])
        self.mask = torch.cat([_pad(self.mask, length, 1, left=True), _pad(mask, length, 1, left=True)])
        if self.encoder_decoder:
            source = max(self.encoded.shape[1], encoded.shape[1])
            crossed = zip(_layers(self.cache.cross_attention_cache), _layers(cache.cross_attention_cache), strict=True)
            for old, new in crossed:
                old.keys = torch.cat([_pad(old.keys, source, 2), _pad(new.keys, source, 2)])
                old.values = torch.cat([_pad(old.values, source, 2), _pad(new.values, source, 2)])
            self.encoded = torch.cat([_pad(self.encoded, source, 1), _pad(encoded, source, 1)])
            self.encoder_mask = torch.cat([_pad(self.encoder_mask, source, 1), _pad(encoder_mask, source, 1)])
        self.positions = torch.cat([self.positions, positions])
        self.next = torch.cat([self.next, tokens])
        self.rows += rows

    def step(self) -> None:
        """One token for every row."""
        count = len(self.rows)
        mask = torch.cat([self.mask, torch.ones(count, 1, dtype=self.mask.dtype, device=self.device)], dim=1)
        padded = bool((mask == 0).any())
        inputs = self.next.unsqueeze(1)
        if self.encoder_decoder:
            from transformers.modeling_outputs import BaseModelOutput

            self._override = self.positions.unsqueeze(1)
            try:
                outputs = self.model(
                    encoder_outputs=BaseModelOutput(last_hidden_state=self.encoded),
                    attention_mask=self.encoder_mask,
                    decoder_input_ids=inputs,
                    decoder_attention_mask=mask if padded else None,
                    past_key_values=self.cache,
                    use_cache=True,
                    return_dict=True,
                    **self._keep,
                )
            finally:
                self._override = None
        else:
            outputs = self.model(
                input_ids=inputs,
                attention_mask=mask if padded else None,
                position_ids=self.positions.unsqueeze(1),
                past_key_values=self.cache,
                use_cache=True,
                return_dict=True,
                **self._keep,
            )
        self.cache = outputs.past_key_values
        self.mask, self.positions = mask, self.positions + 1
        self.next = pick_tokens(self.rows, outputs.logits[:, -1].to(copy=True, dtype=torch.float32), self.device)
        record(self.rows, self.next)

    def drop(self, leaving: list[Row]) -> None:
        """Takes ``leaving`` out of the batch, and the padding no row needs any more."""
        gone = {id(row) for row in leaving}
        keep = [index for index, row in enumerate(self.rows) if id(row) not in gone]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(index)
        self.rows = [self.rows[i] for i in keep]
        self.mask, self.positions, self.next = self.mask[index], self.positions[index], self.next[index]
        first = int(torch.nonzero(self.mask.sum(0))[0])
        if first:
            self.mask = self.mask[:, first:]
            for layer in _layers(self._self_cache(self.cache)):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        if self.encoder_decoder:
            self.encoded, self.encoder_mask = self.encoded[index], self.encoder_mask[index]
            end = int(torch.nonzero(self.encoder_mask.sum(0))[-1]) + 1
            if end < self.encoder_mask.shape[1]:
                self.encoded, self.encoder_mask = self.encoded[:, :end], self.encoder_mask[:, :end]
                for layer in _layers(self.cache.cross_attention_cache):
                    layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]

    def _self_cache(self, cache: Any) -> Any:
        return cache.self_attention_cache if self.encoder_decoder else cache

    def _own_positions(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        """Each row's own decoder position embedding, where the module would give all rows the cache's length."""
        if self._override is None:
            return output
        assert isinstance(module, torch.nn.Embedding)
        return torch.nn.Embedding.forward(module, self._override + int(getattr(module, "offset", 0)))


def _layers(cache: Any) -> list[Any]:
    if hasattr(cache, "self_attention_cache"):
        return [*cache.self_attention_cache.layers, *cache.cross_attention_cache.layers]
    return list(cache.layers)


def _pad(tensor: torch.Tensor, length: int, dim: int, left: bool = False) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    zeros = tensor.new_zeros(shape)
    return torch.cat([zeros, tensor] if left else [tensor, zeros], dim=dim)


def _absolute_positions(model: Any) -> torch.nn.Embedding | None:
    """The decoder's absolute position embedding (BART's learned, Marian's sinusoidal), where it has one."""
    module = getattr(model.get_decoder(), "embed_positions", None)
    return module if isinstance(module, torch.nn.Embedding) else None


def _relative_or_hooked(model: Any) -> bool:
    """An encoder-decoder whose rows can keep their own decoder positions: none absolute (T5), or one we hook."""
    decoder = model.get_decoder()
    return getattr(decoder, "embed_positions", None) is None or _absolute_positions(model) is not None
