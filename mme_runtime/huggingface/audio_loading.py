"""Speech models served with no code: which ``save_pretrained`` directories are speech recognizers or audio
classifiers, the Auto class that loads each, and the feature extractor (and tokenizer) that go with it.

A directory is an audio one when its ``preprocessor_config.json`` names a feature extractor with a sampling rate
(``Wav2Vec2FeatureExtractor``, ``WhisperFeatureExtractor``): its ``...ForSequenceClassification`` is then an audio
classifier, not a text one, and its ``...ForConditionalGeneration`` (Whisper) a speech recognizer, not a text-to-text
model. Runs where ``loading`` runs: on the host, CUDA-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

AUDIO_TASKS = frozenset({"automatic-speech-recognition", "audio-classification"})
PREPROCESSOR_FILE = "preprocessor_config.json"
# What an architecture's name ends with, and the task it serves, in any directory: CTC heads and audio classifiers
# exist for audio only.
ARCHITECTURE_TASKS = {
    "ForCTC": "automatic-speech-recognition",
    "ForAudioClassification": "audio-classification",
}
# What the architecture alone would call a text task, and what it is when the directory holds an audio feature
# extractor (a Wav2Vec2ForSequenceClassification, a WhisperForConditionalGeneration).
AUDIO_READINGS = {"text-classification": "audio-classification", "text2text-generation": "automatic-speech-recognition"}


def is_audio_directory(model_dir: Path) -> bool:
    """Its preprocessor is a feature extractor of sound: it names its type and a sampling rate."""
    try:
        settings = json.loads((model_dir / PREPROCESSOR_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(settings, dict) and "feature_extractor_type" in settings and "sampling_rate" in settings


def audio_task(task: str, model_dir: Path) -> str:
    """The task an architecture's name stands for, read again for an audio directory (``AUDIO_READINGS``)."""
    return AUDIO_READINGS.get(task, task) if is_audio_directory(model_dir) else task


def auto_class(task: str, config: dict[str, Any]) -> str:
    """The Auto class of an audio task's model: an encoder-decoder (Whisper) recognizes speech by generation, any
    other recognizer is a CTC model (Wav2Vec2, HuBERT), as transformers' own pipeline loads them."""
    if task == "audio-classification":
        return "AutoModelForAudioClassification"
    return "AutoModelForSpeechSeq2Seq" if config.get("is_encoder_decoder") else "AutoModelForCTC"


def processors(transformers: Any, model_dir: Path, task: str, options: dict[str, Any]) -> tuple[Any, Any]:
    """The feature extractor, and for speech recognition the tokenizer that turns its tokens into text."""
    feature_extractor = transformers.AutoFeatureExtractor.from_pretrained(str(model_dir), **options)
    if task == "audio-classification":
        return feature_extractor, None
    return feature_extractor, transformers.AutoTokenizer.from_pretrained(str(model_dir), **options)
