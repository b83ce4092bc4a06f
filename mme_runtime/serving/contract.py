"""A model's contract functions: the user's ``model_fn``, ``input_fn``, ``predict_fn``,
``output_fn`` or ``transform_fn`` over the PyTorch defaults, each bound once, and how a load step or
a request step calls them, with the ``context`` they receive. ``bind_code`` binds them at LOAD: the
model's code (a LoRA adapter's over a plain base: the base's) over the defaults that serve its
directory.

The context is MMS's context API plus the model's device and the request's headers: existing
scripts keep using ``context.system_properties[...]`` and ``context.get_request_header(idx,
name)``; new code can read ``context.device``, ``context.gpu_id``, ``context.request_headers`` and
the rest directly.

A failing request step raises ``StepError`` (its status decided in ``content.py``; out of memory,
with the numbers as they were when it was caught); a failing load step fails the LOAD with the step
named.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from sagemaker_inference.errors import BaseInferenceToolkitError

from mme_runtime.base import failures
from mme_runtime.base.config import Config
from mme_runtime.base.devices import ASSIGNED_GPU_ID
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models import lora
from mme_runtime.models.code_fetcher import CodeFetcher, locate_code
from mme_runtime.models.loading import ResolvedModel
from mme_runtime.models.serving_properties import ServingSettings
from mme_runtime.models.user_code import USER_MODULE_PREFIX, UserFunction, load_user_code
from mme_runtime.serving import content
from mme_runtime.serving.content import (
    ERROR_CONTENT_TYPE,
    StepError,
    is_out_of_memory,
    load_failure,
)

CUSTOM_ATTRIBUTES = "x-amzn-sagemaker-custom-attributes"


class InferenceContext:
    """A view of MMS's ``Context`` for one model, or for one request of a batch
    (``request_index``)."""

    def __init__(
        self, mms_context: Any, device: torch.device, request_index: int | None = None
    ) -> None:
        self._mms = mms_context
        self.device = device
        self.request_index = request_index
        self._headers: dict[str, str] | None = None

    def for_request(self, index: int) -> InferenceContext:
        return InferenceContext(self._mms, self.device, index)

    @property
    def mms_context(self) -> Any:
        return self._mms

    @property
    def model_name(self) -> str:
        return str(self._mms.model_name)

    @property
    def model_dir(self) -> str:
        return str(self._mms.system_properties.get("model_dir"))

    @property
    def gpu_id(self) -> int | None:
        """The GPU the frontend assigned this device host (an nvidia-smi index), None on the CPU.

        ``system_properties["gpu_id"]`` is the CUDA ordinal of that GPU inside this host instead (0
        in our hosts, which see only their GPU), so that ``cuda:{gpu_id}`` in existing scripts names
        the right card.
        """
        properties = self._mms.system_properties
        gpu = properties.get(ASSIGNED_GPU_ID, properties.get("gpu_id"))
        return None if gpu is None else int(gpu)

    @property
    def batch_size(self) -> int:
        return int(self._mms.system_properties.get("batch_size") or 1)

    @property
    def request_id(self) -> str | None:
        if self.request_index is None or not self._mms.request_ids:
            return None
        request_id = self._mms.request_ids.get(self.request_index)
        return None if request_id is None else str(request_id)

    @property
    def request_headers(self) -> Mapping[str, str]:
        """This request's HTTP headers, keys in lower case."""
        if self._headers is None:
            self._headers = {}
            if self.request_index is not None and self._mms.request_processor:
                properties = self._mms.request_processor[
                    self.request_index
                ].get_request_properties()
                self._headers = {k.lower(): v for k, v in properties.items() if isinstance(v, str)}
        return self._headers

    def header(self, name: str) -> str | None:
        return self.request_headers.get(name.lower())

    @property
    def custom_attributes(self) -> str | None:
        """``X-Amzn-SageMaker-Custom-Attributes`` of this request (``CustomAttributes`` in
        ``invoke_endpoint``)."""
        return self.header(CUSTOM_ATTRIBUTES)

    def __getattr__(self, name: str) -> Any:
        # Everything else is MMS's context API: system_properties, get_request_header,
        # set_response_status, ...
        return getattr(self._mms, name)


@dataclass(eq=False)
class RequestInFlight:
    """One request on its way through the contract: its context, the Accept it is answered with, and
    the answer."""

    context: InferenceContext
    accept: str
    body: bytes = b""
    content_type: str = ERROR_CONTENT_TYPE
    error: Exception | None = None


