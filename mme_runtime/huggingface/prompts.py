"""Each input of a generative request as the model reads it (``Prompt``): its token ids, the
arguments ``generate`` would get for it, and how its answer is made from a generated sequence.
text-generation's come from transformers' pipeline (``TextGeneration``); the text-to-text tasks',
gone from transformers 5, as transformers 4.57's pipelines made them (``TextToText``). Token ids a
request names must be the model's (``check_token_ids``): on a GPU one outside the vocabulary would
spoil the CUDA context of every model of the process.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface.loading import HuggingFaceModel, base_task
from mme_runtime.huggingface.tasks import lent_pipeline, lent_tokenizer

TEXT_TO_TEXT_NAMES = {
    "text2text-generation": "generated",
    "summarization": "summary",
    "translation": "translation",
}
# What transformers 4.57's text-to-text pipelines asked of generate unless the model's generation
# config says otherwise.
TEXT_TO_TEXT_DEFAULTS = {"max_new_tokens": 256, "num_beams": 4}
# Pipeline parameters that only shape the answer or the tokens, never generate's arguments.
TEXT_TO_TEXT_PARAMETERS = frozenset(
    {"truncation", "clean_up_tokenization_spaces", "src_lang", "tgt_lang"}
)

# Generation parameters that hold token ids (decoder_start_token_id, suppress_tokens,
# bad_words_ids...).
TOKEN_ID_SUFFIXES = ("token_id", "token_ids", "suppress_tokens", "words_ids")


@dataclass
class Prompt:
    """One input, prepared: ``ids`` the model reads (a decoder-only model's prompt, or the encoder's
    input), ``generate`` the keyword arguments generate would get for it, and ``answer`` that makes
    the task's answer from a generated sequence (a decoder-only model's prompt and new tokens; an
    encoder-decoder's start token and new ones)."""

    ids: list[int]
    generate: dict[str, Any]
    answer: Callable[[list[int]], dict[str, Any]]


class TextGeneration:
    """text-generation through transformers' pipeline, with a copy of its tokenizer lent for each
    step (``tasks.lent_pipeline``): tokenizers are not safe to share between threads."""

    def __init__(self, model: HuggingFaceModel, device: torch.device) -> None:
        transformers: Any = importlib.import_module("transformers")
        self._pipeline = transformers.pipeline(
            "text-generation", model=model.model, tokenizer=model.tokenizer, device=device
        )

    def prepare(self, text: str, parameters: dict[str, Any]) -> Prompt:
        with lent_pipeline(self._pipeline) as pipeline:
            return self._prepare(pipeline, text, parameters)

    def _prepare(self, pipeline: Any, text: str, parameters: dict[str, Any]) -> Prompt:
        try:
            before, forward, after = pipeline._sanitize_parameters(**parameters)
            before = {**pipeline._preprocess_params, **before}
            forward = {**pipeline._forward_params, **forward}
            after = {**pipeline._postprocess_params, **after}
            inputs = pipeline.preprocess(text, **before)
            prefix_length = forward.pop("prefix_length", 0)
            arguments = pipeline._prepare_generate_kwargs(forward)
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidInput(f"parameters {parameters}: {exc}") from exc
        if prefix_length:  # as the pipeline does: a total length includes the prefix
            for length, new_tokens in (
                ("max_length", "max_new_tokens"),
                ("min_length", "min_new_tokens"),
            ):
                if length in arguments and new_tokens not in arguments:
                    arguments[length] += prefix_length
        ids = inputs["input_ids"][0].tolist()
        # an empty prompt starts from the model's first token
        prompt_ids = inputs["input_ids"] if ids else None

        def answer(sequence: list[int]) -> dict[str, Any]:
            outputs = {
                "generated_sequence": torch.tensor([[sequence]]),
                "input_ids": prompt_ids,
                "prompt_text": text,
            }
            try:
                with lent_pipeline(self._pipeline) as own:  # made later, maybe on another thread
                    return own.postprocess(outputs, **after)[0]  # type: ignore[no-any-return]
            except (ValueError, TypeError, KeyError) as exc:
                raise InvalidInput(
                    f"the answer could not be made with these parameters: {exc}"
                ) from exc

        return Prompt(ids, arguments, answer)


