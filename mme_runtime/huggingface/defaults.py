"""The contract's defaults for a Hugging Face ``save_pretrained`` directory served with no code:
``model_fn`` loads it for its task (``loading.py``), ``input_fn`` reads the AWS Hugging Face
container's request (``requests.py``), ``predict_fn`` runs the task over a batch of requests in
one padded pass (``tasks.py``) and ``output_fn`` writes the pipeline's answer. A user's
``inference.py`` may still replace any of them, as with the PyTorch defaults; ``register`` offers
them to the serving core.

A generative task (``generation.py``) is not batched by the batcher: its model's scheduler decodes
the rows of every request together, step by step, so ``predict_fn`` returns when that request's
own rows are done. A LoRA adapter's directory (``lora.py``) is served the same way: ``model_fn``
loads its base, the adapter is attached when the model is placed (``lora_layers.py``), and each
request (each generated row) names its adapter, so that the base's pass picks it for its rows.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.huggingface import generation, loading, requests, vision
from mme_runtime.huggingface.audio import AudioRunner
from mme_runtime.huggingface.generation import GenerationLimits, GenerationRunner
from mme_runtime.huggingface.requests import TaskBatch, TaskRequest
from mme_runtime.huggingface.tasks import TaskRunner, shape
from mme_runtime.models import lora, model_package, package_cache, pt2
from mme_runtime.models.serving_properties import ServingSettings
from mme_runtime.serving.contract import DefaultsProvider, register_defaults
from mme_runtime.serving.pass_threads import RunPass, run_here

# The files that hold a tokenizer's tokens: an adapter that ships its own must ship its base's.
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def serves(model_dir: Path) -> bool:
    """Whether a directory is a Hugging Face model for these defaults: no TorchScript or PT2 file
    beside it."""
    others = pt2.pt2_file(model_dir) is not None or model_package.model_file(model_dir) is not None
    return not others and (
        loading.is_hugging_face_directory(model_dir) or lora.is_adapter_directory(model_dir)
    )


def register() -> None:
    """Offers these defaults to the serving core for the directories they serve, and tells the
    package cache which files hold a Hugging Face base's weights."""
    step = "choosing the Hugging Face task"  # what a LOAD that fails in HuggingFaceDefaults names
    register_defaults(DefaultsProvider(serves, HuggingFaceDefaults, step))
    package_cache.register_weight_files(loading.WEIGHT_FILES)
    package_cache.register_base_task(generative_base_task)


def generative_base_task(
    model_dir: Path, task: str | None, container_task: str | None
) -> str | None:
    """A generative model's task: its package is its LoRA adapters' for that task (one scheduler
    decodes the base's rows and theirs together). Other tasks keep a package of their own: an
    adapter's options (``pooling``) could differ from the base's."""
    if not serves(model_dir) or lora.is_adapter_directory(model_dir):
        return None
    try:
        resolved = loading.resolve_task(model_dir, task, container_task)
    except ModelLoadError:
        return None
    return resolved if resolved in ("text-generation", "text2text-generation") else None


def check_adapter(adapter_dir: Path, base_dir: Path, task: str) -> None:
    """Raises ``ModelLoadError`` (400) for an adapter this base cannot serve: a task adapters are
    not served for, a generative adapter over a base that does not generate, or a tokenizer of its
    own (its requests are tokenized with the base's)."""
    served = {*lora.TASK_TYPES.values(), *loading.GENERATIVE_TASKS}
    if loading.base_task(task) not in served:
        raise ModelLoadError(
            f"a LoRA adapter for {task} is not served (adapters are served for "
            f"{', '.join(sorted(served))})",
            status=400,
        )
    try:
        own = loading.resolve_task(base_dir, None, None)
    except ModelLoadError:
        own = None
    generative = loading.GENERATIVE_TASKS
    if loading.base_task(task) in generative and own and loading.base_task(own) not in generative:
        raise ModelLoadError(
            f"the adapter is for {task}, and its base {base_dir.name} is a model for {own}: a "
            "generative adapter needs a base that generates (a ...ForCausalLM or "
            "...ForConditionalGeneration checkpoint)",
            status=400,
        )
    for name in TOKENIZER_FILES:
        mine, theirs = adapter_dir / name, base_dir / name
        if mine.is_file() and not (theirs.is_file() and _same_vocabulary(mine, theirs)):
            raise ModelLoadError(
                f"the adapter ships a tokenizer of its own ({name}) that is not its base's: its "
                "requests are tokenized with the base's, which gives other token ids; remove it "
                "from the adapter, or serve the adapter merged into a model of its own",
                status=400,
            )


def _same_vocabulary(mine: Path, theirs: Path) -> bool:
    """Whether two tokenizer files hold the same tokens (a ``tokenizer.json``'s model and added
    tokens; other files byte for byte)."""
    if mine.name != "tokenizer.json":
        return mine.read_bytes() == theirs.read_bytes()
    try:
        a, b = (json.loads(path.read_text(encoding="utf-8")) for path in (mine, theirs))
    except (OSError, ValueError):
        return False
    keys = ("model", "added_tokens")
    return all(a.get(key) == b.get(key) for key in keys)


