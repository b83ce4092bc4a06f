"""The sentence tasks of sentence-transformers directories, read and answered as Hugging Face's inference toolkit
(``huggingface-inference-toolkit``, ``sentence_transformers_utils.py``) does, computed as sentence-transformers does:

* sentence-embeddings: ``{"inputs": "..."}`` or a list (or ``{"sentences": ...}``) answers ``{"embeddings": ...}``,
  ``SentenceTransformer.encode``'s vectors;
* sentence-similarity: ``{"inputs": {"source_sentence": "...", "sentences": [...]}}`` answers
  ``{"similarities": [...]}``, the cosine of the source's vector with each sentence's;
* sentence-ranking: ``{"inputs": [[query, passage], ...]}`` (one pair: one score) answers ``{"scores": [...]}``,
  ``CrossEncoder.predict``'s (its activation applied); ``{"inputs": {"query", "texts", "return_documents"}}`` answers
  ``CrossEncoder.rank``'s ``[{"score", "index"}]``, best first.

Every sentence (every pair) is a row of its own, so the rows of concurrent requests share padded passes: the embedding
tasks as pooled feature-extraction (``tasks.py``), ranking through ``scores`` here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface.loading import HuggingFaceModel
from mme_runtime.huggingface.sentence_loading import IDENTITY, RANKING_TASK, TASKS

__all__ = ["TASKS", "request", "scores", "shape"]

RANKING_KEYS = frozenset({"sentences", "query", "texts", "return_documents"})
PAIRS = "sentence-ranking takes [query, passage] pairs: a list of them, or one"
_MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")

Forward = Callable[[list[dict[str, Any]], Callable[[Any], Any]], list[dict[str, Any]]]


class Request(Protocol):
    """What is read here of a request (``requests.TaskRequest``, which is built from ``request``'s answer)."""

    inputs: list[Any]
    parameters: dict[str, Any]
    single: bool


Rows = tuple[list[Any], dict[str, Any], bool]


def request(inputs: Any, parameters: dict[str, Any], task: str) -> Rows:
    """A request's rows (its sentences, the source first for similarity, or its pairs), its parameters and whether it
    sent one input. A ranking's parameters are the toolkit pipeline's: ``query`` and ``return_documents``. Raises
    ``InvalidInput`` naming what the task takes."""
    if parameters:  # the Hugging Face toolkit drops them unread: a client relying on one would be misled
        raise InvalidInput(f"{task} takes no parameters, not {sorted(parameters)}")
    if task == "sentence-similarity":
        if not isinstance(inputs, dict) or set(inputs) != {"source_sentence", "sentences"}:
            raise InvalidInput('sentence-similarity takes {"source_sentence": "...", "sentences": ["...", ...]}')
        if not isinstance(inputs["source_sentence"], str):
            raise InvalidInput('"source_sentence" must be a string')
        sentences, _ = _texts(inputs["sentences"], '"sentences"')
        return [inputs["source_sentence"], *sentences], {}, False
    if task == RANKING_TASK:
        return _ranking(inputs)
    if isinstance(inputs, dict):
        if set(inputs) != {"sentences"}:
            raise InvalidInput('sentence-embeddings takes a string, a list of strings, or {"sentences": ...}')
        inputs = inputs["sentences"]
    sentences, single = _texts(inputs, '"inputs"')
    return sentences, {}, single


def _ranking(inputs: Any) -> Rows:
    if not isinstance(inputs, dict):
        return _pairs(inputs)
    unknown = set(inputs) - RANKING_KEYS
    if unknown:
        raise InvalidInput(f"sentence-ranking takes {sorted(RANKING_KEYS)} in its inputs, not {sorted(unknown)}")
    sentences, query, texts = (inputs.get(key) for key in ("sentences", "query", "texts"))
    if sentences is not None:
        if query is not None and texts is not None:
            raise InvalidInput('send either "sentences" (pairs) or "query" and "texts", not both')
        return _pairs(sentences)
    if not isinstance(query, str):
        raise InvalidInput('a ranking takes "query", a string, and "texts", a list of strings')
    documents, _ = _texts(texts, '"texts"', single_allowed=False)
    return_documents = inputs.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise InvalidInput(f'"return_documents" must be true or false, not {return_documents!r}')
    return [(query, text) for text in documents], {"query": query, "return_documents": return_documents}, False


def _pairs(inputs: Any) -> Rows:
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise InvalidInput(PAIRS)
    single = not isinstance(inputs[0], (list, tuple))  # as CrossEncoder.predict tells one pair from a list
    pairs = [inputs] if single else list(inputs)
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(text, str) for text in pair):
            raise InvalidInput(f"{PAIRS}; not {pair!r}"[:300])
    return [(query, passage) for query, passage in pairs], {}, single


def _texts(value: Any, name: str, single_allowed: bool = True) -> tuple[list[str], bool]:
    if isinstance(value, str) and single_allowed:
        return [value], True
    if not isinstance(value, list) or not all(isinstance(text, str) for text in value):
        raise InvalidInput(f"{name} must be {'a string or ' if single_allowed else ''}a list of strings")
    if not value:
        raise InvalidInput(f"{name} is an empty list")
    return value, False


def scores(tokenizer: Any, model: HuggingFaceModel, requests: Sequence[Request], forward: Forward) -> list[Any]:
    """Each pair's score, in order, as ``CrossEncoder.predict`` gives it: the pair tokenized together and cut to the
    model's length (longest text first), its logits through the model's activation; one number for a model of one
    label, a list for more. ``forward`` runs the pairs of all requests in padded passes."""
    limit = model.truncate_to
    rows = []
    for one in requests:
        for query, passage in one.inputs:
            encoded = tokenizer(
                query, passage, truncation="longest_first" if limit else False, max_length=limit, return_tensors="pt"
            )
            rows.append({key: encoded[key] for key in _MODEL_KEYS if key in encoded})

    def run_model(batch: Any) -> Any:
        with torch.inference_mode():
            device = next(model.model.parameters()).device
            logits = model.model(**{key: value.to(device) for key, value in batch.items()}).logits
        return {"logits": logits.float().cpu()}

    activation = getattr(torch.nn, model.score_activation or IDENTITY)()
    one_label = getattr(model.model.config, "num_labels", None) == 1
    answers = []
    for output in forward(rows, run_model):
        row = activation(output["logits"])[0]
        answers.append(row.item() if one_label else row.tolist())
    return answers


def shape(task: str, answers: list[Any], request: Request) -> Any:
    """A request's answer from its rows' (vectors or scores), as the toolkit's sentence pipelines give it."""
    if task == "sentence-embeddings":
        return {"embeddings": answers[0] if request.single else answers}
    if task == "sentence-similarity":
        vectors = torch.nn.functional.normalize(torch.tensor(answers, dtype=torch.float32), dim=1)
        return {"similarities": (vectors[1:] @ vectors[0]).tolist()}
    if "query" not in request.parameters:
        return {"scores": answers[0] if request.single else answers}
    if any(isinstance(score, list) for score in answers):
        raise InvalidInput("a ranking needs a model of one label (a relevance score); send pairs for its logits")
    # CrossEncoder.rank's records, stably sorted best first, with the toolkit's renaming of corpus_id to index last.
    ranked = sorted(range(len(answers)), key=lambda index: answers[index], reverse=True)
    texts = [passage for _, passage in request.inputs]
    documents = request.parameters["return_documents"]
    records = [{"score": answers[i], **({"text": texts[i]} if documents else {})} for i in ranked]
    return [record | {"index": index} for record, index in zip(records, ranked, strict=True)]
