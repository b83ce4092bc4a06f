"""Requests and answers of a Hugging Face model served with no code, as the AWS Hugging Face container
(``sagemaker-huggingface-inference-toolkit``) takes and gives them, so that its clients work unchanged.

A request is ``{"inputs": ..., "parameters": {...}}`` in JSON (a string or a list of strings; for
question-answering ``{"question", "context"}`` or a list of them), a CSV with an ``inputs`` (or ``question`` and
``context``) header, an image (``image/png``, ``image/jpeg``, ...), or an NPY array (``npy.py``). The answer is
the pipeline's, in compact JSON, CSV or NPY; the sentence tasks read theirs in ``sentences.py``. A ``TaskRequest``
is what several requests share a forward pass as: one row per input.
"""

from __future__ import annotations

import base64
import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mme_runtime.base.errors import InvalidInput, UnsupportedContentType
from mme_runtime.huggingface import audio, npy, sentences, tables, zero_shot
from mme_runtime.huggingface.loading import AUDIO_TASKS, IMAGE_TASKS
from mme_runtime.serving import content

IMAGE_TYPES = frozenset(
    {"image/jpeg", "image/png", "image/tiff", "image/bmp", "image/gif", "image/webp", "image/x-image"}
)
ACCEPTS = (content.JSON, content.CSV, content.NPY)
QUESTION_KEYS = ("question", "context")
# An image is decoded into the process every model of its device shares: 25 megapixels is 75 MB as RGB.
MAX_IMAGE_PIXELS = 25_000_000
# A request's images together (a PNG of flat color is a few bytes a megapixel: 6 MB of JSON held hundreds).
MAX_REQUEST_PIXELS = 4 * MAX_IMAGE_PIXELS
# Images in one request: a processor may enlarge each (DETR's makes a 70-byte 1x1 PNG 800x800 float32, 7.7 MB), and a
# request's images are all prepared before its pass.
MAX_IMAGES = 64
# Longest side over shortest: a processor that resizes the shortest side to a size (CLIP's to 224) before it crops
# makes a 1 x 100,000 image 224 x 22,400,000 (60 GB of float32); at 100:1, 224 x 22,400.
MAX_ASPECT_RATIO = 100
# Tasks whose inputs or parameters nest, which a CSV cannot: the AWS container refuses CSV for them too (400).
NO_CSV_TASKS = frozenset({zero_shot.TASK, tables.TASK})


@dataclass(eq=False)
class TaskRequest:
    """One request's inputs and parameters. ``single``: it sent one input (a string, an image, one question), which
    the answer reflects, as the pipeline's does."""

    inputs: list[Any]
    parameters: dict[str, Any] = field(default_factory=dict)
    single: bool = True
    adapter: str | None = None  # the LoRA adapter (its model's name) its rows use; None: the model as it is

    # What the batcher asks of an input it collates (``collate.py``): every request of one model can share a pass.
    def batch_signature(self) -> tuple[Any, ...]:
        return ("hugging-face",)

    @property
    def rows(self) -> int:
        return len(self.inputs)

    @staticmethod
    def join(requests: Sequence[TaskRequest]) -> TaskBatch:
        return TaskBatch(list(requests))


@dataclass
class TaskBatch:
    """Requests that share one forward pass, in order."""

    requests: list[TaskRequest]


