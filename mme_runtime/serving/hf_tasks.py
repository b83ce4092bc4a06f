"""A Hugging Face model's task, run over a batch of requests with one forward pass: each input is prepared on its
own by the task's pipeline (tokenized, with the request's own parameters), the batch is padded to its longest member
with the attention mask, the model runs once, and each row, cut back to its own length, is post-processed as the
pipeline does for that input alone. So each client gets what the unbatched pipeline answers for its input.

transformers 5 has no question-answering pipeline: ``hf_question_answering.py`` is its stand-in here.
"""

from __future__ import annotations

import copy
import importlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.models.hf_loading import HuggingFaceModel
from mme_runtime.serving import hf_question_answering
from mme_runtime.serving.hf_requests import TaskRequest

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
# How much padding a group of rows may add to their own tokens (0.25: a quarter).
PADDING_SLACK = 1.25
# What a request may not ask of the pipeline: tensors in the answer (not JSON), or fetching an image from a URL.
REFUSED_PARAMETERS = frozenset({"return_tensors", "timeout"})


class TaskRunner:
    """One placed model's task. Tokenizers are not safe to share between threads that change their truncation
    and padding ("Already borrowed"): each thread that prepares inputs gets a copy of its own."""

    def __init__(self, model: HuggingFaceModel, device: torch.device) -> None:
        transformers: Any = importlib.import_module("transformers")
        self.model = model
        self.task = model.task
        self._local = threading.local()
        self._pipeline: Any = None
        if self.task != "question-answering":
            self._pipeline = transformers.pipeline(
                self.task,
                model=model.model,
                tokenizer=model.tokenizer,
                image_processor=model.image_processor,
                device=device,
            )

    def run(self, requests: list[TaskRequest]) -> list[Any]:
        """Each input's answer, in order (one per row of every request)."""
        if self._pipeline is None:
            return hf_question_answering.run(self._tokenizer(), self.model, requests, self._forward)
        pipeline = self._thread_pipeline()
        plans: list[tuple[int, int, dict[str, Any]]] = []  # (first row, rows, postprocess parameters) per input
        rows: list[dict[str, Any]] = []
        forward_parameters: dict[str, Any] | None = None
        for request in requests:
            before, forward, after = _parameters(pipeline, request)
            if forward_parameters is not None and forward != forward_parameters:
                raise InvalidInput("requests with different forward parameters cannot share a pass")  # split, retried
            forward_parameters = forward
            for item in request.inputs:
                prepared = _prepare(pipeline, item, before)
                for row in prepared:
                    self._check_length(row)
                plans.append((len(rows), len(prepared), after))
                rows += prepared
        outputs = self._forward(rows, lambda batch: pipeline.forward(batch, **(forward_parameters or {})))
        if self.model.pooling is not None:
            return [self._pooled(outputs[first]) for first, _, _ in plans]
        chunked = _is_chunked(pipeline)
        return [
            pipeline.postprocess(outputs[first : first + count] if chunked else outputs[first], **after)
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

    def _forward(self, rows: list[dict[str, Any]], forward: Callable[[Any], Any]) -> list[dict[str, Any]]:
        """The model over ``rows``, handed back row by row at each row's own length. Rows are sorted by length and
        run in groups padded to their longest, each group as long as padding adds at most ``PADDING_SLACK`` of its
        tokens: a batch of texts from 4 to 200 tokens must not cost sixteen texts of 200."""
        outputs: list[Any] = [None] * len(rows)
        for group in _length_groups([_length(row) or 0 for row in rows]):
            if len(group) == 1:
                outputs[group[0]] = forward(rows[group[0]])
                continue
            base: Any = importlib.import_module("transformers.pipelines.base")
            collate = base.pad_collate_fn(self.model.tokenizer, self.model.image_processor)
            batch = forward(collate([rows[index] for index in group]))
            for position, index in enumerate(group):
                outputs[index] = _row(batch, position, _length(rows[index]))
        return outputs

    def _check_length(self, row: dict[str, Any]) -> None:
        limit = self.model.max_length
        length = _length(row)
        if limit is not None and length is not None and length > limit:
            raise InvalidInput(
                f"an input has {length} tokens and the model takes at most {limit}: shorten it, or send "
                '"parameters": {"truncation": true}'
            )

    def _thread_pipeline(self) -> Any:
        pipeline = getattr(self._local, "pipeline", None)
        if pipeline is None:
            pipeline = copy.copy(self._pipeline)
            if pipeline.tokenizer is not None:
                pipeline.tokenizer = copy.deepcopy(pipeline.tokenizer)
            self._local.pipeline = pipeline
        return pipeline

    def _tokenizer(self) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.model.tokenizer)
        return tokenizer


def _length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of ``lengths`` in groups of close lengths: sorted, a group grows while padding its members to its
    longest adds at most ``PADDING_SLACK`` to their tokens."""
    order = sorted(range(len(lengths)), key=lambda index: lengths[index])
    groups: list[list[int]] = []
    tokens = 0
    for index in order:
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * lengths[index] <= PADDING_SLACK * (tokens + lengths[index]):
            group.append(index)
            tokens += lengths[index]
        else:
            groups.append([index])
            tokens = lengths[index]
    return groups


def _parameters(pipeline: Any, request: TaskRequest) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The request's parameters sorted by the pipeline into preprocess, forward and postprocess ones."""
    refused = REFUSED_PARAMETERS & set(request.parameters)
    if refused:
        raise InvalidInput(f"parameters {sorted(refused)} are not accepted here")
    try:
        before, forward, after = pipeline._sanitize_parameters(**request.parameters)
    except (TypeError, ValueError, KeyError) as exc:
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
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidInput(f"the input could not be prepared for the model: {exc}") from exc


def _is_chunked(pipeline: Any) -> bool:
    from transformers.pipelines.base import ChunkPipeline

    return isinstance(pipeline, ChunkPipeline)


def _length(row: dict[str, Any]) -> int | None:
    ids = row.get("input_ids")
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else None


def _row(batch: Any, index: int, length: int | None) -> Any:
    """Row ``index`` of a batch's outputs, as a pass over that row alone would give them (batch dimension 1, and
    per-token values cut back to the row's ``length``)."""
    values = {key: _take(key, value, index, length) for key, value in batch.items()}
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


def shape(task: str, answers: list[Any], request: TaskRequest) -> Any:
    """The answers of one request as the pipeline returns them for its input: for one input, its answer (a text
    classifier's in a list unless ``top_k`` was given); for a list, the list (fill-mask unwraps a list of one)."""
    if request.single:
        wrap = task == "text-classification" and "top_k" not in request.parameters
        return [answers[0]] if wrap else answers[0]
    if task == "fill-mask" and len(answers) == 1:
        return answers[0]
    return answers
