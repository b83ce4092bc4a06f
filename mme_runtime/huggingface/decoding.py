"""The rows of a batched generation, decoded a token a step with one KV cache: rows join between
steps (prefilled together, each taking a finished row's place or added to the batch) and leave
when done (their place kept, the batch compacted once half of it is empty). A ``Row`` picks its
tokens as ``generate`` would for it alone (``pick_tokens``), or its beam group does
(``beams.py``): the group's rows are prefilled once, and after each step each beam's cache row
becomes a copy of its parent's.

Decoder tokens sit at the right of the self-attention cache (padded on the left, masked) and
encoder outputs at the left of the cross-attention cache; self-attention layers grow in place
(``kv_cache.py``), so a step copies nothing. Each row keeps its own positions: ``position_ids``
for a decoder-only model, a hook on an encoder-decoder's absolute position embedding (BART,
Marian); T5's need nothing.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from mme_runtime.huggingface.kv_cache import (
    TRIM_COLUMNS,
    all_plain,
    copy_rows,
    decoder_cache,
    join,
    pad,
    regrow,
    select,
    write_row,
)

# Finish reasons: the model's end token, max_new_tokens, a stop sequence, the time limit.
EOS, LENGTH, STOP, TIME = "eos", "length", "stop", "time"


@dataclass(eq=False)
class Row:
    """One sequence to generate: a prompt (an encoder-decoder's encoder input) and how to pick its
    tokens."""

    prompt: list[int]
    max_new_tokens: int
    model: str | None = None  # the model it is for: a LoRA adapter's name picks its adapter
    eos: frozenset[int] = frozenset()
    processors: Any = None  # a transformers LogitsProcessorList, or None: the raw logits
    do_sample: bool = False
    generator: torch.Generator | None = None  # None: the global generator, as the pipeline draws
    stopped: Callable[[Row], bool] | None = None  # a stop sequence seen (checked by the scheduler)
    deadline: float = float("inf")  # time.monotonic() after which it is cut
    group: Any = None  # its beams.BeamGroup, which picks its tokens and ends it
    owner: Any = None  # what submitted it (a model's runner): its UNLOAD withdraws its rows
    series: Any = None  # the metrics series of its model, which records its steps
    # the decoder's: prompt + new (decoder-only), or start + new
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    finish: str | None = None
    joined_at: float = 0.0
    error: BaseException | None = None


def pick_tokens(
    rows: Sequence[Row | None], logits: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Each row's next token from its logits, as ``generate`` picks it for that row alone (an empty
    place: argmax)."""
    tokens: list[torch.Tensor | None] = [None] * len(rows)
    plain = [
        i
        for i, row in enumerate(rows)
        if row is None or (row.processors is None and not row.do_sample)
    ]
    if len(plain) == len(rows):
        return torch.argmax(logits, dim=-1)
    if plain:
        chosen = torch.argmax(logits[plain], dim=-1)
        for position, index in enumerate(plain):
            tokens[index] = chosen[position : position + 1]
    for index, row in enumerate(rows):
        if row is None or tokens[index] is not None:
            continue
        scores = logits[index : index + 1]
        if row.processors is not None:
            scores = row.processors(torch.tensor([row.tokens], device=device), scores)
        if row.do_sample:
            probabilities = torch.nn.functional.softmax(scores, dim=-1)
            tokens[index] = torch.multinomial(
                probabilities, num_samples=1, generator=row.generator
            ).squeeze(1)
        else:
            tokens[index] = torch.argmax(scores, dim=-1)
    return torch.cat([token for token in tokens if token is not None])


def advance_groups(
    rows: Sequence[Row | None], logits: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each beam group among ``rows`` takes its step on its rows' logits: its beams' next tokens go
    into ``tokens``. Returns the rows whose caches become copies of others' (into, from), or None
    where there is no group."""
    places = {id(row): index for index, row in enumerate(rows) if row is not None}
    groups = {id(row.group): row.group for row in rows if row is not None and row.group is not None}
    into, source = [], []
    for group in groups.values():
        slots = torch.tensor([places[id(row)] for row in group.rows], device=tokens.device)
        parents, chosen = group.advance(logits[slots])
        tokens[slots] = chosen
        into.append(slots)
        source.append(slots[parents])
    return (torch.cat(into), torch.cat(source)) if groups else None


def record(rows: Sequence[Row | None], tokens: torch.Tensor) -> None:
    """Each row's new token, and whether it ended the row (its end token, or ``max_new_tokens``);
    a beam group's rows are its own."""
    for row, token in zip(rows, tokens.tolist(), strict=True):
        if row is None or row.group is not None:
            continue
        row.tokens.append(token)
        row.generated += 1
        if token in row.eos:
            row.finish = EOS
        elif row.generated >= row.max_new_tokens:
            row.finish = LENGTH


class DecodingBatch:
    """The rows being decoded together on one model, and their caches. Not thread-safe: one
    scheduler thread owns it. ``rows`` has one entry per row of the caches: a ``Row``, or None for a
    place a finished row left. Where the model has LoRA adapters (``holder.adapters``,
    ``lora_layers.py``), each row's passes use its own model's."""

    def __init__(self, model: Any, holder: Any = None) -> None:
        from transformers import DynamicCache, EncoderDecoderCache

        self._caches = (DynamicCache, EncoderDecoderCache)
        self.model = model
        self._holder = holder
        self._selected: tuple[Any, Any] = ((), None)
        self.encoder_decoder = bool(model.config.is_encoder_decoder)
        self.device = next(model.parameters()).device
        parameters = set(inspect.signature(model.forward).parameters)
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        self._positions_module = _absolute_positions(model) if self.encoder_decoder else None
        # Each row's positions while this thread runs a step: a generate alone on another thread
        # (prompt lookup) runs the same module meanwhile, and must get its own.
        self._override = threading.local()
        if self._positions_module is not None:
            self._hook = self._positions_module.register_forward_hook(self._own_positions)
        # Rows may join a running batch only where each keeps its own positions; otherwise only an
        # empty one.
        self.joinable = (
            "position_ids" in parameters if not self.encoder_decoder else _relative_or_hooked(model)
        )
        self._reset()

    def _adapters(
        self, rows: Sequence[Row | None], steps: bool = False
    ) -> AbstractContextManager[Any]:
        """The passes in this block give each row its own model's adapter (``steps``: the batch's
        rows, whose selection is kept while they and the adapters stay the same)."""
        adapters = getattr(self._holder, "adapters", None)
        if adapters is None:
            return nullcontext()
        names = tuple(None if row is None else row.model for row in rows)
        if not steps:
            return adapters.using(adapters.selection(list(names)))  # type: ignore[no-any-return]
        key = (names, adapters.version)
        if self._selected[0] != key:
            self._selected = (key, adapters.selection(list(names)))
        return adapters.using(self._selected[1])  # type: ignore[no-any-return]

    def _reset(self) -> None:
        self._selected = ((), None)  # the steps' adapters (their columns held by its plans)
        self.rows: list[Row | None] = []
        self.cache: Any = None
        self.mask = self.positions = self.next = self.alive = torch.empty(0)
        self.encoded = self.encoder_mask = torch.empty(0)

    @property
    def live(self) -> list[Row]:
        return [row for row in self.rows if row is not None]

    def close(self) -> None:
        if self._positions_module is not None:
            self._hook.remove()
        self._reset()

    def fail_all(self) -> list[Row]:
        """Drops every row (a step failed): their caches go; the caller answers them."""
        rows = self.live
        self._reset()
        return rows

    def consistent(self) -> bool:
        """Whether every row has its cache row (a failed merge may leave them apart)."""
        return not self.rows or self.mask.shape[0] == self.next.shape[0] == self.alive.shape[
            0
        ] == len(self.rows)

    def admit(self, rows: list[Row]) -> None:
        """Prefills ``rows`` together (a beam group's once, copied to each of its rows) and adds
        them to the batch, each with its first token picked."""
        firsts = [row if row.group is None else row.group.rows[0] for row in rows]
        unique = list({id(row): row for row in firsts}.values())
        if self.encoder_decoder:
            outputs, mask, positions, encoded, encoder_mask = self._prefill_encoder_decoder(unique)
        else:
            outputs, mask, positions = self._prefill_decoder(unique)
            encoded = encoder_mask = torch.empty(0)
        logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
        cache = outputs.past_key_values
        if len(unique) < len(rows):  # a group's beams start alike, as generate's do
            order = {id(row): index for index, row in enumerate(unique)}
            copies = torch.tensor([order[id(row)] for row in firsts], device=self.device)
            cache.reorder_cache(copies)
            logits, mask, positions = logits[copies], mask[copies], positions[copies]
            if self.encoder_decoder:
                encoded, encoder_mask = encoded[copies], encoder_mask[copies]
        tokens = pick_tokens(list(rows), logits, self.device)
        advance_groups(rows, logits, tokens)  # its rows alike: no cache row to copy
        if not all_plain(cache):
            # sliding windows or linear attention: padding caches together is not safe
            self.joinable = False
        if not self.rows:
            regrow(cache)
            self.rows, self.cache, self.mask, self.positions, self.next = (
                list(rows),
                cache,
                mask,
                positions,
                tokens,
            )
            self.alive = torch.ones(len(rows), dtype=torch.bool, device=self.device)
            self.encoded, self.encoder_mask = encoded, encoder_mask
        else:
            self._place(rows, cache, mask, positions, tokens, encoded, encoder_mask)
        record(list(rows), tokens)

    def _place(
        self,
        rows: list[Row],
        cache: Any,
        mask: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        encoded: torch.Tensor,
        encoder_mask: torch.Tensor,
    ) -> None:
        """Each joining row takes the place of a finished one where its tokens fit (written in
        place); the others are added to the batch (the caches padded to a common length and copied
        once)."""
        holes = [index for index, row in enumerate(self.rows) if row is None]
        length, added = self.mask.shape[1], []
        for index, row in enumerate(rows):
            tokens_in = int(mask[index].sum())
            source = int(encoder_mask[index].sum()) if self.encoder_decoder else 0
            if (
                not holes
                or tokens_in > length
                or (self.encoder_decoder and source > self.encoded.shape[1])
            ):
                added.append(index)
                continue
            slot = holes.pop(0)
            write_row(self.cache, slot, cache, index, tokens_in, length, source)
            self.mask[slot] = 0
            self.mask[slot, length - tokens_in :] = 1
            self.positions[slot], self.next[slot], self.alive[slot] = (
                positions[index],
                tokens[index],
                True,
            )
            if self.encoder_decoder:
                self.encoded[slot, :source] = encoded[index, :source]
                self.encoder_mask[slot] = 0
                self.encoder_mask[slot, :source] = 1
            self.rows[slot] = row
        if not added:
            return
        picked = torch.tensor(added, device=self.device)
        length = max(length, mask.shape[1])
        source = max(self.encoded.shape[1], encoded.shape[1]) if self.encoder_decoder else 0
        join(self.cache, cache, picked, length, source)
        self.mask = torch.cat(
            [pad(self.mask, length, 1, left=True), pad(mask[picked], length, 1, left=True)]
        )
        if self.encoder_decoder:
            self.encoded = torch.cat(
                [pad(self.encoded, source, 1), pad(encoded[picked], source, 1)]
            )
            self.encoder_mask = torch.cat(
                [pad(self.encoder_mask, source, 1), pad(encoder_mask[picked], source, 1)]
            )
        self.positions = torch.cat([self.positions, positions[picked]])
        self.next = torch.cat([self.next, tokens[picked]])
        self.alive = torch.cat(
            [self.alive, torch.ones(len(added), dtype=torch.bool, device=self.device)]
        )
        self.rows += [rows[i] for i in added]

    def _prefill_decoder(self, rows: list[Row]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        lengths = [len(row.prompt) for row in rows]
        longest = max(lengths)
        ids = torch.tensor(
            [[0] * (longest - len(row.prompt)) + row.prompt for row in rows], device=self.device
        )
        mask = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths], device=self.device)
        for row in rows:
            row.tokens = list(row.prompt)
        padded = bool((mask == 0).any())
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's, from the mask
        cache = decoder_cache(self.model.config.get_text_config(decoder=True))
        with self._adapters(rows):
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
        ids = torch.tensor(
            [row.prompt + [pad] * (longest - len(row.prompt)) for row in rows], device=self.device
        )
        encoder_mask = torch.tensor(
            [[1] * n + [0] * (longest - n) for n in lengths], device=self.device
        )
        starts = [[row.tokens[0]] for row in rows]  # the decoder's start token, set by the planner
        config = self.model.config.get_text_config(decoder=True)
        cache = self._caches[1](self._caches[0](config=config), self._caches[0](config=config))
        with self._adapters(rows):
            encoded = self.model.get_encoder()(
                input_ids=ids, attention_mask=encoder_mask, return_dict=True
            )
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

    def step(self) -> None:
        """One token for every row (a place left empty decodes too, its token unread)."""
        count = len(self.rows)
        mask = torch.cat(
            [self.mask, torch.ones(count, 1, dtype=self.mask.dtype, device=self.device)], dim=1
        )
        padded = bool((mask == 0).any())
        inputs = self.next.unsqueeze(1)
        if self.encoder_decoder:
            from transformers.modeling_outputs import BaseModelOutput

            self._override.positions = self.positions.unsqueeze(1)
            try:
                with self._adapters(self.rows, steps=True):
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
                self._override.positions = None
        else:
            with self._adapters(self.rows, steps=True):
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
        self.mask = mask
        # An empty place stays at position 0, so that it never runs past the model's positions.
        self.positions = torch.where(self.alive, self.positions + 1, 0)
        logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
        self.next = pick_tokens(self.rows, logits, self.device)
        moves = advance_groups(self.rows, logits, self.next)
        if moves is not None:
            copy_rows(self.cache, *moves)  # each beam goes on from its parent's cache
        record(self.rows, self.next)

    def drop(self, leaving: list[Row]) -> None:
        """Takes ``leaving`` out of the batch: their places stay for rows that join, until half the
        batch is empty (then it is compacted); columns no row attends to any more are cut off once
        there are ``TRIM_COLUMNS``."""
        gone = {id(row) for row in leaving}
        for index, row in enumerate(self.rows):
            if row is not None and id(row) in gone:
                self.rows[index] = None
                self.mask[index] = 0  # from now on it attends only to what it decodes itself
                self.alive[index] = False
                if self.encoder_decoder:
                    self.encoder_mask[index] = 0
                    self.encoder_mask[index, 0] = 1
        live = [index for index, row in enumerate(self.rows) if row is not None]
        if not live:
            self._reset()
            return
        attended = torch.nonzero(self.mask[self.alive].sum(0))
        first = int(attended[0]) if len(attended) else 0
        compact = 2 * len(live) <= len(self.rows)
        if not compact and first < TRIM_COLUMNS:
            return
        kept = torch.tensor(live if compact else range(len(self.rows)), device=self.device)
        end = None
        if self.encoder_decoder:
            end = int(torch.nonzero(self.encoder_mask[kept].sum(0))[-1]) + 1
            self.encoded, self.encoder_mask = (
                self.encoded[kept, :end],
                self.encoder_mask[kept, :end],
            )
        select(self.cache, kept, first, end)
        self.rows = [self.rows[i] for i in kept.tolist()]
        self.mask, self.positions = self.mask[kept, first:], self.positions[kept]
        self.next, self.alive = self.next[kept], self.alive[kept]

    def _own_positions(
        self, module: torch.nn.Module, args: Any, output: torch.Tensor
    ) -> torch.Tensor:
        """Each row's own decoder position embedding, where the module would give all rows the
        cache's length."""
        positions = getattr(self._override, "positions", None)
        if positions is None:
            return output
        assert isinstance(module, torch.nn.Embedding)
        return torch.nn.Embedding.forward(module, positions + int(getattr(module, "offset", 0)))


def _absolute_positions(model: Any) -> torch.nn.Embedding | None:
    """The decoder's absolute position embedding (BART's learned, Marian's sinusoidal), where it has
    one."""
    module = getattr(model.get_decoder(), "embed_positions", None)
    return module if isinstance(module, torch.nn.Embedding) else None


def _relative_or_hooked(model: Any) -> bool:
    """An encoder-decoder whose rows can keep their own decoder positions: none absolute (T5), or
    one we hook."""
    decoder = model.get_decoder()
    return (
        getattr(decoder, "embed_positions", None) is None or _absolute_positions(model) is not None
    )
