"""sentence-transformers directories served with no code, and without sentence-transformers: what
a ``SentenceTransformer`` (``modules.json``: the model, ``1_Pooling``, an optional
``Normalize``) or a ``CrossEncoder`` (a classifier and the activation of its scores) computes,
read from its files (``configure``), and their tasks read and answered as Hugging Face's
inference toolkit (``sentence_transformers_utils.py``) does:

* sentence-embeddings: ``{"inputs": "..."}``, a list, or ``{"sentences": ...}``; answers
  ``{"embeddings": ...}``;
* sentence-similarity: ``{"inputs": {"source_sentence": "...", "sentences": [...]}}``; answers
  ``{"similarities": [...]}``, cosines with the source;
* sentence-ranking: ``{"inputs": [[query, passage], ...]}`` answers ``{"scores": [...]}``;
  ``{"inputs": {"query", "texts", "return_documents"}}``, ``CrossEncoder.rank``'s records.

Each sentence (each pair) is a row of its own, so concurrent requests share padded passes: the
embeddings as pooled feature-extraction (``tasks.py``), ranking through ``scores``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from mme_runtime.base.errors import InvalidInput, ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDING_TASKS = frozenset({"sentence-embeddings", "sentence-similarity"})
RANKING_TASK = "sentence-ranking"
TASKS = EMBEDDING_TASKS | {RANKING_TASK}
# The modules of a SentenceTransformer that pooled feature-extraction computes (by the end of their
# type's name, as sentence-transformers 2 to 6 name them): a directory with any other (Dense,
# LayerNorm, ...) would answer wrongly.
SERVED_MODULES = ("Transformer", "Pooling", "Normalize")
# sentence-transformers' pooling for a model with no 1_Pooling/config.json: the mean of its tokens.
DEFAULT_POOLING = "mean"
# How sentence-transformers 2 to 5 wrote the pooling in 1_Pooling/config.json, one flag per mode.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Activations a CrossEncoder may name, and the default: sigmoid for one label (a relevance score),
# else the logits.
SIGMOID, IDENTITY = "Sigmoid", "Identity"
RANKING_KEYS = frozenset({"sentences", "query", "texts", "return_documents"})
PAIRS = "sentence-ranking takes [query, passage] pairs: a list of them, or one"
_MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")

Forward = Callable[[list[dict[str, Any]], Callable[[Any], Any]], list[dict[str, Any]]]


class TaskFields(Protocol):
    """What is read here of a request (a ``requests.TaskRequest``, made of ``request``'s answer)."""

    inputs: list[Any]
    parameters: dict[str, Any]
    single: bool


Rows = tuple[list[Any], dict[str, Any], bool]


def configure(model_dir: Path, loaded: Any) -> None:
    """Makes a loaded model (``loading.HuggingFaceModel``) compute what its sentence task answers:
    pooled feature-extraction for the embedding tasks (its pooling and normalization read by
    ``pooling``), or scores for ranking. Raises ``ModelLoadError`` for a directory that would
    answer otherwise than sentence-transformers."""
    # sentence-transformers reads sentence_bert_config.json only beside a modules.json (else it
    # builds its default modules): it always cuts, never refuses, at max_seq_length, else at what
    # the model takes.
    listed = (model_dir / "modules.json").is_file()
    settings = _read(model_dir / "sentence_bert_config.json") if listed else {}
    max_seq_length = settings.get("max_seq_length") if isinstance(settings, dict) else None
    loaded.truncate_to = (
        max_seq_length
        if isinstance(max_seq_length, int) and max_seq_length > 0
        else loaded.max_length
    )
    if isinstance(settings, dict) and settings.get("do_lower_case"):
        _lower_case(loaded.tokenizer)
    _check_modules(
        model_dir, SERVED_MODULES if loaded.task in EMBEDDING_TASKS else SERVED_MODULES[:1]
    )
    if loaded.task in EMBEDDING_TASKS:
        loaded.task = "feature-extraction"
        loaded.pooling = loaded.pooling or DEFAULT_POOLING
    else:
        loaded.score_activation = score_activation(model_dir, loaded.model.config)


def pooling_mode(settings: dict[str, Any]) -> str | None:
    """The pooling a ``1_Pooling/config.json`` names: ``"pooling_mode": "mean"``
    (sentence-transformers 6), or ``pooling_mode_mean_tokens: true`` and its kin (earlier versions;
    none set means the mean, as they read it)."""
    mode = settings.get("pooling_mode")
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if isinstance(mode, str):
        return mode
    if mode is not None:
        return None  # several modes concatenated: not served
    chosen = [name for key, name in LEGACY_POOLING_KEYS.items() if settings.get(key)]
    return DEFAULT_POOLING if not chosen else chosen[0] if len(chosen) == 1 else None


def score_activation(model_dir: Path, config: Any) -> str:
    """The ``torch.nn`` activation a CrossEncoder applies to its logits, found where
    sentence-transformers looks: ``config_sentence_transformers.json``, then ``config.json``
    (``sentence_transformers.activation_fn``, or the older
    ``sbert_ce_default_activation_function``), else sigmoid for one label and the logits for more. A
    path outside ``torch`` is code of the model's own: sentence-transformers ignores it unless
    trusted, and so do we."""
    path = _read(model_dir / "config_sentence_transformers.json").get("activation_fn")
    if not path:
        path = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn")
    path = path or getattr(config, "sbert_ce_default_activation_function", None)
    if isinstance(path, str) and path.startswith("torch."):
        name = path.rsplit(".", 1)[-1]
        activation = getattr(torch.nn, name, None)
        if not (isinstance(activation, type) and issubclass(activation, torch.nn.Module)):
            raise ModelLoadError(
                f"{model_dir.name} names the activation {path!r}, which torch.nn does not have"
            )
        try:
            activation()
        except TypeError as exc:
            raise ModelLoadError(
                f"{model_dir.name}: the activation {path!r} is not a plain activation: {exc}"
            ) from exc
        return name
    if path:
        logger.warning(
            "model_dir=%s names the activation %s, code of its own: the default is used instead",
            model_dir,
            path,
        )
    return SIGMOID if config.num_labels == 1 else IDENTITY


def _lower_case(tokenizer: Any) -> None:
    """``do_lower_case``: texts lowercased before the tokenizer's own normalization, as
    sentence-transformers does it (a ``Lowercase`` put first, unless the tokenizer has one)."""
    from tokenizers.normalizers import Lowercase, Sequence

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelLoadError(
            "do_lower_case=true in sentence_bert_config.json needs a fast tokenizer "
            "(tokenizer.json)"
        )
    current = backend.normalizer
    steps = [] if current is None else [current]
    if isinstance(current, Sequence):
        # it iterates over its steps: its stub does not say so
        steps = list(current)  # type: ignore[call-overload]
    if not any(isinstance(step, Lowercase) for step in steps):
        backend.normalizer = Sequence([Lowercase(), *steps])


def _check_modules(model_dir: Path, served: tuple[str, ...]) -> None:
    modules = _read(model_dir / "modules.json", default=[])
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise ModelLoadError(f"{model_dir.name}: modules.json is not a list of modules")
    others = [
        str(module.get("type"))
        for module in modules
        if not str(module.get("type")).endswith(served)
    ]
    if others:
        raise ModelLoadError(
            f"{model_dir.name}'s modules.json has modules served only with code "
            f"({', '.join(others)}): served with no code are {', '.join(served)}"
        )
    paths = {
        str(module.get("path", ""))
        for module in modules
        if str(module.get("type")).endswith("Transformer")
    }
    if paths - {""}:
        raise ModelLoadError(
            f"{model_dir.name}: its transformer must be the directory itself, not {sorted(paths)}"
        )


def _read(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        return {} if default is None else default
    except ValueError as exc:
        raise ModelLoadError(f"{path.parent.name}/{path.name} is not JSON: {exc}") from exc


def max_seq_length(model_dir: Path) -> int | None:
    try:
        value = json.loads((model_dir / "sentence_bert_config.json").read_text(encoding="utf-8"))[
            "max_seq_length"
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def pooling(model_dir: Path, configured: str | None) -> tuple[str | None, bool]:
    """``pooling=`` from serving.properties (``none`` for every token's vector), else what a
    sentence-transformers directory says (``1_Pooling/config.json``, a ``Normalize`` module in
    ``modules.json``), else none."""
    normalize = False
    try:
        modules = json.loads((model_dir / "modules.json").read_text(encoding="utf-8"))
        normalize = any("Normalize" in str(module.get("type", "")) for module in modules)
    except (OSError, ValueError, AttributeError):
        pass
    if configured is not None:
        return (None if configured == "none" else configured), normalize
    try:
        settings = json.loads((model_dir / "1_Pooling" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, False
    mode = pooling_mode(settings)
    if mode in ("cls", "mean"):
        return mode, normalize
    raise ModelLoadError(
        f"1_Pooling/config.json asks for a pooling this server does not do: {settings}; set "
        "pooling="
    )


def request(inputs: Any, parameters: dict[str, Any], task: str) -> Rows:
    """A request's rows (its sentences, the source first for similarity, or its pairs), its
    parameters and whether it sent one input. A ranking's parameters are the toolkit pipeline's:
    ``query`` and ``return_documents``. Raises ``InvalidInput`` naming what the task takes."""
    if parameters:
        # the Hugging Face toolkit drops them unread: a client relying on one would be misled
        raise InvalidInput(f"{task} takes no parameters, not {sorted(parameters)}")
    if task == "sentence-similarity":
        if not isinstance(inputs, dict) or set(inputs) != {"source_sentence", "sentences"}:
            raise InvalidInput(
                'sentence-similarity takes {"source_sentence": "...", "sentences": ["...", ...]}'
            )
        if not isinstance(inputs["source_sentence"], str):
            raise InvalidInput('"source_sentence" must be a string')
        sentences, _ = _texts(inputs["sentences"], '"sentences"')
        return [inputs["source_sentence"], *sentences], {}, False
    if task == RANKING_TASK:
        return _ranking(inputs)
    if isinstance(inputs, dict):
        if set(inputs) != {"sentences"}:
            raise InvalidInput(
                'sentence-embeddings takes a string, a list of strings, or {"sentences": ...}'
            )
        inputs = inputs["sentences"]
    sentences, single = _texts(inputs, '"inputs"')
    return sentences, {}, single


def _ranking(inputs: Any) -> Rows:
    if not isinstance(inputs, dict):
        return _pairs(inputs)
    unknown = set(inputs) - RANKING_KEYS
    if unknown:
        raise InvalidInput(
            f"sentence-ranking takes {sorted(RANKING_KEYS)} in its inputs, not {sorted(unknown)}"
        )
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
    return (
        [(query, text) for text in documents],
        {"query": query, "return_documents": return_documents},
        False,
    )


def _pairs(inputs: Any) -> Rows:
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise InvalidInput(PAIRS)
    # as CrossEncoder.predict tells one pair from a list
    single = not isinstance(inputs[0], (list, tuple))
    pairs = [inputs] if single else list(inputs)
    for pair in pairs:
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(text, str) for text in pair)
        ):
            raise InvalidInput(f"{PAIRS}; not {pair!r}"[:300])
    return [(query, passage) for query, passage in pairs], {}, single


def _texts(value: Any, name: str, single_allowed: bool = True) -> tuple[list[str], bool]:
    if isinstance(value, str) and single_allowed:
        return [value], True
    if not isinstance(value, list) or not all(isinstance(text, str) for text in value):
        raise InvalidInput(
            f"{name} must be {'a string or ' if single_allowed else ''}a list of strings"
        )
    if not value:
        raise InvalidInput(f"{name} is an empty list")
    return value, False


def scores(
    tokenizer: Any, model: Any, requests: Sequence[TaskFields], forward: Forward
) -> list[Any]:
    """Each pair's score, in order, as ``CrossEncoder.predict`` gives it: the pair tokenized
    together and cut to the model's length (longest text first), its logits through the model's
    activation; one number for a model of one label, a list for more. ``forward`` runs the pairs of
    all requests in padded passes. ``model``: a ``loading.HuggingFaceModel`` (typed ``Any``:
    ``loading`` imports this module)."""
    limit = model.truncate_to
    rows = []
    for one in requests:
        for query, passage in one.inputs:
            encoded = tokenizer(
                query,
                passage,
                truncation="longest_first" if limit else False,
                max_length=limit,
                return_tensors="pt",
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


def shape(task: str, answers: list[Any], request: TaskFields) -> Any:
    """A request's answer from its rows' (vectors or scores), as the toolkit's sentence pipelines
    give it."""
    if task == "sentence-embeddings":
        return {"embeddings": answers[0] if request.single else answers}
    if task == "sentence-similarity":
        vectors = torch.nn.functional.normalize(torch.tensor(answers, dtype=torch.float32), dim=1)
        return {"similarities": (vectors[1:] @ vectors[0]).tolist()}
    if "query" not in request.parameters:
        return {"scores": answers[0] if request.single else answers}
    if any(isinstance(score, list) for score in answers):
        raise InvalidInput(
            "a ranking needs a model of one label (a relevance score); send pairs for its logits"
        )
    # CrossEncoder.rank's records, stably sorted best first, with the toolkit's renaming of
    # corpus_id to index last.
    ranked = sorted(range(len(answers)), key=lambda index: answers[index], reverse=True)
    texts = [passage for _, passage in request.inputs]
    documents = request.parameters["return_documents"]
    records = [{"score": answers[i], **({"text": texts[i]} if documents else {})} for i in ranked]
    return [record | {"index": index} for record, index in zip(records, ranked, strict=True)]
