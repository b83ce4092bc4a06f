"""Rows of a batch padded into forward passes and cut back: the padding ``tasks.py`` runs Hugging Face models on.

Rows are grouped by length (``length_groups``), padded on the right whatever side the tokenizer pads (``pad``: the
attention mask hides the padding, and cutting back keeps each row's own tokens first), and each row's outputs are
cut back to what a pass over that row alone gives (``row``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# The keys of a prepared input that hold one entry per token: cut back to each row's own length after the pass.
TOKEN_KEYS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "special_tokens_mask",
        "offset_mapping",
        "start_logits",
        "end_logits",
    }
)
# Padding values of the keys a tokenizer or an image processor makes; anything else pads with 0.
PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1, "p_mask": 1}
# What one more forward pass costs, in tokens of padding: measured on the CPU for a BERT of 4 layers and hidden 256,
# a pass costs about 2.7 ms before its first token and 0.035 ms a token, in one row or sixteen. On a GPU the fixed
# cost weighs more still, so grouping by this figure errs towards fewer passes there.
PASS_COST_TOKENS = 64
MAX_ROWS_PLANNED = 256


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of ``lengths`` in groups that cost the fewest tokens in all: sorted by length, cut where a pass of its
    own (``PASS_COST_TOKENS``) costs less than padding the shorter rows up to the longer ones would."""
    order = sorted(range(len(lengths)), key=lambda index: lengths[index])
    groups: list[list[int]] = []
    for start in range(0, len(order), MAX_ROWS_PLANNED):  # the plan is quadratic in rows: plan long lists in windows
        window = order[start : start + MAX_ROWS_PLANNED]
        # best[i]: the cheapest cost of the first i rows, and where its last group starts.
        best = [(0, 0)] + [(0, 0)] * len(window)
        for end in range(1, len(window) + 1):
            longest = lengths[window[end - 1]]
            best[end] = min(
                (best[first][0] + PASS_COST_TOKENS + (end - first) * longest, first) for first in range(end)
            )
        cuts, end = [], len(window)
        while end > 0:
            cuts.append((best[end][1], end))
            end = best[end][1]
        groups += [window[first:end] for first, end in reversed(cuts)]
    return groups


def pad(rows: list[dict[str, Any]], pad_id: int | None) -> dict[str, Any]:
    """One batch of ``rows``: tensors padded on the right to the longest along their second dimension, and stacked
    (images are one size already); anything else listed. A tokenizer with no pad token pads with id 0: the
    attention mask hides it and every row is cut back before anyone reads it."""
    batch: dict[str, Any] = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if not all(isinstance(value, torch.Tensor) for value in values):
            batch[key] = values
            continue
        longest = max(value.shape[1] if value.dim() > 1 else 0 for value in values)
        fill = (pad_id or 0) if key == "input_ids" else PAD_VALUES.get(key, 0)
        padded = [_pad_right(value, longest, fill) for value in values]
        batch[key] = torch.cat(padded)
    return batch


def _pad_right(value: torch.Tensor, longest: int, fill: int) -> torch.Tensor:
    if value.dim() < 2 or value.shape[1] == longest:
        return value
    shape = (value.shape[0], longest - value.shape[1], *value.shape[2:])
    return torch.cat([value, torch.full(shape, fill, dtype=value.dtype)], dim=1)


def length(row: dict[str, Any]) -> int | None:
    ids = row.get("input_ids")
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else None


def row(batch: Any, index: int, prepared: dict[str, Any]) -> Any:
    """Row ``index`` of a batch's outputs, as a pass over that row alone would give them (batch dimension 1, and
    per-token values cut back to the row's ``length``)."""
    tokens = length(prepared)
    values = {key: _take(key, value, index, tokens) for key, value in batch.items()}
    return type(batch)(values) if isinstance(batch, dict) else values


def _take(key: str, value: Any, index: int, length: int | None) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        row = value[index : index + 1]
        per_token = length is not None and row.dim() >= 2 and (key in TOKEN_KEYS or row.dim() >= 3)
        return row[:, :length] if per_token else row
    if isinstance(value, np.ndarray) and value.ndim > 0:
        return value[index : index + 1]
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        return tuple(_take(key, element, index, length) for element in value)
    if isinstance(value, list):
        return value[index]
    return value
