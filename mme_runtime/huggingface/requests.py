"""Requests and answers of a Hugging Face model served with no code, as the AWS Hugging Face
container (``sagemaker-huggingface-inference-toolkit``) takes and gives them, so that its
clients work unchanged: ``{"inputs": ..., "parameters": {...}}`` in JSON, a CSV with an
``inputs`` (or ``question`` and ``context``) header, an image, audio or an NPY array; answers in
compact JSON, CSV or NPY. A ``TaskRequest`` is what requests share a forward pass as.

An NPY body's array is the ``inputs`` (texts, or audio samples at the model's rate); a pickled
object array is refused, since unpickling could run any code. Audio (WAV, FLAC, OGG, MP3) is
decoded by soundfile (no ffmpeg), mixed down to one channel and resampled by soxr; it is held in
the process every model of the device shares, so its length is capped (``MAX_AUDIO_SECONDS``),
read from its header before anything is decoded.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mme_runtime.base.errors import InvalidInput, UnsupportedContentType
from mme_runtime.huggingface import sentences, tables, zero_shot
from mme_runtime.huggingface.loading import AUDIO_TASKS, IMAGE_TASKS
from mme_runtime.serving import content

IMAGE_TYPES = frozenset(
    {
        "image/jpeg",
        "image/png",
        "image/tiff",
        "image/bmp",
        "image/gif",
        "image/webp",
        "image/x-image",
    }
)
ACCEPTS = (content.JSON, content.CSV, content.NPY)
QUESTION_KEYS = ("question", "context")
# An image is decoded into the process every model of its device shares: 25 megapixels is 75 MB as
# RGB.
MAX_IMAGE_PIXELS = 25_000_000
# A request's images together (a PNG of flat color is a few bytes a megapixel: 6 MB of JSON held
# hundreds).
MAX_REQUEST_PIXELS = 4 * MAX_IMAGE_PIXELS
# Images in one request: a processor may enlarge each (DETR's makes a 70-byte 1x1 PNG 800x800
# float32, 7.7 MB), and a request's images are all prepared before its pass.
MAX_IMAGES = 64
# Longest side over shortest: a processor that resizes the shortest side to a size (CLIP's to 224)
# before it crops makes a 1 x 100,000 image 224 x 22,400,000 (60 GB of float32); at 100:1, 224 x
# 22,400.
MAX_ASPECT_RATIO = 100
# Tasks whose inputs or parameters nest, which a CSV cannot: the AWS container refuses CSV for them
# too (400).
NO_CSV_TASKS = frozenset({zero_shot.TASK, tables.TASK})
# The AWS toolkit's audio types (its content_types.AUDIO_TYPES), then the aliases browsers and tools
# send.
AWS_AUDIO_TYPES = ("audio/x-flac", "audio/mpeg", "audio/wave", "audio/ogg", "audio/x-audio")
AUDIO_TYPES = frozenset(
    {*AWS_AUDIO_TYPES, "audio/flac", "audio/wav", "audio/x-wav", "audio/mp3", "audio/vorbis"}
)
# Five minutes of sound: at most 115 MB of float32 samples before resampling (at 96 kHz; 19 MB at 16
# kHz), and what Whisper transcribes in ten 30 s windows. A CTC model or a classifier attends over
# all of it at once: send long audio with "chunk_length_s", which the pipeline cuts into windows.
MAX_AUDIO_SECONDS = 300
# Rates above this are no sound a speech model was trained on, and would let a short clip hold many
# samples.
MAX_SAMPLING_RATE = 96_000
# Clips in one request: Whisper pads each to a 30 s window (480,000 samples, 80x3000 features)
# however short it is.
MAX_CLIPS = 64
# decoded and mixed down a block at a time: never all channels of the clip at once
BLOCK_FRAMES = 1 << 16
# An array of samples (an NPY body) says no rate: it is taken at the model's, as the pipeline takes
# a bare array.
MODELS_RATE = 0
# what such a clip's length is counted at, against the cap: speech models' usual rate
NOMINAL_RATE = 16_000
# The array kinds an NPY body may hold (``npy_inputs``), and what an answer with no NPY form says.
TEXT_KINDS = "US"  # unicode, and bytes read as UTF-8
NUMBER_KINDS = "biuf"
NO_FORM = (
    "this answer has no NPY form (it is not numbers in a rectangular array): ask for "
    "application/json"
)


@dataclass(eq=False)
class TaskRequest:
    """One request's inputs and parameters. ``single``: it sent one input (a string, an image, one
    question), which the answer reflects, as the pipeline's does."""

    inputs: list[Any]
    parameters: dict[str, Any] = field(default_factory=dict)
    single: bool = True
    # the LoRA adapter (its model's name) its rows use; None: the model as it is
    adapter: str | None = None

    # What the batcher asks of an input it collates (``batcher.py``): every request of one model can
    # share a pass.
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
        if task not in IMAGE_TASKS:
            # as audio for a model that takes none: the type is refused, 415
            raise UnsupportedContentType(
                f"content type {content_type!r} is an image, which {task} does not take"
            )
        return TaskRequest([_image(body)])
    if media in AUDIO_TYPES:  # speech models
        return TaskRequest([read_body(body, content_type, task, AUDIO_TASKS)])
    if isinstance(body, (bytes, bytearray)) and media != content.NPY:
        body = content.utf8_text(body)
    if media == content.NPY:
        data = {"inputs": npy_inputs(body)}  # the array is the inputs
    elif media == content.JSON:
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise InvalidInput(f"the body is not JSON: {exc}") from exc
    elif media == content.CSV:
        if task in NO_CSV_TASKS:
            raise InvalidInput(
                f"content type {content.CSV} is not supported with {task}: send {content.JSON}"
            )
        data = _csv(body)
    else:
        raise UnsupportedContentType(
            f"content type {content_type!r} is not supported: send {content.JSON}, {content.CSV}, "
            f"{content.NPY}, an image or audio"
        )
    if not isinstance(data, dict) or "inputs" not in data:
        raise InvalidInput(
            'the body must be a JSON object with "inputs" (and optionally "parameters")'
        )
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
        return TaskRequest(read_inputs(items, task), parameters, single)
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
    """The answer in compact JSON (as the toolkit writes it), CSV for a list of records, or NPY for
    numbers."""
    if content.media_type(accept) == content.NPY:
        return encode_npy(answer)
    if content.media_type(accept) == content.CSV:
        records = answer if isinstance(answer, list) else [answer]
        if not records or not all(isinstance(record, dict) for record in records):
            raise InvalidInput(
                "this answer has no CSV form (it is not a list of records): ask for "
                "application/json"
            )
        stream = io.StringIO()
        writer = csv.DictWriter(stream, list(records[0]))
        writer.writeheader()
        writer.writerows(records)
        return stream.getvalue().encode()
    return json.dumps(
        answer, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_plain
    ).encode()


