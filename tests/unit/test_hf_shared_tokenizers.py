"""A Hugging Face model travels with its tokenizer pickled into a tensor of bytes that is the same for tokenizers
loaded from equal files anywhere (so a package holds it once), and a process unpickles each such tokenizer once per
task while a model holds it; a byte of difference or another task gives a tokenizer of its own."""

from __future__ import annotations

import gc
import json
import pickle
from pathlib import Path

import hf_models
import torch

from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface.loading import packed

TEXT = "a good movie about paris"


def fine_tunes(tmp_path: Path, count: int = 2) -> list[Path]:
    base = hf_models.bert_sized_vocabulary(hf_models.bert(tmp_path / "base"))
    return [hf_models.fine_tune(base, tmp_path / f"tune-{index}", index) for index in range(count)]


def loaded(directory: Path, task: str = "text-classification") -> hf_loading.HuggingFaceModel:
    return hf_loading.load(directory, task, trust_remote_code=False)


def test_tokenizers_from_equal_files_in_two_directories_pack_to_equal_bytes(tmp_path: Path) -> None:
    first, second = fine_tunes(tmp_path)
    one, two = packed(loaded(first).tokenizer), packed(loaded(second).tokenizer)
    assert torch.equal(one, two) and one.numel() > 100_000  # BERT's vocabulary: a blob of its own pages


def test_a_byte_of_difference_packs_to_other_bytes(tmp_path: Path) -> None:
    first, second = fine_tunes(tmp_path)
    config = json.loads((second / "tokenizer_config.json").read_text())
    config["model_max_length"] = 511
    (second / "tokenizer_config.json").write_text(json.dumps(config))
    assert not torch.equal(packed(loaded(first).tokenizer), packed(loaded(second).tokenizer))


def test_equal_tokenizers_unpickle_once_per_task_while_a_model_holds_one(tmp_path: Path) -> None:
    first, second = fine_tunes(tmp_path)
    one, two = pickle.loads(pickle.dumps(loaded(first))), pickle.loads(pickle.dumps(loaded(second)))
    assert two.tokenizer is one.tokenizer
    assert one.tokenizer.name_or_path == str(first)  # named after the model that brought it
    assert one.tokenizer(TEXT)["input_ids"] == loaded(first).tokenizer(TEXT)["input_ids"]
    other_task = pickle.loads(pickle.dumps(loaded(first, "feature-extraction")))
    assert other_task.tokenizer is not one.tokenizer  # a pipeline may set what its task needs on its tokenizer
    held = id(one.tokenizer)
    del one, two
    gc.collect()
    again = pickle.loads(pickle.dumps(loaded(second)))
    assert again.tokenizer(TEXT)["input_ids"] == other_task.tokenizer(TEXT)["input_ids"]
    assert again.tokenizer.name_or_path == str(second), held  # the first ones were gone: a new one, named anew
