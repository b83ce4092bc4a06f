"""A Hugging Face model's task, run over a batch of requests: each input is prepared on its own by the task's
pipeline (tokenized, with the request's own parameters), the rows are grouped by length and each group padded into
one forward pass (``padding.py``), and each row, cut back to its own length, is post-processed as the pipeline
does for that input alone. So each client gets what the unbatched pipeline answers for its input.

transformers 5 has no question-answering pipeline: ``question_answering.py`` is its stand-in here. The sentence
tasks (``sentences.py``) run as pooled feature-extraction, or score pairs there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface import padding, question_answering, sentences, tables, vision
from mme_runtime.huggingface.loading import HuggingFaceModel
from mme_runtime.huggingface.requests import TaskRequest
from mme_runtime.huggingface.tokenizer_copies import lent_pipeline, lent_tokenizer

# The tasks whose pipelines take "truncation": a text longer than the model takes may be cut to fit.
TRUNCATING_TASKS = frozenset({"text-classification", "feature-extraction"})
# What a request may not ask of the pipeline: tensors in the answer (not JSON), or fetching an image from a URL.
REFUSED_PARAMETERS = frozenset({"return_tensors", "timeout"})


class TaskRunner:
    """One placed model's task. A batch is prepared with a copy of the tokenizer lent for it
    (``tokenizer_copies.py``): tokenizers are not safe to share between threads."""

    def __init__(self, model: HuggingFaceModel, device: torch.device) -> None:
        transformers: Any = importlib.import_module("transformers")
        self.model = model
        self.task = model.task
        self._pipeline: Any = None
        if self.task not in ("question-answering", "sentence-ranking"):  # written by hand
            self._pipeline = transformers.pipeline(
                self.task,
                model=model.model,
                tokenizer=model.tokenizer,
                image_processor=model.image_processor,
                device=device,
            )

    def run(self, requests: list[TaskRequest]) -> list[Any]:
        """Each input's answer, in order (one per row of every request), with a tokenizer lent for the batch."""
        if self._pipeline is None:
            with lent_tokenizer(self.model.tokenizer) as tokenizer:
                if self.task == "sentence-ranking":
                    return sentences.scores(tokenizer, self.model, requests, self._forward)
                return question_answering.run(tokenizer, self.model, requests, self._forward)
        with lent_pipeline(self._pipeline) as pipeline:
            if self.task == tables.TASK:
                return tables.run(pipeline, self.model, requests, self._forward)
            if self.task in vision.TASKS:  # images batched per shape, masks as PNG
                return vision.run(pipeline, requests)
            return self._run_texts(pipeline, requests)

    def _run_texts(self, pipeline: Any, requests: list[TaskRequest]) -> list[Any]:
        plans: list[tuple[int, int, dict[str, Any]]] = []  # (first row, rows, postprocess parameters) per input
        rows: list[dict[str, Any]] = []
        adapters: list[str | None] = []  # the LoRA adapter of each row (its request's)
        forward_parameters: dict[str, Any] | None = None
        for request in requests:
            before, forward, after = _parameters(pipeline, request, self.model)
            if forward_parameters is not None and forward != forward_parameters:
                raise InvalidInput("requests with different forward parameters cannot share a pass")  # split, retried
            forward_parameters = forward
            for item in request.inputs:
                prepared = _prepare(pipeline, item, before)
                for row in prepared:
                    self._check_length(row)
                plans.append((len(rows), len(prepared), after))
                rows += prepared
                adapters += [request.adapter] * len(prepared)
        outputs = self._forward(rows, lambda batch: pipeline.forward(batch, **(forward_parameters or {})), adapters)
        if self.model.pooling is not None:
            return [self._pooled(outputs[first]) for first, _, _ in plans]
        chunked = _is_chunked(pipeline)
        return [
            _postprocess(pipeline, outputs[first : first + count] if chunked else outputs[first], after)
            for first, count, after in plans
        ]

    def _pooled(self, output: Any) -> list[float]:
        """One vector for an input (feature-extraction with pooling): the mean of its tokens' vectors, or its first
        token's (``[CLS]``), scaled to length 1 when the model asks for it."""
        tokens = output[0][0]  # the row's own tokens: padding was cut off
        vector = tokens.mean(dim=0) if self.model.pooling == "mean" else tokens[0]
        if self.model.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()  # type: ignore[no-any-return]

    def _forward(
        self, rows: list[dict[str, Any]], forward: Callable[[Any], Any], adapters: list[str | None] | None = None
    ) -> list[dict[str, Any]]:
        """The model over ``rows``, handed back row by row as a pass over each alone gives it (``padding.py``):
        sorted by length, in groups padded to their longest, so that a batch of texts from 4 to 200 tokens costs
        neither sixteen texts of 200 nor sixteen passes. ``adapters``: each row's LoRA adapter (``lora_layers.py``)."""
        outputs: list[Any] = [None] * len(rows)
        pad_id = getattr(self.model.tokenizer, "pad_token_id", None)
        for group in padding.length_groups([padding.length(row) or 0 for row in rows]):
            members = [rows[index] for index in group]
            with self._selecting(None if adapters is None else [adapters[index] for index in group]):
                batch = forward(members[0] if len(members) == 1 else padding.pad(members, pad_id))
            for position, index in enumerate(group):
                outputs[index] = batch if len(members) == 1 else padding.row(batch, position, members[position])
        return outputs

    def _selecting(self, adapters: list[str | None] | None) -> AbstractContextManager[Any]:
        """The pass in this block runs each row through its own adapter, when the model has adapters."""
        model_adapters = getattr(self.model, "adapters", None)
        return nullcontext() if model_adapters is None else model_adapters.selecting(adapters or [None])

    def _check_length(self, row: dict[str, Any]) -> None:
        limit = self.model.max_length
        length = padding.length(row)
        if limit is not None and length is not None and length > limit:
            advice = ', or send "parameters": {"truncation": true}' if self.task in TRUNCATING_TASKS else ""
            raise InvalidInput(f"an input has {length} tokens and the model takes at most {limit}: shorten it{advice}")


