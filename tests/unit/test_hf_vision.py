"""The vision tasks on their own (no server): batched over images of several shapes, each image answers what the
transformers pipeline answers for it alone (scores within 1e-4, boxes and masks equal), in as few passes as the
shapes allow; bad parameters are refused naming what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hf_vision_models
import pytest
import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface import requests as hf_requests
from mme_runtime.huggingface import vision as hf_vision
from mme_runtime.huggingface.requests import TaskRequest
from mme_runtime.huggingface.tasks import TaskRunner

BUILDERS = {
    "object-detection": hf_vision_models.detr,
    "image-segmentation": hf_vision_models.segformer,
    "zero-shot-image-classification": hf_vision_models.clip,
}
# Images of three shapes: DETR's processor keeps each aspect ratio, SegFormer's and CLIP's resize to one size.
SIZES = ((48, 64), (64, 48), (40, 40))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision")
    return {task: build(root / task) for task, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def runners(models: dict[str, Path]) -> dict[str, TaskRunner]:
    cpu = torch.device("cpu")
    return {task: TaskRunner(hf_loading.load(path, task, False).place(cpu), cpu) for task, path in models.items()}


def reference(path: Path, task: str) -> Any:
    import transformers

    return transformers.pipeline(task, model=str(path))


def counting_passes(runner: TaskRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The images in each forward pass the runner's pipeline runs (its lent copies share the counted forward)."""
    pipeline = runner._pipeline
    forward, sizes = pipeline.forward, []

    def counted(inputs: Any, **kwargs: Any) -> Any:
        sizes.append(int(inputs["pixel_values"].shape[0]))
        return forward(inputs, **kwargs)

    monkeypatch.setattr(pipeline, "forward", counted)
    return sizes