def _check(item: Any, task: str) -> None:
    if task == "question-answering":
        if not isinstance(item, dict) or not all(
            isinstance(item.get(key), str) for key in QUESTION_KEYS
        ):
            raise InvalidInput(
                'question-answering takes {"question": "...", "context": "..."} (or a list of them)'
            )
    elif task in IMAGE_TASKS:
        if not isinstance(item, str):
            raise InvalidInput(
                f"{task} takes an image body (image/png, image/jpeg, ...) or base64 in JSON"
            )
    elif task == tables.TASK:
        tables.check_input(item)
    elif task == "text-classification" and isinstance(item, dict):
        if not isinstance(item.get("text"), str) or not isinstance(item.get("text_pair", ""), str):
            raise InvalidInput('a text pair is {"text": "...", "text_pair": "..."}')
    elif not isinstance(item, str):
        raise InvalidInput(
            f'{task} takes "inputs" as a string or a list of strings, not {type(item).__name__}'
        )


def _csv(text: str) -> dict[str, Any]:
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows or not ({"inputs", *QUESTION_KEYS} & set(rows[0])):
        raise InvalidInput(
            "a CSV body needs a header row naming its column: inputs (or question and context)"
        )
    if "inputs" in rows[0]:
        return {"inputs": [row["inputs"] for row in rows]}
    return {"inputs": rows}


