"""One message's requests through the contract: each read on its own, ``input_fn`` for each, one ``predict_fn`` per
batch (through the batcher, so requests from many connections share a forward pass), ``output_fn`` for each.

Each request carries its own status (``content.py``): one bad request never fails its neighbours, and tracebacks go
to the log, never to clients. A request whose forward pass is not done within ``SAGEMAKER_MODEL_SERVER_TIMEOUT``
is answered 504 (the pass runs on: a thread cannot be stopped). ``Transformer`` (``transformer.py``) adds the model's
lifecycle: load, place, close.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar, cast

import torch
from sagemaker_inference.transformer import Transformer as ToolkitTransformer

from mme_runtime.base import failures
from mme_runtime.base.config import Config
from mme_runtime.base.errors import PayloadTooLarge, RequestTimeout
from mme_runtime.models.serving_properties import ServingSettings
from mme_runtime.operations import metrics
from mme_runtime.serving import content
from mme_runtime.serving.batcher import Batcher, Job, group, rows, run_batch, signature
from mme_runtime.serving.content import (
    Request,
    error_response,
    http_status,
    is_client_error,
    is_out_of_memory,
    phrase,
    release_cached_device_memory,
    release_memory_of,
    request_body,
    to_bytes,
)
from mme_runtime.serving.context import InferenceContext
from mme_runtime.serving.contract import Contract
from mme_runtime.serving.pass_threads import PassThreads

# MMS times each request too, and past its timer answers 500 "Worker died." and drops the connection: ours answers
# a moment before, in words (its timer is SAGEMAKER_MODEL_SERVER_TIMEOUT or longer, started a moment before ours).
TIMEOUT_MARGIN_SECONDS = 1.0
T = TypeVar("T")


class RequestPipeline(ToolkitTransformer):  # type: ignore[misc]
    """The toolkit's Transformer, answering per request: per-item batches and status-carrying errors."""

    def __init__(self, default_inference_handler: Any, config: Config) -> None:
        super().__init__(default_inference_handler=default_inference_handler)
        self._config = config
        self._contract = Contract()
        self._model: Any = None
        self._context: InferenceContext | None = None  # the model's, once it is placed on its device
        self._attached = False
        self._settings = ServingSettings(1, 0, "none")
        self._batcher: Batcher | None = None
        # torch's grad mode is per thread: the connections' threads get the one the loading thread had after model_fn.
        self._grad_enabled: bool | None = None
        # Called after each forward pass; what it raises fails the pass's requests (a write to shared weights).
        self.after_forward: Callable[[], None] | None = None
        # Run first and last in each thread its batcher starts and ends, now or later (a device host marks the thread
        # its model's: crash_board.py).
        self.thread_started: Callable[[], None] = lambda: None
        self.thread_ended: Callable[[], None] = lambda: None
        # A GPU device host's threads for every model's passes (``batcher.PassThreads``); None: each model's own.
        self.pass_threads: PassThreads | None = None
        # LoRA adapters over a plain module (``lora.py``): each job's rows use its own model's adapter.
        self.row_adapters: Any = None

    def on_pass_thread(self, function: Callable[[], T], mark: bool = True) -> T:
        """``function()`` on the device's pass threads, marked as this model's there (unless ``mark`` is false: a
        pass over several models), or on this thread where there are none."""
        if self.pass_threads is None:
            return function()
        started = self.thread_started if mark else (lambda: None)
        return cast(T, self.pass_threads.run(function, metrics.current(), started, self.thread_ended))

    def transform(self, data: list[Any], context: Any) -> list[bytes]:
        """Answers one message's requests (MMS's ``context`` is this message's own); safe from many threads."""
        if not self._attached:
            self.validate_and_initialize(context=context)
        assert self._context is not None
        timeout = self._config.response_timeout_seconds
        deadline = time.monotonic() + max(timeout - TIMEOUT_MARGIN_SECONDS, timeout / 2)
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
            self._answer(requests, payloads, content_types, deadline)
        results = []
        for index, request in enumerate(requests):
            if request.error is not None:
                request.body, request.content_type = error_response(request.error, request.context)
                status = http_status(request.error)
                context.set_response_status(status, phrase(status), index)
                if is_out_of_memory(request.error):
                    release_memory_of(request.error)  # so the next request finds the memory this one could not
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

    def _answer(
        self,
        requests: list[Request],
        payloads: list[Any],
        content_types: list[str | None],
        deadline: float | None = None,
    ) -> None:
        """The contract on requests that have no error yet: ``input_fn`` for each, one ``predict_fn`` per batch,
        ``output_fn`` for each (or ``transform_fn`` for each, alone). Sets each request's body or error; a request
        whose pass is not done by ``deadline`` (``time.monotonic``) gets a ``RequestTimeout``."""
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
        where = f"{step} still running" if late == "running" else f"waiting behind a call of {step} still running"
        seconds = self._config.response_timeout_seconds
        return RequestTimeout(failures.timed_out(seconds, "SAGEMAKER_MODEL_SERVER_TIMEOUT", where))

    def _decode(self, request: Request, payload: Any, content_type: str | None) -> Job:
        """``input_fn``, or for ``transform_fn`` the raw request: a job for the batcher."""
        if self._contract.answers_whole:
            return Job((payload, content_type, request.accept), request, None, 1)
        if self._contract.negotiates_accept:
            # Decided before any work, so an Accept we cannot produce costs the caller nothing.
            request.accept = content.negotiate(request.accept, self._config.default_accept, self._contract.accepts)
        data = self._contract.call("input_fn", request.context, payload, content_type)
        shape = signature(data) if self._settings.batching else None
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
        """The rows of a pass over adapters: a lone job's are all its model's; a batch's, each job's own."""
        adapters = self.row_adapters
        if adapters is None:
            return nullcontext()
        selected: AbstractContextManager[Any]
        if len(jobs) == 1:
            selected = adapters.selecting_all(jobs[0].request.context.model_name)
        else:
            selected = adapters.selecting([job.request.context.model_name for job in jobs for _ in range(job.rows)])
        return selected

    def _run_jobs_here(self, jobs: list[Job]) -> None:
        if self._contract.answers_whole:
            for job in jobs:
                try:
                    with self._selecting([job]):
                        job.result = self._contract.call("transform_fn", job.request.context, self._model, *job.data)
                except Exception as exc:  # request boundary
                    job.error = exc
            return
        run_batch(jobs, self._predict, self._context, _retry_in_halves, release_cached_device_memory, self._selecting)

    def _predict(self, data: Any, request: Request | InferenceContext) -> Any:
        """``predict_fn`` with a lone request's own context, or the model's for a batch."""
        context = request.context if isinstance(request, Request) else request
        return self._contract.call("predict_fn", context, data, self._model)

    def _encode(self, request: Request, result: Any) -> None:
        if not self._contract.answers_whole:
            result = self._contract.call("output_fn", request.context, result, request.accept)
        response_type = request.accept
        if isinstance(result, tuple):
            result, response_type = result
        request.body, request.content_type = to_bytes(result), str(response_type)


def _retry_in_halves(exc: BaseException) -> bool:
    """A failed batch is retried in halves when a smaller one may pass: out of memory, or a client error that one of
    its requests may have caused alone."""
    return is_out_of_memory(exc) or is_client_error(exc)
