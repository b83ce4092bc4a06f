"""A Hugging Face model's task over a batch of requests: each input prepared alone by the task's
pipeline (with its request's parameters), rows grouped by length (``length_groups``) and each
group padded into one pass (``pad``), each row's outputs cut back to its own (``cut_back``) and
post-processed as the pipeline does for that input alone: each client gets what the unbatched
pipeline answers. Question answering (``question_answering.py``: transformers 5 has no such
pipeline), tables and sentence ranking make their own rows for these passes; images are batched
per shape (``vision.py``).

Tokenizers are not safe to share between threads that change their truncation and padding: a
thread tokenizes with a copy lent for one step (``lent_tokenizer``, ``lent_pipeline``), made
only when all are out and shared by the models of one tokenizer (the adapters of a base). Copies
kept per thread and model outweighed all else a model adds beyond its weights.
"""

from __future__ import annotations

import copy
import importlib
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np
import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface import question_answering, sentences, tables, vision
from mme_runtime.huggingface.loading import HuggingFaceModel
from mme_runtime.huggingface.requests import TaskRequest

# The tasks whose pipelines take "truncation": a text longer than the model takes may be cut to fit.
TRUNCATING_TASKS = frozenset({"text-classification", "feature-extraction"})
# What a request may not ask of the pipeline: tensors in the answer (not JSON), or fetching an image
# from a URL.
REFUSED_PARAMETERS = frozenset({"return_tensors", "timeout"})
# The keys of a prepared input that hold one entry per token: cut back to each row's own length
# after the pass.
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
# Padding values of the keys a tokenizer or an image processor makes; anything else pads with 0.
PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1, "p_mask": 1}
# What one more forward pass costs, in tokens of padding: measured on the CPU for a BERT of 4 layers
# and hidden 256, a pass costs about 2.7 ms before its first token and 0.035 ms a token, in one row
# or sixteen. On a GPU the fixed cost weighs more still, so grouping by this figure errs towards
# fewer passes there.
PASS_COST_TOKENS = 64
MAX_ROWS_PLANNED = 256
# The copies of each tokenizer in this process (``copies_of``).
_registry_lock = threading.Lock()
# by id() of the tokenizer; an entry leaves with its tokenizer
_copies: dict[int, TokenizerCopies] = {}


class TaskRunner:
    """One placed model's task. A batch is prepared with a copy of the tokenizer lent for it
    (``lent_tokenizer``): tokenizers are not safe to share between threads."""

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
        """Each input's answer, in order (one per row of every request), with a tokenizer lent for
        the batch."""
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
        # (first row, rows, postprocess parameters) per input
        plans: list[tuple[int, int, dict[str, Any]]] = []
        rows: list[dict[str, Any]] = []
        adapters: list[str | None] = []  # the LoRA adapter of each row (its request's)
        forward_parameters: dict[str, Any] | None = None
        for request in requests:
            before, forward, after = _parameters(pipeline, request, self.model)
            if forward_parameters is not None and forward != forward_parameters:
                # split, retried
                raise InvalidInput("requests with different forward parameters cannot share a pass")
            forward_parameters = forward
            for item in request.inputs:
                prepared = prepare(pipeline, item, before)
                for row in prepared:
                    self._check_length(row)
                plans.append((len(rows), len(prepared), after))
                rows += prepared
                adapters += [request.adapter] * len(prepared)
        outputs = self._forward(
            rows, lambda batch: pipeline.forward(batch, **(forward_parameters or {})), adapters
        )
        if self.model.pooling is not None:
            return [self._pooled(outputs[first]) for first, _, _ in plans]
        chunked = _is_chunked(pipeline)
        return [
            postprocess(
                pipeline, outputs[first : first + count] if chunked else outputs[first], after
            )
            for first, count, after in plans
        ]

    def _pooled(self, output: Any) -> list[float]:
        """One vector for an input (feature-extraction with pooling): the mean of its tokens'
        vectors, or its first token's (``[CLS]``), scaled to length 1 when the model asks for it."""
        tokens = output[0][0]  # the row's own tokens: padding was cut off
        vector = tokens.mean(dim=0) if self.model.pooling == "mean" else tokens[0]
        if self.model.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()  # type: ignore[no-any-return]

    def _forward(
        self,
        rows: list[dict[str, Any]],
        forward: Callable[[Any], Any],
        adapters: list[str | None] | None = None,
    ) -> list[dict[str, Any]]:
        """The model over ``rows``, handed back row by row as a pass over each alone gives it
        (``cut_back``): sorted by length, in groups padded to their longest, so that a batch of
        texts from 4 to 200 tokens costs neither sixteen texts of 200 nor sixteen passes.
        ``adapters``: each row's LoRA adapter (``lora_layers.py``)."""
        outputs: list[Any] = [None] * len(rows)
        pad_id = getattr(self.model.tokenizer, "pad_token_id", None)
        for group in length_groups([length(row) or 0 for row in rows]):
            members = [rows[index] for index in group]
            with self._selecting(
                None if adapters is None else [adapters[index] for index in group]
            ):
                batch = forward(members[0] if len(members) == 1 else pad(members, pad_id))
            for position, index in enumerate(group):
                outputs[index] = (
                    batch if len(members) == 1 else cut_back(batch, position, members[position])
                )
        return outputs

    def _selecting(self, adapters: list[str | None] | None) -> AbstractContextManager[Any]:
        """The pass in this block runs each row through its own adapter, when the model has
        adapters."""
        model_adapters = getattr(self.model, "adapters", None)
        return (
            nullcontext()
            if model_adapters is None
            else model_adapters.selecting(adapters or [None])
        )

    def _check_length(self, row: dict[str, Any]) -> None:
        limit = self.model.max_length
        tokens = length(row)
        if limit is not None and tokens is not None and tokens > limit:
            advice = (
                ', or send "parameters": {"truncation": true}'
                if self.task in TRUNCATING_TASKS
                else ""
            )
            raise InvalidInput(
                f"an input has {tokens} tokens and the model takes at most {limit}: shorten "
                f"it{advice}"
            )


