"""What a Hugging Face request may not ask of the process that decodes it (found in review): an image body sent to a
model that takes no images is a 415, as audio is; an image may not be so narrow that a processor resizing its
shortest side to a fixed size (CLIP's) makes it gigabytes; a request's images together, a zero-shot request's (text,
label) pairs, are capped."""

from __future__ import annotations

import base64
import io
import json

import pytest

from mme_runtime.base.errors import InvalidInput, UnsupportedContentType
from mme_runtime.huggingface import requests as hf_requests
from mme_runtime.huggingface import zero_shot as hf_zero_shot
from mme_runtime.huggingface.requests import decode


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (20, 30, 40)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    "task", ["table-question-answering", "zero-shot-classification", "text-classification", "audio-classification"]
)
def test_an_image_body_to_a_model_that_takes_no_images_is_415(task: str) -> None:
    with pytest.raises(UnsupportedContentType, match="image"):
        decode(_png(4, 4), "image/png", task)


@pytest.mark.parametrize("size", [(1, 20_000), (20_000, 1), (3, 2_000)])
def test_an_image_too_narrow_for_a_shortest_side_resize_is_400(size: tuple[int, int]) -> None:
    """CLIP's processor resizes a 1 x 100,000 image to 224 x 22,400,000 (60 GB of float32) before it crops it."""
    with pytest.raises(InvalidInput, match="aspect"):
        decode(_png(*size), "image/png", "zero-shot-image-classification")
    body = json.dumps({"inputs": base64.b64encode(_png(*size)).decode()})
    with pytest.raises(InvalidInput, match="aspect"):
        decode(body, "application/json", "object-detection")
    assert decode(_png(1, 1), "image/png", "object-detection").inputs[0].size == (1, 1)
    assert decode(_png(1, 50), "image/png", "object-detection").inputs[0].size == (1, 50)


def test_the_images_of_one_request_are_capped_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PNG of one flat color is a few bytes a megapixel: 6 MB of JSON held hundreds of 25-megapixel images."""
    monkeypatch.setattr(hf_requests, "MAX_IMAGE_PIXELS", 100)
    monkeypatch.setattr(hf_requests, "MAX_REQUEST_PIXELS", 400)
    image = base64.b64encode(_png(10, 10)).decode()
    assert len(decode(json.dumps({"inputs": [image] * 4}), "application/json", "object-detection").inputs) == 4
    with pytest.raises(InvalidInput, match="images of this request"):
        decode(json.dumps({"inputs": [image] * 5}), "application/json", "object-detection")


def test_a_zero_shot_request_has_at_most_max_pairs_text_label_pairs() -> None:
    """Each (text, label) pair is a row of the model: a few bytes of labels times a few bytes of texts made millions
    of rows, tokenized and held in the device's shared process, and a pass that every request of the batch waited on."""
    labels = ",".join(f"l{index}" for index in range(hf_zero_shot.MAX_PAIRS // 2))
    fits = {"inputs": ["a", "b"], "parameters": {"candidate_labels": labels}}
    assert decode(json.dumps(fits), "application/json", hf_zero_shot.TASK).rows == 2
    over = {"inputs": ["a", "b", "c"], "parameters": {"candidate_labels": labels}}
    with pytest.raises(InvalidInput, match="pairs"):
        decode(json.dumps(over), "application/json", hf_zero_shot.TASK)


@pytest.mark.parametrize("template", ["{:100000000}", "{!r:>9999}", "This {} is {:{}}"])
def test_a_zero_shot_template_with_a_format_spec_is_400_before_it_is_filled(template: str) -> None:
    """``"{:100000000}"`` made each label's hypothesis 100 MB (and the pipeline tokenizes one per label)."""
    body = {"inputs": "a", "parameters": {"candidate_labels": ["x", "y"], "hypothesis_template": template}}
    with pytest.raises(InvalidInput, match="hypothesis_template"):
        decode(json.dumps(body), "application/json", hf_zero_shot.TASK)


def test_a_zero_shot_request_reads_at_most_max_characters_through_the_tokenizer() -> None:
    """Each pair's text and hypothesis are tokenized alone: a 3 MB text times 1,000 labels was 3 GB of tokenizing."""
    labels = [f"l{index}" for index in range(100)]
    text = "x" * (hf_zero_shot.MAX_CHARACTERS // 100)
    with pytest.raises(InvalidInput, match="characters"):
        decode(
            json.dumps({"inputs": text, "parameters": {"candidate_labels": labels}}),
            "application/json",
            "zero-shot-classification",
        )
    fits = {"inputs": text[:-100], "parameters": {"candidate_labels": labels, "hypothesis_template": "{}"}}
    assert decode(json.dumps(fits), "application/json", hf_zero_shot.TASK).rows == 1


def test_a_request_holds_at_most_max_images() -> None:
    """A 1x1 PNG is 70 bytes and DETR's processor makes it 800x800 float32 (7.7 MB): 6 MB of JSON held 60,000 of
    them, all prepared before the pass (2,000 took 350 MB more with a tiny DETR of 64 pixels)."""
    image = base64.b64encode(_png(1, 1)).decode()
    limit = hf_requests.MAX_IMAGES
    assert decode(json.dumps({"inputs": [image] * limit}), "application/json", "object-detection").rows == limit
    with pytest.raises(InvalidInput, match=f"at most {limit} images"):
        decode(json.dumps({"inputs": [image] * (limit + 1)}), "application/json", "image-classification")


def test_an_npy_body_of_more_rows_than_clips_is_refused_before_it_is_split() -> None:
    """A 6 MB NPY of shape (6,000,000, 1) int8 was split into six million row arrays (1 GB) before the clip cap."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.zeros((hf_requests.MAX_CLIPS + 1, 1), np.int8))
    with pytest.raises(InvalidInput, match="rows"):
        hf_requests.npy_inputs(buffer.getvalue())
