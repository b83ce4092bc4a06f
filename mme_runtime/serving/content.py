"""Content types: parsing media types, negotiating ``Accept``, and the JSON/CSV/NPY codecs for tensors.

Decoding failures raise ``InvalidInput`` (400), unknown types ``UnsupportedContentType`` (415) and
``UnsupportedAccept`` (406): the client sees which types are supported.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import torch

from mme_runtime.base.errors import InvalidInput, UnsupportedAccept, UnsupportedContentType

JSON = "application/json"
CSV = "text/csv"
NPY = "application/x-npy"
ANY = "*/*"
SUPPORTED = (JSON, CSV, NPY)
# Decoded to str before reaching input_fn, as the toolkit does, so user scripts get text for text formats.
# Arrays and numpy scalars as JSON numbers (float32 in its shortest form); keys that are not strings as strings.
ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
TEXT_TYPES = frozenset({JSON, CSV, "text/plain", "application/jsonlines", "application/x-www-form-urlencoded"})


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
    """Picks the response type: the best supported match for ``accept``, ``default`` for none or ``*/*``."""
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
        raise UnsupportedContentType(f"unsupported Content-Type {content_type!r}; supported: {', '.join(SUPPORTED)}")
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
        if _finite(array):  # orjson would write NaN and infinity as null: those keep the standard library's spelling
            try:
                return orjson.dumps(array, option=ORJSON_OPTIONS)
            except TypeError:
                pass  # a type orjson does not know (a non-contiguous array, say): the slower path below decides
        try:
            return json.dumps(_jsonable(array), allow_nan=True).encode("utf-8")
        except TypeError as exc:
            raise TypeError(f"prediction of type {type(prediction).__name__} cannot be encoded as JSON") from exc
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
        # The standard library's parser names the problem better, and accepts NaN and Infinity, which the caller
        # then hears about by name; it runs only for bodies orjson refused.
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    # The toolkit's convention: {"instances": [...]} or {"inputs": [...]} wrap the actual data.
    if isinstance(value, dict):
        for key in ("instances", "inputs"):
            if key in value:
                return value[key]
        raise InvalidInput("JSON object must hold the data under 'instances' or 'inputs', or be an array")
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