def _parameters(
    pipeline: Any, request: TaskRequest, model: HuggingFaceModel
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The request's parameters sorted by the pipeline into preprocess, forward and postprocess
    ones. Truncation cuts at the model's own limit, and a sentence-transformers model truncates as
    sentence-transformers does."""
    refused = REFUSED_PARAMETERS & set(request.parameters)
    if refused:
        raise InvalidInput(f"parameters {sorted(refused)} are not accepted here")
    parameters = dict(request.parameters)
    if model.truncate_to is not None and "truncation" not in parameters:
        parameters["truncation"] = True
    if parameters.get("truncation") and model.task in TRUNCATING_TASKS:
        limit = model.truncate_to or model.max_length
        if limit is not None and model.task == "feature-extraction":
            parameters["tokenize_kwargs"] = {
                "max_length": limit,
                **parameters.get("tokenize_kwargs", {}),
            }
        elif limit is not None:
            parameters.setdefault("max_length", limit)
    try:
        before, forward, after = pipeline._sanitize_parameters(**parameters)
    except Exception as exc:  # noqa: BLE001
        # whatever the pipeline refuses in them is the request's
        raise InvalidInput(f"parameters {request.parameters}: {exc}") from exc
    return (
        {**pipeline._preprocess_params, **before},
        {**pipeline._forward_params, **forward},
        {**pipeline._postprocess_params, **after},
    )


def prepare(
    pipeline: Any, item: Any, parameters: dict[str, Any], what: str = "input"
) -> list[dict[str, Any]]:
    """One input prepared as the pipeline does: one row, or a chunked pipeline's rows (a
    recognizer's chunks)."""
    try:
        prepared = pipeline.preprocess(item, **parameters)
        return list(prepared) if _is_chunked(pipeline) else [prepared]
    except Exception as exc:  # noqa: BLE001 - a fill-mask text without [MASK], a chunk_length_s shorter than its
        # strides: this request's own fault
        raise InvalidInput(f"the {what} could not be prepared for the model: {exc}") from exc


def postprocess(pipeline: Any, outputs: Any, parameters: dict[str, Any]) -> Any:
    try:
        return pipeline.postprocess(outputs, **parameters)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        # a top_k of "abc", say: the batch is split
        raise InvalidInput(f"the answer could not be made with these parameters: {exc}") from exc


def _is_chunked(pipeline: Any) -> bool:
    from transformers.pipelines.base import ChunkPipeline

    return isinstance(pipeline, ChunkPipeline)


def shape(task: str, answers: list[Any], request: TaskRequest) -> Any:
    """The answers of one request as the pipeline returns them for its input: for one input, its
    answer (a text classifier's in a list unless ``top_k`` was given); for a list, the list
    (fill-mask unwraps a list of one)."""
    if task in sentences.TASKS:
        return sentences.shape(task, answers, request)
    if request.single:
        wrap = task == "text-classification" and "top_k" not in request.parameters
        return [answers[0]] if wrap else answers[0]
    if task in ("fill-mask", tables.TASK) and len(answers) == 1:
        return answers[0]
    return answers


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of ``lengths`` in groups that cost the fewest tokens in all: sorted by length, cut
    where a pass of its own (``PASS_COST_TOKENS``) costs less than padding the shorter rows up to
    the longer ones would."""
    order = sorted(range(len(lengths)), key=lambda index: lengths[index])
    groups: list[list[int]] = []
    for start in range(0, len(order), MAX_ROWS_PLANNED):
        # the plan is quadratic in rows: plan long lists in windows
        window = order[start : start + MAX_ROWS_PLANNED]
        # best[i]: the cheapest cost of the first i rows, and where its last group starts.
        best = [(0, 0)] + [(0, 0)] * len(window)
        for end in range(1, len(window) + 1):
            longest = lengths[window[end - 1]]
            best[end] = min(
                (best[first][0] + PASS_COST_TOKENS + (end - first) * longest, first)
                for first in range(end)
            )
        cuts, end = [], len(window)
        while end > 0:
            cuts.append((best[end][1], end))
            end = best[end][1]
        groups += [window[first:end] for first, end in reversed(cuts)]
    return groups


def pad(rows: list[dict[str, Any]], pad_id: int | None) -> dict[str, Any]:
    """One batch of ``rows``: tensors padded on the right to the longest along their second
    dimension, and stacked (images are one size already); anything else listed. A tokenizer with no
    pad token pads with id 0: the attention mask hides it and every row is cut back before anyone
    reads it."""
    batch: dict[str, Any] = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if not all(isinstance(value, torch.Tensor) for value in values):
            batch[key] = values
            continue
        longest = max(value.shape[1] if value.dim() > 1 else 0 for value in values)
        fill = (pad_id or 0) if key == "input_ids" else PAD_VALUES.get(key, 0)
        padded = [_pad_right(value, longest, fill) for value in values]
        batch[key] = torch.cat(padded)
    return batch


def _pad_right(value: torch.Tensor, longest: int, fill: int) -> torch.Tensor:
    if value.dim() < 2 or value.shape[1] == longest:
        return value
    shape = (value.shape[0], longest - value.shape[1], *value.shape[2:])
    return torch.cat([value, torch.full(shape, fill, dtype=value.dtype)], dim=1)


def length(row: dict[str, Any]) -> int | None:
    ids = row.get("input_ids")
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else None


def cut_back(batch: Any, index: int, prepared: dict[str, Any]) -> Any:
    """Row ``index`` of a batch's outputs, as a pass over that row alone would give them (batch
    dimension 1, and per-token values cut back to the row's ``length``)."""
    tokens = length(prepared)
    values = {key: _take(key, value, index, tokens) for key, value in batch.items()}
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


class TokenizerCopies:
    """The copies of one tokenizer. It holds the tokenizer weakly: the copies go when the models
    that hold it do."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = weakref.ref(tokenizer)
        self._lock = threading.Lock()
        self._free: list[Any] = []
        self.made = 0

    @contextmanager
    def lend(self) -> Iterator[Any]:
        with self._lock:
            own = self._free.pop() if self._free else None
        if own is None:
            own = self._copy()
        try:
            yield own
        finally:
            with self._lock:
                self._free.append(own)

    def _copy(self) -> Any:
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer was released while its model still serves")
        own = copy.deepcopy(tokenizer)
        with self._lock:
            self.made += 1
        return own


def copies_of(tokenizer: Any) -> TokenizerCopies:
    """The one ``TokenizerCopies`` of ``tokenizer`` in this process."""
    key = id(tokenizer)
    with _registry_lock:
        copies = _copies.get(key)
        if copies is None:
            copies = _copies[key] = TokenizerCopies(tokenizer)
            weakref.finalize(tokenizer, _forget, key, copies)
    return copies


def _forget(key: int, copies: TokenizerCopies) -> None:
    with _registry_lock:
        if _copies.get(key) is copies:  # an id is reused only after its object is gone
            del _copies[key]


@contextmanager
def lent_tokenizer(tokenizer: Any) -> Iterator[Any]:
    """A copy of ``tokenizer`` for this step (None for a model without one)."""
    if tokenizer is None:
        yield None
        return
    with copies_of(tokenizer).lend() as own:
        yield own


@contextmanager
def lent_pipeline(pipeline: Any) -> Iterator[Any]:
    """A shallow copy of a transformers pipeline with a lent copy of its tokenizer, for this
    step."""
    with lent_tokenizer(pipeline.tokenizer) as tokenizer:
        own = copy.copy(pipeline)
        own.tokenizer = tokenizer
        yield own
