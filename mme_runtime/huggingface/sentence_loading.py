"""sentence-transformers directories served with no code, and without sentence-transformers: what a
``SentenceTransformer`` (``modules.json``: the model, ``1_Pooling``, an optional ``Normalize``) or a ``CrossEncoder``
(a ``...ForSequenceClassification`` and the activation of its scores) does, read from its files.

The embedding tasks (sentence-embeddings, sentence-similarity) run as pooled feature-extraction: one vector per text,
every text cut to the model's ``max_seq_length`` as sentence-transformers cuts it. Never touches CUDA.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from mme_runtime.base.errors import ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDING_TASKS = frozenset({"sentence-embeddings", "sentence-similarity"})
RANKING_TASK = "sentence-ranking"
TASKS = EMBEDDING_TASKS | {RANKING_TASK}
# The modules of a SentenceTransformer that pooled feature-extraction computes (by the end of their type's name, as
# sentence-transformers 2 to 6 name them): a directory with any other (Dense, LayerNorm, ...) would answer wrongly.
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
# Activations a CrossEncoder may name, and the default: sigmoid for one label (a relevance score), else the logits.
SIGMOID, IDENTITY = "Sigmoid", "Identity"


def configure(model_dir: Path, loaded: Any) -> None:
    """Makes a loaded model (``loading.HuggingFaceModel``) compute what its sentence task answers: pooled
    feature-extraction for the embedding tasks (its pooling and normalization read by ``loading``), or scores
    for ranking. Raises ``ModelLoadError`` for a directory that would answer otherwise than sentence-transformers."""
    # sentence-transformers reads sentence_bert_config.json only beside a modules.json (else it builds its default
    # modules): it always cuts, never refuses, at max_seq_length, else at what the model takes.
    listed = (model_dir / "modules.json").is_file()
    settings = _read(model_dir / "sentence_bert_config.json") if listed else {}
    max_seq_length = settings.get("max_seq_length") if isinstance(settings, dict) else None
    loaded.truncate_to = max_seq_length if isinstance(max_seq_length, int) and max_seq_length > 0 else loaded.max_length
    if isinstance(settings, dict) and settings.get("do_lower_case"):
        _lower_case(loaded.tokenizer)
    _check_modules(model_dir, SERVED_MODULES if loaded.task in EMBEDDING_TASKS else SERVED_MODULES[:1])
    if loaded.task in EMBEDDING_TASKS:
        loaded.task = "feature-extraction"
        loaded.pooling = loaded.pooling or DEFAULT_POOLING
    else:
        loaded.score_activation = score_activation(model_dir, loaded.model.config)


def pooling_mode(settings: dict[str, Any]) -> str | None:
    """The pooling a ``1_Pooling/config.json`` names: ``"pooling_mode": "mean"`` (sentence-transformers 6), or
    ``pooling_mode_mean_tokens: true`` and its kin (earlier versions; none set means the mean, as they read it)."""
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
    """The ``torch.nn`` activation a CrossEncoder applies to its logits, found where sentence-transformers looks:
    ``config_sentence_transformers.json``, then ``config.json`` (``sentence_transformers.activation_fn``, or the
    older ``sbert_ce_default_activation_function``), else sigmoid for one label and the logits for more. A path
    outside ``torch`` is code of the model's own: sentence-transformers ignores it unless trusted, and so do we."""
    path = _read(model_dir / "config_sentence_transformers.json").get("activation_fn")
    if not path:
        path = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn")
    path = path or getattr(config, "sbert_ce_default_activation_function", None)
    if isinstance(path, str) and path.startswith("torch."):
        name = path.rsplit(".", 1)[-1]
        activation = getattr(torch.nn, name, None)
        if not (isinstance(activation, type) and issubclass(activation, torch.nn.Module)):
            raise ModelLoadError(f"{model_dir.name} names the activation {path!r}, which torch.nn does not have")
        try:
            activation()
        except TypeError as exc:
            raise ModelLoadError(f"{model_dir.name}: the activation {path!r} is not a plain activation: {exc}") from exc
        return name
    if path:
        logger.warning(
            "model_dir=%s names the activation %s, code of its own: the default is used instead", model_dir, path
        )
    return SIGMOID if config.num_labels == 1 else IDENTITY


def _lower_case(tokenizer: Any) -> None:
    """``do_lower_case``: texts lowercased before the tokenizer's own normalization, as sentence-transformers does it
    (a ``Lowercase`` put first, unless the tokenizer has one)."""
    from tokenizers.normalizers import Lowercase, Sequence

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelLoadError("do_lower_case=true in sentence_bert_config.json needs a fast tokenizer (tokenizer.json)")
    current = backend.normalizer
    steps = [] if current is None else [current]
    if isinstance(current, Sequence):
        steps = list(current)  # type: ignore[call-overload]  # it iterates over its steps: its stub does not say so
    if not any(isinstance(step, Lowercase) for step in steps):
        backend.normalizer = Sequence([Lowercase(), *steps])


def _check_modules(model_dir: Path, served: tuple[str, ...]) -> None:
    modules = _read(model_dir / "modules.json", default=[])
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise ModelLoadError(f"{model_dir.name}: modules.json is not a list of modules")
    others = [str(module.get("type")) for module in modules if not str(module.get("type")).endswith(served)]
    if others:
        raise ModelLoadError(
            f"{model_dir.name}'s modules.json has modules served only with code ({', '.join(others)}): served with no "
            f"code are {', '.join(served)}"
        )
    paths = {str(module.get("path", "")) for module in modules if str(module.get("type")).endswith("Transformer")}
    if paths - {""}:
        raise ModelLoadError(f"{model_dir.name}: its transformer must be the directory itself, not {sorted(paths)}")


def _read(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        return {} if default is None else default
    except ValueError as exc:
        raise ModelLoadError(f"{path.parent.name}/{path.name} is not JSON: {exc}") from exc


def max_seq_length(model_dir: Path) -> int | None:
    try:
        value = json.loads((model_dir / "sentence_bert_config.json").read_text(encoding="utf-8"))["max_seq_length"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def pooling(model_dir: Path, configured: str | None) -> tuple[str | None, bool]:
    """``pooling=`` from serving.properties (``none`` for every token's vector), else what a sentence-transformers
    directory says (``1_Pooling/config.json``, a ``Normalize`` module in ``modules.json``), else none."""
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
    raise ModelLoadError(f"1_Pooling/config.json asks for a pooling this server does not do: {settings}; set pooling=")
