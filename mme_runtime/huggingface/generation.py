"""Generative tasks served with no code: each input becomes rows (``decoding.Row``) that the model's
scheduler decodes with every other client's (``scheduler.py``), each picking its tokens as
``generate`` would for it alone, or a beam group of rows (``beams.py``) picking its beams as
``generate``'s beam search does. Assisted generation (prompt lookup) runs ``generate`` alone; the
modes transformers keeps on the Hub (contrastive, group or constrained beam search, DoLa) answer
400.

Parameters go to ``generate`` as the pipeline passes them, plus ``stop`` and ``seed``; what a
request asks over the model's cap (``max_new_tokens``) or its positions answers 400, a default
over them is lowered, and a generation still running at its time limit is cut, with a
``warning``. Token ids outside the vocabulary answer 400 (``check_token_ids``, for speech too):
on a GPU they would spoil the CUDA context of every model of the process. text-generation runs
transformers' pipeline; the text-to-text tasks, gone from transformers 5, run as 4.57 ran them
(each input's prompt: ``prompts.py``).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import torch

from mme_runtime.base.config import Config
from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface.beams import BEAM_MODES, BeamGroup, unserved_mode_reason
from mme_runtime.huggingface.decoding import TIME, DecodingBatch, Row
from mme_runtime.huggingface.kv_cache import budget_for
from mme_runtime.huggingface.loading import HuggingFaceModel
from mme_runtime.huggingface.prompts import (
    Prompt,
    TextGeneration,
    TextToText,
    check_token_ids,
    vocabulary,
)
from mme_runtime.huggingface.requests import TaskRequest
from mme_runtime.huggingface.scheduler import Scheduler
from mme_runtime.operations import metrics
from mme_runtime.serving.pass_threads import RunPass, run_here

logger = logging.getLogger(__name__)

# How a generation is held is the server's: a static cache of max_cache_len 10**6 is allocated
# whole, and an offloaded one fails on a CPU.
SERVER_PARAMETERS = frozenset(
    {
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "continuous_batching_config",
    }
)
# A generation is cut this long before SAGEMAKER_MODEL_SERVER_TIMEOUT, so that its answer leaves in
# time.
TIME_MARGIN_SECONDS = 10.0
STOP_KEYS = ("stop", "stop_sequence", "stop_strings")
MAX_STOPS = 16
REFUSED = frozenset(
    {
        "return_tensors",
        "timeout",
        "generation_config",
        "streamer",
        "assistant_model",
        "assistant_tokenizer",
    }
    | {
        "custom_generate",
        "trust_remote_code",
        "tokenizer",
        "return_dict_in_generate",
        "output_scores",
    }
    | {"output_logits", "output_attentions", "output_hidden_states", "synced_gpus"}
    | SERVER_PARAMETERS
)
# Type and lower bound of the parameters clients send most: a wrong one answers 400 naming it.
INTEGERS = {
    "max_new_tokens": 1,
    "min_new_tokens": 0,
    "max_length": 1,
    "min_length": 0,
    "top_k": 0,
    "seed": 0,
}
INTEGERS |= {"num_return_sequences": 1, "num_beams": 1, "no_repeat_ngram_size": 0}
NUMBERS = {"temperature", "top_p", "repetition_penalty", "length_penalty"}
BOOLEANS = {"do_sample", "return_full_text"}
LOOP_MODES = frozenset({"greedy_search", "sample"})


@dataclass(frozen=True)
class GenerationLimits:
    max_new_tokens: int = Config.max_new_tokens  # a request asking more answers 400
    # where that cap was set, for the answer that names it
    max_new_tokens_from: str = "MME_MAX_NEW_TOKENS"
    seconds: float = 60.0 - TIME_MARGIN_SECONDS
    max_rows: int = 1  # rows decoded together at most: the model's batch_size
    kv_cache_mb: int | None = None  # the decoding batch's KV cache (None: half the free memory)
    kv_cache_from: str = "MME_KV_CACHE_MB"  # where that bound was set, for the answer that names it


class GenerationRunner:
    """One placed model's generative task, its scheduler, and what runs ``generate`` alone."""

    def __init__(
        self,
        model: HuggingFaceModel,
        device: torch.device,
        limits: GenerationLimits,
        name: str,
        run_pass: RunPass = run_here,
    ) -> None:
        self.model, self.limits, self.name = model, limits, name
        self._device, self._run_pass = device, run_pass
        # The first of a base's models makes what they share, under its base's own lock: the
        # first LOADs of other bases do not wait for it (a pipeline, two tokenizer copies).
        with _making_lock(model):
            with _SHARED_LOCK:
                shared: SharedGeneration | None = model.generation
                if shared is not None and not shared.scheduler.closed:
                    shared.users.add(self)
            if shared is None or self not in shared.users:
                made = SharedGeneration.make(model, device, limits, name, run_pass)
                with _SHARED_LOCK:
                    shared = model.generation = made
                    shared.users.add(self)
            elif _batch_settings(limits) != _batch_settings(shared.limits):
                logger.warning(
                    "model=%s batch_size=%d kv_cache_mb=%s ignored: its rows decode in its base's "
                    "batch, whose batch_size=%d and kv_cache_mb=%s the first of its models set",
                    *(name, *_batch_settings(limits), *_batch_settings(shared.limits)),
                )
        self._shared, self._scheduler, self._task = shared, shared.scheduler, shared.task
        self._vocabulary = shared.vocabulary
        self._stop_tokenizer, self._alone_tokenizer = shared.stop_tokenizer, shared.alone_tokenizer
        self._alone = shared.alone  # generate alone: one at a time

    def close(self) -> None:
        """This model's rows leave the scheduler; the scheduler ends with its last model."""
        shared = self._shared
        with _SHARED_LOCK:
            shared.users.discard(self)
            last = not shared.users
            if last and self.model.generation is shared:
                self.model.generation = None
        if last:
            shared.scheduler.close()
        else:
            shared.scheduler.withdraw(self)

    def run(self, requests: list[TaskRequest]) -> list[list[dict[str, Any]]]:
        """Each input's answers (one per returned sequence), in order."""
        deadline = time.monotonic() + self.limits.seconds
        planned: list[tuple[Prompt, list[Row] | None, Any, tuple[str, ...]]] = []
        for request in requests:
            parameters, stops, seed = _parameters(request.parameters)
            check_token_ids(parameters, self._vocabulary)
            for item in request.inputs:
                prompt = self._task.prepare(item, parameters)
                rows, config = self._plan(prompt, set(request.parameters), stops, seed, deadline)
                planned.append((prompt, rows, config, stops))
        alone = {
            index: self._generate_alone(prompt, config, stops, deadline)
            for index, (prompt, rows, config, stops) in enumerate(planned)
            if rows is None
        }
        rows = [row for _, rows, _, _ in planned if rows is not None for row in rows]
        for row in rows:
            row.owner, row.series = self, metrics.current()
        self._scheduler.submit(rows)
        answers = []
        for index, (prompt, rows, _, _) in enumerate(planned):
            if rows is None:
                sequences, cut = alone[index]
            else:
                for row in rows:
                    if row.error is not None:
                        raise row.error
                group = rows[0].group
                sequences = group.sequences() if group is not None else [row.tokens for row in rows]
                cut = any(row.finish == TIME for row in rows)
            records = [prompt.answer(sequence) for sequence in sequences]
            if cut:
                warning = (
                    f"cut after {self.limits.seconds:g} s, the time limit of one request: "
                    "answered what was generated"
                )
                records = [{**record, "warning": warning} for record in records]
            answers.append(records)
        return answers

    def _plan(
        self,
        prompt: Prompt,
        sent: set[str],
        stops: tuple[str, ...],
        seed: int | None,
        deadline: float,
    ) -> tuple[list[Row] | None, Any]:
        """The rows of one input (None: it runs ``generate`` alone), and its generation config."""
        model: Any = self.model.model
        ids = prompt.ids or _first_token(model)
        # the decoder's tokens before the first new one
        start = 1 if model.config.is_encoder_decoder else len(ids)
        arguments = dict(prompt.generate)
        base = arguments.pop("generation_config", None)
        # As generate tells them: a length nobody set, or one set by the request, task or model.
        unset = [
            key not in arguments
            and getattr(base, key, None) is None
            and getattr(model.generation_config, key) is None
            for key in ("max_length", "min_length")
        ]
        try:
            config, unused = model._prepare_generation_config(base, **arguments)
            if unused:
                raise InvalidInput(
                    f"parameters {sorted(unused)} are not generation parameters of this model"
                )
            config.validate()
            inputs = torch.tensor([ids], device=self._device)
            model._prepare_special_tokens(config, True, device=self._device)
            config = model._prepare_generated_length(
                config, unset[0], unset[1], "input_ids", start, inputs
            )
            config.max_new_tokens = self._new_tokens(config.max_length - start, len(ids), sent)
            config.max_length = start + config.max_new_tokens  # as generate alone gets it
            mode = config.get_generation_mode().value
            if mode not in LOOP_MODES | BEAM_MODES:
                reason = unserved_mode_reason(mode)
                if reason is not None:
                    raise InvalidInput(reason)
                return None, config
            beams = config.num_beams if mode in BEAM_MODES else 1  # a group's rows join together
            self._scheduler.check_room(len(ids), config.max_new_tokens, beams)
            processors = model._get_logits_processor(
                generation_config=config,
                input_ids_seq_length=start,
                encoder_input_ids=inputs,
                device=self._device,
            )
        except ValueError as exc:
            raise InvalidInput(f"parameters {arguments}: {exc}") from exc
        if mode in BEAM_MODES:
            return self._beams(ids, config, processors, stops, seed, deadline).rows, config
        eos = config._eos_token_tensor
        ends = frozenset() if eos is None else frozenset(eos.view(-1).tolist())
        rows = []
        for index in range(config.num_return_sequences or 1):
            row = Row(
                ids,
                config.max_new_tokens,
                self.name,
                ends,
                processors if len(processors) else None,
                bool(config.do_sample),
            )
            if seed is not None and config.do_sample:
                # its own draws: the rows beside it change nothing
                row.generator = torch.Generator(device=self._device).manual_seed(seed + index)
            row.stopped = self._stop_check(stops) if stops else None
            row.deadline = deadline
            if model.config.is_encoder_decoder:
                row.tokens = [int(config._decoder_start_token_tensor.view(-1)[0])]
            rows.append(row)
        return rows, config

    def _beams(
        self,
        ids: list[int],
        config: Any,
        processors: Any,
        stops: tuple[str, ...],
        seed: int | None,
        deadline: float,
    ) -> BeamGroup:
        """One input's beam search (``beams.py``), with ``generate``'s stopping criteria: stop
        sequences end a beam as its ``stop_strings`` do."""
        from transformers import StoppingCriteriaList

        model: Any = self.model.model
        if stops:
            config.stop_strings = list(stops)
        with self._alone if stops else nullcontext():  # its tokenizer reads the stop strings
            criteria = model._get_stopping_criteria(
                config, StoppingCriteriaList(), self._alone_tokenizer
            )
        generator = None
        if seed is not None and config.do_sample:  # its own draws, as a sampled row's
            generator = torch.Generator(device=self._device).manual_seed(seed)
        processors = processors if len(processors) else None
        return BeamGroup(model, config, processors, criteria, ids, self.name, generator, deadline)

    def _new_tokens(self, wanted: int, prompt_length: int, sent: set[str]) -> int:
        """How many tokens an input may get: what it asks for, within the cap and the model's
        positions. One that asks for more than either answers 400; a default over them is
        lowered."""
        asked = bool({"max_new_tokens", "max_length"} & sent)
        cap = self.limits.max_new_tokens
        if wanted > cap and asked:
            raise InvalidInput(
                f"max_new_tokens={wanted} is over this model's limit of {cap} "
                f"({self.limits.max_new_tokens_from})"
            )
        model, settings = self.model, getattr(self.model.model, "config", None)
        if getattr(settings, "is_encoder_decoder", False):
            if model.max_length is not None and prompt_length > model.max_length:
                raise InvalidInput(
                    f"an input has {prompt_length} tokens and the model takes at most "
                    f"{model.max_length}: shorten it, "
                    'or send "parameters": {"truncation": true}'
                )
            room = getattr(settings, "max_position_embeddings", None)
            room = None if room is None else room - 1
        else:
            room = None if model.max_length is None else model.max_length - prompt_length
            if room is not None and room < 1:
                raise InvalidInput(
                    f"the prompt has {prompt_length} tokens: the model takes at most "
                    f"{model.max_length}"
                )
        if room is not None and wanted > room and asked:
            raise InvalidInput(
                f"max_new_tokens={wanted} does not fit: the model has room for {room} more tokens"
            )
        return max(1, min(wanted, cap, room if room is not None else wanted))

    def _stop_check(self, stops: tuple[str, ...]) -> Any:
        tokenizer: Any = self._stop_tokenizer

        def stopped(row: Row) -> bool:
            text = tokenizer.decode(
                row.tokens[len(row.tokens) - row.generated :], skip_special_tokens=True
            )
            return any(stop in text for stop in stops)

        return stopped

    def _generate_alone(
        self, prompt: Prompt, config: Any, stops: tuple[str, ...], deadline: float
    ) -> tuple[list[list[int]], bool]:
        """``generate`` for one input alone (prompt lookup, say), stopped at the deadline: one at a
        time, on a pass thread of a GPU's."""
        with self._alone:
            generated: tuple[list[list[int]], bool] = self._run_pass(
                functools.partial(self._generate, prompt, config, stops, deadline)
            )
        return generated

    def _generate(
        self, prompt: Prompt, config: Any, stops: tuple[str, ...], deadline: float
    ) -> tuple[list[list[int]], bool]:
        model: Any = self.model.model
        arguments = {
            key: value for key, value in prompt.generate.items() if key != "generation_config"
        }
        arguments["max_new_tokens"] = config.max_new_tokens
        adapters = self.model.adapters  # the adapter this thread's passes use: this model's
        selected = nullcontext() if adapters is None else adapters.selecting_all(self.name)
        with torch.inference_mode(), selected:
            remaining = deadline - time.monotonic()
            if stops:
                arguments.update(stop_strings=list(stops), tokenizer=self._alone_tokenizer)
            ids = torch.tensor([prompt.ids or _first_token(model)], device=self._device)
            output = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=prompt.generate.get("generation_config"),
                max_time=max(0.001, remaining),
                **arguments,
            )
        sequences = getattr(output, "sequences", output)
        return [sequence.tolist() for sequence in sequences], time.monotonic() >= deadline


