"""How a generative task turns an input into token ids and generate's arguments, and generated ids into its answer,
as the pipeline the AWS Hugging Face container runs does it.

text-generation is transformers' own pipeline (its preprocessing, its defaults: sampling at temperature 0.7 and 256
new tokens unless the model's generation config says otherwise, its postprocessing with ``return_full_text``).
"""

from __future__ import annotations

import copy
import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.models.hf_loading import HuggingFaceModel

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    """One input, prepared: ``ids`` the model reads (a decoder-only model's prompt, or the encoder's input),
    ``generate`` the keyword arguments generate would get for it, and ``answer`` that makes the task's answer from a
    generated sequence (a decoder-only model's prompt and new tokens; an encoder-decoder's start token and new ones)."""

    ids: list[int]
    generate: dict[str, Any]
    answer: Callable[[list[int]], dict[str, Any]]


class TextGeneration:
    """text-generation through transformers' pipeline: each thread prepares its inputs with its own copy (tokenizers
    are not safe to share between threads that change their settings)."""

    def __init__(self, model: HuggingFaceModel, device: torch.device) -> None:
        transformers: Any = importlib.import_module("transformers")
        self._pipeline = transformers.pipeline(
            "text-generation", model=model.model, tokenizer=model.tokenizer, device=device
        )
        self._local = threading.local()

    def prepare(self, text: str, parameters: dict[str, Any]) -> Prompt:
        pipeline = self._thread_pipeline()
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
            for length, new_tokens in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
                if length in arguments and new_tokens not in arguments:
                    arguments[length] += prefix_length
        ids = inputs["input_ids"][0].tolist()
        prompt_ids = inputs["input_ids"] if ids else None  # an empty prompt starts from the model's first token

        def answer(sequence: list[int]) -> dict[str, Any]:
            outputs = {"generated_sequence": torch.tensor([[sequence]]), "input_ids": prompt_ids, "prompt_text": text}
            try:
                return pipeline.postprocess(outputs, **after)[0]  # type: ignore[no-any-return]
            except (ValueError, TypeError, KeyError) as exc:
                raise InvalidInput(f"the answer could not be made with these parameters: {exc}") from exc

        return Prompt(ids, arguments, answer)

    def _thread_pipeline(self) -> Any:
        pipeline = getattr(self._local, "pipeline", None)
        if pipeline is None:
            pipeline = copy.copy(self._pipeline)
            pipeline.tokenizer = copy.deepcopy(pipeline.tokenizer)
            self._local.pipeline = pipeline
        return pipeline
