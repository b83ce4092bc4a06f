"""Hugging Face models with no code: a ``save_pretrained`` directory (``config.json`` and its weights) loaded as its
task's ``AutoModelFor...``, with its tokenizer or image processor, on the host and CUDA-free.

The task comes from ``task=`` in the model's ``serving.properties``, else ``HF_TASK`` (the AWS Hugging Face
container's variable, container-wide), else from ``config.json``'s architecture where that names one task. Code that
a ``config.json`` asks for (``auto_map``) runs only with ``trust_remote_code=true`` in ``serving.properties``;
pickled weights load only through ``weights_only``. transformers is imported on the first such model, never at start.
"""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mme_runtime.base.errors import ModelLoadError

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# The tasks served with no code, each with the Auto class that loads its model.
TASKS = {
    "text-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "feature-extraction": "AutoModel",
    "fill-mask": "AutoModelForMaskedLM",
    "question-answering": "AutoModelForQuestionAnswering",
    "image-classification": "AutoModelForImageClassification",
}
ALIASES = {"sentiment-analysis": "text-classification", "ner": "token-classification"}
IMAGE_TASKS = frozenset({"image-classification"})
# What an architecture's name ends with, and the task it serves (``BertForSequenceClassification``: a classifier).
ARCHITECTURE_TASKS = {
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForMaskedLM": "fill-mask",
    "ForQuestionAnswering": "question-answering",
    "ForImageClassification": "image-classification",
}
# Models whose position ids start after the padding index, so max_position_embeddings overstates what they take.
OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "longformer"})
GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForSeq2SeqLM")
GENERATIVE_HINT = "generative models (text-generation, text2text-generation) need an inference.py of their own here"


@dataclass
class HuggingFaceModel:
    """What ``model_fn`` returns for such a directory: it travels to a device host like any model (the module's
    tensors in shared memory), and ``place`` puts it on its device there."""

    task: str
    model: torch.nn.Module
    tokenizer: Any | None  # text tasks
    image_processor: Any | None  # image tasks
    max_length: int | None  # tokens the model takes at most (its position embeddings)
    # Its classes come from its directory (trust_remote_code): only a process that imported them can unpickle it.
    remote_code: bool = False
    pooling: str | None = None  # feature-extraction: "mean" or "cls" gives one vector per input; None, every token's
    normalize: bool = False  # pooled vectors scaled to length 1 (a sentence-transformers Normalize module)
    truncate_to: int | None = None  # a sentence-transformers model's max_seq_length: longer texts are cut to it
    adapters: Any = None  # its LoRA adapters once one is attached in the process that serves it (``lora.py``)

    def place(self, device: torch.device) -> HuggingFaceModel:
        self.model = self.model.to(device).eval()
        return self


def is_hugging_face_directory(model_dir: Path) -> bool:
    """A ``save_pretrained`` directory: ``config.json`` naming a model type, and weights transformers reads."""
    config = _read_config(model_dir)
    return config is not None and "model_type" in config and any((model_dir / f).is_file() for f in WEIGHT_FILES)


def resolve_task(model_dir: Path, model_task: str | None, container_task: str | None) -> str:
    """The model's task: its ``serving.properties``, else ``HF_TASK``, else its architecture. Raises
    ``ModelLoadError`` naming what is supported when the task is unknown, unsupported or cannot be told."""
    chosen = model_task or container_task
    if chosen is not None:
        task = ALIASES.get(chosen.strip(), chosen.strip())
        if task not in TASKS:
            raise ModelLoadError(f"task {chosen!r} is not served with no code ({GENERATIVE_HINT}); {_supported()}")
        return task
    architectures = (_read_config(model_dir) or {}).get("architectures") or []
    found = {task for name in architectures for suffix, task in ARCHITECTURE_TASKS.items() if name.endswith(suffix)}
    if len(found) == 1:
        return found.pop()
    if any(name.endswith(GENERATIVE_SUFFIXES) for name in architectures):
        raise ModelLoadError(f"{architectures} generate text: {GENERATIVE_HINT}; {_supported()}")
    if not architectures or all(name.endswith("Model") and "For" not in name for name in architectures):
        return "feature-extraction"  # a bare encoder (BertModel): what it computes is its hidden states
    raise ModelLoadError(
        f"cannot tell the task from config.json's architectures {architectures}: set task= in serving.properties "
        f"or HF_TASK; {_supported()}"
    )