# Held while a runner joins or leaves what its base's models share (``SharedGeneration.users``).
_SHARED_LOCK = threading.Lock()


def _making_lock(model: HuggingFaceModel) -> threading.Lock:
    """The lock a base's first runners make its ``SharedGeneration`` under: one per base."""
    with _SHARED_LOCK:
        model.generation_lock = model.generation_lock or threading.Lock()
        return model.generation_lock  # type: ignore[no-any-return]


def _batch_settings(limits: GenerationLimits) -> tuple[int, int | str]:
    """What a base's models share of their settings: rows per step and the KV cache bound."""
    return limits.max_rows, limits.kv_cache_mb or "unset"


@dataclass(eq=False)
class SharedGeneration:
    """What the models over one base's weights (the base and its LoRA adapters) share to generate,
    made by the first and ended with the last (``users``): the scheduler whose steps decode all
    their rows, the task's pipeline, and the tokenizer copies of the scheduler thread (stop
    sequences) and of ``generate`` alone. Per adapter, only its own tensors are more."""

    scheduler: Scheduler
    task: TextGeneration | TextToText
    vocabulary: int | None
    stop_tokenizer: Any
    alone_tokenizer: Any
    limits: GenerationLimits  # the first model's: its batch_size and KV bound are the batch's
    alone: threading.Lock = field(default_factory=threading.Lock)
    users: set[GenerationRunner] = field(default_factory=set)  # each model's runner

    @staticmethod
    def make(
        model: HuggingFaceModel,
        device: torch.device,
        limits: GenerationLimits,
        name: str,
        run_pass: RunPass,
    ) -> SharedGeneration:
        budget = budget_for(model.model, device, limits.kv_cache_mb, limits.kv_cache_from)
        batch = DecodingBatch(model.model, model)
        generative = model.task == "text-generation"
        return SharedGeneration(
            Scheduler(batch, limits.max_rows, name, run_pass, budget),
            TextGeneration(model, device) if generative else TextToText(model, model.task),
            vocabulary(model.model),
            copy.deepcopy(model.tokenizer),
            copy.deepcopy(model.tokenizer),
            limits,
        )


