"""Tiny speech models built offline, as ``save_pretrained`` leaves them, and audio to send them: a Wav2Vec2 CTC
recognizer with its character tokenizer, a Wav2Vec2 audio classifier, a Whisper-shaped recognizer with a byte-level
BPE tokenizer trained here, and tones with noise written as WAV, FLAC, OGG or MP3 by soundfile. No hub, no network.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import hf_models
import numpy as np
import torch

SAMPLING_RATE = 16_000
CHARACTERS = list("abcdefghijklmnopqrstuvwxyz'")
SOUND_LABELS = {0: "speech", 1: "music", 2: "noise", 3: "silence"}
# Whisper's special tokens, last in its vocabulary as in the real one: its tokenizer reads every id after
# <|notimestamps|> as a timestamp.
WHISPER_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>"]
WHISPER_SPECIALS += ["<|notimestamps|>"]


def _transformers() -> Any:
    return hf_models._transformers()


def _wav2vec2_config(layer_norm: bool, **extra: Any) -> Any:
    """A Wav2Vec2 of a few thousand parameters: three convolutions (320 samples a frame, as the real ones), two
    layers. ``layer_norm``: its convolutions normalize each frame (``feat_extract_norm="layer"``, the kind trained
    with attention masks, whose padding can be masked); otherwise one group norm over the whole clip."""
    return _transformers().Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 8, 8),
        conv_kernel=(10, 8, 8),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer" if layer_norm else "group",
        do_stable_layer_norm=layer_norm,
        mask_time_prob=0.0,
        **extra,
    )


def _feature_extractor(layer_norm: bool) -> Any:
    return _transformers().Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=SAMPLING_RATE,
        padding_value=0.0,
        do_normalize=True,
        return_attention_mask=layer_norm,
    )


def wav2vec2_ctc(directory: Path, seed: int = 0, layer_norm: bool = True) -> Path:
    """A Wav2Vec2ForCTC with random weights, its character tokenizer and feature extractor (a Wav2Vec2Processor)."""
    transformers = _transformers()

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4}
    vocab |= {character: 5 + index for index, character in enumerate(CHARACTERS)}
    vocab_file = directory / "vocab.json"
    vocab_file.write_text(json.dumps(vocab))
    tokenizer = transformers.Wav2Vec2CTCTokenizer(str(vocab_file), word_delimiter_token="|")
    torch.manual_seed(seed)
    config = _wav2vec2_config(layer_norm, vocab_size=len(vocab), pad_token_id=0, ctc_loss_reduction="mean")
    model = _spread(transformers.Wav2Vec2ForCTC(config), seed)
    model.save_pretrained(directory)
    transformers.Wav2Vec2Processor(
        feature_extractor=_feature_extractor(layer_norm), tokenizer=tokenizer
    ).save_pretrained(directory)
    return directory


def wav2vec2_classifier(directory: Path, seed: int = 0, layer_norm: bool = True) -> Path:
    """A Wav2Vec2ForSequenceClassification over ``SOUND_LABELS``, with its feature extractor (no tokenizer)."""
    transformers = _transformers()

    torch.manual_seed(seed)
    config = _wav2vec2_config(
        layer_norm,
        classifier_proj_size=16,
        id2label=SOUND_LABELS,
        label2id={label: index for index, label in SOUND_LABELS.items()},
    )
    _spread(transformers.Wav2Vec2ForSequenceClassification(config), seed).save_pretrained(directory)
    _feature_extractor(layer_norm).save_pretrained(directory)
    return directory


def whisper(directory: Path, seed: int = 0, mel_bins: int = 16) -> Path:
    """A Whisper-shaped recognizer (English only: its prompt is <|startoftranscript|><|notimestamps|>), greedy by
    its generation config, up to 24 tokens, with a byte-level BPE tokenizer trained on ``hf_models.corpus()``."""
    transformers = _transformers()

    vocab, merges = hf_models._byte_bpe([], size=300)
    vocab |= {token: len(vocab) + index for index, token in enumerate(WHISPER_SPECIALS)}
    tokenizer = transformers.WhisperTokenizer(vocab=vocab, merges=merges, model_max_length=64)
    start, end, no_timestamps = (
        vocab[token] for token in ("<|startoftranscript|>", "<|endoftext|>", "<|notimestamps|>")
    )
    config = transformers.WhisperConfig(
        vocab_size=len(vocab),
        num_mel_bins=mel_bins,
        d_model=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_target_positions=64,
        decoder_start_token_id=start,
        eos_token_id=end,
        pad_token_id=end,
        bos_token_id=end,
    )
    torch.manual_seed(seed)
    model = hf_models._lively(transformers.WhisperForConditionalGeneration(config), end, seed=seed, scale=0.3)
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=start,
        eos_token_id=end,
        pad_token_id=end,
        bos_token_id=end,
        max_length=24,
        num_beams=1,
        no_timestamps_token_id=no_timestamps,
        is_multilingual=False,
        forced_decoder_ids=[[1, no_timestamps]],
        begin_suppress_tokens=[end],
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    transformers.WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=SAMPLING_RATE).save_pretrained(directory)
    return directory


def _spread(model: Any, seed: int) -> Any:
    """Output layers drawn wider than transformers draws them, so that a random CTC head emits characters that
    depend on the audio (not one blank everywhere) and a classifier's scores differ between clips."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 and "lm_head" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            elif parameter.dim() >= 2 and ("classifier" in name or "projector" in name):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


def waveform(seconds: float, sampling_rate: int = SAMPLING_RATE, seed: int = 0, channels: int = 1) -> np.ndarray:
    """Tones with noise, ``(samples, channels)`` as soundfile writes them, within [-0.9, 0.9]."""
    rng = np.random.default_rng(seed)
    time = np.arange(int(seconds * sampling_rate)) / sampling_rate
    columns = []
    for channel in range(channels):
        pitch = 110 * (1 + rng.integers(1, 8)) * (1 + channel)
        tone = 0.5 * np.sin(2 * np.pi * pitch * time) * (0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * time))
        columns.append(tone + 0.2 * rng.standard_normal(time.shape))
    return np.clip(np.stack(columns, axis=1), -0.9, 0.9).astype(np.float32)


def encode(samples: np.ndarray, sampling_rate: int, format: str, subtype: str | None = None) -> bytes:
    """``samples`` as a file of ``format`` (WAV, FLAC, OGG, MP3), as a client would send it."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, samples, sampling_rate, format=format, subtype=subtype)
    return buffer.getvalue()


def audio_file(seconds: float, format: str = "WAV", sampling_rate: int = SAMPLING_RATE, seed: int = 0) -> bytes:
    return encode(waveform(seconds, sampling_rate, seed), sampling_rate, format)