def _image(raw: bytes | bytearray) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise InvalidInput(
                f"the image has {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} "
                "here"
            )
        if max(image.size) > MAX_ASPECT_RATIO * min(image.size):
            raise InvalidInput(
                f"the image is {image.width}x{image.height}: an aspect ratio over "
                f"{MAX_ASPECT_RATIO}:1"
            )
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidInput(f"the body is not an image this server reads: {exc}") from exc


def _images(items: list[Any]) -> list[Any]:
    if len(items) > MAX_IMAGES:
        raise InvalidInput(
            f"the request sends {len(items)} images; at most {MAX_IMAGES} images in one request"
        )
    images, pixels = [], 0
    for item in items:
        images.append(_image(_base64(item)))
        pixels += images[-1].width * images[-1].height
        if pixels > MAX_REQUEST_PIXELS:
            raise InvalidInput(
                f"the images of this request hold more than {MAX_REQUEST_PIXELS} pixels: send fewer"
            )
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


def npy_inputs(body: bytes | bytearray | str) -> Any:
    """The ``inputs`` an NPY body holds. Raises ``InvalidInput`` naming what is wrong with it."""
    if isinstance(body, str):
        raise InvalidInput("an NPY body must be binary")
    stream = io.BytesIO(bytes(body))
    try:
        version = np.lib.format.read_magic(stream)
        header = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        dtype = header(stream)[2]
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidInput(f"the body is not an NPY array: {exc}") from exc
    if dtype.hasobject:
        raise InvalidInput(
            "an NPY body holding Python objects (a pickle) is refused: send an array of strings or "
            "numbers"
        )
    try:
        array = np.load(io.BytesIO(bytes(body)), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidInput(f"the body is not an NPY array: {exc}") from exc
    if array.dtype.kind in TEXT_KINDS:
        if array.dtype.kind == "S":
            try:
                array = np.char.decode(array, "utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"an NPY array of bytes must hold UTF-8 text: {exc}") from exc
        return array.tolist()  # a str for a 0-d array, else (nested) lists of them
    if array.dtype.kind in NUMBER_KINDS:
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise InvalidInput("the NPY array holds NaN or infinity")
        if array.ndim == 2 and len(array) > MAX_CLIPS:
            # before six million rows become six million arrays
            raise InvalidInput(
                f"an NPY body holds one clip a row: {len(array)} rows, at most {MAX_CLIPS}"
            )
        return list(array) if array.ndim == 2 else array
    raise InvalidInput(f"an NPY body must hold strings or numbers, not {array.dtype}")


def encode_npy(answer: Any) -> bytes:
    """The answer's numbers as NPY: a numeric answer as it is, and a dict of one numeric entry
    (``{"embeddings": ...}``) as that entry. Raises ``InvalidInput`` for an answer of records or
    text."""
    if isinstance(answer, dict) and len(answer) == 1:
        answer = next(iter(answer.values()))
    try:
        array = np.asarray(answer)
    except ValueError as exc:  # ragged: vectors of texts of different lengths
        raise InvalidInput(NO_FORM) from exc
    if array.dtype.kind not in NUMBER_KINDS:
        raise InvalidInput(NO_FORM)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@dataclass(eq=False)
class Audio:
    """A clip decoded to one channel of float32 samples at its own rate (resampled later, to the
    model's), or at ``MODELS_RATE``."""

    samples: np.ndarray
    sampling_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / (self.sampling_rate or NOMINAL_RATE)


def read_body(body: Any, content_type: str | None, task: str, audio_tasks: frozenset[str]) -> Audio:
    """An audio body, for a model whose task takes audio. Raises ``UnsupportedContentType`` (415)
    for another model, and ``InvalidInput`` (400) for a body that is not audio soundfile reads, or
    that lasts too long."""
    if task not in audio_tasks:
        raise UnsupportedContentType(
            f"content type {content_type!r} is audio, which {task} does not take"
        )
    return decode_audio(bytes(body))


def read_inputs(items: list[Any], task: str) -> list[Audio]:
    """Audio files sent as base64 in JSON's ``inputs`` (or samples, in an NPY body), at most
    ``MAX_CLIPS``; together they last at most ``MAX_AUDIO_SECONDS``."""
    if len(items) > MAX_CLIPS:
        raise InvalidInput(
            f"the request sends {len(items)} clips; at most {MAX_CLIPS} clips in one request"
        )
    clips = []
    total = 0.0
    for item in items:
        clips.append(
            samples(item, task) if isinstance(item, np.ndarray) else read_base64(item, task)
        )
        total += clips[-1].seconds
        if total > MAX_AUDIO_SECONDS:
            raise InvalidInput(
                f"the clips of this request last {total:.1f} s or more; at most "
                f"{MAX_AUDIO_SECONDS} s"
            )
    return clips


def samples(item: np.ndarray, task: str) -> Audio:
    """A clip sent as its samples (a row of an NPY body's numbers), at the model's rate."""
    clip = np.asarray(item, dtype=np.float32)
    if clip.ndim != 1 or not clip.size:
        raise InvalidInput(f"{task} takes samples as one row of numbers per clip")
    return Audio(clip, MODELS_RATE)


def read_base64(item: Any, task: str) -> Audio:
    """An audio file sent as base64 (a path or a URL is refused: the pipeline would open it)."""
    if not isinstance(item, str):
        raise InvalidInput(
            f'{task} takes "inputs" as an audio file in base64 (or a list of them), not '
            f"{type(item).__name__}"
        )
    try:
        raw = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(
            f"{task} takes audio as the body (audio/x-flac, audio/wave, ...) or base64 in JSON: "
            f"{exc}"
        ) from exc
    return decode_audio(raw)


def decode_audio(raw: bytes) -> Audio:
    """The file's samples, channels averaged (as ffmpeg's ``-ac 1`` mixes them). The cap is checked
    on the header's frame count before anything is decoded: soundfile reads no further than that
    count."""
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as sound:
            rate, frames = int(sound.samplerate), int(sound.frames)
            if not 0 < rate <= MAX_SAMPLING_RATE:
                raise InvalidInput(
                    f"the audio's sampling rate is {rate} Hz; at most {MAX_SAMPLING_RATE} here"
                )
            limit = MAX_AUDIO_SECONDS * rate
            if frames > limit:
                raise InvalidInput(_too_long(frames / rate))
            blocks = []
            for block in sound.blocks(BLOCK_FRAMES, dtype="float32", always_2d=True):
                blocks.append(
                    block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0]
                )
    # soundfile.LibsndfileError is a RuntimeError
    except (RuntimeError, TypeError, ValueError) as exc:
        # its str() names the BytesIO object
        reason = getattr(exc, "error_string", None) or str(exc)
        raise InvalidInput(
            f"the body is not audio this server reads (WAV, FLAC, OGG or MP3): {reason}"
        ) from exc
    samples = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)
    if not len(samples):
        raise InvalidInput("the audio holds no samples")
    if not np.isfinite(samples).all():
        # a float WAV may: a classifier's scores would be NaN, which JSON cannot write
        raise InvalidInput("the audio holds samples that are not finite numbers (NaN or infinity)")
    return Audio(samples, rate)


def resample(audio: Audio, sampling_rate: int) -> np.ndarray:
    """The clip at ``sampling_rate``: soxr's high-quality resampler (transformers' pipelines
    resample with torchaudio, which no wheel of this torch has), or the samples themselves at that
    rate already."""
    if audio.sampling_rate in (sampling_rate, MODELS_RATE):
        return audio.samples
    import soxr

    return np.asarray(
        soxr.resample(audio.samples, audio.sampling_rate, sampling_rate), dtype=np.float32
    )


def _too_long(seconds: float) -> str:
    return f"the audio lasts {seconds:.1f} s; at most {MAX_AUDIO_SECONDS} s here: send it in parts"
