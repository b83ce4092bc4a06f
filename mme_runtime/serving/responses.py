"""What a request becomes: its body and type, or for a failed request or load step its HTTP status, the JSON body
the client sees, and the log line. ``Request`` carries one request through the contract (``transformer.py``).

Statuses come from the error's type, never from its text: user errors carrying a status (``ContainerError``, the
toolkit's ``BaseInferenceToolkitError``) keep theirs, running out of host or device memory is 507, anything else 500.
The client gets the error's type and message, cut to ``MAX_MESSAGE_CHARS``, in the words the log line has after the
status (``base/failures.py``: ``out of GPU memory in predict_fn: ...``); the traceback goes to the log only.
"""

from __future__ import annotations

import http
import json
import logging
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sagemaker_inference.errors import BaseInferenceToolkitError

from mme_runtime.base import failures
from mme_runtime.base.errors import (
    ContainerError,
    InsufficientMemory,
    InvalidInput,
    ModelLoadError,
    RequestTimeout,
    first_line,
)
from mme_runtime.serving import content

if TYPE_CHECKING:
    from mme_runtime.serving.context import InferenceContext

logger = logging.getLogger(__name__)

ERROR_CONTENT_TYPE = "application/json"
MAX_MESSAGE_CHARS = 1000
MAX_CHAINED = 8  # exceptions followed through __cause__ and __context__


def is_out_of_memory(exc: BaseException) -> bool:
    """Host or device memory exhaustion (``failures.is_out_of_memory``), raised by a contract function or not."""
    return failures.is_out_of_memory(exc.cause if isinstance(exc, StepError) else exc)


def is_client_error(exc: BaseException) -> bool:
    return isinstance(exc, BaseInferenceToolkitError) and 400 <= int(exc.status_code) < 500


# What input_fn raises when it cannot decode the request (json.JSONDecodeError and UnicodeDecodeError are ValueErrors,
# a missing key a KeyError): the client's bad input, answered 400. Anything else it raises stays 500.
DECODING_ERRORS = (ValueError, TypeError, KeyError, IndexError)


def http_status(exc: BaseException) -> int:
    if isinstance(exc, BaseInferenceToolkitError):
        return int(exc.status_code)
    if is_out_of_memory(exc):
        return 507
    if is_decoding_error(exc):
        return 400
    return 500


def is_decoding_error(exc: BaseException) -> bool:
    """An exception the user's ``input_fn`` raised decoding the request (``DECODING_ERRORS``)."""
    return isinstance(exc, StepError) and exc.step == "input_fn" and isinstance(exc.cause, DECODING_ERRORS)


def release_cached_device_memory() -> None:
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def release_memory_of(exc: BaseException) -> None:
    """After an out-of-memory error is answered and logged: the frames its tracebacks hold let go of their tensors,
    and torch's cache gives what they held back to the card, so the next request finds it."""
    seen: BaseException | None = exc
    for _ in range(MAX_CHAINED):
        if seen is None:
            break
        traceback.clear_frames(seen.__traceback__)  # frames still running (none here) are left as they are
        seen = seen.__cause__ or seen.__context__
    release_cached_device_memory()


class StepError(Exception):
    """A failure inside a user (or default) contract function: 500, naming the function. ``explained``: the answer's
    message where it was written when the error was caught (out of memory: the numbers as they were then)."""

    def __init__(self, step: str, cause: Exception, explained: str | None = None) -> None:
        super().__init__(f"{step}: {cause}")
        self.step = step
        self.cause = cause
        self.explained = explained


def error_response(exc: Exception, request: Any) -> tuple[bytes, str]:
    """The body and content type answering ``request`` (an ``InferenceContext``) with ``exc``; logs it."""
    status = http_status(exc)
    if isinstance(exc, StepError) and exc.explained:
        message, error_type = exc.explained, "InsufficientMemory" if status == 507 else type(exc.cause).__name__
    elif isinstance(exc, StepError):
        cause = first_line(exc.cause) if status < 500 else str(exc.cause)  # a client sees what it sent wrong
        message = f"{exc.step} raised {type(exc.cause).__name__}: {cause}"
        error_type = type(exc.cause).__name__
    elif isinstance(exc, BaseInferenceToolkitError):
        message, error_type = str(exc.message), type(exc).__name__
    elif is_out_of_memory(exc):  # outside the contract's functions (joining a batch, say)
        message, error_type = failures.out_of_memory(exc), "InsufficientMemory"
    else:
        message, error_type = f"{type(exc).__name__}: {exc}", type(exc).__name__
    message = message[:MAX_MESSAGE_CHARS]
    if status >= 500:
        logger.error(
            "model=%s request=%s status=%d: %s",
            request.model_name,
            request.request_id,
            status,
            message,
            exc_info=_traceback_of(exc),
        )
    else:
        logger.warning("model=%s request=%s status=%d: %s", request.model_name, request.request_id, status, message)
    body = {"code": status, "type": error_type, "message": message, "request_id": request.request_id}
    return json.dumps(body).encode("utf-8"), ERROR_CONTENT_TYPE


def _traceback_of(exc: Exception) -> BaseException | None:
    """What a failed request's log line shows the traceback of: what the user's function raised; none for a timeout."""
    if isinstance(exc, RequestTimeout):
        return None
    return exc.cause if isinstance(exc, StepError) else exc


def load_failure(step: str, exc: Exception) -> ContainerError:
    """The error a failed load step answers with (507 for memory, the user's own status, else 500), in words
    (``failures.raised``): the process that fails the LOAD logs it once, with the traceback of what user code raised."""
    if isinstance(exc, ContainerError) and type(exc).__module__.startswith("mme_runtime."):
        # Ours, in words of its own (no model file, say): the step goes before them.
        return type(exc)(f"{step} failed: {exc.message}"[:MAX_MESSAGE_CHARS], int(exc.status_code), exc.trace)
    message = failures.raised(step, exc)[:MAX_MESSAGE_CHARS]
    if isinstance(exc, BaseInferenceToolkitError):  # the user's, with a status of its choosing: deliberate
        return ContainerError(message, int(exc.status_code))
    kind = InsufficientMemory if is_out_of_memory(exc) else ModelLoadError
    return kind(message, trace=exc)


def phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


@dataclass(eq=False)
class Request:
    """One request on its way through the contract: its context, the Accept it is answered with, and the answer."""

    context: InferenceContext
    accept: str
    body: bytes = b""
    content_type: str = ERROR_CONTENT_TYPE
    error: Exception | None = None


def request_body(item: Any) -> Any:
    """The request body MMS hands over (parameter "body" for raw payloads)."""
    if isinstance(item, Mapping):
        if "body" in item:
            return item["body"]
        for value in item.values():
            return value
        raise InvalidInput("request has no body")
    return item


def to_bytes(result: Any) -> bytes:
    """What ``output_fn`` returned, as the answer's bytes (anything else JSON-encoded, or a 500 naming the type)."""
    if isinstance(result, (bytes, bytearray)):
        return bytes(result)
    if isinstance(result, str):
        return result.encode("utf-8")
    try:
        return content.encode(result, content.JSON)
    except TypeError as exc:
        raise StepError("output_fn", TypeError(f"returned {type(result).__name__}, expected bytes or str")) from exc
