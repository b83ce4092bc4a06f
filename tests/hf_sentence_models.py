"""Tiny sentence-transformers directories built offline from the tiny BERT of ``hf_models``: a SentenceTransformer
laid out as the hub's (``modules.json``, ``1_Pooling``, ``2_Normalize``, ``sentence_bert_config.json``) or as
sentence-transformers 6 saves one, and a CrossEncoder (a ``BertForSequenceClassification``). No hub, no network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hf_models
import torch

# Texts of one model cut to this many tokens, as its sentence_bert_config.json says: long texts test the cut.
MAX_SEQ_LENGTH = 24


def sentence_transformer(
    directory: Path,
    pooling: str = "mean",
    normalize: bool = True,
    modern: bool = False,
    max_seq_length: int = MAX_SEQ_LENGTH,
    seed: int = 0,
    do_lower_case: bool = False,
) -> Path:
    """A BERT with sentence-transformers' files: the hub's layout (sentence-transformers 2, ``pooling_mode_*`` flags)
    or, ``modern``, sentence-transformers 6's (``"pooling_mode": "mean"``, its module names, the cut in the
    tokenizer's ``model_max_length``). ``do_lower_case``: its tokenizer keeps case, and the model's settings ask
    sentence-transformers to lowercase texts first."""
    hf_models.bert(directory, "feature-extraction", seed=seed)
    package = "sentence_transformers.base.modules" if modern else "sentence_transformers.models"
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": f"{package}.{'transformer.' if modern else ''}Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": f"{package}.Normalize"})
        (directory / "2_Normalize").mkdir()
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "1_Pooling").mkdir()
    if modern:
        settings: dict[str, Any] = {"embedding_dimension": 32, "pooling_mode": pooling, "include_prompt": True}
        _update(directory / "tokenizer_config.json", model_max_length=max_seq_length)
    else:
        settings = {"word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls"}
        settings |= {"pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": pooling == "max"}
        settings |= {"pooling_mode_mean_sqrt_len_tokens": False}
        sentence_bert = {"max_seq_length": max_seq_length, "do_lower_case": do_lower_case}
        if do_lower_case:
            _keep_case(directory)
        (directory / "sentence_bert_config.json").write_text(json.dumps(sentence_bert))
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    (directory / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "cosine"}))
    return directory


def cross_encoder(
    directory: Path,
    num_labels: int = 1,
    activation: str | None = None,
    seed: int = 0,
    max_seq_length: int | None = None,
) -> Path:
    """A BERT cross-encoder of ``num_labels`` labels, as CrossEncoder saves one; ``activation`` (a ``torch.nn``
    path) is written where sentence-transformers 4 and later write it (``config.json``'s ``sentence_transformers``),
    ``max_seq_length`` in ``sentence_bert_config.json``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=1,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=num_labels,
    )
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():  # scores spread over the sigmoid, not all near 0.5
        model.classifier.weight.normal_(0, 4.0)
    model.save_pretrained(directory)
    hf_models.tokenizer(directory)
    if activation is not None:
        _update(directory / "config.json", sentence_transformers={"activation_fn": activation, "version": "4.0.1"})
    if max_seq_length is not None:  # as sentence-transformers 6 saves a CrossEncoder: the cut beside modules.json
        settings = {"transformer_task": "sequence-classification", "max_seq_length": max_seq_length}
        (directory / "sentence_bert_config.json").write_text(json.dumps(settings))
        module_type = "sentence_transformers.base.modules.transformer.Transformer"
        transformer = {"idx": 0, "name": "0", "path": "", "type": module_type}
        (directory / "modules.json").write_text(json.dumps([transformer]))
        (directory / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "CrossEncoder"}))
    return directory


def _keep_case(directory: Path) -> None:
    """The tokenizer no longer lowercases: "PARIS" is unknown to its lowercase vocabulary."""
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = False
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))


def _update(path: Path, **values: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}, indent=2))