def decode(body: Any, content_type: str | None, task: str) -> TaskRequest:
    """The request as the toolkit reads it. Raises ``InvalidInput`` (400) naming what is wrong, and
    ``UnsupportedContentType`` (415) naming what is accepted."""
    media = content.media_type(content_type) or content.JSON
    if media in IMAGE_TYPES:
        if task not in IMAGE_TASKS:  # as audio for a model that takes none: the type is refused, 415
            raise UnsupportedContentType(f"content type {content_type!r} is an image, which {task} does not take")
        return TaskRequest([_image(body)])
    if media in audio.AUDIO_TYPES:  # speech models: serving/audio.py
        return TaskRequest([audio.read_body(body, content_type, task, AUDIO_TASKS)])
    if isinstance(body, (bytes, bytearray)) and media != content.NPY:
        body = content.utf8_text(body)
    if media == content.NPY:
        data = {"inputs": npy.inputs(body)}  # the array is the inputs (npy.py)
    elif media == content.JSON:
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise InvalidInput(f"the body is not JSON: {exc}") from exc
    elif media == content.CSV:
        if task in NO_CSV_TASKS:
            raise InvalidInput(f"content type {content.CSV} is not supported with {task}: send {content.JSON}")
        data = _csv(body)
    else:
        raise UnsupportedContentType(
            f"content type {content_type!r} is not supported: send {content.JSON}, {content.CSV}, {content.NPY}, an "
            "image or audio"
        )
    if not isinstance(data, dict) or "inputs" not in data:
        raise InvalidInput('the body must be a JSON object with "inputs" (and optionally "parameters")')
    parameters = data.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput(f'"parameters" must be an object, not {type(parameters).__name__}')
    inputs = data["inputs"]
    if task in sentences.TASKS:
        return TaskRequest(*sentences.request(inputs, parameters, task))
    single = not isinstance(inputs, list)
    items = [inputs] if single else inputs
    if not items:
        raise InvalidInput('"inputs" is an empty list')
    if task in AUDIO_TASKS:
        return TaskRequest(audio.read_inputs(items, task), parameters, single)
    for item in items:
        _check(item, task)
    if task == zero_shot.TASK:
        zero_shot.check_parameters(parameters, items)
    elif task == tables.TASK:
        tables.check_parameters(parameters, items)
    if task in IMAGE_TASKS:
        items = _images(items)
    return TaskRequest(items, parameters, single)


def encode(answer: Any, accept: str) -> bytes:
    """The answer in compact JSON (as the toolkit writes it), CSV for a list of records, or NPY for numbers."""
    if content.media_type(accept) == content.NPY:
        return npy.encode(answer)
    if content.media_type(accept) == content.CSV:
        records = answer if isinstance(answer, list) else [answer]
        if not records or not all(isinstance(record, dict) for record in records):
            raise InvalidInput("this answer has no CSV form (it is not a list of records): ask for application/json")
        stream = io.StringIO()
        writer = csv.DictWriter(stream, list(records[0]))
        writer.writeheader()
        writer.writerows(records)
        return stream.getvalue().encode()
    return json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_plain).encode()


def _check(item: Any, task: str) -> None:
    if task == "question-answering":
        if not isinstance(item, dict) or not all(isinstance(item.get(key), str) for key in QUESTION_KEYS):
            raise InvalidInput('question-answering takes {"question": "...", "context": "..."} (or a list of them)')
    elif task in IMAGE_TASKS:
        if not isinstance(item, str):
            raise InvalidInput(f"{task} takes an image body (image/png, image/jpeg, ...) or base64 in JSON")
    elif task == tables.TASK:
        tables.check_input(item)
    elif task == "text-classification" and isinstance(item, dict):
        if not isinstance(item.get("text"), str) or not isinstance(item.get("text_pair", ""), str):
            raise InvalidInput('a text pair is {"text": "...", "text_pair": "..."}')
    elif not isinstance(item, str):
        raise InvalidInput(f'{task} takes "inputs" as a string or a list of strings, not {type(item).__name__}')


def _csv(text: str) -> dict[str, Any]:
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows or not ({"inputs", *QUESTION_KEYS} & set(rows[0])):
        raise InvalidInput("a CSV body needs a header row naming its column: inputs (or question and context)")
    if "inputs" in rows[0]:
        return {"inputs": [row["inputs"] for row in rows]}
    return {"inputs": rows}


def _image(raw: bytes | bytearray) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise InvalidInput(f"the image has {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} here")
        if max(image.size) > MAX_ASPECT_RATIO * min(image.size):
            raise InvalidInput(f"the image is {image.width}x{image.height}: an aspect ratio over {MAX_ASPECT_RATIO}:1")
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidInput(f"the body is not an image this server reads: {exc}") from exc


def _images(items: list[Any]) -> list[Any]:
    if len(items) > MAX_IMAGES:
        raise InvalidInput(f"the request sends {len(items)} images; at most {MAX_IMAGES} images in one request")
    images, pixels = [], 0
    for item in items:
        images.append(_image(_base64(item)))
        pixels += images[-1].width * images[-1].height
        if pixels > MAX_REQUEST_PIXELS:
            raise InvalidInput(f"the images of this request hold more than {MAX_REQUEST_PIXELS} pixels: send fewer")
    return images


def _base64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:  # binascii.Error
        raise InvalidInput(f"an image in JSON must be base64: {exc}") from exc


def _plain(value: Any) -> Any:
    """What ``json`` cannot write by itself: numpy numbers and arrays, tensors."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
