"""What goes in and out of a request: content types (parsing media types, negotiating ``Accept``,
the JSON/CSV/NPY codecs for tensors), and each request's answer: its status and, for a failure, its
error body.

Decoding failures raise ``InvalidInput`` (400), unknown types ``UnsupportedContentType`` (415) and
``UnsupportedAccept`` (406): the client sees which types are supported. A failed step's status comes
from the error (``StepError``; out of memory with the numbers, 507), and its body says what went
wrong in JSON with the request's id, never a traceback (the log has it).
"""

from __future__ import annotations

import http
import io
import json
import logging
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import orjson
import torch
from sagemaker_inference.errors import BaseInferenceToolkitError

from mme_runtime.base import failures
from mme_runtime.base.errors import (
    ContainerError,
    InsufficientMemory,
    InvalidInput,
    ModelLoadError,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedAccept,
    UnsupportedContentType,
    first_line,
)

JSON = "application/json"
CSV = "text/csv"
NPY = "application/x-npy"
ANY = "*/*"
SUPPORTED = (JSON, CSV, NPY)
# Decoded to str before reaching input_fn, as the toolkit does, so user scripts get text for text
# formats. Arrays and numpy scalars as JSON numbers (float32 in its shortest form); keys that are
# not strings as strings.
ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
TEXT_TYPES = frozenset(
    {JSON, CSV, "text/plain", "application/jsonlines", "application/x-www-form-urlencoded"}
)


def media_type(value: str | None) -> str | None:
    """``"Application/JSON; charset=utf-8"`` -> ``"application/json"``; empty -> None."""
    if value is None:
        return None
    essence = value.split(";", 1)[0].strip().lower()
    return essence or None


def _accept_ranges(accept: str) -> list[tuple[float, int, str]]:
    """Media ranges of an Accept header with their q-values, best first (ties keep header order)."""
    ranges = []
    for position, part in enumerate(accept.split(",")):
        fields = [f.strip() for f in part.split(";")]
        essence = fields[0].lower()
        if not essence:
            continue
        quality = 1.0
        for parameter in fields[1:]:
            name, _, raw = parameter.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(raw)
                except ValueError:
                    quality = 0.0
                if not math.isfinite(quality):
                    quality = 0.0
        if quality > 0:
            ranges.append((-quality, position, essence))
    ranges.sort()
    return ranges


def _matches(media_range: str, candidate: str) -> bool:
    if media_range == ANY:
        return True
    kind, _, subtype = media_range.partition("/")
    if subtype == "*":
        return candidate.startswith(kind + "/")
    return media_range == candidate


def negotiate(accept: str | None, default: str, supported: Sequence[str] = SUPPORTED) -> str:
    """Picks the response type: the best supported match for ``accept``, ``default`` for none or
    ``*/*``."""
    if accept is None or not accept.strip():
        return default
    for _, _, media_range in _accept_ranges(accept):
        if media_range == ANY:
            return default
        for candidate in supported:
            if _matches(media_range, candidate):
                return candidate
    raise UnsupportedAccept(f"cannot produce {accept!r}; supported: {', '.join(supported)}")


def decode(body: bytes | bytearray | str, content_type: str | None) -> torch.Tensor:
    """Decodes a JSON, CSV or NPY payload into a tensor."""
    essence = media_type(content_type)
    if essence is None:
        raise UnsupportedContentType(f"missing Content-Type; supported: {', '.join(SUPPORTED)}")
    if essence not in SUPPORTED:
        raise UnsupportedContentType(
            f"unsupported Content-Type {content_type!r}; supported: {', '.join(SUPPORTED)}"
        )
    if len(body) == 0:
        raise InvalidInput(f"empty request body for {essence}")
    if essence == NPY:
        return _to_tensor(_decode_npy(body), float32=False)
    text = body if isinstance(body, str) else utf8_text(body)
    array = _decode_json(text) if essence == JSON else _decode_csv(text)
    # Like the AWS PyTorch handler: text formats become float32 tensors, NPY keeps its dtype.
    return _to_tensor(array, float32=True)


