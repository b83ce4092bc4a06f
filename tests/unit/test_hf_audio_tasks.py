"""The speech task runner on its own (no server): clips of different lengths padded into one pass give each row the
logits of its pass alone (within 1e-4) where the model masks padding, run alone where it does not, Whisper's
batched generate gives each clip the text of its lone pipeline, and bad parameters are the client's 400."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hf_audio_models
import pytest
import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface import audio as hf_audio
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface.audio import AudioRunner
from mme_runtime.huggingface.requests import Audio, TaskRequest

ASR = "automatic-speech-recognition"
SECONDS = (0.25, 1.3, 0.6, 2.1, 0.9)


def _runner(directory: Path, task: str) -> AudioRunner:
    model = hf_loading.load(directory, task, trust_remote_code=False)
    return AudioRunner(model.place(torch.device("cpu")), torch.device("cpu"))


def _clip(seconds: float, seed: int, rate: int = hf_audio_models.SAMPLING_RATE) -> Audio:
    return Audio(hf_audio_models.waveform(seconds, rate, seed)[:, 0], rate)


def _pipeline(directory: Path, task: str) -> Any:
    import transformers

    return transformers.pipeline(task, model=str(directory))


def test_ctc_logits_of_padded_rows_equal_each_clips_pass_alone(tmp_path: Path) -> None:
    directory = hf_audio_models.wav2vec2_ctc(tmp_path / "ctc")
    runner = _runner(directory, ASR)
    pipeline = runner._pipeline
    rows = [list(pipeline.preprocess(_clip(seconds, seed).samples))[0] for seed, seconds in enumerate(SECONDS)]
    model = runner.model.model
    with torch.inference_mode():
        batch = hf_audio.pad_rows(rows)
        padded = model(input_values=batch["input_values"], attention_mask=batch["attention_mask"]).logits
        for index, row in enumerate(rows):
            alone = model(input_values=row["input_values"], attention_mask=row["attention_mask"]).logits
            assert alone.shape[1] == runner._frames(row) <= padded.shape[1]
            assert torch.allclose(padded[index : index + 1, : alone.shape[1]], alone, atol=1e-4)
    assert hf_audio.pass_groups(rows, [{}] * len(rows), maskable=True) != [[i] for i in range(len(rows))]


def test_ctc_and_classifier_answers_in_one_batch_equal_the_lone_pipelines(tmp_path: Path) -> None:
    for task, directory in (
        (ASR, hf_audio_models.wav2vec2_ctc(tmp_path / "ctc")),
        ("audio-classification", hf_audio_models.wav2vec2_classifier(tmp_path / "cls")),
        ("audio-classification", hf_audio_models.wav2vec2_classifier(tmp_path / "group", layer_norm=False)),
    ):
        runner, pipeline = _runner(directory, task), _pipeline(directory, task)
        parameters = [{"top_k": 2}, {}, {"function_to_apply": "none"}] if task != ASR else [{}, {}, {}]
        requests = [TaskRequest([_clip(s, seed)], parameters[seed % 3]) for seed, s in enumerate(SECONDS)]
        answers = runner.run(requests)
        for request, answer in zip(requests, answers, strict=True):
            expected = pipeline(request.inputs[0].samples, **request.parameters)
            assert _close(answer, expected), (task, answer, expected)


def test_npy_samples_are_taken_at_the_models_rate_as_the_pipeline_takes_a_bare_array(tmp_path: Path) -> None:
    import numpy as np

    from mme_runtime.huggingface.requests import decode

    directory = hf_audio_models.wav2vec2_classifier(tmp_path / "cls")
    runner, pipeline = _runner(directory, "audio-classification"), _pipeline(directory, "audio-classification")
    clips = np.stack([_clip(1.0, seed).samples for seed in range(2)])
    request = decode(_npy(clips), "application/x-npy", "audio-classification")
    assert not request.single and [clip.sampling_rate for clip in request.inputs] == [0, 0]
    for answer, clip in zip(runner.run([request]), clips, strict=True):
        assert _close(answer, pipeline(clip)), answer
    with pytest.raises(InvalidInput, match="NaN"):
        decode(_npy(np.array([0.5, np.nan], dtype=np.float32)), "application/x-npy", "audio-classification")


def _npy(array: Any) -> bytes:
    import io

    import numpy as np

    body = io.BytesIO()
    np.save(body, array)
    return body.getvalue()


def test_a_model_that_normalizes_over_the_whole_clip_never_pads() -> None:
    rows = [{"input_values": torch.zeros(1, n)} for n in (3200, 6400, 3200)]
    assert hf_audio.pass_groups(rows, [{}] * 3, maskable=False) == [[0, 2], [1]]
    generations = [{"num_beams": 1}, {"num_beams": 2}, {"num_beams": 1}]
    assert hf_audio.pass_groups(rows[:1] * 3, generations, maskable=False) == [[0, 2], [1]]


def test_long_audio_in_chunks_answers_as_the_pipeline_does(tmp_path: Path) -> None:
    directory = hf_audio_models.wav2vec2_ctc(tmp_path / "ctc")
    runner, pipeline = _runner(directory, ASR), _pipeline(directory, ASR)
    parameters = {"chunk_length_s": 1.0, "stride_length_s": 0.2}
    clip = _clip(3.3, 5)
    [answer, short] = runner.run([TaskRequest([clip], parameters), TaskRequest([_clip(0.4, 6)], {})])
    assert answer == pipeline(clip.samples, **parameters)
    timestamps = runner.run([TaskRequest([clip], {"return_timestamps": "word"})])[0]
    assert _close(timestamps, pipeline(clip.samples, return_timestamps="word"))


def test_whisper_generates_a_batch_of_clips_as_each_alone(tmp_path: Path) -> None:
    directory = hf_audio_models.whisper(tmp_path / "whisper")
    runner, pipeline = _runner(directory, ASR), _pipeline(directory, ASR)
    parameters = [{}, {"max_new_tokens": 5}, {}, {}, {"max_new_tokens": 5}]
    requests = [TaskRequest([_clip(s, seed)], parameters[seed]) for seed, s in enumerate(SECONDS)]
    answers = runner.run(requests)
    texts = set()
    for request, answer in zip(requests, answers, strict=True):
        assert answer == pipeline(request.inputs[0].samples, **request.parameters)
        texts.add(answer["text"])
    assert len(texts) > 2  # the clips were told apart: nothing was shared between rows


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({"num_beams": 50}, "num_beams"),
        ({"num_return_sequences": 2}, "num_return_sequences"),
        ({"not_a_parameter": 1}, "not generation parameters"),
        ({"return_tensors": True}, "not accepted"),
        ({"max_new_tokens": 500}, "could not run"),
        # A token id past the vocabulary is an IndexError in the embedding on the CPU, a device-side assert on a GPU
        # that leaves its CUDA context (every model of the device's process) unusable.
        ({"decoder_start_token_id": 10**8}, "token ids"),
        ({"pad_token_id": -1}, "token ids"),
        ({"suppress_tokens": [1, 10**6]}, "token ids"),
        # How the server holds the generation is not the client's: an offloaded cache failed the batch on a CPU (an
        # AssertionError, 500), a static cache of max_cache_len 10**6 was allocated whole.
        ({"cache_implementation": "offloaded_static"}, "not accepted"),
        ({"cache_implementation": "static", "max_cache_len": 10**6}, "not accepted"),
        ({"compile_config": {}}, "not accepted"),
    ],
)
def test_whisper_refuses_what_would_break_or_multiply_its_rows(
    whisper_runner: AudioRunner, parameters: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        whisper_runner.run([TaskRequest([_clip(0.3, 1)], parameters)])


@pytest.fixture(scope="module")
def whisper_runner(tmp_path_factory: pytest.TempPathFactory) -> AudioRunner:
    return _runner(hf_audio_models.whisper(tmp_path_factory.mktemp("whisper") / "model"), ASR)


def test_a_ctc_model_takes_no_generation_parameters_and_a_classifier_no_text(tmp_path: Path) -> None:
    runner = _runner(hf_audio_models.wav2vec2_ctc(tmp_path / "ctc"), ASR)
    with pytest.raises(InvalidInput, match="no generation parameters"):
        runner.run([TaskRequest([_clip(0.3, 1)], {"max_new_tokens": 3})])
    with pytest.raises(InvalidInput, match="could not be prepared.*superior to stride"):
        runner.run([TaskRequest([_clip(0.3, 1)], {"chunk_length_s": 0.1, "stride_length_s": 0.1})])
    with pytest.raises(InvalidInput, match="takes audio"):
        runner.run([TaskRequest(["a text"], {})])


def test_a_classifier_with_more_labels_than_frames_answers_each_batched_clip_as_alone(tmp_path: Path) -> None:
    """A classifier's logits are one per label, not per frame: cutting a padded row back to its frames must leave
    them whole, or a clip shorter than the labels are many (a language identifier of 256 languages) loses labels."""
    import transformers

    labels = {index: f"class {index}" for index in range(40)}
    config = hf_audio_models._wav2vec2_config(
        True, classifier_proj_size=16, id2label=labels, label2id={name: index for index, name in labels.items()}
    )
    torch.manual_seed(0)
    transformers.Wav2Vec2ForSequenceClassification(config).save_pretrained(tmp_path / "many")
    hf_audio_models._feature_extractor(True).save_pretrained(tmp_path / "many")
    runner, pipeline = (
        _runner(tmp_path / "many", "audio-classification"),
        _pipeline(tmp_path / "many", "audio-classification"),
    )
    requests = [TaskRequest([_clip(seconds, seed)], {"top_k": 40}) for seed, seconds in enumerate((0.25, 0.4, 0.3))]
    answers = runner.run(requests)  # 12 to 20 frames each, padded into one pass
    for request, answer in zip(requests, answers, strict=True):
        assert _close(answer, pipeline(request.inputs[0].samples, top_k=40)), request


@pytest.mark.parametrize("samples", [1, 300])
def test_a_clip_shorter_than_one_frame_is_its_clients_400_alone_or_in_a_batch(tmp_path: Path, samples: int) -> None:
    """Wav2Vec2's convolutions need 400 samples (25 ms) for a frame: a shorter clip (or chunk) failed its pass with a
    RuntimeError, a 500 for every request of its batch."""
    import numpy as np

    runner = _runner(hf_audio_models.wav2vec2_classifier(tmp_path / "cls"), "audio-classification")
    tiny = Audio(np.full(samples, 0.1, dtype=np.float32), hf_audio_models.SAMPLING_RATE)
    for requests in ([TaskRequest([tiny])], [TaskRequest([_clip(0.5, 1)]), TaskRequest([tiny])]):
        with pytest.raises(InvalidInput, match="too short"):
            runner.run(requests)
    ctc = _runner(hf_audio_models.wav2vec2_ctc(tmp_path / "ctc"), ASR)
    with pytest.raises(InvalidInput, match="too short"):
        ctc.run([TaskRequest([_clip(1.0, 2)], {"chunk_length_s": 0.02, "stride_length_s": 0.0})])


def _close(ours: Any, theirs: Any, tolerance: float = 1e-4) -> bool:
    ours, theirs = json.loads(json.dumps(ours)), json.loads(json.dumps(theirs))
    if isinstance(ours, dict):
        return (
            isinstance(theirs, dict) and ours.keys() == theirs.keys() and all(_close(ours[k], theirs[k]) for k in ours)
        )
    if isinstance(ours, list):
        return isinstance(theirs, list) and len(ours) == len(theirs) and all(map(_close, ours, theirs))
    if isinstance(ours, float) or isinstance(theirs, float):
        return abs(float(ours) - float(theirs)) <= tolerance
    return bool(ours == theirs)
