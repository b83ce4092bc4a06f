"""A tokenizer's copies are lent a step at a time: one thread after another reuses one copy, threads at once get
copies of their own, models that share a tokenizer share its copies, and the copies go with the tokenizer."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import hf_models
from transformers import AutoTokenizer

from mme_runtime.huggingface import tasks as hf_tasks
from mme_runtime.huggingface.tasks import copies_of, lent_tokenizer


def a_tokenizer(tmp_path: Path) -> object:
    hf_models.tokenizer(tmp_path)
    return AutoTokenizer.from_pretrained(str(tmp_path))


def test_threads_one_after_another_share_one_copy(tmp_path: Path) -> None:
    tokenizer = a_tokenizer(tmp_path)
    seen = []

    def step() -> None:
        with lent_tokenizer(tokenizer) as own:
            seen.append(id(own))

    for _ in range(3):
        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
    assert copies_of(tokenizer).made == 1 and len(set(seen)) == 1


def test_threads_at_once_each_get_a_copy_no_other_uses(tmp_path: Path) -> None:
    tokenizer = a_tokenizer(tmp_path)
    inside = threading.Barrier(4)
    held: list[object] = []

    def step() -> None:
        with lent_tokenizer(tokenizer) as own:
            held.append(own)
            inside.wait(10)  # all four hold theirs at once
            assert own(hf_models.text_of_tokens(5, 1), truncation=True, max_length=4)["input_ids"]

    threads = [threading.Thread(target=step) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(own) for own in held}) == 4 and tokenizer not in held
    assert copies_of(tokenizer).made == 4
    with lent_tokenizer(tokenizer):  # later steps reuse them
        pass
    assert copies_of(tokenizer).made == 4


def test_the_copies_leave_with_their_tokenizer(tmp_path: Path) -> None:
    tokenizer = a_tokenizer(tmp_path)
    with lent_tokenizer(tokenizer) as own:
        assert own is not tokenizer
    key = id(tokenizer)
    assert key in hf_tasks._copies
    del tokenizer, own
    gc.collect()
    assert key not in hf_tasks._copies


def test_a_model_without_a_tokenizer_borrows_none() -> None:
    with lent_tokenizer(None) as own:
        assert own is None
