"""One model's contract, from its LOAD to its UNLOAD, and each message's requests through it.

``load`` runs ``model_fn`` in a CUDA-free loader (model on host memory); ``adopt`` takes the model
``model_fn`` built there (a device host); ``attach`` runs once the host's GPU is bound: it places
the model, may compile it, answers its warm-up sample, and ``start_batcher`` then lets many threads
call ``transform``: each message's requests, each read on its own, ``input_fn`` for each, one
``predict_fn`` per batch (through the batcher, so requests from many connections share a forward
pass), ``output_fn`` for each. Each request carries its own status (``content.py``): one bad request
never fails its neighbours, and tracebacks go to the log, never to clients. A request whose forward
pass is not done within ``SAGEMAKER_MODEL_SERVER_TIMEOUT`` is answered 504 (the pass runs on: a
thread cannot be stopped). ``close`` lets the model go.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar, cast

import torch
from sagemaker_inference.transformer import Transformer as ToolkitTransformer

from mme_runtime.base import failures
from mme_runtime.base.config import Config
from mme_runtime.base.errors import RequestTimeout
from mme_runtime.models import lora, lora_layers
from mme_runtime.models.loading import ResolvedModel, resolve_model
from mme_runtime.models.serving_properties import ServingSettings
from mme_runtime.operations import metrics
from mme_runtime.serving import content
from mme_runtime.serving.batcher import (
    Batcher,
    Job,
    group,
    rows,
    run_batch,
    run_by_first,
    signature,
)
from mme_runtime.serving.content import (
    check_answer,
    error_response,
    http_status,
    is_client_error,
    is_out_of_memory,
    load_failure,
    phrase,
    read_request,
    release_cached_device_memory,
    release_memory_of,
    to_bytes,
)
from mme_runtime.serving.contract import Contract, InferenceContext, RequestInFlight, bind_code
from mme_runtime.serving.pass_threads import PassThreads
from mme_runtime.serving.placement import compiled, dry_run, place_model

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")
# MMS times each request too, and past its timer answers 500 "Worker died." and drops the
# connection: ours answers a moment before, in words (its timer is SAGEMAKER_MODEL_SERVER_TIMEOUT or
# longer, started a moment before ours).
TIMEOUT_MARGIN_SECONDS = 1.0
T = TypeVar("T")


class ServedModel(ToolkitTransformer):  # type: ignore[misc]
    """One model's contract: loaded once, placed on its device once, then answering each message's
    requests (the toolkit's Transformer, answering per request: per-item batches and status-carrying
    errors)."""

    def __init__(self, default_inference_handler: Any, config: Config) -> None:
        super().__init__(default_inference_handler=default_inference_handler)
        self._config = config
        self._contract = Contract()
        self._model: Any = None
        # the model's, once it is placed on its device
        self._context: InferenceContext | None = None
        self._attached = False
        self._settings = ServingSettings(1, 0, "none")
        self._batcher: Batcher | None = None
        # torch's grad mode is per thread: the connections' threads get the one the loading thread
        # had after model_fn.
        self._grad_enabled: bool | None = None
        # Called after each forward pass; what it raises fails the pass's requests (a write to
        # shared weights).
        self.after_forward: Callable[[], None] | None = None
        # Run first and last in each thread its batcher starts and ends, now or later (a device host
        # marks the thread its model's: crash_board.py).
        self.thread_started: Callable[[], None] = lambda: None
        self.thread_ended: Callable[[], None] = lambda: None
        # A GPU device host's threads for every model's passes (``batcher.PassThreads``); None: each
        # model's own.
        self.pass_threads: PassThreads | None = None
        # LoRA adapters over a plain module (``lora_layers.py``): a job's rows use its model's
        self.row_adapters: Any = None
        self._defaults = default_inference_handler
        self._loaded = False
        self._code_dir: Path | None = None
        self._user_modules: dict[str, ModuleType] = {}
        self._adapter: lora.Adapter | None = None  # a LoRA adapter's: attached when placed
        self._adapter_bytes = 0  # its tensors, held by the layers it wraps once attached
        # where model_fn and the code come from: the model's, or its base's
        self._source_dir: Path | None = None
        # a generative model's defaults: its scheduler batches, not the batcher
        self._scheduling: Any = None

    @property
    def model(self) -> Any:
        return self._model

    @property
    def adapter_bytes(self) -> int:
        """A LoRA adapter's own tensors (its base's are the base package's)."""
        return self._adapter_bytes

    @property
    def code_dir(self) -> Path | None:
        """The directory its inference code came from (None: the defaults)."""
        return self._code_dir

    @property
    def settings(self) -> ServingSettings:
        return self._settings

    def load(
        self, mms_context: Any, device: torch.device = HOST, resolved: ResolvedModel | None = None
    ) -> None:
        """Imports the user's code and runs ``model_fn``: what a loader does once per model.
        ``resolved``: the model as its LOAD resolved it (``loading.resolve_model``); None resolves
        it here."""
        context = InferenceContext(mms_context, device)
        started = time.monotonic()
        self._prepare(context, resolved)
        self._run_model_fn(context)
        logger.info("model=%s loaded seconds=%.2f", context.model_name, time.monotonic() - started)

    def adopt(
        self,
        mms_context: Any,
        make_model: Callable[[], Any],
        made_with_code: str | None,
        resolved: ResolvedModel | None = None,
    ) -> bool:
        """Imports the user's code and takes the model ``model_fn`` returned in another process
        (``make_model`` rebuilds it here, so it runs once the user's classes are importable): what a
        device host does. Unless the code is not what ``model_fn`` ran with (``made_with_code``: a
        new object at SAGEMAKER_SUBMIT_DIRECTORY's S3 URI since the package was made, and kept):
        then ``model_fn`` runs here, and False says the package went unused."""
        context = InferenceContext(mms_context, HOST)
        self._prepare(context, resolved)
        code = None if self._code_dir is None else str(self._code_dir)
        if code != made_with_code:
            name = context.model_name
            logger.info(
                "model=%s code is %s, its package's was %s: model_fn runs here",
                name,
                code,
                made_with_code,
            )
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

    def _prepare(self, context: InferenceContext, resolved: ResolvedModel | None) -> None:
        """The model's settings and its user code (imported under the model's unique name),
        functions bound."""
        model_dir = Path(context.model_dir)
        resolved = resolved or resolve_model(model_dir, self._config)
        self._settings = resolved.settings
        code = bind_code(context.model_name, model_dir, resolved, self._defaults, self._config)
        self._contract, self._code_dir = code.contract, code.code_dir
        self._source_dir, self._adapter = code.source_dir, code.adapter
        self._user_modules, self._scheduling = code.user_modules, code.scheduling

    def attach(
        self, mms_context: Any, device: torch.device, resolved: ResolvedModel | None = None
    ) -> None:
        """Places the loaded model on this device host's device and warms it up; runs in the host
        (loading it first, from ``resolved`` where given, when ``adopt`` did not)."""
        if not self._loaded:
            self.load(mms_context, device, resolved)
        properties = mms_context.system_properties
        self._settings = self._settings.with_load_batch_size(int(properties.get("batch_size") or 1))
        properties["batch_size"] = self._settings.batch_size  # what context.batch_size reports
        if self._settings.batching and self._contract.answers_whole:
            logger.warning(
                "model=%s batch_size=%d ignored: transform_fn answers each request whole (batching "
                "needs input_fn/predict_fn/output_fn)",
                mms_context.model_name,
                self._settings.batch_size,
            )
            self._settings = replace(self._settings, batch_size=1, source="transform_fn")
        self._context = InferenceContext(mms_context, device)
        try:
            self._model = place_model(self._model, device)
            if self._adapter is not None:
                plain = isinstance(self._model, torch.nn.Module)  # else a Hugging Face model's
                module = self._model if plain else self._model.model
                name, adapter = self._context.model_name, self._adapter
                adapters = lora_layers.attach(self._model, module, name, adapter)
                self._adapter_bytes, self._adapter = adapter.let_go(), None
                if self._source_dir != Path(self._context.model_dir):
                    self.row_adapters = adapters  # a plain module: its rows picked per job
        except Exception as exc:  # boundary: a model that cannot be placed fails the host's LOAD
            raise load_failure("placing the model", exc) from exc
        if self._settings.compile:
            self._model = compiled(
                self._model,
                self._contract,
                self._context,
                self._settings,
                self._config,
                self._code_dir,
            )
        self._contract.run_load_step(
            "model_warmup_fn", self._context, self._context.model_dir, self._model
        )
        dry_run(self._code_dir, self._context, self._config.default_accept, self._answer)
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
        """From now on ``transform`` may be called from many threads at once: their forward passes
        go through one batcher (one at a time, gathered up to ``batch_size``). Called by the host
        once the model is attached."""
        if self._context is None:
            raise RuntimeError("attach the model before starting its batcher")
        self._grad_enabled = torch.is_grad_enabled()
        size, delay = self._settings.batch_size, self._settings.max_batch_delay_ms
        name, ended = self._context.model_name, self.thread_ended
        adapters = getattr(self._model, "adapters", None)
        # A pass over a base's adapters, or a generative base's step (its adapters' rows may share
        # it), is no one model's: none is marked the culprit of its crash.
        shared = adapters is not None or self._scheduling is not None
        run_pass = functools.partial(self.on_pass_thread, mark=not shared)
        if self._scheduling is not None:  # its rows share steps in a scheduler: no batcher
            self._scheduling.start(self._model, size, name, run_pass)
            return self._settings
        if self._batcher is None:
            if adapters is not None:
                # one queue for every adapter of the base: their requests share its passes; it
                # outlives the adapter that made it: of that adapter's hooks it takes the unmarking.
                make = functools.partial(
                    Batcher, run_by_first, size, delay, name, thread_ended=ended, run_pass=run_pass
                )
                self._batcher = adapters.batcher(name, make)
            else:
                run, started = self._run_jobs, self.thread_started
                concurrency = self._settings.concurrency
                self._batcher = Batcher(
                    run, size, delay, name, concurrency, started, ended, run_pass=run_pass
                )
        return self._settings

    def parts(self, owns_model: bool = True) -> list[Any]:
        """What its UNLOAD frees (``MemoryRelease``): itself, its user modules, and its model unless
        another model here holds it too (``owns_model`` false: it took another's package whole; a
        LoRA adapter's base), which would keep it alive and cost every UNLOAD a full collection."""
        shared = not owns_model or getattr(self._model, "adapters", None) is not None
        return [self, *([] if shared else [self._model]), *self._user_modules.values()]

    def close(self) -> None:
        """Lets go of the model (its UNLOAD in a device host): the batcher's threads end, the user
        module goes."""
        if self._scheduling is not None:  # its rows leave the scheduler before its adapter goes
            self._scheduling.close()
            self._scheduling = None
        adapters = getattr(self._model, "adapters", None)
        if adapters is not None and self._context is not None:
            if self._batcher is not None:
                self._batcher.withdraw(self._run_jobs)
            # its adapter goes; the shared batcher with the last one
            adapters.leave(self._context.model_name)
        elif self._batcher is not None:
            self._batcher.close()
        self._batcher = None
        self._model = None
        for name, module in self._user_modules.items():  # its script, under the model's unique name
            if sys.modules.get(name) is module:
                # not a LOAD of the same name that imported it again since
                del sys.modules[name]
        self._contract = Contract()
        self._attached = self._loaded = False

    def validate_and_initialize(self, model_dir: str | None = None, context: Any = None) -> None:
        """The toolkit's entry point: load and attach on the host when nothing did it before."""
        if not self._attached:
            self.attach(context, HOST)

    def on_pass_thread(self, function: Callable[[], T], mark: bool = True) -> T:
        """``function()`` on the device's pass threads, marked as this model's there (unless
        ``mark`` is false: a pass over several models), or on this thread where there are none."""
        if self.pass_threads is None:
            return function()
        started = self.thread_started if mark else (lambda: None)
        return cast(
            T, self.pass_threads.run(function, metrics.current(), started, self.thread_ended)
        )

    def transform(self, data: list[Any], context: Any) -> list[bytes]:
        """Answers one message's requests (MMS's ``context`` is this message's own); safe from many
        threads."""
        if not self._attached:
            self.validate_and_initialize(context=context)
        assert self._context is not None
        timeout = self._config.response_timeout_seconds
        deadline = time.monotonic() + max(timeout - TIMEOUT_MARGIN_SECONDS, timeout / 2)
        base = InferenceContext(context, self._context.device)
        requests, payloads, content_types = [], [], []
        for index, item in enumerate(data):
            request = RequestInFlight(base.for_request(index), self._config.default_accept)
            try:
                payload, content_type, accept = read_request(
                    item, request.context.header, self._config.max_request_bytes
                )
                request.accept = accept or request.accept
            except Exception as exc:  # request boundary: this request answers with its status
                request.error, payload, content_type = exc, None, None
            requests.append(request)
            payloads.append(payload)
            content_types.append(content_type)
        with self._grad_mode():
            self._answer(requests, payloads, content_types, deadline)
        results = []
        for index, request in enumerate(requests):
            if request.error is not None:
                request.body, request.content_type = error_response(request.error, request.context)
                status = http_status(request.error)
                context.set_response_status(status, phrase(status), index)
                if is_out_of_memory(request.error):
                    # so the next request finds the memory this one could not
                    release_memory_of(request.error)
            context.set_response_content_type(index, request.content_type)
            results.append(request.body)
        return results

    def _answer(
        self,
        requests: list[RequestInFlight],
        payloads: list[Any],
        content_types: list[str | None],
        deadline: float | None = None,
    ) -> None:
        """The contract on requests that have no error yet: ``input_fn`` for each, one
        ``predict_fn`` per batch, ``output_fn`` for each (or ``transform_fn`` for each, alone). Sets
        each request's body or error; a request whose pass is not done by ``deadline``
        (``time.monotonic``) gets a ``RequestTimeout``."""
        jobs = []
        for request, payload, content_type in zip(requests, payloads, content_types, strict=True):
            if request.error is None:
                try:
                    jobs.append(self._decode(request, payload, content_type))
                except Exception as exc:  # request boundary
                    request.error = exc
        if self._batcher is not None:
            for job in jobs:
                job.run_by = self._run_jobs
            self._batcher.submit(jobs, deadline)
        else:
            for batch in group(jobs, self._settings.batch_size):
                self._run_jobs(batch)
        for job in jobs:
            request = job.request
            if job.late is not None:
                request.error = self._timed_out(job.late)
                continue
            if job.error is not None:
                request.error = job.error
                continue
            try:
                self._encode(request, job.result)
            except Exception as exc:  # request boundary
                request.error = exc

    def _timed_out(self, late: str) -> RequestTimeout:
        step = "transform_fn" if self._contract.answers_whole else "predict_fn"
        where = (
            f"{step} still running"
            if late == "running"
            else f"waiting behind a call of {step} still running"
        )
        seconds = self._config.response_timeout_seconds
        return RequestTimeout(failures.timed_out(seconds, "SAGEMAKER_MODEL_SERVER_TIMEOUT", where))

    def _decode(self, request: RequestInFlight, payload: Any, content_type: str | None) -> Job:
        """``input_fn``, or for ``transform_fn`` the raw request: a job for the batcher."""
        if self._contract.answers_whole:
            return Job((payload, content_type, request.accept), request, None, 1)
        if self._contract.negotiates_accept:
            # Decided before any work, so an Accept we cannot produce costs the caller nothing.
            request.accept = content.negotiate(
                request.accept, self._config.default_accept, self._contract.accepts
            )
        data = self._contract.call("input_fn", request.context, payload, content_type)
        shape = signature(data) if self._settings.batch_size > 1 else None  # rows to batch by shape
        count = rows(data) if shape is not None else 1
        return Job(data, request, shape, count)

    def _grad_mode(self) -> AbstractContextManager[Any]:
        if self._grad_enabled is None:
            return nullcontext()
        return torch.set_grad_enabled(self._grad_enabled)

    def _run_jobs(self, jobs: list[Job]) -> None:
        """One forward pass: ``predict_fn`` on the batch (``transform_fn`` on a lone request)."""
        with self._grad_mode():
            self._run_jobs_here(jobs)
        if self.after_forward is not None:
            try:
                self.after_forward()
            except Exception as exc:  # request boundary: every request of the pass gets the error
                for job in jobs:
                    job.result, job.error = None, exc

    def _selecting(self, jobs: list[Job]) -> AbstractContextManager[Any]:
        """The rows of a pass over adapters: a lone job's are all its model's; a batch's, each job's
        own."""
        adapters = self.row_adapters
        if adapters is None:
            return nullcontext()
        selected: AbstractContextManager[Any]
        if len(jobs) == 1:
            selected = adapters.selecting_all(jobs[0].request.context.model_name)
        else:
            selected = adapters.selecting(
                [job.request.context.model_name for job in jobs for _ in range(job.rows)]
            )
        return selected

    def _run_jobs_here(self, jobs: list[Job]) -> None:
        if self._contract.answers_whole:
            for job in jobs:
                try:
                    with self._selecting([job]):
                        job.result = self._contract.call(
                            "transform_fn", job.request.context, self._model, *job.data
                        )
                except Exception as exc:  # request boundary
                    job.error = exc
            return
        run_batch(
            jobs,
            self._predict,
            self._context,
            _retry_in_halves,
            release_cached_device_memory,
            self._selecting,
        )

    def _predict(self, data: Any, request: RequestInFlight | InferenceContext) -> Any:
        """``predict_fn`` with a lone request's own context, or the model's for a batch."""
        context = request.context if isinstance(request, RequestInFlight) else request
        return self._contract.call("predict_fn", context, data, self._model)

    def _encode(self, request: RequestInFlight, result: Any) -> None:
        if not self._contract.answers_whole:
            result = self._contract.call("output_fn", request.context, result, request.accept)
        response_type = request.accept
        if isinstance(result, tuple):
            result, response_type = result
        request.body, request.content_type = to_bytes(result), str(response_type)
        step = "transform_fn" if self._contract.answers_whole else "output_fn"
        check_answer(step, request.body, request.content_type, self._config.max_response_bytes)


def _retry_in_halves(exc: BaseException) -> bool:
    """A failed batch is retried in halves when a smaller one may pass: out of memory, or a client
    error that one of its requests may have caused alone."""
    return is_out_of_memory(exc) or is_client_error(exc)
