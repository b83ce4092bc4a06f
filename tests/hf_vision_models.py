"""Tiny vision models built offline, the way a user's ``save_pretrained`` leaves them, with random weights: a DETR
object detector and panoptic segmenter (a small ResNet backbone, no timm), a SegFormer semantic segmenter and a CLIP
model with a byte-level BPE tokenizer trained here, for zero-shot image classification. Test images are drawn here
too. No hub, no network.
"""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

import torch
from hf_models import _transformers, corpus

OBJECT_LABELS = {0: "cat", 1: "dog", 2: "bird", 3: "car"}
SEGMENT_LABELS = {0: "sky", 1: "road", 2: "tree", 3: "person"}


def _labels(names: dict[int, str]) -> dict[str, Any]:
    return {"id2label": names, "label2id": {name: index for index, name in names.items()}}


def detr(directory: Path, seed: int = 0, shortest_edge: int = 64, longest_edge: int = 96) -> Path:
    """A DETR detector, 10 queries, over a two-stage ResNet of 8 and 16 channels (no timm). Its image processor keeps
    the aspect ratio (shortest edge ``shortest_edge``, longest at most ``longest_edge``), so images of other shapes
    give inputs of other shapes, as DETR's own processor does at 800 and 1333."""
    transformers = _transformers()

    torch.manual_seed(seed)
    backbone = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", out_features=["stage2"]
    )
    config = transformers.DetrConfig(
        backbone_config=backbone,
        use_timm_backbone=False,
        num_queries=10,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        **_labels(OBJECT_LABELS),
    )
    _widen(transformers.DetrForObjectDetection(config), seed).save_pretrained(directory)
    transformers.DetrImageProcessorPil(
        size={"shortest_edge": shortest_edge, "longest_edge": longest_edge}
    ).save_pretrained(directory)
    return directory


def detr_panoptic(directory: Path, seed: int = 0) -> Path:
    """A DETR panoptic segmenter (``DetrForSegmentation``): its mask head reads four backbone stages and needs widths
    its group norms divide (64 wide, 8 heads). Its processor keeps the aspect ratio, as ``detr``'s does."""
    transformers = _transformers()

    torch.manual_seed(seed)
    backbone = transformers.ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 8, 16, 16],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = transformers.DetrConfig(
        backbone_config=backbone,
        use_timm_backbone=False,
        num_queries=10,
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        **_labels(OBJECT_LABELS),
    )
    _widen(transformers.DetrForSegmentation(config), seed).save_pretrained(directory)
    transformers.DetrImageProcessorPil(size={"shortest_edge": 64, "longest_edge": 96}).save_pretrained(directory)
    return directory


def _widen(model: Any, seed: int) -> Any:
    """Weights drawn wider than transformers draws them (the backbone aside), so that each query finds a box of its
    own and scores spread around 0.5: at transformers' scale every query answers one box with one score."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 and "backbone" not in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


def segformer(directory: Path, seed: int = 0, size: int = 32) -> Path:
    """A SegFormer semantic segmenter of two stages (8 and 16 channels) over ``size`` x ``size`` inputs."""
    transformers = _transformers()

    torch.manual_seed(seed)
    config = transformers.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=16,
        **_labels(SEGMENT_LABELS),
    )
    transformers.SegformerForSemanticSegmentation(config).eval().save_pretrained(directory)
    transformers.SegformerImageProcessorPil(size={"height": size, "width": size}).save_pretrained(directory)
    return directory


def _clip_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE with CLIP's end-of-word suffix and special tokens, trained on ``corpus()``."""
    import json

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    specials = ["<|startoftext|>", "<|endoftext|>"]
    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.normalizer = normalizers.Lowercase()
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    bpe.train_from_iterator(corpus() + ["this is a photo of"] * 20, trainer)
    data = json.loads(bpe.to_str())["model"]
    return data["vocab"], [tuple(merge) for merge in data["merges"]]


def clip(directory: Path, seed: int = 0, size: int = 32) -> Path:
    """A CLIP model (text and vision towers of two layers, 32 wide) with a CLIP tokenizer and image processor."""
    transformers = _transformers()

    vocab, merges = _clip_bpe()
    tokenizer = transformers.CLIPTokenizer(vocab=vocab, merges=merges)
    torch.manual_seed(seed)
    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = transformers.CLIPConfig(
        text_config={
            **tower,
            "vocab_size": len(vocab),
            "max_position_embeddings": 64,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**tower, "image_size": size, "patch_size": 8},
        projection_dim=16,
    )
    transformers.CLIPModel(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    processor.save_pretrained(directory)
    return directory


def image(seed: int, width: int = 48, height: int = 48) -> Any:
    """A random RGB image of blocks (so that segments are larger than a pixel)."""
    from PIL import Image

    rng = random.Random(seed)
    small = Image.new("RGB", (max(1, width // 8), max(1, height // 8)))
    small.putdata(
        [(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(small.width * small.height)]
    )
    return small.resize((width, height), Image.Resampling.NEAREST)


def encoded(picture: Any, kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format=kind)
    return buffer.getvalue()


def base64_image(picture: Any, kind: str = "PNG") -> str:
    return base64.b64encode(encoded(picture, kind)).decode()


def mask_pixels(encoded_mask: str) -> Any:
    """A mask as the server answers it (a PNG in base64), as an array of pixels."""
    import numpy as np
    from PIL import Image

    return np.array(Image.open(io.BytesIO(base64.b64decode(encoded_mask))))


def same_answer(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> bool:
    """Ours (as JSON gives it) against the pipeline's for one image: scores within 1e-4, everything else equal, and a
    mask (ours a base64 PNG, theirs a PIL image) pixel for pixel."""
    import numpy as np

    if len(ours) != len(theirs):
        return False
    for mine, other in zip(ours, theirs, strict=True):
        if mine.keys() != other.keys():
            return False
        for key, value in mine.items():
            if key == "score" and value is not None:
                if abs(value - other[key]) > 1e-4:
                    return False
            elif key == "mask":
                if not np.array_equal(mask_pixels(value), np.array(other[key])):
                    return False
            elif value != other[key]:
                return False
    return True
