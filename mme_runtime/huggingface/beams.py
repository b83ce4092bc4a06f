"""Beam search in the continuous batch: the beams of one input are rows of the batch (a group) that
decode with every other row; after each step the group picks its beams as transformers' beam
search picks them for that input alone, and says which row each beam continues.

Its arithmetic is ``GenerationMixin._beam_search``'s in transformers 5.23 for a batch of one, with
the same helpers; keep it in step with that function when transformers moves. Nothing here runs
the model or touches the cache: ``decoding.py`` does. Also which of ``generate``'s other modes
cannot be served (``unserved_mode_reason``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mme_runtime.huggingface.decoding import EOS, LENGTH, TIME, Row

# The generation modes decoded as beam groups (``GenerationConfig.get_generation_mode``).
BEAM_MODES = frozenset({"beam_search", "beam_sample"})


class BeamGroup:
    """The ``num_beams`` rows of one input (``rows``, beam i in row i, for the model ``name``) and
    its beam search state, with ``generate``'s logits ``processors`` and stopping ``criteria``. Its
    rows join the batch together, are prefilled once (``DecodingBatch.admit`` copies the first
    row's prefill), and leave together when ``advance`` ends the search."""

    def __init__(
        self,
        model: Any,
        config: Any,
        processors: Any,
        criteria: Any,
        prompt: list[int],
        name: str | None = None,
        generator: torch.Generator | None = None,
        deadline: float = float("inf"),
    ) -> None:
        self._model = model  # for transformers' beam search helpers
        self._processors, self._criteria = processors, criteria
        self._generator = generator  # a seeded beam sample's own draws
        self._do_sample = bool(config.do_sample)
        self._early_stopping = config.early_stopping
        self._length_penalty = config.length_penalty
        self._max_length = int(config.max_length)
        self._returned = config.num_return_sequences or 1
        self.deadline = deadline  # its rows have none: the group ends them all at once
        beams = self.size = int(config.num_beams)
        # the decoder's tokens before the first new one
        start = list(prompt)
        if model.config.is_encoder_decoder:
            start = [int(config._decoder_start_token_tensor.view(-1)[0])]
        self.rows = [
            Row(prompt, config.max_new_tokens, name, tokens=list(start), group=self)
            for _ in range(beams)
        ]
        device = next(model.parameters()).device
        self._prompt = self._length = len(start)
        eos, pad = config._eos_token_tensor, config._pad_token_tensor
        fill = pad or eos[0] if eos is not None else -1  # as _beam_search fills its sequences
        self._running = torch.full(
            (1, beams, self._max_length), fill, dtype=torch.int64, device=device
        )
        self._running[:, :, : self._length] = torch.tensor(start, device=device)
        self._sequences = self._running.detach().clone()
        self._running_scores = torch.zeros((1, beams), dtype=torch.float, device=device)
        self._running_scores[:, 1:] = -1e9  # the first step draws from the first beam alone
        self._scores = torch.full((1, beams), -1e9, dtype=torch.float, device=device)
        self._finished = torch.zeros((1, beams), dtype=torch.bool, device=device)
        self._improvable = torch.ones((1, 1), dtype=torch.bool, device=device)
        indices = (1, beams, self._max_length - self._length)
        self._running_indices = torch.full(indices, -1, dtype=torch.int32, device=device)
        self._indices = self._running_indices.detach().clone()
        self._keep = max(2, 1 + (0 if eos is None else eos.shape[0])) * beams
        self._top = torch.cat(
            (
                torch.ones(beams, dtype=torch.bool),
                torch.zeros(self._keep - beams, dtype=torch.bool),
            )
        ).to(device)

    def advance(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the search from its rows' logits (float32, beam i in row i): each beam's
        parent (the row whose cache it continues) and its next token. At the end of the search
        its rows get their ``finish``."""
        model, beams, length = self._model, self.size, self._length
        running = self._running[0, :, :length]
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        if self._processors is not None:
            log_probs = self._processors(running, log_probs)
        log_probs = log_probs.reshape(1, beams, -1) + self._running_scores[:, :, None]
        log_probs = log_probs.reshape(1, -1)
        top, sequences, indices = self._top_k(log_probs)
        hits = self._criteria(model._flatten_beam_dim(sequences[:, :, : length + 1]), None)
        cut = time.monotonic() >= self.deadline
        if cut:  # as generate's max_time: every candidate ends here
            hits = torch.ones_like(hits)
        hits = hits.view(1, self._keep)
        running = model._get_running_beams_for_next_iteration(
            topk_log_probs=top,
            topk_running_sequences=sequences,
            topk_running_beam_indices=indices,
            next_token_hits_stopping_criteria=hits,
            num_beams=beams,
        )
        self._running, self._running_scores, self._running_indices = running
        finished = model._update_finished_beams(
            sequences=self._sequences,
            topk_running_sequences=sequences,
            beam_scores=self._scores,
            topk_log_probs=top,
            beam_indices=self._indices,
            topk_running_beam_indices=indices,
            is_early_stop_heuristic_unsatisfied=self._improvable,
            is_sent_finished=self._finished,
            next_token_hits_stopping_criteria=hits,
            top_num_beam_mask=self._top,
            num_beams=beams,
            cur_len=length,
            decoder_prompt_len=self._prompt,
            length_penalty=self._length_penalty,
            early_stopping=self._early_stopping,
        )
        self._sequences, self._scores, self._indices, self._finished = finished
        parents = self._running_indices[0, :, length - self._prompt].to(torch.long)
        self._length = length = length + 1
        self._improvable = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self._improvable,
            running_beam_scores=self._running_scores,
            beam_scores=self._scores,
            is_sent_finished=self._finished,
            cur_len=length,
            max_length=self._max_length,
            decoder_prompt_len=self._prompt,
            early_stopping=self._early_stopping,
            length_penalty=self._length_penalty,
        )
        going = model._beam_search_has_unfinished_sequences(
            self._improvable, self._finished, hits, self._early_stopping
        )
        if not bool(going):
            finish = TIME if cut else LENGTH if length >= self._max_length else EOS
            for row in self.rows:
                row.finish, row.generated = finish, length - self._prompt
        return parents, self._running[0, :, length - 1]

    def _top_k(self, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The best (or drawn) continuations of every beam: transformers' own, or for a seeded
        beam sample the same drawn from the request's generator."""
        length = self._length
        if self._generator is None:
            return self._model._get_top_k_continuations(  # type: ignore[no-any-return]
                accumulated_log_probs=log_probs,
                running_sequences=self._running,
                running_beam_indices=self._running_indices,
                cur_len=length,
                decoder_prompt_len=self._prompt,
                do_sample=self._do_sample,
                beams_to_keep=self._keep,
                num_beams=self.size,
                batch_size=1,
            )
        chosen = torch.multinomial(
            torch.nn.functional.softmax(log_probs, dim=-1),
            num_samples=self._keep,
            generator=self._generator,
        )
        top = torch.gather(input=log_probs, dim=1, index=chosen)
        parents = chosen // (log_probs.shape[-1] // self.size)
        indices = self._model._gather_beams(self._running_indices, parents)
        sequences = self._model._gather_beams(self._running, parents)
        sequences[:, :, length] = chosen % (log_probs.shape[-1] // self.size)
        indices[:, :, length - self._prompt] = parents
        return top, sequences, indices

    def sequences(self) -> list[list[int]]:
        """The best ``num_return_sequences`` hypotheses, as ``generate`` returns them (padded to
        the longest)."""
        sequences = self._sequences[0, : self._returned]
        generated = int((self._indices[0, : self._returned] + 1).bool().sum(dim=1).max())
        return sequences[:, : self._prompt + generated].tolist()


def unserved_mode_reason(mode: str) -> str | None:
    """Why a decoding mode cannot be served, or None: transformers 5 moved contrastive search, group
    and constrained beam search and DoLa to ``custom_generate`` repositories on the Hub, and
    ``generate`` would download their code, which a server must not do."""
    from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMode

    where = GENERATION_MODES_MAPPING.get(GenerationMode(mode), "")
    if "/" not in where:
        return None
    return (
        f"{mode.replace('_', ' ')} is not served here: transformers keeps its code on the Hub "
        f"({where}), which this server does not download"
    )
