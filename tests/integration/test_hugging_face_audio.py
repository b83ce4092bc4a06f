"""Speech models served with no code, through the real frontend: audio bodies of every type the AWS toolkit takes
(and base64 in JSON with parameters) answer what transformers' pipeline answers for the same sound, decoded by
soundfile and resampled by soxr here, under 16 concurrent clients whose requests share passes; bad audio is the
client's 400, a type that is not audio or JSON its 415."""

from __future__ import annotations

import base64
import functools
import io
import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hf_audio_models
import hf_models
import numpy as np
import pytest
from serving import RunningServer, batch_passes, borrowed

ASR = "automatic-speech-recognition"
MODELS = {"ctc": ASR, "classifier": "audio-classification", "whisper": ASR}
FORMATS = [("WAV", "audio/wave"), ("FLAC", "audio/x-flac"), ("OGG", "audio/ogg"), ("MP3", "audio/mpeg")]
RATES = (16_000, 22_050, 44_100, 8_000)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-audio-models")
    hf_audio_models.wav2vec2_ctc(root / "ctc")
    hf_audio_models.wav2vec2_classifier(root / "classifier")
    hf_audio_models.whisper(root / "whisper")
    return root


@pytest.fixture(scope="module")
def server(shared_server: RunningServer, built: Path) -> Iterator[RunningServer]:
    """Each model batched (up to 16 requests a pass), its task told by its directory alone (no task=)."""
    with borrowed(shared_server) as running:
        for name in MODELS:
            shutil.copytree(built / name, running.models / name)
            (running.models / name / "serving.properties").write_text("batch_size=16\nmax_batch_delay=50\n")
            response = running.load(name)
            assert response.status_code == 200, f"{name}: {response.text}\n{running.log_text()[-3000:]}"
        yield running


def reference(built: Path, name: str, raw: bytes, parameters: dict[str, Any]) -> Any:
    """transformers' pipeline for the same sound: the file read by soundfile, its channels averaged, resampled by
    soxr to the model's rate (the pipeline's own resampling needs torchaudio), through JSON as a client gets it."""
    import soundfile
    import soxr
    import transformers

    samples, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    mono = samples.mean(axis=1, dtype=np.float32)
    pipeline = _pipelines.get(name) or _pipelines.setdefault(
        name, transformers.pipeline(MODELS[name], str(built / name))
    )
    target = pipeline.feature_extractor.sampling_rate
    resampled = mono if rate == target else soxr.resample(mono, rate, target)
    answer = pipeline({"raw": resampled, "sampling_rate": target}, **parameters)
    return json.loads(json.dumps(answer))


_pipelines: dict[str, Any] = {}


close = hf_models.answers_close


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(("format", "content_type"), FORMATS)
def test_each_audio_type_answers_what_the_pipeline_answers_for_its_sound(
    server: RunningServer, built: Path, name: str, format: str, content_type: str
) -> None:
    raw = hf_audio_models.encode(hf_audio_models.waveform(0.8, 22_050, seed=3, channels=2), 22_050, format)
    response = server.invoke(name, raw, content_type=content_type)
    assert response.status_code == 200, response.text
    assert close(response.json(), reference(built, name, raw, {})), (response.json(), reference(built, name, raw, {}))


def test_the_aws_answers_have_the_pipelines_shape_and_x_audio_is_any_file(server: RunningServer) -> None:
    raw = hf_audio_models.audio_file(0.5, "FLAC")
    text = server.invoke("whisper", raw, content_type="audio/x-audio").json()
    assert set(text) == {"text"} and isinstance(text["text"], str)
    labels = server.invoke("classifier", raw, content_type="audio/x-audio").json()
    assert len(labels) == 4 and all(set(label) == {"label", "score"} for label in labels)  # top_k 5, 4 labels


def test_base64_in_json_takes_parameters_and_a_list_answers_a_list(server: RunningServer, built: Path) -> None:
    clips = [hf_audio_models.audio_file(0.4 + 0.3 * seed, "OGG", seed=seed) for seed in range(3)]
    body = {"inputs": [base64.b64encode(clip).decode() for clip in clips], "parameters": {"top_k": 2}}
    response = server.invoke("classifier", json.dumps(body))
    assert response.status_code == 200, response.text
    assert close(response.json(), [reference(built, "classifier", clip, {"top_k": 2}) for clip in clips])
    timestamps = {"inputs": body["inputs"][0], "parameters": {"return_timestamps": "word"}}
    words = server.invoke("ctc", json.dumps(timestamps)).json()
    assert close(words, reference(built, "ctc", clips[0], {"return_timestamps": "word"})) and "chunks" in words


