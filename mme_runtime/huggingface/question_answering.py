"""Extractive question answering, which transformers 5 no longer ships as a pipeline, answered as
the AWS Hugging Face container's pipeline (transformers 4) answers it: ``{"score", "start", "end",
"answer"}``.

The question and its context are tokenized together, the context cut into windows of ``max_seq_len``
tokens that overlap by ``doc_stride``; every window of every request shares the forward pass. In
each window the start and end scores are softmaxed over the context's tokens; a span's score is
their product, over spans of at most ``max_answer_len`` tokens; the best ``top_k`` spans over all
windows are the answer, as characters of the context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface.loading import HuggingFaceModel
from mme_runtime.huggingface.requests import TaskRequest

DEFAULTS = {
    "top_k": 1,
    "max_answer_len": 15,
    "max_seq_len": 384,
    "doc_stride": 128,
    "handle_impossible_answer": False,
}
DEFAULTS |= {"align_to_words": True}
# What the transformers 4 pipeline took and what changes nothing here: accepted, so its clients work
# unchanged.
ACCEPTED = frozenset({"max_question_len", "padding"})
MASKED = -10_000.0

Forward = Callable[[list[dict[str, Any]], Callable[[Any], Any]], list[dict[str, Any]]]


def run(
    tokenizer: Any, model: HuggingFaceModel, requests: list[TaskRequest], forward: Forward
) -> list[Any]:
    """Each question's answer, in order; ``forward`` runs the windows of all of them in one padded
    pass."""
    windows: list[dict[str, Any]] = []
    plans: list[tuple[int, int, dict[str, Any], dict[str, Any]]] = []
    for request in requests:
        options = _options(request.parameters, model.max_length)
        for item in request.inputs:
            prepared = _windows(tokenizer, item["question"], item["context"], options)
            plans.append((len(windows), len(prepared), item, options))
            windows += prepared
    inputs = [
        {key: value for key, value in window.items() if key in _MODEL_KEYS} for window in windows
    ]

    def run_model(batch: Any) -> Any:
        with torch.inference_mode():
            device = next(model.model.parameters()).device
            outputs = model.model(**{key: value.to(device) for key, value in batch.items()})
        return {
            "start_logits": outputs.start_logits.cpu(),
            "end_logits": outputs.end_logits.cpu(),
            **batch,
        }

    outputs = forward(inputs, run_model)
    return [
        _answer(
            windows[first : first + count], outputs[first : first + count], item["context"], options
        )
        for first, count, item, options in plans
    ]


_MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def _options(parameters: dict[str, Any], max_length: int | None) -> dict[str, Any]:
    unknown = set(parameters) - set(DEFAULTS) - ACCEPTED
    if unknown:
        raise InvalidInput(
            f"question-answering takes the parameters {sorted(DEFAULTS)}, not {sorted(unknown)}"
        )
    options = {
        **DEFAULTS,
        **{key: value for key, value in parameters.items() if key not in ACCEPTED},
    }
    for key in ("top_k", "max_answer_len", "max_seq_len", "doc_stride"):
        if not isinstance(options[key], int) or isinstance(options[key], bool) or options[key] < 1:
            raise InvalidInput(f"{key} must be a positive integer, not {options[key]!r}")
    if max_length is not None:
        options["max_seq_len"] = min(options["max_seq_len"], max_length)
    options["doc_stride"] = min(options["doc_stride"], options["max_seq_len"] // 2)
    return options


def _windows(
    tokenizer: Any, question: str, context: str, options: dict[str, Any]
) -> list[dict[str, Any]]:
    """The question with each window of the context, and which tokens are the context's."""
    try:
        encoded = tokenizer(
            question,
            context,
            truncation="only_second",
            max_length=options["max_seq_len"],
            stride=options["doc_stride"],
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
        )
    except Exception as exc:  # noqa: BLE001
        # the tokenizer refuses this question/context pair: the client's input
        raise InvalidInput(f"the question could not be tokenized with its context: {exc}") from exc
    windows = []
    cls = tokenizer.cls_token_id
    for index in range(len(encoded["input_ids"])):
        window: dict[str, Any] = {
            key: torch.tensor([encoded[key][index]]) for key in _MODEL_KEYS if key in encoded
        }
        inside = np.array([sequence == 1 for sequence in encoded.sequence_ids(index)])
        # The first token ([CLS]) stands for "no answer": it takes part in the softmax, never in a
        # span.
        window["allowed"] = inside | (np.array(encoded["input_ids"][index]) == cls)
        window["context"] = inside
        window["encoding"] = encoded.encodings[index]
        windows.append(window)
    return windows


def _answer(
    windows: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    context: str,
    options: dict[str, Any],
) -> Any:
    """The best spans over the windows, as the pipeline gives them: one dict, or a list of
    ``top_k``. A span found in several windows (they overlap) counts once, with its scores added."""
    answers: dict[str, dict[str, Any]] = {}  # by the answer's text, lowercased
    null_score = 1_000_000.0
    for window, output in zip(windows, outputs, strict=True):
        allowed, inside = window["allowed"], window["context"]
        start = _softmax(np.where(allowed, output["start_logits"][0].numpy(), MASKED))
        end = _softmax(np.where(allowed, output["end_logits"][0].numpy(), MASKED))
        null_score = min(null_score, float(start[0] * end[0]))
        start[0] = end[0] = 0.0  # [CLS] is no span
        scores = np.outer(start, end)
        # 0 <= end - start < max_answer_len
        spans = np.triu(scores) - np.triu(scores, options["max_answer_len"])
        # Extra candidates: two spans inside one word are one answer once aligned to words.
        for flat in np.argsort(-spans, axis=None, kind="stable")[: options["top_k"] * 2 + 10]:
            first, last = (int(i) for i in np.unravel_index(flat, spans.shape))
            if not (inside[first] and inside[last]):
                continue
            begin, finish = _characters(
                window["encoding"], first, last, bool(options["align_to_words"])
            )
            text = context[begin:finish]
            found = answers.get(text.lower())
            if found is not None:
                found["score"] += float(spans[first, last])
            else:
                answers[text.lower()] = {
                    "score": float(spans[first, last]),
                    "start": begin,
                    "end": finish,
                    "answer": text,
                }
    ranked = list(answers.values())
    if options["handle_impossible_answer"]:
        ranked.append({"score": null_score, "start": 0, "end": 0, "answer": ""})
    ranked = sorted(ranked, key=lambda answer: -answer["score"])[: options["top_k"]]
    return ranked[0] if len(ranked) == 1 else ranked


def _characters(encoding: Any, first: int, last: int, align_to_words: bool) -> tuple[int, int]:
    """The characters of the context from the start of the span's first word to the end of its last
    (or of its first and last tokens, without ``align_to_words``)."""
    first_word, last_word = encoding.token_to_word(first), encoding.token_to_word(last)
    if not align_to_words or first_word is None or last_word is None:
        return int(encoding.offsets[first][0]), int(encoding.offsets[last][1])
    return int(encoding.word_to_chars(first_word, 1)[0]), int(
        encoding.word_to_chars(last_word, 1)[1]
    )


def _softmax(logits: np.ndarray) -> np.ndarray:
    exponentials = np.exp(logits - logits.max())
    return exponentials / exponentials.sum()  # type: ignore[no-any-return]