class HuggingFaceDefaults:
    """One model's defaults (its task is its own)."""

    ACCEPTS = requests.ACCEPTS

    def __init__(self, model_dir: Path, settings: ServingSettings, config: Config) -> None:
        """Raises ``ModelLoadError`` when the model's task is unknown, unsupported or cannot be
        told, or an adapter's base cannot be found."""
        self.adapter: lora.Adapter | None = None
        self.base_dir = model_dir
        task = settings.task
        if lora.is_adapter_directory(model_dir):
            self.adapter = lora.read_adapter(model_dir)
            self.base_dir = lora.find_base(model_dir, settings.base_model, config)
            task = task or self.adapter.task
        self.task = loading.resolve_task(self.base_dir, task, config.hf_task)
        if self.adapter is not None:
            check_adapter(model_dir, self.base_dir, self.task)
        self._trust_remote_code = settings.trust_remote_code
        self._pooling = settings.pooling
        self._runner: TaskRunner | AudioRunner | None = None
        self._lock = threading.Lock()
        self._config = config
        self._generator: GenerationRunner | None = None
        self._limits = generation_limits(settings, config)

    @property
    def schedules_itself(self) -> bool:
        """A generative task: its scheduler, not the batcher, puts the rows of many requests into
        one step."""
        return loading.base_task(self.task) in loading.GENERATIVE_TASKS

    def start(
        self,
        model: loading.HuggingFaceModel,
        max_rows: int,
        name: str,
        run_pass: RunPass = run_here,
    ) -> None:
        """Starts the model's scheduler, for up to ``max_rows`` rows per step (its batch size), once
        it is placed; its steps run through ``run_pass`` (on a GPU's pass threads)."""
        with self._lock:
            self.close()
            device = next(model.model.parameters(), torch.empty(0)).device
            limits = replace(self._limits, max_rows=max_rows)
            self._generator = GenerationRunner(model, device, limits, name, run_pass)

    def close(self) -> None:
        """Ends the scheduler (the model's UNLOAD): its rows fail, its thread lets the model go."""
        if self._generator is not None:
            self._generator.close()
            self._generator = None

    def default_model_fn(self, model_dir: str, context: Any = None) -> loading.HuggingFaceModel:
        return loading.load(self.base_dir, self.task, self._trust_remote_code, self._pooling)

    def default_input_fn(
        self, input_data: Any, content_type: str | None, context: Any = None
    ) -> TaskRequest:
        request = requests.decode(input_data, content_type, self.task)
        if self.task in vision.TASKS:  # a bad parameter is refused before the request joins a batch
            vision.check_parameters(self.task, request.parameters)
        if self.adapter is not None and context is not None:
            # the rows it adds to a pass use this model's adapter
            request.adapter = context.model_name
        return request

    def default_predict_fn(
        self, data: TaskRequest | TaskBatch, model: Any, context: Any = None
    ) -> list[Any]:
        """Every input's answer, in order: the batcher hands each request its own (one per input it
        sent)."""
        if not isinstance(model, loading.HuggingFaceModel):
            raise ModelLoadError(
                "a model_fn of its own must come with a predict_fn of its own for this model"
            )
        requests = data.requests if isinstance(data, TaskBatch) else [data]
        if self.schedules_itself:
            if self._generator is None:  # the warm-up request, before the scheduler starts
                self.start(model, self._limits.max_rows, getattr(context, "model_name", "warm-up"))
            assert self._generator is not None
            generated = self._generator.run(requests)
            owners = [request for request in requests for _ in request.inputs]
            return [_Answer(answer, owner) for answer, owner in zip(generated, owners, strict=True)]
        answers = self._runner_for(model).run(requests)
        owners = [request for request in requests for _ in range(request.rows)]
        return [_Answer(answer, owner) for answer, owner in zip(answers, owners, strict=True)]

    def default_output_fn(self, prediction: list[Any], accept: str, context: Any = None) -> bytes:
        request = prediction[0].request
        answers = [answer.value for answer in prediction]
        if self.schedules_itself:
            return requests.encode(generation.shape(self.task, answers, request), accept)
        return requests.encode(shape(self.task, answers, request), accept)

    def _runner_for(self, model: loading.HuggingFaceModel) -> TaskRunner | AudioRunner:
        with self._lock:
            if self._runner is None or self._runner.model is not model:
                device = next(model.model.parameters(), torch.empty(0)).device
                audio = self.task in loading.AUDIO_TASKS  # speech: audio.py
                self._runner = AudioRunner(model, device) if audio else TaskRunner(model, device)
            return self._runner


def generation_limits(settings: ServingSettings, config: Config) -> GenerationLimits:
    """The cap on new tokens (``serving.properties``'s ``max_new_tokens``, else
    ``MME_MAX_NEW_TOKENS``) and the time limit of a generation (``serving.properties``, else cut
    ``TIME_MARGIN_SECONDS`` before ``SAGEMAKER_MODEL_SERVER_TIMEOUT``, so that it answers in
    time), and the KV cache of its decoding batch (``kv_cache_mb``, else ``MME_KV_CACHE_MB``, else
    half the device's free memory)."""
    cap = settings.max_new_tokens or config.max_new_tokens
    source = (
        "max_new_tokens in serving.properties" if settings.max_new_tokens else "MME_MAX_NEW_TOKENS"
    )
    latest = max(1.0, config.response_timeout_seconds - generation.TIME_MARGIN_SECONDS)
    seconds = min(settings.max_generation_seconds or latest, latest)
    kv_mb = settings.kv_cache_mb or config.kv_cache_mb or None
    kv_from = "kv_cache_mb in serving.properties" if settings.kv_cache_mb else "MME_KV_CACHE_MB"
    return GenerationLimits(cap, source, seconds, settings.batch_size, kv_mb, kv_from)


class _Answer:
    """One input's answer, with the request it answers (its parameters and whether it sent one
    input)."""

    __slots__ = ("request", "value")

    def __init__(self, value: Any, request: TaskRequest) -> None:
        self.value = value
        self.request = request
