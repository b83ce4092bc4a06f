"""Table question answering (TAPAS), answered as transformers' table-question-answering pipeline
answers it: ``{"answer", "coordinates", "cells", "aggregator"}`` for each query, ``aggregator``
when the model has that head.

A request is ``{"query": "..." or ["...", ...], "table": {"column": ["cell", ...], ...}}`` (or a
list of them); it is checked before it joins a batch (``check_input``, ``check_parameters``). Each
(table, query) pair is tokenized alone by the pipeline's own tokenizer; the pairs of every request
of a batch share padded forward passes (``tasks.py``), and each pair's logits, cut back to its own
tokens, go through the pipeline's own postprocessing. Padding changes no answer: the padding
tokens are masked from attention and belong to no cell (the pipeline itself pads the queries of
one table together). A conversational (SQA) request, ``"sequential": true``, feeds each query's
answer into the next query's input, so its queries run in order, one pass each, as the pipeline
runs them, and share no pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface.loading import HuggingFaceModel

TASK = "table-question-answering"
PADDING = (True, False, "longest", "max_length", "do_not_pad")
TRUNCATION = (True, False, "drop_rows_to_fit", "do_not_truncate")
MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")
# What one request's tables may hold, counted once per query: TAPAS's tokenizer is pure Python
# (about 2,000 cells or 50,000 characters a second on one core here) and reads the whole table for
# each query, in the pass that the requests of its batch wait on. The model reads 512 tokens at
# most: a larger table is mostly dropped to fit anyway.
MAX_CELLS = 10_000
MAX_CHARACTERS = 200_000

Forward = Callable[[list[dict[str, Any]], Callable[[Any], Any]], list[dict[str, Any]]]


class TaskFields(Protocol):
    """What this module reads of a request (``requests.TaskRequest``, which imports this module)."""

    inputs: list[Any]
    parameters: dict[str, Any]


def check_input(item: Any) -> None:
    """Raises ``InvalidInput`` unless ``item`` is a query (or a list of them) and a table of string
    cells, each column a list of one length."""
    if not isinstance(item, dict) or "query" not in item or "table" not in item:
        raise InvalidInput(
            'table-question-answering takes {"query": "...", "table": {"column": ["cell", ...]}}'
        )
    query, table = item["query"], item["table"]
    queries = query if isinstance(query, list) else [query]
    if not queries or not all(isinstance(text, str) and text for text in queries):
        raise InvalidInput(f'"query" must be a non-empty string or a list of them, not {query!r}')
    if not isinstance(table, dict) or not table:
        raise InvalidInput('"table" must be an object of columns, {"column": ["cell", ...], ...}')
    lengths = set()
    for column, cells in table.items():
        if not isinstance(cells, list) or not all(isinstance(cell, str) for cell in cells):
            raise InvalidInput(
                f"column {column!r} of the table must be a list of strings (cells are text)"
            )
        lengths.add(len(cells))
    if len(lengths) != 1 or 0 in lengths:
        raise InvalidInput(
            f"the table's columns must have one length, at least 1: they have {sorted(lengths)}"
        )


def check_parameters(parameters: dict[str, Any], items: Sequence[Any] = ()) -> None:
    """Raises ``InvalidInput`` for a parameter the pipeline does not take, or ``items`` (checked
    inputs) too large to tokenize in a pass."""
    cells = characters = 0
    for item in items:
        queries = item["query"] if isinstance(item["query"], list) else [item["query"]]
        cells += len(queries) * sum(len(column) + 1 for column in item["table"].values())
        table = sum(len(name) + sum(map(len, column)) for name, column in item["table"].items())
        characters += len(queries) * table + sum(map(len, queries))
    if cells > MAX_CELLS or characters > MAX_CHARACTERS:
        raise InvalidInput(
            f"the tables of this request are read once per query: {cells} cells and {characters} "
            f"characters in all, at most {MAX_CELLS} cells and {MAX_CHARACTERS} characters here "
            "(TAPAS reads 512 tokens at most)"
        )
    unknown = set(parameters) - {"sequential", "padding", "truncation"}
    if unknown:
        raise InvalidInput(
            "table-question-answering takes sequential, padding and truncation, not "
            f"{sorted(unknown)}"
        )
    if not isinstance(parameters.get("sequential", False), bool):
        raise InvalidInput(f"sequential must be true or false, not {parameters['sequential']!r}")
    for key, allowed in (("padding", PADDING), ("truncation", TRUNCATION)):
        if key in parameters and parameters[key] not in allowed:
            raise InvalidInput(f"{key} must be one of {allowed}, not {parameters[key]!r}")


def run(
    pipeline: Any, model: HuggingFaceModel, requests: Sequence[TaskFields], forward: Forward
) -> list[Any]:
    """Each input's answer, in order: one dict, or a list of them for an input of several
    queries."""
    import pandas

    rows: list[dict[str, Any]] = []
    # (table, the input's rows) or (table, its sequential outputs)
    plans: list[tuple[Any, list[int] | Any]] = []
    for request in requests:
        preprocess: dict[str, Any] = {
            key: request.parameters[key]
            for key in ("padding", "truncation")
            if key in request.parameters
        }
        for item in request.inputs:
            table = pandas.DataFrame(item["table"])
            queries = item["query"] if isinstance(item["query"], list) else [item["query"]]
            if request.parameters.get("sequential"):
                prepared = _prepare(pipeline, model, table, queries, preprocess)
                plans.append((table, pipeline.forward(prepared, sequential=True)))
                continue
            first = len(rows)
            for query in queries:
                prepared = _prepare(pipeline, model, table, query, preprocess)
                rows.append({key: prepared[key] for key in MODEL_KEYS})
            plans.append((table, list(range(first, len(rows)))))
    outputs = forward(rows, _run_model(model)) if rows else []
    answers = []
    for table, planned in plans:
        if not isinstance(planned, list):  # a sequential input: the pipeline's own outputs
            answers.append(_postprocess(pipeline, planned))
            continue
        each = [
            _postprocess(pipeline, _pipeline_outputs(rows[index], outputs[index], table))
            for index in planned
        ]
        answers.append(each[0] if len(each) == 1 else each)
    return answers


def _prepare(
    pipeline: Any, model: HuggingFaceModel, table: Any, query: Any, options: dict[str, Any]
) -> Any:
    """The pair (or an input's queries) tokenized by the pipeline, refused when it needs more
    positions, rows or columns than the model has embeddings for (``"truncation": false`` on a large
    table)."""
    try:
        prepared = pipeline.preprocess({"table": table, "query": query}, **options)
    except Exception as exc:  # noqa: BLE001
        # the tokenizer refuses this table or query: the client's input
        raise InvalidInput(
            f"the table and query could not be prepared for the model: {exc}"
        ) from exc
    length = prepared["input_ids"].shape[-1]
    if model.max_length is not None and length > model.max_length:
        raise InvalidInput(
            f"the table and query take {length} tokens and the model takes at most "
            f"{model.max_length}: send a "
            'smaller table, or leave "truncation" on to drop rows that do not fit'
        )
    config: Any = model.model.config
    sizes = torch.tensor(config.type_vocab_sizes)
    if bool((prepared["token_type_ids"].reshape(-1, len(sizes)).max(dim=0).values >= sizes).any()):
        raise InvalidInput(
            f"the table has more rows or columns than the model numbers ({sizes.tolist()})"
        )
    return prepared


def _postprocess(pipeline: Any, outputs: dict[str, Any]) -> Any:
    """The pipeline's answer to one pair. A table with no text at all (every cell and column name
    empty) gives it no cell to answer from, and it fails (an UnboundLocalError in transformers 5):
    that is this request's 400, so that the batcher retries the requests beside it without it, not a
    500 for all of them."""
    try:
        return pipeline.postprocess(outputs)
    except Exception as exc:  # noqa: BLE001 - it reads only this pair's table, tokens and logits
        raise InvalidInput(
            f"no answer could be read from this table (does it hold any text?): {exc}"
        ) from exc


def _run_model(model: HuggingFaceModel) -> Callable[[Any], Any]:
    def run_model(batch: dict[str, Any]) -> dict[str, Any]:
        device = next(model.model.parameters()).device
        with torch.inference_mode():
            outputs = model.model(**{key: batch[key].to(device) for key in MODEL_KEYS})
        found = {"logits": outputs.logits.cpu()}
        if getattr(outputs, "logits_aggregation", None) is not None:
            found["logits_aggregation"] = outputs.logits_aggregation.cpu()
        return found

    return run_model


def _pipeline_outputs(
    prepared: dict[str, Any], output: dict[str, Any], table: Any
) -> dict[str, Any]:
    """What the pipeline's ``_forward`` hands its postprocessing for this pair alone: its inputs,
    its table, and the model's outputs, the per-token logits cut back to the pair's own tokens."""
    length = prepared["input_ids"].shape[-1]
    logits: tuple[torch.Tensor, ...] = (output["logits"][:, :length],)
    if "logits_aggregation" in output:
        logits += (output["logits_aggregation"],)
    return {"model_inputs": dict(prepared), "table": table, "outputs": logits}