def _parameters(
    pipeline: Any, request: TaskRequest, model: HuggingFaceModel
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The request's parameters sorted by the pipeline into preprocess, forward and postprocess ones. Truncation
    cuts at the model's own limit, and a sentence-transformers model truncates as sentence-transformers does."""
    refused = REFUSED_PARAMETERS & set(request.parameters)
    if refused:
        raise InvalidInput(f"parameters {sorted(refused)} are not accepted here")
    parameters = dict(request.parameters)
    if model.truncate_to is not None and "truncation" not in parameters:
        parameters["truncation"] = True
    if parameters.get("truncation") and model.task in TRUNCATING_TASKS:
        limit = model.truncate_to or model.max_length
        if limit is not None and model.task == "feature-extraction":
            parameters["tokenize_kwargs"] = {"max_length": limit, **parameters.get("tokenize_kwargs", {})}
        elif limit is not None:
            parameters.setdefault("max_length", limit)
    try:
        before, forward, after = pipeline._sanitize_parameters(**parameters)
    except Exception as exc:  # noqa: BLE001 - whatever the pipeline refuses in them is the request's
        raise InvalidInput(f"parameters {request.parameters}: {exc}") from exc
    return (
        {**pipeline._preprocess_params, **before},
        {**pipeline._forward_params, **forward},
        {**pipeline._postprocess_params, **after},
    )


def _prepare(pipeline: Any, item: Any, parameters: dict[str, Any]) -> list[dict[str, Any]]:
    """One input prepared as the pipeline does: one row, or a chunked pipeline's rows."""
    try:
        prepared = pipeline.preprocess(item, **parameters)
        return list(prepared) if _is_chunked(pipeline) else [prepared]
    except Exception as exc:  # noqa: BLE001 - a fill-mask text without [MASK], say: this request's own fault
        raise InvalidInput(f"the input could not be prepared for the model: {exc}") from exc


def _postprocess(pipeline: Any, outputs: Any, parameters: dict[str, Any]) -> Any:
    try:
        return pipeline.postprocess(outputs, **parameters)
    except (TypeError, ValueError, KeyError, IndexError) as exc:  # a top_k of "abc", say: the batch is split
        raise InvalidInput(f"the answer could not be made with these parameters: {exc}") from exc


def _is_chunked(pipeline: Any) -> bool:
    from transformers.pipelines.base import ChunkPipeline

    return isinstance(pipeline, ChunkPipeline)


def shape(task: str, answers: list[Any], request: TaskRequest) -> Any:
    """The answers of one request as the pipeline returns them for its input: for one input, its answer (a text
    classifier's in a list unless ``top_k`` was given); for a list, the list (fill-mask unwraps a list of one)."""
    if task in sentences.TASKS:
        return sentences.shape(task, answers, request)
    if request.single:
        wrap = task == "text-classification" and "top_k" not in request.parameters
        return [answers[0]] if wrap else answers[0]
    if task in ("fill-mask", tables.TASK) and len(answers) == 1:
        return answers[0]
    return answers