def _first_token(model: Any) -> list[int]:
    bos = model.generation_config.bos_token_id
    if bos is None:
        raise InvalidInput("the prompt is empty and the model has no token to start from")
    return [int(bos)]


def _parameters(parameters: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...], int | None]:
    """The request's parameters for the task, its stop sequences and its seed. Raises
    ``InvalidInput`` (400)."""
    refused = REFUSED & set(parameters)
    if refused:
        raise InvalidInput(f"parameters {sorted(refused)} are not accepted here")
    for key, least in INTEGERS.items():
        value = parameters.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < least
        ):
            raise InvalidInput(f"{key} must be an integer of at least {least}, not {value!r}")
    for key in NUMBERS:
        value = parameters.get(key)
        if value is not None and (not isinstance(value, Real) or isinstance(value, bool)):
            raise InvalidInput(f"{key} must be a number, not {value!r}")
    for key in BOOLEANS:
        if key in parameters and not isinstance(parameters[key], bool):
            raise InvalidInput(f"{key} must be true or false, not {parameters[key]!r}")
    stopping = parameters.get("early_stopping", False)
    if not isinstance(stopping, bool) and stopping != "never":
        raise InvalidInput(f'early_stopping must be true, false or "never", not {stopping!r}')
    temperature, top_p = parameters.get("temperature"), parameters.get("top_p")
    if temperature is not None and temperature <= 0:
        raise InvalidInput(f"temperature must be above 0, not {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise InvalidInput(f"top_p must be above 0 and at most 1, not {top_p}")
    stops: list[str] = []
    for key in STOP_KEYS:
        value = parameters.get(key)
        value = [value] if isinstance(value, str) else value
        if value is not None and (
            not isinstance(value, list) or not all(isinstance(s, str) and s for s in value)
        ):
            raise InvalidInput(
                f"{key} must be a string or a list of strings, not {parameters[key]!r}"
            )
        stops += value or []
    if len(stops) > MAX_STOPS:
        raise InvalidInput(f"at most {MAX_STOPS} stop sequences, not {len(stops)}")
    rest = {key: value for key, value in parameters.items() if key not in (*STOP_KEYS, "seed")}
    return rest, tuple(dict.fromkeys(stops)), parameters.get("seed")


def shape(task: str, answers: list[list[dict[str, Any]]], request: TaskRequest) -> Any:
    """One request's answer as the pipeline gives it: for one input its records
    (``[{"generated_text": ...}]``); for a list, text-generation's a list of those, the text-to-text
    tasks' one record per input where each has one."""
    if request.single:
        return answers[0]
    if task != "text-generation" and all(len(records) == 1 for records in answers):
        return [records[0] for records in answers]
    return answers
