"""What a request becomes: its body and type, or for a failed request or load step its HTTP status, the JSON body
the client sees, and the log line. ``Request`` carries one request through the contract (``transformer.py``).

Statuses come from the error's type, never from its text: user errors carrying a status (``ContainerError``, the
toolkit's ``BaseInferenceToolkitError``) keep theirs, running out of host or device memory is 507, anything else 500.
The client gets the error's type and message, cut to ``MAX_MESSAGE_CHARS``; the traceback goes to the log only.
"""

from __future__ import annotations

import http
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sagemaker_inference.errors import BaseInferenceToolkitError

from mme_runtime.base.errors import ContainerError, InsufficientMemory, InvalidInput, ModelLoadError, first_line
from mme_runtime.serving import content

if TYPE_CHECKING:
    from mme_runtime.serving.context import InferenceContext

logger = logging.getLogger(__name__)

ERROR_CONTENT_TYPE = "application/json"
MAX_MESSAGE_CHARS = 1000


def is_out_of_memory(exc: BaseException) -> bool:
    """Host or device memory exhaustion, judged by type (never by the text "CUDA")."""
    return isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError))


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


class StepError(Exception):
    """A failure inside a user (or default) contract function: 500, naming the function."""

    def __init__(self, step: str, cause: Exception) -> None:
        super().__init__(f"{step}: {cause}")
        self.step = step
        self.cause = cause


def error_response(exc: Exception, request: Any) -> tuple[bytes, str]:
    """The body and content type answering ``request`` (an ``InferenceContext``) with ``exc``; logs it."""
    status = http_status(exc)
    if isinstance(exc, StepError):
        cause = first_line(exc.cause) if status < 500 else str(exc.cause)  # a client sees what it sent wrong
        message = f"{exc.step} raised {type(exc.cause).__name__}: {cause}"
        error_type = type(exc.cause).__name__
    elif isinstance(exc, BaseInferenceToolkitError):
        message, error_type = str(exc.message), type(exc).__name__
    elif is_out_of_memory(exc):
        message, error_type = "out of memory while serving this request", "InsufficientMemory"
    else:
        message, error_type = f"{type(exc).__name__}: {exc}", type(exc).__name__
    message = message[:MAX_MESSAGE_CHARS]
    if status >= 500:
        logger.error(
            "model=%s request=%s status=%d %s",
            request.model_name,
            request.request_id,
            status,
            message,
            exc_info=exc,
        )
    else:
        logger.warning("model=%s request=%s status=%d %s", request.model_name, request.request_id, status, message)
    body = {"code": status, "type": error_type, "message": message, "request_id": request.request_id}
    return json.dumps(body).encode("utf-8"), ERROR_CONTENT_TYPE


def load_failure(model_name: str, step: str, exc: Exception) -> ContainerError:
    """The error a failed load step answers with: 507 for memory, the user's own status, else 500."""
    if isinstance(exc, BaseInferenceToolkitError):
        # A deliberate error with its own message and status: no traceback needed to understand it.
        message = f"{step} failed: {exc.message}"[:MAX_MESSAGE_CHARS]
        logger.error("model=%s %s", model_name, message)
        kind = type(exc) if type(exc) in (ModelLoadError, InsufficientMemory) else ContainerError
        return kind(message, int(exc.status_code))
    logger.error("model=%s %s failed", model_name, step, exc_info=exc)
    message = f"{step} failed: {type(exc).__name__}: {exc}"[:MAX_MESSAGE_CHARS]
    if is_out_of_memory(exc):
        return InsufficientMemory(message)
    return ModelLoadError(message)


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