class Contract:
    """The functions one model answers with, decided once at LOAD."""

    def __init__(
        self,
        functions: Mapping[str, UserFunction] | None = None,
        user: Collection[str] = (),
        accepts: Sequence[str] = content.SUPPORTED,
    ) -> None:
        self._functions = dict(functions or {})
        self.accepts = tuple(accepts)  # what the default output_fn writes
        # no batching: the request goes in and out whole
        self.answers_whole = "transform_fn" in self._functions
        # Decided once per model, not per request: only our default output_fn needs Accept
        # negotiated up front.
        self.negotiates_accept = not self.answers_whole and "output_fn" not in user

    @classmethod
    def bind(cls, defaults: Any, user: Mapping[str, UserFunction]) -> Contract:
        """The user's functions over the defaults' (``model_fn``, ``input_fn``, ``predict_fn``,
        ``output_fn``): the PyTorch ones, or registered ones (``huggingface/defaults.py``), which
        write their own media types."""
        functions = {
            name: UserFunction.bind(name, getattr(defaults, f"default_{name}"))
            for name in ("model_fn", "input_fn", "predict_fn", "output_fn")
        }
        return cls({**functions, **user}, user, getattr(defaults, "ACCEPTS", content.SUPPORTED))

    def call(self, name: str, context: InferenceContext, *args: Any) -> Any:
        """A request step: what it raises becomes that request's status, never its neighbours'."""
        try:
            return _apply(self._functions[name], args, context)
        except BaseInferenceToolkitError:
            raise
        except Exception as exc:
            if is_out_of_memory(exc):  # measured now, while what ran out still holds its memory
                raise StepError(name, exc, failures.out_of_memory(exc, name)) from exc
            raise StepError(name, exc) from exc

    def run_load_step(self, name: str, context: InferenceContext, *args: Any) -> Any:
        """A load step (``pre_model_fn``, ``model_fn``, ``model_warmup_fn``), skipped when the model
        has none."""
        function = self._functions.get(name)
        if function is None:
            return None
        try:
            return _apply(function, args, context)
        except Exception as exc:
            # boundary: the LOAD fails with the cause named; the traceback is logged
            raise load_failure(name, exc) from exc


def _apply(function: UserFunction, args: tuple[Any, ...], context: InferenceContext) -> Any:
    """Calls a contract function with or without ``context``, as it was decided at bind time."""
    if function.takes_context:
        return function.function(*args, context)
    return function.function(*args)


CONTRACT = frozenset(
    {"model_fn", "input_fn", "predict_fn", "output_fn"}
)  # a script that defines all four needs no defaults


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


@dataclass(frozen=True)
class ModelCode:
    """What a model's LOAD binds: its contract, and where its code and ``model_fn`` come from."""

    contract: Contract
    # where model_fn and the code come from: the model's, or its base's
    source_dir: Path
    code_dir: Path | None  # the directory its inference code came from (None: the defaults)
    user_modules: dict[str, ModuleType]  # its scripts, under the model's unique name
    scheduling: Any  # a generative model's defaults: its scheduler batches, not the batcher
    adapter: lora.Adapter | None  # a LoRA adapter's directory: attached over its base when placed


def bind_code(
    model_name: str, model_dir: Path, resolved: ResolvedModel, defaults: Any, config: Config
) -> ModelCode:
    """The model's user code (imported under the model's unique name) over ``defaults`` (the
    PyTorch ones) or registered ones, functions bound."""
    settings = resolved.settings
    source_dir, plain_adapter = _adapter_base(model_dir, settings, config)
    code_dir, source = resolved.code_dir, resolved.code_source
    if source_dir != model_dir:  # a LoRA adapter over a plain base: the base's code serves it
        fetcher = CodeFetcher(config.cache_dir / "code", config.s3_timeout_seconds)
        code_dir, source = locate_code(source_dir, config.submit_directory, fetcher)
    user = load_user_code(model_name, code_dir, source, config)
    user_modules = {
        name: sys.modules[name]
        for name in {function.function.__module__ for function in user.values()}
        if name.startswith(USER_MODULE_PREFIX) and name in sys.modules
    }
    defaults = _defaults_for(
        source_dir if plain_adapter else model_dir, user, defaults, settings, config
    )
    contract = Contract.bind(defaults, user)
    schedules = getattr(defaults, "schedules_itself", False) and "predict_fn" not in user
    adapter = plain_adapter or (None if "model_fn" in user else getattr(defaults, "adapter", None))
    return ModelCode(
        contract, source_dir, code_dir, user_modules, defaults if schedules else None, adapter
    )


def _adapter_base(
    model_dir: Path, settings: ServingSettings, config: Config
) -> tuple[Path, lora.Adapter | None]:
    """Where the model's code and ``model_fn`` come from: its own directory, or for a LoRA
    adapter over a plain PyTorch base (a ``code/inference.py`` of its own), that base's, with
    the adapter (a base that registered defaults serve, a Hugging Face one, is theirs to
    load)."""
    if not lora.is_adapter_directory(model_dir):
        return model_dir, None
    try:
        base = lora.find_base(model_dir, settings.base_model, config)
        if defaults_provider(base) is not None:
            return model_dir, None
        return base, lora.read_adapter(model_dir)
    except ModelLoadError as exc:
        raise load_failure("reading the LoRA adapter", exc) from exc


def _defaults_for(
    model_dir: Path,
    user: Mapping[str, Any],
    defaults: Any,
    settings: ServingSettings,
    config: Config,
) -> Any:
    """The PyTorch defaults, or registered ones (a Hugging Face model's) where they serve the
    directory and user code leaves a contract function to the defaults."""
    provider = defaults_provider(model_dir)
    if provider is None or "transform_fn" in user or CONTRACT <= set(user):
        return defaults
    try:
        return provider.make(model_dir, settings, config)
    except ModelLoadError as exc:
        raise load_failure(provider.step, exc) from exc
