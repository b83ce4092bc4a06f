"""Audio in requests to speech models: a body of WAV, FLAC, OGG (Vorbis, Opus) or MP3, or the same file as base64 in
JSON, decoded by soundfile (its wheels carry libsndfile with every one of these: no ffmpeg on the system), mixed
down to one channel and resampled by soxr to the rate the model's feature extractor takes.

The AWS Hugging Face container hands the body's bytes to the pipeline, which pipes them through an ``ffmpeg``
process; its content types are the ones taken here, with their common aliases. One request's audio is held in the
process that every model of the device shares, so its length is capped (``MAX_AUDIO_SECONDS``): longer audio, audio
that does not decode, or JSON that is not base64 is the client's 400, never read further than the cap.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from mme_runtime.base.errors import InvalidInput, UnsupportedContentType

# The AWS toolkit's audio types (its content_types.AUDIO_TYPES), then the aliases browsers and tools send.
AWS_AUDIO_TYPES = ("audio/x-flac", "audio/mpeg", "audio/wave", "audio/ogg", "audio/x-audio")
AUDIO_TYPES = frozenset({*AWS_AUDIO_TYPES, "audio/flac", "audio/wav", "audio/x-wav", "audio/mp3", "audio/vorbis"})
# Five minutes of sound: at most 115 MB of float32 samples before resampling (at 96 kHz; 19 MB at 16 kHz), and what
# Whisper transcribes in ten 30 s windows. A CTC model or a classifier attends over all of it at once: send long
# audio with "chunk_length_s", which the pipeline cuts into windows.
MAX_AUDIO_SECONDS = 300
# Rates above this are no sound a speech model was trained on, and would let a short clip hold many samples.
MAX_SAMPLING_RATE = 96_000
# Clips in one request: Whisper pads each to a 30 s window (480,000 samples, 80x3000 features) however short it is.
MAX_CLIPS = 64
BLOCK_FRAMES = 1 << 16  # decoded and mixed down a block at a time: never all channels of the clip at once


# An array of samples (an NPY body) says no rate: it is taken at the model's, as the pipeline takes a bare array.
MODELS_RATE = 0
NOMINAL_RATE = 16_000  # what such a clip's length is counted at, against the cap: speech models' usual rate


@dataclass(eq=False)
class Audio:
    """A clip decoded to one channel of float32 samples at its own rate (resampled later, to the model's), or at
    ``MODELS_RATE``."""

    samples: np.ndarray
    sampling_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / (self.sampling_rate or NOMINAL_RATE)


def read_body(body: Any, content_type: str | None, task: str, audio_tasks: frozenset[str]) -> Audio:
    """An audio body, for a model whose task takes audio. Raises ``UnsupportedContentType`` (415) for another
    model, and ``InvalidInput`` (400) for a body that is not audio soundfile reads, or that lasts too long."""
    if task not in audio_tasks:
        raise UnsupportedContentType(f"content type {content_type!r} is audio, which {task} does not take")
    return decode(bytes(body))


def read_inputs(items: list[Any], task: str) -> list[Audio]:
    """Audio files sent as base64 in JSON's ``inputs`` (or samples, in an NPY body), at most ``MAX_CLIPS``; together
    they last at most ``MAX_AUDIO_SECONDS``."""
    if len(items) > MAX_CLIPS:
        raise InvalidInput(f"the request sends {len(items)} clips; at most {MAX_CLIPS} clips in one request")
    clips = []
    total = 0.0
    for item in items:
        clips.append(samples(item, task) if isinstance(item, np.ndarray) else read_base64(item, task))
        total += clips[-1].seconds
        if total > MAX_AUDIO_SECONDS:
            raise InvalidInput(f"the clips of this request last {total:.1f} s or more; at most {MAX_AUDIO_SECONDS} s")
    return clips


def samples(item: np.ndarray, task: str) -> Audio:
    """A clip sent as its samples (an NPY body's row of numbers: ``npy.py``), at the model's rate."""
    clip = np.asarray(item, dtype=np.float32)
    if clip.ndim != 1 or not clip.size:
        raise InvalidInput(f"{task} takes samples as one row of numbers per clip")
    return Audio(clip, MODELS_RATE)


def read_base64(item: Any, task: str) -> Audio:
    """An audio file sent as base64 (a path or a URL is refused: the pipeline would open it)."""
    if not isinstance(item, str):
        raise InvalidInput(
            f'{task} takes "inputs" as an audio file in base64 (or a list of them), not {type(item).__name__}'
        )
    try:
        raw = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(
            f"{task} takes audio as the body (audio/x-flac, audio/wave, ...) or base64 in JSON: {exc}"
        ) from exc
    return decode(raw)


def decode(raw: bytes) -> Audio:
    """The file's samples, channels averaged (as ffmpeg's ``-ac 1`` mixes them). The cap is checked on the header's
    frame count before anything is decoded: soundfile reads no further than that count."""
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as sound:
            rate, frames = int(sound.samplerate), int(sound.frames)
            if not 0 < rate <= MAX_SAMPLING_RATE:
                raise InvalidInput(f"the audio's sampling rate is {rate} Hz; at most {MAX_SAMPLING_RATE} here")
            limit = MAX_AUDIO_SECONDS * rate
            if frames > limit:
                raise InvalidInput(_too_long(frames / rate))
            blocks = []
            for block in sound.blocks(BLOCK_FRAMES, dtype="float32", always_2d=True):
                blocks.append(block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0])
    except (RuntimeError, TypeError, ValueError) as exc:  # soundfile.LibsndfileError is a RuntimeError
        reason = getattr(exc, "error_string", None) or str(exc)  # its str() names the BytesIO object
        raise InvalidInput(f"the body is not audio this server reads (WAV, FLAC, OGG or MP3): {reason}") from exc
    samples = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)
    if not len(samples):
        raise InvalidInput("the audio holds no samples")
    if not np.isfinite(samples).all():  # a float WAV may: a classifier's scores would be NaN, which JSON cannot write
        raise InvalidInput("the audio holds samples that are not finite numbers (NaN or infinity)")
    return Audio(samples, rate)


def resample(audio: Audio, sampling_rate: int) -> np.ndarray:
    """The clip at ``sampling_rate``: soxr's high-quality resampler (transformers' pipelines resample with
    torchaudio, which no wheel of this torch has), or the samples themselves at that rate already."""
    if audio.sampling_rate in (sampling_rate, MODELS_RATE):
        return audio.samples
    import soxr

    return np.asarray(soxr.resample(audio.samples, audio.sampling_rate, sampling_rate), dtype=np.float32)


def _too_long(seconds: float) -> str:
    return f"the audio lasts {seconds:.1f} s; at most {MAX_AUDIO_SECONDS} s here: send it in parts"