def load(model_dir: Path, task: str, trust_remote_code: bool, pooling: str | None = None) -> HuggingFaceModel:
    """The model on the host, in eval mode, with what prepares its inputs. Never touches CUDA."""
    transformers = _transformers()

    config = _read_config(model_dir) or {}
    if "auto_map" in config:
        if not trust_remote_code:
            raise ModelLoadError(
                f"config.json asks for code of its own (auto_map: {sorted(config['auto_map'])}); it runs only with "
                "trust_remote_code=true in the model's serving.properties"
            )
        logger.warning("model_dir=%s runs the code its config.json names (trust_remote_code=true)", model_dir)
    options: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        auto = getattr(transformers, TASKS[task])
        model, info = auto.from_pretrained(str(model_dir), weights_only=True, output_loading_info=True, **options)
        tokenizer = image_processor = None
        if task in IMAGE_TASKS:
            image_processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), **options)
        else:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), **options)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"transformers could not load {model_dir.name} for {task}: {exc}") from exc
    _check_head(model_dir, task, config, info)
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and config.get("model_type") in OFFSET_POSITIONS:
        positions -= int(config.get("pad_token_id") or 0) + 1  # RoBERTa counts positions after the padding index
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    limits = [n for n in (positions, tokenizer_limit) if isinstance(n, int) and 0 < n < 1_000_000]
    logger.info("model_dir=%s loaded with transformers as %s (%s)", model_dir, task, type(model).__name__)
    limit = min(limits) if limits else None
    loaded = HuggingFaceModel(task, model.eval(), tokenizer, image_processor, limit, "auto_map" in config)
    if task == "feature-extraction":
        loaded.pooling, loaded.normalize = _pooling(model_dir, pooling)
        loaded.truncate_to = _max_seq_length(model_dir) if loaded.pooling else None
    return loaded


def _check_head(model_dir: Path, task: str, config: dict[str, Any], info: dict[str, Any]) -> None:
    """A task whose head the weights do not hold would answer from random weights: the LOAD fails instead."""
    missing = [*info.get("missing_keys", []), *(key for key, *_ in info.get("mismatched_keys", []))]
    if task == "feature-extraction":  # its answer is the hidden states: a pooler the weights lack is never read
        missing = [key for key in missing if "pooler" not in key]
    if missing:
        raise ModelLoadError(
            f"{model_dir.name} holds {config.get('architectures')}, whose weights lack what {task} needs "
            f"({', '.join(sorted(missing)[:4])}{', ...' if len(missing) > 4 else ''}): set the task that matches "
            "the directory (task= in serving.properties, or HF_TASK)"
        )


def _max_seq_length(model_dir: Path) -> int | None:
    try:
        value = json.loads((model_dir / "sentence_bert_config.json").read_text(encoding="utf-8"))["max_seq_length"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _transformers() -> Any:
    """transformers, imported on first use (the warm process imports it once, before forking such a model's
    loader). Typed ``Any``: its Auto classes are not annotated."""
    module = importlib.import_module("transformers")
    module.utils.logging.disable_progress_bar()  # one "Loading weights" bar per LOAD is noise in the model's log
    return module


def _pooling(model_dir: Path, configured: str | None) -> tuple[str | None, bool]:
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
    if settings.get("pooling_mode_cls_token"):
        return "cls", normalize
    if settings.get("pooling_mode_mean_tokens"):
        return "mean", normalize
    raise ModelLoadError(f"1_Pooling/config.json asks for a pooling this server does not do: {settings}; set pooling=")


def _read_config(model_dir: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _supported() -> str:
    return f"supported: {', '.join(TASKS)}"
