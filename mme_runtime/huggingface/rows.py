"""One row of a batched generation (``decoding.py``) and how it picks its next token: as ``generate`` picks it for
that row alone, its own logits processors over its own tokens, then argmax, or a draw with its own
``torch.Generator`` (the global one if it has none, as the pipeline draws).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Finish reasons: the model's end token, max_new_tokens, a stop sequence, the time limit.
EOS, LENGTH, STOP, TIME = "eos", "length", "stop", "time"


@dataclass(eq=False)
class Row:
    """One sequence to generate: a prompt (an encoder-decoder's encoder input) and how to pick its tokens."""

    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int] = frozenset()
    processors: Any = None  # a transformers LogitsProcessorList, or None: the raw logits
    do_sample: bool = False
    generator: torch.Generator | None = None  # None: the global generator, as the pipeline draws
    stopped: Callable[[Row], bool] | None = None  # a stop sequence seen (checked by the scheduler)
    deadline: float = float("inf")  # time.monotonic() after which it is cut
    tokens: list[int] = field(default_factory=list)  # the decoder's: prompt + new (decoder-only), or start + new
    generated: int = 0
    finish: str | None = None
    joined_at: float = 0.0
    error: BaseException | None = None


def pick_tokens(rows: Sequence[Row | None], logits: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Each row's next token from its logits, as ``generate`` picks it for that row alone (an empty place: argmax)."""
    tokens: list[torch.Tensor | None] = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if row is None or (row.processors is None and not row.do_sample)]
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
            tokens[index] = torch.multinomial(probabilities, num_samples=1, generator=row.generator).squeeze(1)
        else:
            tokens[index] = torch.argmax(scores, dim=-1)
    return torch.cat([token for token in tokens if token is not None])


def record(rows: Sequence[Row | None], tokens: torch.Tensor) -> None:
    """Each row's new token, and whether it ended the row (its end token, or ``max_new_tokens``)."""
    for row, token in zip(rows, tokens.tolist(), strict=True):
        if row is None:
            continue
        row.tokens.append(token)
        row.generated += 1
        if token in row.eos:
            row.finish = EOS
        elif row.generated >= row.max_new_tokens:
            row.finish = LENGTH