class TextToText:
    """text2text-generation, summarization and translation_xx_to_yy, as transformers 4.57's
    pipelines ran them."""

    def __init__(self, model: HuggingFaceModel, task: str) -> None:
        self._model = model
        self._name = TEXT_TO_TEXT_NAMES[base_task(task)]
        config = model.model.config
        specific = dict(getattr(config, "task_specific_params", None) or {})
        if task == "translation":
            # as transformers 4.57: the model's first translation task, if it names one
            task = next((key for key in specific if key.startswith("translation")), task)
        self.task = task
        parts = task.split("_")
        self._languages = (
            (parts[1], parts[3]) if len(parts) == 4 and parts[0] == "translation" else (None, None)
        )
        self.generation_config, prefix = _pipeline_generation_config(
            model, specific.get(task) or {}
        )
        self._prefix = prefix if prefix is not None else getattr(config, "prefix", None) or ""

    def prepare(self, text: str, parameters: dict[str, Any]) -> Prompt:
        unknown = {"return_tensors", "return_text", "return_type", "return_full_text"} & set(
            parameters
        )
        if unknown:
            raise InvalidInput(f"{sorted(unknown)} are not parameters of {self.task}")
        with lent_tokenizer(self._model.tokenizer) as tokenizer:
            return self._prepare(tokenizer, text, parameters)

    def _prepare(self, tokenizer: Any, text: str, parameters: dict[str, Any]) -> Prompt:
        truncation = parameters.get("truncation", False)
        source, target = (
            parameters.get("src_lang", self._languages[0]),
            parameters.get("tgt_lang", self._languages[1]),
        )
        try:
            if (
                callable(getattr(tokenizer, "_build_translation_inputs", None))
                and self._name == "translation"
            ):
                inputs = tokenizer._build_translation_inputs(
                    text,
                    return_tensors="pt",
                    truncation=truncation,
                    src_lang=source,
                    tgt_lang=target,
                )
            else:
                inputs = tokenizer(
                    self._prefix + text, padding=False, truncation=truncation, return_tensors="pt"
                )
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidInput(f"the input could not be tokenized: {exc}") from exc
        arguments = {
            key: value for key, value in parameters.items() if key not in TEXT_TO_TEXT_PARAMETERS
        }
        extra = {
            key: value
            for key, value in inputs.items()
            if key not in ("input_ids", "attention_mask", "token_type_ids")
        }
        # forced_bos_token_id of a multilingual tokenizer's translation inputs, say
        arguments.update(extra)
        clean = bool(parameters.get("clean_up_tokenization_spaces", False))
        key = f"{self._name}_text"

        def answer(sequence: list[int]) -> dict[str, Any]:
            with lent_tokenizer(self._model.tokenizer) as own:
                # made later, maybe on another thread
                text = own.decode(
                    sequence, skip_special_tokens=True, clean_up_tokenization_spaces=clean
                )
            return {key: text}

        return Prompt(
            inputs["input_ids"][0].tolist(),
            {"generation_config": self.generation_config, **arguments},
            answer,
        )


def _pipeline_generation_config(
    loaded: HuggingFaceModel, specific: dict[str, Any]
) -> tuple[Any, str | None]:
    """The generation config transformers 4.57's text-to-text pipeline built once: its defaults
    where the model's generation config sets nothing, a ``max_length`` the model sets honoured, then
    the task's ``task_specific_params``, and the tokenizer's pad token where the model has none; and
    the task's ``prefix``, if it names one."""
    model: Any = loaded.model
    own = model.generation_config.to_diff_dict()
    defaults = {key: value for key, value in TEXT_TO_TEXT_DEFAULTS.items() if key not in own}
    config = copy.deepcopy(model.generation_config)
    config.update(**defaults)
    if "max_new_tokens" in defaults and own.get("max_length") not in (None, 20):
        # a max_length the model chose wins over the pipeline's default
        config.max_new_tokens = None
    specific = dict(specific)
    prefix = specific.pop("prefix", None)
    config.update(**specific)
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    if config.pad_token_id is None and pad is not None:
        config.pad_token_id = pad
    return config, prefix


def check_token_ids(parameters: dict[str, Any], vocabulary: int | None) -> None:
    """Raises ``InvalidInput`` (400) for a token id outside the model's ``vocabulary`` (None: it
    says none)."""
    if vocabulary is None:
        return
    for key, value in parameters.items():
        if key.endswith(TOKEN_ID_SUFFIXES):
            outside = [token for token in _integers(value) if not 0 <= token < vocabulary]
            if outside:
                raise InvalidInput(
                    f"{key} names token ids {outside[:5]} outside the model's {vocabulary} tokens"
                )


def vocabulary(model: Any) -> int | None:
    """How many token ids the model embeds (its decoder's, for an encoder-decoder), or None when it
    says none."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return int(getattr(embeddings, "num_embeddings", 0)) or None


def _integers(value: Any) -> list[int]:
    """The integers in a parameter's value, however nested in lists."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [token for item in value for token in _integers(item)]
    return []
