"""The lifecycle of one model's contract: loaded once, placed on its device once, closed at UNLOAD.

``load`` may run in a CUDA-free process before fork (model on host memory); ``adopt`` takes a model that ``model_fn``
built in another process (a device host); ``attach`` runs once the process's GPU is bound: it places the model, may
compile it, answers its warm-up sample, and ``start_batcher`` then lets many threads call ``transform``
(``pipeline.py``, where each request goes through ``input_fn``, ``predict_fn`` and ``output_fn``).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models import lora
from mme_runtime.models.pt2 import compile_model
from mme_runtime.models.serving_properties import ServingSettings, read_settings
from mme_runtime.models.user_code import USER_MODULE_PREFIX, load_user_code
from mme_runtime.serving.batcher import Batcher, run_by_first
from mme_runtime.serving.content import Request, StepError, load_failure
from mme_runtime.serving.context import InferenceContext
from mme_runtime.serving.contract import Contract
from mme_runtime.serving.pipeline import RequestPipeline
from mme_runtime.serving.placement import place_model, warmup_sample

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")
CONTRACT = frozenset({"model_fn", "input_fn", "predict_fn", "output_fn"})


@dataclass(frozen=True)
class DefaultsProvider:
    """Defaults other than the PyTorch ones, for the model directories ``serves`` accepts:
    ``make(model_dir, settings, config)`` builds a model's, or raises ``ModelLoadError``, which
    fails the LOAD as ``step``."""

    serves: Callable[[Path], bool]
    make: Callable[[Path, ServingSettings, Config], Any]
    step: str


# Registered by the packages that bring them (``mme_runtime.huggingface``): this core names none.
_providers: list[DefaultsProvider] = []


def register_defaults(provider: DefaultsProvider) -> None:
    """Offers ``provider``'s defaults to every model loaded from now on (once, however often)."""
    if provider not in _providers:
        _providers.append(provider)


def defaults_provider(model_dir: Path) -> DefaultsProvider | None:
    """The registered defaults that serve ``model_dir``; None: the PyTorch ones."""
    return next((provider for provider in _providers if provider.serves(model_dir)), None)


