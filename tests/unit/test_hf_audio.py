"""Audio in requests to speech models, on its own: every format the AWS toolkit takes decodes with soundfile (no
ffmpeg), channels are mixed down, the rate is changed by soxr, the cap and undecodable bodies are the client's 400,
and speech directories are told from text ones by their feature extractor."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import hf_audio_models
import numpy as np
import pytest

from mme_runtime.base.errors import InvalidInput, UnsupportedContentType
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface import requests as hf_requests

ASR = "automatic-speech-recognition"


@pytest.mark.parametrize(("format", "tolerance"), [("WAV", 1e-4), ("FLAC", 1e-4), ("OGG", None), ("MP3", None)])
def test_each_format_decodes_to_the_samples_written(format: str, tolerance: float | None) -> None:
    written = hf_audio_models.waveform(0.5, 16_000, seed=1)[:, 0]
    clip = hf_requests.decode_audio(hf_audio_models.encode(written, 16_000, format))
    assert clip.sampling_rate == 16_000 and clip.samples.dtype == np.float32
    if tolerance is not None:  # lossless: PCM 16 bits
        assert clip.samples.shape == written.shape and np.abs(clip.samples - written).max() < tolerance
    else:  # lossy, and MP3 adds its encoder's delay: about as long, and as loud
        assert abs(len(clip.samples) - len(written)) < 0.1 * len(written)
        assert abs(np.sqrt(np.mean(clip.samples**2)) - np.sqrt(np.mean(written**2))) < 0.05


def test_channels_are_averaged_as_ffmpegs_ac_1_mixes_them() -> None:
    stereo = hf_audio_models.waveform(0.3, 22_050, seed=2, channels=2)
    clip = hf_requests.decode_audio(hf_audio_models.encode(stereo, 22_050, "WAV", "FLOAT"))
    assert clip.sampling_rate == 22_050
    np.testing.assert_allclose(clip.samples, stereo.mean(axis=1), atol=1e-7)


def test_a_clip_is_resampled_by_soxr_to_the_models_rate_and_left_alone_at_it() -> None:
    import soxr

    clip = hf_requests.Audio(hf_audio_models.waveform(0.5, 44_100)[:, 0], 44_100)
    resampled = hf_requests.resample(clip, 16_000)
    assert resampled.dtype == np.float32 and len(resampled) == 8_000
    np.testing.assert_array_equal(resampled, soxr.resample(clip.samples, 44_100, 16_000))
    same = hf_requests.Audio(clip.samples, 16_000)
    assert hf_requests.resample(same, 16_000) is same.samples


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"not audio at all" * 8, "not audio this server reads"),
        (b"", "not audio this server reads"),
        (hf_audio_models.encode(np.zeros((0, 1), np.float32), 16_000, "WAV"), "no samples"),
        (hf_audio_models.audio_file(0.01, "WAV", sampling_rate=192_000), "at most 96000"),
    ],
)
def test_what_does_not_decode_is_the_clients_400(raw: bytes, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment) as caught:
        hf_requests.decode_audio(raw)
    assert "BytesIO" not in str(caught.value)


def test_audio_over_the_cap_is_refused_before_it_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_requests, "MAX_AUDIO_SECONDS", 1)
    with pytest.raises(InvalidInput, match=r"lasts 1\.5 s; at most 1 s"):
        hf_requests.decode_audio(hf_audio_models.audio_file(1.5, "FLAC"))
    with pytest.raises(InvalidInput, match=r"at most 1 s"):
        hf_requests.decode_audio(hf_audio_models.audio_file(1.2, "MP3"))
    assert 0.8 < hf_requests.decode_audio(hf_audio_models.audio_file(0.9, "MP3")).seconds < 1


def test_every_aws_audio_type_is_taken_and_base64_in_json_with_parameters() -> None:
    raw = hf_audio_models.audio_file(0.2, "OGG")
    for media in (*hf_requests.AWS_AUDIO_TYPES, "audio/wav", "audio/flac"):
        request = hf_requests.decode(raw, media, ASR)
        assert isinstance(request.inputs[0], hf_requests.Audio) and request.single and request.parameters == {}
    body = {"inputs": [base64.b64encode(raw).decode()] * 2, "parameters": {"top_k": 2}}
    request = hf_requests.decode(json.dumps(body), "application/json", "audio-classification")
    assert len(request.inputs) == 2 and not request.single and request.parameters == {"top_k": 2}


@pytest.mark.parametrize(
    ("body", "content_type", "task", "error", "fragment"),
    [
        (b"RIFF", "audio/wave", "text-classification", UnsupportedContentType, "audio"),
        (b"...", "audio/webm", ASR, UnsupportedContentType, "not supported"),
        (json.dumps({"inputs": "/etc/hosts"}), "application/json", ASR, InvalidInput, "base64"),
        (json.dumps({"inputs": "https://example.com/a.flac"}), "application/json", ASR, InvalidInput, "base64"),
        (json.dumps({"inputs": 3}), "application/json", "audio-classification", InvalidInput, "base64"),
    ],
)
def test_what_a_speech_model_does_not_take_is_refused(
    body: bytes | str, content_type: str, task: str, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        hf_requests.decode(body, content_type, task)


def test_the_clips_of_one_request_share_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_requests, "MAX_AUDIO_SECONDS", 1)
    clip = base64.b64encode(hf_audio_models.audio_file(0.6, "WAV")).decode()
    with pytest.raises(InvalidInput, match="clips of this request"):
        hf_requests.decode(json.dumps({"inputs": [clip, clip]}), "application/json", ASR)


def _directory(path: Path, architecture: str, preprocessor: dict[str, object] | None, **config: object) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "x", "architectures": [architecture], **config}))
    if preprocessor is not None:
        (path / hf_loading.PREPROCESSOR_FILE).write_text(json.dumps(preprocessor))
    return path


@pytest.mark.parametrize(
    ("architecture", "config", "task"),
    [
        ("Wav2Vec2ForCTC", {}, ASR),
        ("Wav2Vec2ForSequenceClassification", {}, "audio-classification"),
        ("ASTForAudioClassification", {}, "audio-classification"),
        ("WhisperForConditionalGeneration", {"is_encoder_decoder": True}, ASR),
    ],
)
def test_a_speech_directory_is_told_by_its_feature_extractor(
    tmp_path: Path, architecture: str, config: dict[str, object], task: str
) -> None:
    extractor = {"feature_extractor_type": "Wav2Vec2FeatureExtractor", "sampling_rate": 16_000}
    assert hf_loading.resolve_task(_directory(tmp_path / "a", architecture, extractor, **config), None, None) == task
    assert hf_loading.audio_auto_class(task, config).startswith("AutoModelFor")
    text = _directory(tmp_path / "t", architecture, {"image_processor_type": "ViTImageProcessor"}, **config)
    assert hf_loading.resolve_task(text, None, None) in {task, "text-classification", "text2text-generation"}
    assert hf_loading.resolve_task(text, "automatic-speech-recognition", None) == ASR


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_samples_that_are_not_numbers_are_the_clients_400(value: float) -> None:
    """A float WAV may hold NaN or infinity: a classifier's scores were NaN, which JSON cannot write (a 500)."""
    samples = hf_audio_models.waveform(0.2)[:, 0].copy()
    samples[10] = value
    with pytest.raises(InvalidInput, match="not finite"):
        hf_requests.decode_audio(hf_audio_models.encode(samples, hf_audio_models.SAMPLING_RATE, "WAV", "FLOAT"))


def test_a_request_holds_at_most_max_clips() -> None:
    """Whisper pads every clip to a 30 s window: a 1-sample WAV is 64 bytes of base64, and 1,000 of them (64 KB of
    JSON) grew a device host by 2 GB and took 32 s with a tiny Whisper; 6 MB of JSON held 95,000."""
    clip = base64.b64encode(hf_audio_models.audio_file(0.05)).decode()
    limit = hf_requests.MAX_CLIPS
    assert len(hf_requests.read_inputs([clip] * limit, "automatic-speech-recognition")) == limit
    with pytest.raises(InvalidInput, match=f"at most {limit} clips"):
        hf_requests.read_inputs([clip] * (limit + 1), "automatic-speech-recognition")