def encode(prediction: Any, accept: str) -> bytes:
    """Encodes a prediction (tensor, array, list or scalar) as JSON, CSV or NPY."""
    array = _to_numpy(prediction)
    if accept == JSON:
        if _finite(array):
            # orjson would write NaN and infinity as null: those keep the standard library's
            # spelling
            try:
                return orjson.dumps(array, option=ORJSON_OPTIONS)
            except TypeError:
                # a type orjson does not know (a non-contiguous array, say): the slower path below
                # decides
                pass
        try:
            return json.dumps(_jsonable(array), allow_nan=True).encode("utf-8")
        except TypeError as exc:
            raise TypeError(
                f"prediction of type {type(prediction).__name__} cannot be encoded as JSON"
            ) from exc
    if accept == CSV:
        buffer = io.StringIO()
        np.savetxt(buffer, np.atleast_2d(np.asarray(array)), delimiter=",", fmt="%s")
        return buffer.getvalue().encode("utf-8")
    if accept == NPY:
        buffer_bytes = io.BytesIO()
        np.save(buffer_bytes, np.asarray(array), allow_pickle=False)
        return buffer_bytes.getvalue()
    raise UnsupportedAccept(f"cannot produce {accept!r}; supported: {', '.join(SUPPORTED)}")


def utf8_text(body: bytes | bytearray) -> str:
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"request body is not valid UTF-8 (byte {exc.start})") from exc


