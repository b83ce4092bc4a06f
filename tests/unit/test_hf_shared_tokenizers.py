"""Tokenizers loaded from the same files, for the same task and with the same options, share a key, and a host
keeps one object per key while a model uses it; a byte of difference, another task or other options, another key."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import hf_models
from transformers import AutoTokenizer

from mme_runtime.models.hf_shared_tokenizers import content_key, one_per_content

OPTIONS = {"local_files_only": True, "trust_remote_code": False}


def tokenizer_dirs(tmp_path: Path) -> tuple[Path, Path]:
    first = tmp_path / "first"
    hf_models.tokenizer(first)
    second = tmp_path / "second"
    shutil.copytree(first, second)
    (second / "config.json").write_text(json.dumps({"id2label": {"0": "another head"}}))  # not a tokenizer file
    return first, second


def key_of(directory: Path, task: str = "text-classification", options: dict[str, object] = OPTIONS) -> str | None:
    return content_key(directory, task, AutoTokenizer.from_pretrained(str(directory)), options)


def test_the_same_files_task_and_options_give_the_same_key(tmp_path: Path) -> None:
    first, second = tokenizer_dirs(tmp_path)
    assert key_of(first) == key_of(second) is not None


def test_a_byte_of_difference_another_task_or_other_options_give_another_key(tmp_path: Path) -> None:
    first, second = tokenizer_dirs(tmp_path)
    config = json.loads((second / "tokenizer_config.json").read_text())
    config["model_max_length"] = 511
    (second / "tokenizer_config.json").write_text(json.dumps(config))
    assert key_of(first) != key_of(second)
    assert key_of(first) != key_of(first, task="token-classification")
    assert key_of(first) != key_of(first, options={**OPTIONS, "trust_remote_code": True})


def test_a_host_keeps_one_tokenizer_per_key_while_a_model_holds_it(tmp_path: Path) -> None:
    first, second = tokenizer_dirs(tmp_path)
    one = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(first)), tokenizer_key=key_of(first))
    two = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(second)), tokenizer_key=key_of(second))
    assert not one_per_content(one)
    assert one_per_content(two)
    assert two.tokenizer is one.tokenizer
    del one, two
    gc.collect()
    three = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(second)), tokenizer_key=key_of(second))
    own = three.tokenizer
    assert not one_per_content(three)  # the others are gone: it keeps its own
    assert three.tokenizer is own


def test_a_model_without_a_key_keeps_its_tokenizer(tmp_path: Path) -> None:
    first, _ = tokenizer_dirs(tmp_path)
    model = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(first)), tokenizer_key=None)
    own = model.tokenizer
    one_per_content(model)
    assert model.tokenizer is own
