"""The SageMaker contract for one model: load once, place on the executor's device once, then answer each request.

``load`` may run in the CUDA-free backend server before fork (model on host memory); ``attach`` runs in the
executor after its GPU is bound. ``transform`` takes each request through three stages: ``input_fn`` (its own
headers, content type and Accept), ``predict_fn`` (through the batcher once ``start_batcher`` ran, so requests from
many connections share a forward pass; inline otherwise) and ``output_fn``. Each request gets its own status, so one
bad request never fails its neighbours. Tracebacks go to the log, never to clients.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from sagemaker_inference.errors import BaseInferenceToolkitError
from sagemaker_inference.transformer import Transformer as ToolkitTransformer

from mme_runtime import collate, content
from mme_runtime.batcher import Batcher, Job, group, run_batch
from mme_runtime.compiling import compile_model
from mme_runtime.config import Config
from mme_runtime.context import InferenceContext
from mme_runtime.errors import ModelLoadError, PayloadTooLarge
from mme_runtime.placement import place_model, warmup_sample
from mme_runtime.responses import (
    Request,
    StepError,
    error_response,
    http_status,
    is_client_error,
    is_out_of_memory,
    load_failure,
    phrase,
    release_cached_device_memory,
    request_body,
    to_bytes,
)
from mme_runtime.serving_properties import ServingSettings, read_settings
from mme_runtime.user_code import USER_MODULE_PREFIX, UserFunction, load_user_code

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")


class Transformer(ToolkitTransformer):  # type: ignore[misc]
    """The toolkit's Transformer, with per-item batches, status-carrying errors and context passed by name."""

    def __init__(self, default_inference_handler: Any, config: Config) -> None:
        super().__init__(default_inference_handler=default_inference_handler)
        self._config = config
        self._defaults = default_inference_handler
        self._functions: dict[str, UserFunction] = {}
        self._model: Any = None
        self._context: InferenceContext | None = None
        self._loaded = False
        self._attached = False
        self._code_dir: Path | None = None
        self._user_modules: dict[str, ModuleType] = {}
        self._negotiates_accept = True
        self._settings = ServingSettings(1, 0, "none")
        self._batcher: Batcher | None = None
        # torch's grad mode is per thread: the executor's threads get the one its main thread had after model_fn.
        self._grad_enabled: bool | None = None

    @property
    def model(self) -> Any:
        return self._model

    @property
    def settings(self) -> ServingSettings:
        return self._settings

    def load(self, mms_context: Any, device: torch.device = HOST) -> None:
        """Imports the user's code and runs ``model_fn``: what the preload server does once per model."""
        context = InferenceContext(mms_context, device)
        started = time.monotonic()
        self._prepare(context)
        self._run_load_step("pre_model_fn", context, context.model_dir)
        self._model = self._run_load_step("model_fn", context, context.model_dir)
        self._loaded = True
        logger.info("model=%s loaded seconds=%.2f", context.model_name, time.monotonic() - started)

    def adopt(self, mms_context: Any, make_model: Callable[[], Any]) -> None:
        """Imports the user's code and takes the model ``model_fn`` returned in another process (``make_model``
        rebuilds it here, so it runs once the user's classes are importable): what a device host does."""
        context = InferenceContext(mms_context, HOST)
        self._prepare(context)
        try:
            self._model = make_model()
        except Exception as exc:  # boundary: the LOAD fails with the cause
            raise load_failure(context.model_name, "taking the preloaded model", exc) from exc
        self._loaded = True

    def _prepare(self, context: InferenceContext) -> None:
        """The model's settings and its user code (imported under the model's unique name), functions bound."""
        model_dir = Path(context.model_dir)
        config = self._config
        try:
            self._settings = read_settings(model_dir, config)
        except ModelLoadError as exc:
            raise load_failure(context.model_name, "reading serving settings", exc) from exc
        code_dir, user = load_user_code(context.model_name, model_dir, config)
        self._user_modules = {
            name: sys.modules[name]
            for name in {function.function.__module__ for function in user.values()}
            if name.startswith(USER_MODULE_PREFIX) and name in sys.modules
        }
        self._functions = self._with_defaults(user)
        # Decided once per model, not per request: only our default output_fn needs Accept negotiated up front.
        self._negotiates_accept = "transform_fn" not in user and "output_fn" not in user
        self._code_dir = code_dir

    def attach(self, mms_context: Any, device: torch.device) -> None:
        """Places the loaded model on this executor's device and warms it up; runs in the executor."""
        if not self._loaded:
            self.load(mms_context, device)
        properties = mms_context.system_properties
        self._settings = self._settings.with_load_batch_size(int(properties.get("batch_size") or 1))
        properties["batch_size"] = self._settings.batch_size  # what context.batch_size reports
        if self._settings.batching and "transform_fn" in self._functions:
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
        except Exception as exc:  # boundary: a model that cannot be placed fails the executor's LOAD
            raise load_failure(self._context.model_name, "placing the model", exc) from exc
        if self._settings.compile:
            self._compile(self._context, device)
        self._run_load_step("model_warmup_fn", self._context, self._context.model_dir, self._model)
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
        batcher (one at a time, gathered up to ``batch_size``). Called by the executor once the model is attached."""
        if self._context is None:
            raise RuntimeError("attach the model before starting its batcher")
        self._grad_enabled = torch.is_grad_enabled()
        if self._batcher is None:
            settings = self._settings
            self._batcher = Batcher(
                self._run_jobs,
                settings.batch_size,
                settings.max_batch_delay_ms,
                self._context.model_name,
                settings.concurrency,
            )
        return self._settings

    @property
    def batcher_threads(self) -> list[threading.Thread]:
        return [] if self._batcher is None else list(self._batcher.threads)

    def close(self) -> None:
        """Lets go of the model (its UNLOAD in a device host): the batcher's threads end, the user module goes."""
        if self._batcher is not None:
            self._batcher.close()
            self._batcher = None
        self._model = None
        for name, module in self._user_modules.items():  # its script, under the model's unique name
            if sys.modules.get(name) is module:  # not a LOAD of the same name that imported it again since
                del sys.modules[name]
        self._functions = {}
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
            sample = self._call("input_fn", context, payload, content_type)
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
        """Answers the model's sample request (``code/warmup.json``, ``.csv`` or ``.npy``) once per executor, so
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
            raise load_failure(context.model_name, f"warm-up request code/{sample}", cause) from request.error
        logger.info("model=%s warm-up request seconds=%.3f", context.model_name, time.monotonic() - started)

    def validate_and_initialize(self, model_dir: str | None = None, context: Any = None) -> None:
        """The toolkit's entry point: load and attach on the host when nothing did it before."""
        if not self._attached:
            self.attach(context, HOST)

    def transform(self, data: list[Any], context: Any) -> list[bytes]:
        """Answers one message's requests (MMS's ``context`` is this message's own); safe from many threads."""
        if not self._attached:
            self.validate_and_initialize(context=context)
        assert self._context is not None
        base = InferenceContext(context, self._context.device)
        requests, payloads, content_types = [], [], []
        for index, item in enumerate(data):
            request = Request(base.for_request(index), self._config.default_accept)
            try:
                payload, content_type = self._read(item, request)
            except Exception as exc:  # request boundary: this request answers with its status
                request.error, payload, content_type = exc, None, None
            requests.append(request)
            payloads.append(payload)
            content_types.append(content_type)
        with self._grad_mode():
            self._answer(requests, payloads, content_types)
        results = []
        for index, request in enumerate(requests):
            if request.error is not None:
                if is_out_of_memory(request.error):
                    release_cached_device_memory()  # so the next request finds the memory this one could not
                request.body, request.content_type = error_response(request.error, request.context)
                status = http_status(request.error)
                context.set_response_status(status, phrase(status), index)
            context.set_response_content_type(index, request.content_type)
            results.append(request.body)
        return results

    def _read(self, item: Any, request: Request) -> tuple[Any, str | None]:
        """The request's payload and content type, with its Accept settled on ``request``."""
        payload = request_body(item)
        if isinstance(payload, (bytes, bytearray, str)) and len(payload) > self._config.max_request_bytes:
            raise PayloadTooLarge(
                f"request body of {len(payload)} bytes exceeds the limit of {self._config.max_request_bytes} "
                "(SAGEMAKER_MAX_REQUEST_SIZE)"
            )
        content_type = request.context.header("content-type")
        accept = request.context.header("accept")
        if accept is not None and accept.strip() not in ("", content.ANY):
            request.accept = accept
        if isinstance(payload, (bytes, bytearray)) and content.media_type(content_type) in content.TEXT_TYPES:
            payload = content.utf8_text(payload)
        return payload, content_type

    def _answer(self, requests: list[Request], payloads: list[Any], content_types: list[str | None]) -> None:
        """The contract on requests that have no error yet: ``input_fn`` for each, one ``predict_fn`` per batch,
        ``output_fn`` for each (or ``transform_fn`` for each, alone). Sets each request's body or error."""
        jobs = []
        for request, payload, content_type in zip(requests, payloads, content_types, strict=True):
            if request.error is None:
                try:
                    jobs.append(self._decode(request, payload, content_type))
                except Exception as exc:  # request boundary
                    request.error = exc
        if self._batcher is not None:
            self._batcher.submit(jobs)
        else:
            for batch in group(jobs, self._settings.batch_size):
                self._run_jobs(batch)
        for job in jobs:
            request = job.request
            if job.error is not None:
                request.error = job.error
                continue
            try:
                self._encode(request, job.result)
            except Exception as exc:  # request boundary
                request.error = exc

    def _decode(self, request: Request, payload: Any, content_type: str | None) -> Job:
        """``input_fn``, or for ``transform_fn`` the raw request: a job for the batcher."""
        if "transform_fn" in self._functions:
            return Job((payload, content_type, request.accept), request, None, 1)
        if self._negotiates_accept:
            # Decided before any work, so an Accept we cannot produce costs the caller nothing.
            request.accept = content.negotiate(request.accept, self._config.default_accept)
        data = self._call("input_fn", request.context, payload, content_type)
        signature = collate.signature(data) if self._settings.batching else None
        rows = collate.rows(data) if signature is not None else 1
        return Job(data, request, signature, rows)

    def _grad_mode(self) -> AbstractContextManager[Any]:
        if self._grad_enabled is None:
            return nullcontext()
        return torch.set_grad_enabled(self._grad_enabled)

    def _run_jobs(self, jobs: list[Job]) -> None:
        """One forward pass: ``predict_fn`` on the batch (``transform_fn`` on a lone request)."""
        with self._grad_mode():
            self._run_jobs_here(jobs)

    def _run_jobs_here(self, jobs: list[Job]) -> None:
        if "transform_fn" in self._functions:
            for job in jobs:
                try:
                    job.result = self._call("transform_fn", job.request.context, self._model, *job.data)
                except Exception as exc:  # request boundary
                    job.error = exc
            return
        run_batch(jobs, self._predict, self._context, _retry_in_halves, release_cached_device_memory)

    def _predict(self, data: Any, request: Request | InferenceContext) -> Any:
        """``predict_fn`` with a lone request's own context, or the model's for a batch."""
        context = request.context if isinstance(request, Request) else request
        return self._call("predict_fn", context, data, self._model)

    def _encode(self, request: Request, result: Any) -> None:
        if "transform_fn" not in self._functions:
            result = self._call("output_fn", request.context, result, request.accept)
        response_type = request.accept
        if isinstance(result, tuple):
            result, response_type = result
        request.body, request.content_type = to_bytes(result), str(response_type)

    def _call(self, name: str, context: InferenceContext, *args: Any) -> Any:
        try:
            return self._functions[name](*args, context=context)
        except BaseInferenceToolkitError:
            raise
        except Exception as exc:
            if is_out_of_memory(exc):
                raise
            raise StepError(name, exc) from exc

    def _with_defaults(self, user: Mapping[str, UserFunction]) -> dict[str, UserFunction]:
        defaults = self._defaults
        functions = {
            "pre_model_fn": None,
            "model_warmup_fn": None,
            "model_fn": defaults.default_model_fn,
            "input_fn": defaults.default_input_fn,
            "predict_fn": defaults.default_predict_fn,
            "output_fn": defaults.default_output_fn,
        }
        bound = {name: UserFunction.bind(name, fn) for name, fn in functions.items() if fn is not None}
        bound.update(user)
        return bound

    def _run_load_step(self, name: str, context: InferenceContext, *args: Any) -> Any:
        function = self._functions.get(name)
        if function is None:
            return None
        try:
            return function(*args, context=context)
        except Exception as exc:  # boundary: the LOAD fails with the cause named; the traceback is logged
            raise load_failure(context.model_name, name, exc) from exc


def _retry_in_halves(exc: BaseException) -> bool:
    """A failed batch is retried in halves when a smaller one may pass: out of memory, or a client error that one of
    its requests may have caused alone."""
    return is_out_of_memory(exc) or is_client_error(exc)