def _decode_json(text: str) -> Any:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        # The standard library's parser names the problem better, and accepts NaN and Infinity,
        # which the caller then hears about by name; it runs only for bodies orjson refused.
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(
                f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from exc
    # The toolkit's convention: {"instances": [...]} or {"inputs": [...]} wrap the actual data.
    if isinstance(value, dict):
        for key in ("instances", "inputs"):
            if key in value:
                return value[key]
        raise InvalidInput(
            "JSON object must hold the data under 'instances' or 'inputs', or be an array"
        )
    return value


def _decode_csv(text: str) -> np.ndarray:
    rows = [line for line in text.splitlines() if line.strip()]
    if not rows:
        raise InvalidInput("CSV body has no rows")
    try:
        parsed = [[float(cell) for cell in row.split(",")] for row in rows]
    except ValueError as exc:
        raise InvalidInput(f"CSV must hold numbers only: {exc}") from exc
    widths = {len(row) for row in parsed}
    if len(widths) != 1:
        raise InvalidInput(f"CSV rows have different lengths: {sorted(widths)}")
    return np.asarray(parsed, dtype=np.float32)


def _decode_npy(body: bytes | bytearray | str) -> np.ndarray:
    if isinstance(body, str):
        raise InvalidInput("NPY payload must be binary")
    try:
        array = np.load(io.BytesIO(bytes(body)), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidInput(f"malformed NPY payload: {exc}") from exc
    if not isinstance(array, np.ndarray):
        raise InvalidInput("NPY payload must hold a single array")
    return array


def _to_tensor(data: Any, float32: bool) -> torch.Tensor:
    try:
        array = np.asarray(data)
    except ValueError as exc:
        raise InvalidInput(f"payload is not a rectangular array: {exc}") from exc
    if array.dtype == object or array.dtype.kind in "SUVMm":
        raise InvalidInput("payload must hold numbers in a rectangular array")
    if float32:
        array = array.astype(np.float32)
    if array.dtype.kind in "fc" and not np.isfinite(array).all():
        raise InvalidInput("payload holds NaN or infinity")
    try:
        return torch.from_numpy(np.ascontiguousarray(array))
    except TypeError as exc:
        raise InvalidInput(f"unsupported array type {array.dtype}") from exc


def _finite(value: Any) -> bool:
    """Whether ``value`` (arrays, lists, dicts, numbers) holds no NaN or infinity."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind not in "fc" or bool(np.isfinite(value).all())
    if isinstance(value, (list, tuple)):
        return all(_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    if isinstance(value, (float, np.floating)):
        return math.isfinite(value)
    return True


def _to_numpy(prediction: Any) -> Any:
    if isinstance(prediction, torch.Tensor):
        return prediction.detach().cpu().numpy()
    if isinstance(prediction, (list, tuple)):
        return [_to_numpy(item) for item in prediction]
    if isinstance(prediction, dict):
        return {key: _to_numpy(value) for key, value in prediction.items()}
    return prediction


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    return value


logger = logging.getLogger(__name__)

ERROR_CONTENT_TYPE = "application/json"
MAX_MESSAGE_CHARS = 1000
MAX_CHAINED = 8  # exceptions followed through __cause__ and __context__


def is_out_of_memory(exc: BaseException) -> bool:
    """Host or device memory exhaustion (``failures.is_out_of_memory``), raised by a contract
    function or not."""
    return failures.is_out_of_memory(exc.cause if isinstance(exc, StepError) else exc)


def is_client_error(exc: BaseException) -> bool:
    return isinstance(exc, BaseInferenceToolkitError) and 400 <= int(exc.status_code) < 500


# What input_fn raises when it cannot decode the request (json.JSONDecodeError and
# UnicodeDecodeError are ValueErrors, a missing key a KeyError): the client's bad input,
# answered 400. Anything else it raises stays 500.
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
    return (
        isinstance(exc, StepError)
        and exc.step == "input_fn"
        and isinstance(exc.cause, DECODING_ERRORS)
    )


def release_cached_device_memory() -> None:
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def release_memory_of(exc: BaseException) -> None:
    """After an out-of-memory error is answered and logged: the frames its tracebacks hold let go of
    their tensors, and torch's cache gives what they held back to the card, so the next request
    finds it."""
    seen: BaseException | None = exc
    for _ in range(MAX_CHAINED):
        if seen is None:
            break
        # frames still running (none here) are left as they are
        traceback.clear_frames(seen.__traceback__)
        seen = seen.__cause__ or seen.__context__
    release_cached_device_memory()


class StepError(Exception):
    """A failure inside a user (or default) contract function: 500, naming the function.
    ``explained``: the answer's message where it was written when the error was caught (out of
    memory: the numbers as they were then)."""

    def __init__(self, step: str, cause: Exception, explained: str | None = None) -> None:
        super().__init__(f"{step}: {cause}")
        self.step = step
        self.cause = cause
        self.explained = explained


def error_response(exc: Exception, request: Any) -> tuple[bytes, str]:
    """The body and content type answering ``request`` (an ``InferenceContext``) with ``exc``; logs
    it."""
    status = http_status(exc)
    if isinstance(exc, StepError) and exc.explained:
        message, error_type = (
            exc.explained,
            "InsufficientMemory" if status == 507 else type(exc.cause).__name__,
        )
    elif isinstance(exc, StepError):
        # a client sees what it sent wrong
        cause = first_line(exc.cause) if status < 500 else str(exc.cause)
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
        logger.warning(
            "model=%s request=%s status=%d: %s",
            request.model_name,
            request.request_id,
            status,
            message,
        )
    body = {
        "code": status,
        "type": error_type,
        "message": message,
        "request_id": request.request_id,
    }
    return json.dumps(body).encode("utf-8"), ERROR_CONTENT_TYPE


def _traceback_of(exc: Exception) -> BaseException | None:
    """What a failed request's log line shows the traceback of: what the user's function raised;
    none for a timeout."""
    if isinstance(exc, RequestTimeout):
        return None
    return exc.cause if isinstance(exc, StepError) else exc


def load_failure(step: str, exc: Exception) -> ContainerError:
    """The error a failed load step answers with (507 for memory, the user's own status, else 500),
    in words (``failures.raised``): the process that fails the LOAD logs it once, with the traceback
    of what user code raised."""
    if isinstance(exc, ContainerError) and type(exc).__module__.startswith("mme_runtime."):
        # Ours, in words of its own (no model file, say): the step goes before them.
        return type(exc)(
            f"{step} failed: {exc.message}"[:MAX_MESSAGE_CHARS], int(exc.status_code), exc.trace
        )
    message = failures.raised(step, exc)[:MAX_MESSAGE_CHARS]
    if isinstance(exc, BaseInferenceToolkitError):
        # the user's, with a status of its choosing: deliberate
        return ContainerError(message, int(exc.status_code))
    kind = InsufficientMemory if is_out_of_memory(exc) else ModelLoadError
    return kind(message, trace=exc)


def phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def request_body(item: Any) -> Any:
    """The request body MMS hands over (parameter "body" for raw payloads)."""
    if isinstance(item, Mapping):
        if "body" in item:
            return item["body"]
        for value in item.values():
            return value
        raise InvalidInput("request has no body")
    return item


def read_request(
    item: Any, header: Callable[[str], str | None], max_request_bytes: int
) -> tuple[Any, str | None, str | None]:
    """The request's payload, its content type, and the Accept it asks for (None: the default),
    from its body and its ``header`` function (the request's context's)."""
    payload = request_body(item)
    if isinstance(payload, (bytes, bytearray, str)) and len(payload) > max_request_bytes:
        raise PayloadTooLarge(
            f"request body of {len(payload)} bytes exceeds the limit of "
            f"{max_request_bytes} (SAGEMAKER_MAX_REQUEST_SIZE)"
        )
    content_type, accept = header("content-type"), header("accept")
    if accept is not None and accept.strip() in ("", ANY):
        accept = None
    if accept is not None and not _fits_the_wire(accept):
        # it becomes the answer's Content-Type when output_fn names none (check_answer)
        raise UnsupportedAccept(f"Accept {accept!r} is not printable ASCII")
    if isinstance(payload, (bytes, bytearray)) and media_type(content_type) in TEXT_TYPES:
        payload = utf8_text(payload)
    return payload, content_type, accept


def check_answer(step: str, body: bytes, content_type: str, max_response_bytes: int) -> None:
    """Refuses an answer MMS's frontend would take for a corrupt one, dropping the worker with
    every request of its message (docs/troubleshooting.md): a Content-Type that is not printable
    ASCII (MMS's encoder counts its characters, then writes its UTF-8 bytes), or a body over the
    frontend's limit. ``step`` is the function that returned it."""
    if not _fits_the_wire(content_type):
        problem = f"returned the Content-Type {content_type!r}: not printable ASCII"
        raise StepError(step, ValueError(problem))
    if len(body) > max_response_bytes:
        problem = (
            f"returned {len(body)} bytes, over the frontend's limit of {max_response_bytes} for "
            "an answer (max_response_size; SAGEMAKER_MAX_REQUEST_SIZE raises it)"
        )
        raise StepError(step, ValueError(problem))


def _fits_the_wire(content_type: str) -> bool:
    """Whether MMS's encoder frames ``content_type`` right: it counts characters and writes UTF-8
    bytes, so only printable ASCII is the same length both ways."""
    return content_type.isascii() and content_type.isprintable()


def to_bytes(result: Any) -> bytes:
    """What ``output_fn`` returned, as the answer's bytes (anything else JSON-encoded, or a 500
    naming the type)."""
    if isinstance(result, (bytes, bytearray)):
        return bytes(result)
    if isinstance(result, str):
        return result.encode("utf-8")
    try:
        return encode(result, JSON)
    except TypeError as exc:
        raise StepError(
            "output_fn", TypeError(f"returned {type(result).__name__}, expected bytes or str")
        ) from exc