@pytest.mark.parametrize("name", list(MODELS))
def test_sixteen_clients_with_mixed_audio_and_parameters_share_passes_and_each_gets_its_own(
    server: RunningServer, built: Path, name: str
) -> None:
    """Clips of 0.2 to 2.5 s, in four formats and four rates, half as bodies and half as base64 with parameters:
    every answer equals the pipeline's for that clip alone (scores within 1e-4, text exactly), and requests shared
    forward passes (Whisper's: one batched generate)."""
    options = {
        "ctc": [{}, {"return_timestamps": "char"}],
        "classifier": [{"top_k": 1}, {"function_to_apply": "none", "top_k": None}, {"top_k": 3}],
        "whisper": [{}, {"max_new_tokens": 6}],
    }[name]
    count = 16 if name == "whisper" else 32
    cases = []
    for seed in range(count):
        format, content_type = FORMATS[seed % len(FORMATS)]
        rate = RATES[(seed // 4) % len(RATES)]
        raw = hf_audio_models.encode(hf_audio_models.waveform(0.2 + (seed * 0.37) % 2.3, rate, seed), rate, format)
        parameters = options[seed % len(options)] if seed % 2 else {}
        cases.append((raw, content_type, parameters))
    before = batch_passes(server, name)

    def ask(case: tuple[bytes, str, dict[str, Any]]) -> Any:
        raw, content_type, parameters = case
        if parameters:
            body = json.dumps({"inputs": base64.b64encode(raw).decode(), "parameters": parameters})
            response = server.invoke(name, body)
        else:
            response = server.invoke(name, raw, content_type=content_type)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(16) as clients:
        answers = list(clients.map(ask, cases))
    for (raw, _, parameters), answer in zip(cases, answers, strict=True):
        assert close(answer, reference(built, name, raw, parameters)), (parameters, answer)
    passes, rows = (after - earlier for after, earlier in zip(batch_passes(server, name), before, strict=True))
    assert rows == count and passes < count, (passes, rows)


@pytest.mark.parametrize(
    ("body", "content_type", "status", "fragment"),
    [
        (b"this is no sound at all" * 10, "audio/wave", 400, "not audio this server reads"),
        (hf_audio_models.audio_file(0.3, "WAV")[:40], "audio/wave", 400, "not audio"),
        (hf_audio_models.encode(np.zeros((301 * 8_000, 1), np.float32), 8_000, "FLAC"), "audio/x-flac", 400, "300 s"),
        (b"\x1aE\xdf\xa3", "audio/webm", 415, "not supported"),
        (json.dumps({"inputs": "/etc/hostname"}), "application/json", 400, "base64"),
        (json.dumps({"inputs": "aGVsbG8="}), "application/json", 400, "not audio"),
    ],
)
def test_bad_audio_is_the_clients_error_and_the_model_serves_on(
    server: RunningServer, body: bytes | str, content_type: str, status: int, fragment: str
) -> None:
    response = server.invoke("ctc", body, content_type=content_type)
    assert response.status_code == status, response.text
    assert fragment in response.json()["message"] and "Traceback" not in response.text
    assert server.invoke("ctc", hf_audio_models.audio_file(0.3), content_type="audio/wav").status_code == 200


def test_a_clip_too_short_for_a_frame_is_its_own_400_among_others(server: RunningServer) -> None:
    """Under 400 samples Wav2Vec2's convolutions make no frame: the pass failed (a 500 for every request of its batch),
    or, padded with longer clips, answered what the clip alone never would."""
    short = hf_audio_models.encode(np.full((300, 1), 0.1, np.float32), 16_000, "WAV")
    good = hf_audio_models.audio_file(0.5)
    for name in ("ctc", "classifier"):
        with ThreadPoolExecutor(8) as clients:
            bodies = [short if index == 3 else good for index in range(8)]
            send = functools.partial(server.invoke, name, content_type="audio/wave")
            responses = list(clients.map(send, bodies))
        assert responses[3].status_code == 400 and "too short" in responses[3].json()["message"], responses[3].text
        assert all(response.status_code == 200 for index, response in enumerate(responses) if index != 3)


def test_bad_parameters_answer_400_for_the_request_at_fault_only(server: RunningServer, built: Path) -> None:
    raw = hf_audio_models.audio_file(0.6, "WAV", seed=9)
    good = {"inputs": base64.b64encode(raw).decode(), "parameters": {"max_new_tokens": 4}}
    bad = {**good, "parameters": {"num_beams": 99}}
    with ThreadPoolExecutor(8) as clients:
        responses = list(clients.map(lambda body: server.invoke("whisper", json.dumps(body)), [good, bad] * 4))
    for index, response in enumerate(responses):
        if index % 2:
            assert response.status_code == 400 and "num_beams" in response.json()["message"], response.text
        else:
            assert response.status_code == 200 and response.json() == reference(
                built, "whisper", raw, {"max_new_tokens": 4}
            )
