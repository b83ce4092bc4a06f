"""Tiny models for zero-shot classification and table question answering, built offline as a user's
``save_pretrained`` leaves them: an NLI-shaped BERT (contradiction, neutral, entailment) with the WordPiece tokenizer
of ``hf_models``, and a TAPAS with its cell-selection and aggregation heads and a ``vocab.txt`` written here. Their
weights are drawn wider than transformers' initialiser draws them, so that answers differ from input to input and a
comparison within 1e-4 tells one answer from another.
"""

from __future__ import annotations

from pathlib import Path

import hf_models
import torch

NLI_LABELS = {0: "contradiction", 1: "neutral", 2: "entailment"}
AGGREGATION_LABELS = {0: "NONE", 1: "SUM", 2: "AVERAGE", 3: "COUNT"}
TABLE_WORDS = (
    "how many stars does the repository have which city is largest what is the population of paris berlin rome "
    "name age city country year total sum average count number people who lives in born movies actor brad pitt "
    "leonardo george clooney transformers datasets tokenizers python rust and , ? ."
).split()
TABLE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EMPTY]"]


def nli_bert(directory: Path, seed: int = 0, layers: int = 2, hidden: int = 32) -> Path:
    """A BERT-shaped NLI classifier: the zero-shot pipeline takes its ``entailment`` logit for each label."""
    transformers = hf_models._transformers()

    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=300,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        intermediate_size=hidden * 2,
        max_position_embeddings=512,
        initializer_range=0.2,
        id2label=NLI_LABELS,
        label2id={label: index for index, label in NLI_LABELS.items()},
    )
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, 2.0)  # scores that differ from label to label
    model.save_pretrained(directory)
    hf_models.tokenizer(directory)
    return directory


def table_vocabulary() -> list[str]:
    """The specials, every word of ``TABLE_WORDS`` and the digits: numbers become several word pieces."""
    digits = [str(digit) for digit in range(10)] + [f"##{digit}" for digit in range(10)]
    words = sorted(set(TABLE_WORDS))
    return TABLE_SPECIALS + words + digits


def tapas(directory: Path, seed: int = 1, aggregation: bool = True, hidden: int = 32) -> Path:
    """A TAPAS-shaped table question answerer (as WTQ's: cells chosen, then an aggregator over them when
    ``aggregation``), with a ``TapasTokenizer`` over ``table_vocabulary()``. Seed 1 by default: it chooses cells
    for most tables (seed 0 chooses none for most, which would compare empty answers)."""
    transformers = hf_models._transformers()

    directory.mkdir(parents=True, exist_ok=True)
    vocabulary = table_vocabulary()
    (directory / "vocab.txt").write_text("\n".join(vocabulary) + "\n", encoding="utf-8")
    torch.manual_seed(seed)
    options: dict[str, object] = {}
    if aggregation:
        options = {
            "num_aggregation_labels": len(AGGREGATION_LABELS),
            "aggregation_labels": AGGREGATION_LABELS,
            "no_aggregation_label_index": 0,
            "use_answer_as_supervision": True,
            "select_one_column": True,
        }
    config = transformers.TapasConfig(
        vocab_size=len(vocabulary),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=128,
        initializer_range=0.2,
        **options,
    )
    model = transformers.TapasForQuestionAnswering(config).eval()
    with torch.no_grad():  # cell logits on both sides of the 0.5 threshold: some cells chosen, others not
        model.output_weights.normal_(0.0, 1.0)
        if aggregation:
            model.column_output_weights.normal_(0.0, 1.0)
            model.aggregation_classifier.weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    transformers.TapasTokenizer(str(directory / "vocab.txt"), model_max_length=128).save_pretrained(directory)
    return directory