def test_detections_of_images_of_several_shapes_share_a_pass_per_shape(
    runners: dict[str, TaskRunner], models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = runners["object-detection"]
    images = [hf_vision_models.image(seed, *SIZES[seed % 3]) for seed in range(9)]
    thresholds = [0.0, 0.5, 0.55]
    requests = [TaskRequest([image], {"threshold": thresholds[index % 3]}) for index, image in enumerate(images)]
    requests.append(TaskRequest(images[:2], {}, single=False))  # the pipeline's default threshold, 0.5
    passes = counting_passes(runner, monkeypatch)
    answers = runner.run(requests)
    assert sorted(passes) == [3, 4, 4]  # three shapes; the list's two images join theirs
    pipe = reference(models["object-detection"], "object-detection")
    for index, image in enumerate(images):
        expected = pipe(image, threshold=thresholds[index % 3])
        assert hf_vision_models.same_answer(answers[index], expected), index
    assert hf_vision_models.same_answer(answers[9], pipe(images[0])) and hf_vision_models.same_answer(
        answers[10], pipe(images[1])
    )
    assert {len(answer) for answer in answers[:9]} != {10}  # the thresholds kept some boxes and not others
    assert set(answers[0][0]) == {"score", "label", "box"} and set(answers[0][0]["box"]) == {
        "xmin",
        "ymin",
        "xmax",
        "ymax",
    }


def test_segments_of_images_of_any_size_share_one_pass_with_masks_as_png(
    runners: dict[str, TaskRunner], models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = runners["image-segmentation"]
    images = [hf_vision_models.image(seed, *SIZES[seed % 3]) for seed in range(6)]
    parameters: list[dict[str, Any]] = [{}, {"subtask": "semantic"}, {"threshold": 0.5, "mask_threshold": 0.2}] * 2
    passes = counting_passes(runner, monkeypatch)
    answers = runner.run([TaskRequest([image], own) for image, own in zip(images, parameters, strict=True)])
    assert passes == [6]
    pipe = reference(models["image-segmentation"], "image-segmentation")
    for image, own, answer in zip(images, parameters, answers, strict=True):
        assert hf_vision_models.same_answer(answer, pipe(image, **own))
        assert all(
            hf_vision_models.mask_pixels(segment["mask"]).shape == (image.height, image.width) for segment in answer
        )
        assert all(segment["score"] is None for segment in answer)  # semantic segments have no score


def test_zero_shot_images_and_all_their_labels_share_one_pass(
    runners: dict[str, TaskRunner], models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests with different labels (some shared, some a word longer) and templates: one pass, and each image is
    scored against its own labels as the pipeline scores them."""
    runner = runners["zero-shot-image-classification"]
    labels = [["cat", "dog"], ["a car on the road", "cat"], ["bird"], ["dog", "cat", "the capital of france"]]
    templates = [None, "{}", "a picture of {}", None]
    requests, expected_calls = [], []
    for index in range(8):
        image = hf_vision_models.image(index, *SIZES[index % 3])
        own: dict[str, Any] = {"candidate_labels": labels[index % 4]}
        if templates[index % 4] is not None:
            own["hypothesis_template"] = templates[index % 4]
        requests.append(TaskRequest([image], own))
        expected_calls.append((image, own))
    passes = counting_passes(runner, monkeypatch)
    answers = runner.run(requests)
    assert passes == [8]
    pipe = reference(models["zero-shot-image-classification"], "zero-shot-image-classification")
    for (image, own), answer in zip(expected_calls, answers, strict=True):
        assert hf_vision_models.same_answer(answer, pipe(image, **own))
    assert [item["label"] for item in answers[2]] == ["bird"] and answers[2][0]["score"] == pytest.approx(1.0)


def test_each_distinct_label_text_is_computed_once(
    runners: dict[str, TaskRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = runners["zero-shot-image-classification"]._pipeline
    image = hf_vision_models.image(1)
    rows = [
        hf_vision._prepare(pipeline, image, {"candidate_labels": labels})
        for labels in (["cat", "dog"], ["the capital of france", "cat"], ["dog"])
    ]
    texts: list[int] = []
    forward = pipeline.forward

    def counted(inputs: Any) -> Any:
        texts.append(int(inputs["text_inputs"][0]["input_ids"].shape[0]))
        return forward(inputs)

    monkeypatch.setattr(pipeline, "forward", counted)
    outputs = hf_vision._zero_shot_pass(pipeline, rows)
    assert texts == [3]  # cat, dog and the capital of france, whatever each was padded to in its request
    assert [tuple(output["logits"].shape) for output in outputs] == [(1, 2), (1, 2), (1, 1)]


@pytest.mark.parametrize(
    ("task", "parameters", "fragment"),
    [
        ("object-detection", {"threshold": "high"}, "threshold must be a number"),
        ("object-detection", {"threshold": True}, "threshold must be a number"),
        ("object-detection", {"top_k": 3}, "not ['top_k']"),
        ("object-detection", {"timeout": 3}, "not ['timeout']"),
        ("image-segmentation", {"subtask": "everything"}, "subtask must be one of"),
        ("image-segmentation", {"overlap_mask_area_threshold": float("nan")}, "must be a number"),
        ("zero-shot-image-classification", {}, "candidate_labels"),
        ("zero-shot-image-classification", {"candidate_labels": "cat,dog"}, "list of strings"),
        ("zero-shot-image-classification", {"candidate_labels": []}, "non-empty"),
        ("zero-shot-image-classification", {"candidate_labels": ["a", 2]}, "list of strings"),
        ("zero-shot-image-classification", {"candidate_labels": ["a"], "hypothesis_template": 1}, "template"),
        # Every distinct label is a row of one pass of the text model, each filled into the template first.
        ("zero-shot-image-classification", {"candidate_labels": ["a"] * 4097}, "at most 4096"),
        ("zero-shot-image-classification", {"candidate_labels": ["a"], "hypothesis_template": "{:99999999}"}, "spec"),
        (
            "zero-shot-image-classification",
            {"candidate_labels": ["a"] * 9, "hypothesis_template": "{}" * 10**6},
            "char",
        ),
    ],
)
def test_bad_parameters_are_refused_naming_what_is_wrong(task: str, parameters: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        hf_vision.check_parameters(task, parameters)
    assert fragment in str(refused.value)


def test_what_the_model_cannot_do_is_refused_before_any_pass(
    runners: dict[str, TaskRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    segmenter = runners["image-segmentation"]
    passes = counting_passes(segmenter, monkeypatch)
    image = hf_vision_models.image(0)
    with pytest.raises(InvalidInput, match="does not segment by subtask 'panoptic'; it does \\['semantic'\\]"):
        segmenter.run([TaskRequest([image]), TaskRequest([image], {"subtask": "panoptic"})])
    zero_shot = runners["zero-shot-image-classification"]
    zero_passes = counting_passes(zero_shot, monkeypatch)
    long_label = " ".join(["the capital of france"] * 20)
    with pytest.raises(InvalidInput, match="reads at most 64"):
        zero_shot.run([TaskRequest([image], {"candidate_labels": [long_label]})])
    assert passes == [] and zero_passes == []


def test_the_task_comes_from_the_architecture_and_clip_loads_its_tokenizer(models: dict[str, Path]) -> None:
    for task, path in models.items():
        assert hf_loading.resolve_task(path, None, None) == task
    clip = hf_loading.load(models["zero-shot-image-classification"], "zero-shot-image-classification", False)
    assert clip.tokenizer is not None and clip.image_processor is not None
    segmenter = hf_loading.load(models["image-segmentation"], "image-segmentation", False)
    assert type(segmenter.model).__name__ == "SegformerForSemanticSegmentation"


def test_images_come_as_the_body_or_base64_in_json() -> None:
    picture = hf_vision_models.image(2, 40, 30)
    body = hf_requests.decode(hf_vision_models.encoded(picture), "image/png", "object-detection")
    assert body.single and body.inputs[0].size == (40, 30) and body.parameters == {}
    encoded = hf_vision_models.base64_image(picture)
    listed = hf_requests.decode(f'{{"inputs": ["{encoded}", "{encoded}"]}}', "application/json", "image-segmentation")
    assert not listed.single and len(listed.inputs) == 2 and listed.inputs[1].size == (40, 30)
    with pytest.raises(InvalidInput, match="image-segmentation takes an image body"):
        hf_requests.decode('{"inputs": 3}', "application/json", "image-segmentation")
    with pytest.raises(InvalidInput, match="base64"):
        hf_requests.decode('{"inputs": "http://example.com/cat.png"}', "application/json", "object-detection")


def test_a_segmenter_unpickled_in_another_process_reads_its_hidden_states_once_placed(models: dict[str, Path]) -> None:
    """transformers registers what a model class can capture when a model is built; a device host unpickles models
    built in a loader, so ``place`` registers them again (else SegFormer's head gets no hidden states)."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    loaded = hf_loading.load(models["image-segmentation"], "image-segmentation", False)
    for module in loaded.model.modules():  # as in a process that never built one
        _CAN_RECORD_REGISTRY.pop(str(module.__class__), None)
    runner = TaskRunner(loaded.place(torch.device("cpu")), torch.device("cpu"))
    [answer] = runner.run([TaskRequest([hf_vision_models.image(0)])])
    assert answer and {"label", "mask", "score"} == set(answer[0])


def test_detr_panoptic_segments_by_each_subtask_in_a_pass_per_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DETR's panoptic head (AutoModelForImageSegmentation), asked for panoptic, instance and semantic segments by
    requests sharing passes. A lone image's masks are the pipeline's exactly; in a batch a mask pixel whose
    probability is at its threshold within float rounding may go the other way, so a few may differ."""
    import numpy as np

    path = hf_vision_models.detr_panoptic(tmp_path / "panoptic")
    assert hf_loading.resolve_task(path, None, None) == "image-segmentation"
    cpu = torch.device("cpu")
    loaded = hf_loading.load(path, "image-segmentation", False)
    assert type(loaded.model).__name__ == "DetrForSegmentation"
    runner = TaskRunner(loaded.place(cpu), cpu)
    pipe = reference(path, "image-segmentation")
    images = [hf_vision_models.image(seed, *SIZES[seed % 2]) for seed in range(6)]
    subtasks: list[dict[str, Any]] = [{}, {"subtask": "instance", "threshold": 0.3}, {"subtask": "semantic"}]
    subtasks.append({"subtask": "panoptic", "threshold": 0.2, "overlap_mask_area_threshold": 0.1})
    [alone] = runner.run([TaskRequest([images[0]])])
    assert hf_vision_models.same_answer(alone, pipe(images[0]))
    passes = counting_passes(runner, monkeypatch)
    answers = runner.run([TaskRequest([image], subtasks[index % 4]) for index, image in enumerate(images)])
    assert sorted(passes) == [3, 3]
    for index, (image, answer) in enumerate(zip(images, answers, strict=True)):
        expected = pipe(image, **subtasks[index % 4])
        assert [(item["label"], item["score"] is None) for item in answer] == [
            (item["label"], item["score"] is None) for item in expected
        ]
        for mine, theirs in zip(answer, expected, strict=True):
            assert mine["score"] is None or abs(mine["score"] - theirs["score"]) <= 1e-4
            differ = int((hf_vision_models.mask_pixels(mine["mask"]) != np.array(theirs["mask"])).sum())
            assert differ <= image.width * image.height // 500, (index, differ)
