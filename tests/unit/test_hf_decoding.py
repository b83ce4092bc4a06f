"""The batch of generations on its own: rows joining between steps (into places finished rows left, or added to the
batch), leaving, the batch compacted and its unused columns cut off; every row's tokens are transformers' generate's
for that prompt alone, greedy, for decoder-only and encoder-decoder models (relative and absolute positions)."""

from __future__ import annotations

import random
from pathlib import Path

import hf_models
import pytest
import torch

from mme_runtime.huggingface import decoding as hf_decoding
from mme_runtime.huggingface.decoding import DecodingBatch, Row


def _model(kind: str, directory: Path) -> torch.nn.Module:
    import transformers

    source = getattr(hf_models, kind)(directory / kind)
    auto = transformers.AutoModelForCausalLM if kind == "gpt2" else transformers.AutoModelForSeq2SeqLM
    return auto.from_pretrained(source).eval()


@pytest.mark.parametrize("kind", ["gpt2", "t5", "bart"])
def test_rows_joining_and_leaving_get_generates_tokens_alone(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_decoding, "TRIM_COLUMNS", 4)  # cut unused columns often
    model = _model(kind, tmp_path)
    rng = random.Random(5)
    vocabulary = model.config.vocab_size
    cases = [([rng.randrange(3, vocabulary) for _ in range(rng.randint(1, 30))], rng.randint(1, 30)) for _ in range(24)]
    encoder_decoder = model.config.is_encoder_decoder
    start = model.generation_config.decoder_start_token_id
    rows = []
    for prompt, new_tokens in cases:
        row = Row(prompt, new_tokens, frozenset({model.generation_config.eos_token_id}))
        row.tokens = [start] if encoder_decoder else []
        rows.append(row)
    arrivals = sorted((rng.randint(0, 25), index) for index in range(len(rows)))
    batch = DecodingBatch(model)
    widest, step = 0, 0
    with torch.inference_mode():
        while arrivals or batch.rows:
            joining = [rows[index] for at, index in arrivals if at <= step]
            arrivals = [(at, index) for at, index in arrivals if at > step]
            if joining:
                batch.admit(joining)
            batch.drop([row for row in batch.live if row.finish is not None])
            if batch.rows:
                widest = max(widest, len(batch.rows))
                batch.step()
                batch.drop([row for row in batch.live if row.finish is not None])
            step += 1
    batch.close()
    assert widest > 4  # rows shared steps
    for (prompt, new_tokens), row in zip(cases, rows, strict=True):
        ids = torch.tensor([prompt])
        expected = model.generate(  # no forced end token: these rows have no logits processors
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            forced_eos_token_id=None,
        )
        assert row.tokens == expected[0].tolist(), prompt


def test_a_row_takes_the_place_a_finished_row_left(tmp_path: Path) -> None:
    model = _model("gpt2", tmp_path)
    batch = DecodingBatch(model)
    with torch.inference_mode():
        first, second, third = Row([5, 6, 7, 8], 1), Row([9, 10, 11, 12, 13], 50), Row([3, 4], 50)
        batch.admit([first, second, third])
        batch.drop([first])
        assert batch.rows == [None, second, third]
        fourth = Row([14, 15], 3)
        batch.admit([fourth])
        assert batch.rows == [fourth, second, third]  # written in place, nothing copied
        batch.step()
    batch.close()