class Transformer(RequestPipeline):
    """One model's contract: loaded once, placed on its device once, then answering requests (``RequestPipeline``)."""

    def __init__(self, default_inference_handler: Any, config: Config) -> None:
        super().__init__(default_inference_handler, config)
        self._defaults = default_inference_handler
        self._loaded = False
        self._code_dir: Path | None = None
        self._user_modules: dict[str, ModuleType] = {}
        self._adapter: lora.Adapter | None = None  # a LoRA adapter's directory: attached over its base when placed
        self._source_dir: Path | None = None  # where model_fn and the code come from: the model's, or its base's
        self._scheduling: Any = None  # a generative model's defaults: its scheduler batches, not the batcher

    @property
    def model(self) -> Any:
        return self._model

    @property
    def adapter_bytes(self) -> int:
        """A LoRA adapter's own tensors (its base's are the base package's)."""
        return 0 if self._adapter is None else self._adapter.nbytes

    @property
    def code_dir(self) -> Path | None:
        """The directory its inference code came from (None: the defaults)."""
        return self._code_dir

    @property
    def settings(self) -> ServingSettings:
        return self._settings

    def load(self, mms_context: Any, device: torch.device = HOST) -> None:
        """Imports the user's code and runs ``model_fn``: what a loader does once per model."""
        context = InferenceContext(mms_context, device)
        started = time.monotonic()
        self._prepare(context)
        self._run_model_fn(context)
        logger.info("model=%s loaded seconds=%.2f", context.model_name, time.monotonic() - started)

    def adopt(self, mms_context: Any, make_model: Callable[[], Any], made_with_code: str | None = None) -> bool:
        """Imports the user's code and takes the model ``model_fn`` returned in another process (``make_model``
        rebuilds it here, so it runs once the user's classes are importable): what a device host does. Unless the
        code is not what ``model_fn`` ran with (``made_with_code``: a new object at SAGEMAKER_SUBMIT_DIRECTORY's S3
        URI since the package was made, and kept): then ``model_fn`` runs here, and False says the package went
        unused."""
        context = InferenceContext(mms_context, HOST)
        self._prepare(context)
        code = None if self._code_dir is None else str(self._code_dir)
        if code != made_with_code:
            name = context.model_name
            logger.info("model=%s code is %s, its package's was %s: model_fn runs here", name, code, made_with_code)
            self._run_model_fn(context)
            return False
        try:
            self._model = make_model()
        except Exception as exc:  # boundary: the LOAD fails with the cause
            raise load_failure("taking the preloaded model", exc) from exc
        self._loaded = True
        return True

    def _run_model_fn(self, context: InferenceContext) -> None:
        source = str(self._source_dir or context.model_dir)
        self._contract.run_load_step("pre_model_fn", context, source)
        self._model = self._contract.run_load_step("model_fn", context, source)
        self._loaded = True

    def _prepare(self, context: InferenceContext) -> None:
        """The model's settings and its user code (imported under the model's unique name), functions bound."""
        model_dir = Path(context.model_dir)
        config = self._config
        try:
            self._settings = read_settings(model_dir, config)
        except ModelLoadError as exc:
            raise load_failure("reading serving settings", exc) from exc
        self._source_dir, plain_adapter = self._adapter_base(context, model_dir)
        code_dir, user = load_user_code(context.model_name, self._source_dir, config)
        self._user_modules = {
            name: sys.modules[name]
            for name in {function.function.__module__ for function in user.values()}
            if name.startswith(USER_MODULE_PREFIX) and name in sys.modules
        }
        defaults = self._defaults_for(context, self._source_dir if plain_adapter else model_dir, user)
        self._contract = Contract.bind(defaults, user)
        schedules = getattr(defaults, "schedules_itself", False) and "predict_fn" not in user
        self._scheduling = defaults if schedules else None
        self._adapter = plain_adapter or (None if "model_fn" in user else getattr(defaults, "adapter", None))
        self._code_dir = code_dir

    def _adapter_base(self, context: InferenceContext, model_dir: Path) -> tuple[Path, lora.Adapter | None]:
        """Where the model's code and ``model_fn`` come from: its own directory, or for a LoRA adapter over a plain
        PyTorch base (a ``code/inference.py`` of its own), that base's, with the adapter (a base
        that registered defaults serve, a Hugging Face one, is theirs to load)."""
        if not lora.is_adapter_directory(model_dir):
            return model_dir, None
        try:
            base = lora.find_base(model_dir, self._settings.base_model, self._config)
            if defaults_provider(base) is not None:
                return model_dir, None
            return base, lora.read_adapter(model_dir)
        except ModelLoadError as exc:
            raise load_failure("reading the LoRA adapter", exc) from exc

    def _defaults_for(self, context: InferenceContext, model_dir: Path, user: Mapping[str, Any]) -> Any:
        """The PyTorch defaults, or registered ones (a Hugging Face model's) where they serve the
        directory and user code leaves a contract function to the defaults."""
        provider = defaults_provider(model_dir)
        if provider is None or "transform_fn" in user or CONTRACT <= set(user):
            return self._defaults
        try:
            return provider.make(model_dir, self._settings, self._config)
        except ModelLoadError as exc:
            raise load_failure(provider.step, exc) from exc

    def attach(self, mms_context: Any, device: torch.device) -> None:
        """Places the loaded model on this device host's device and warms it up; runs in the host."""
        if not self._loaded:
            self.load(mms_context, device)
        properties = mms_context.system_properties
        self._settings = self._settings.with_load_batch_size(int(properties.get("batch_size") or 1))
        properties["batch_size"] = self._settings.batch_size  # what context.batch_size reports
        if self._settings.batching and self._contract.answers_whole:
            logger.warning(
                "model=%s batch_size=%d ignored: transform_fn answers each request whole (batching needs "
                "input_fn/predict_fn/output_fn)",
                mms_context.model_name,
                self._settings.batch_size,
            )
            self._settings = replace(self._settings, batch_size=1, source="transform_fn")
        self._context = InferenceContext(mms_context, device)
        try:
            self._model = place_model(self._model, device)
            if self._adapter is not None:
                module = self._model if isinstance(self._model, torch.nn.Module) else self._model.model
                adapters = lora.attach(self._model, module, self._context.model_name, self._adapter)
                if self._source_dir != Path(self._context.model_dir):  # a plain module: its rows picked per job
                    self.row_adapters = adapters
        except Exception as exc:  # boundary: a model that cannot be placed fails the host's LOAD
            raise load_failure("placing the model", exc) from exc
        if self._settings.compile:
            self._compile(self._context, device)
        self._contract.run_load_step("model_warmup_fn", self._context, self._context.model_dir, self._model)
        self._dry_run(self._context)
        self._attached = True
        logger.info(
            "model=%s device=%s gpu=%s batch_size=%d max_batch_delay_ms=%d (%s) ready",
            self._context.model_name,
            device,
            self._context.gpu_id,
            self._settings.batch_size,
            self._settings.max_batch_delay_ms,
            self._settings.source,
        )

    def start_batcher(self) -> ServingSettings:
        """From now on ``transform`` may be called from many threads at once: their forward passes go through one
        batcher (one at a time, gathered up to ``batch_size``). Called by the host once the model is attached."""
        if self._context is None:
            raise RuntimeError("attach the model before starting its batcher")
        self._grad_enabled = torch.is_grad_enabled()
        if self._scheduling is not None:  # its rows share steps in its own scheduler: no batcher
            name = self._context.model_name
            self._scheduling.start(self._model, self._settings.batch_size, name, self.on_pass_thread)
            return self._settings
        if self._batcher is None:
            size, delay, name = self._settings.batch_size, self._settings.max_batch_delay_ms, self._context.model_name
            adapters = getattr(self._model, "adapters", None)
            if adapters is not None:  # one queue for every adapter of the base: their requests share its passes
                # Its threads are no one adapter's (none is marked the culprit of a crash in a pass over them all),
                # and it outlives the adapter that made it: of that adapter's hooks it takes the unmarking alone.
                unmarked = functools.partial(self.on_pass_thread, mark=False)
                make = functools.partial(
                    Batcher, run_by_first, size, delay, name, thread_ended=self.thread_ended, run_pass=unmarked
                )
                self._batcher = adapters.batcher(name, make)
            else:
                started, ended = self.thread_started, self.thread_ended
                concurrency = self._settings.concurrency
                self._batcher = Batcher(
                    self._run_jobs, size, delay, name, concurrency, started, ended, run_pass=self.on_pass_thread
                )
        return self._settings

    @property
    def scheduler_threads(self) -> list[threading.Thread]:
        """The generation scheduler's thread, which lives as long as the model (a batcher's threads run
        ``thread_started`` and ``thread_ended`` themselves)."""
        return [] if self._scheduling is None else list(self._scheduling.threads)

    def close(self) -> None:
        """Lets go of the model (its UNLOAD in a device host): the batcher's threads end, the user module goes."""
        adapters = getattr(self._model, "adapters", None)
        if adapters is not None and self._context is not None:
            if self._batcher is not None:
                self._batcher.withdraw(self._run_jobs)
            adapters.leave(self._context.model_name)  # its adapter goes; the shared batcher with the last one
        elif self._batcher is not None:
            self._batcher.close()
        self._batcher = None
        if self._scheduling is not None:
            self._scheduling.close()
            self._scheduling = None
        self._model = None
        for name, module in self._user_modules.items():  # its script, under the model's unique name
            if sys.modules.get(name) is module:  # not a LOAD of the same name that imported it again since
                del sys.modules[name]
        self._contract = Contract()
        self._attached = self._loaded = False

    def _compile(self, context: InferenceContext, device: torch.device) -> None:
        """``compile=true``: the model compiled for this device (traced on the decoded warm-up sample), or eager."""
        found = warmup_sample(self._code_dir)
        if found is None:
            logger.warning(
                "model=%s compile=true: serving eager, not compiled: compiling needs a sample request in code/ "
                "(warmup.json, warmup.csv or warmup.npy) to trace the model with",
                context.model_name,
            )
            return
        _, payload, content_type = found
        try:
            sample = self._contract.call("input_fn", context, payload, content_type)
        except Exception as exc:  # boundary: the dry run below reports a sample the model cannot take
            logger.warning(
                "model=%s compile=true: serving eager: input_fn refused the warm-up sample: %s", context.model_name, exc
            )
            return
        self._model = compile_model(
            self._model,
            context.model_name,
            Path(context.model_dir),
            device,
            self._settings,
            sample,
            self._config.cache_dir,
        )

    def _dry_run(self, context: InferenceContext) -> None:
        """Answers the model's sample request (``code/warmup.json``, ``.csv`` or ``.npy``) once per device host, so
        TorchScript profiling and lazy initialisation are paid at LOAD, not by the first caller."""
        found = warmup_sample(self._code_dir)
        if found is None:
            return
        sample, payload, content_type = found
        started = time.monotonic()
        request = Request(context, self._config.default_accept)
        self._answer([request], [payload], [content_type])
        if request.error is not None:  # a sample the model cannot answer fails the LOAD, with the cause
            cause = request.error.cause if isinstance(request.error, StepError) else request.error
            raise load_failure(f"warm-up request code/{sample}", cause) from request.error
        logger.info("model=%s warm-up request seconds=%.3f", context.model_name, time.monotonic() - started)

    def validate_and_initialize(self, model_dir: str | None = None, context: Any = None) -> None:
        """The toolkit's entry point: load and attach on the host when nothing did it before."""
        if not self._attached:
            self.attach(context, HOST)
