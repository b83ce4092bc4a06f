"""Vision models served with no code, through the real frontend: object-detection, image-segmentation and
zero-shot-image-classification answer what the transformers pipeline answers (the AWS Hugging Face container's
contract: masks as base64 PNG), for an image body or base64 in JSON; 16 concurrent clients with mixed images and
parameters share passes and each gets its own answer; a bad request is the client's 400, alone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hf_vision_models
import pytest
import requests
from serving import RunningServer, batch_passes, borrowed

MODELS = {
    "detr": ("object-detection", hf_vision_models.detr),
    "segformer": ("image-segmentation", hf_vision_models.segformer),
    "clip": ("zero-shot-image-classification", hf_vision_models.clip),
}
LABELS = [["cat", "dog"], ["a car on the road", "cat", "bird"], ["dog"], ["the capital of france", "dog"]]
SIZES = ((48, 64), (64, 48), (40, 40), (56, 32))  # DETR gives inputs of four shapes; the others resize to one


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-vision-models")
    return {name: build(root / name) for name, (_, build) in MODELS.items()}


@pytest.fixture(scope="module")
def pipelines(models: dict[str, Path]) -> dict[str, Any]:
    """transformers' own pipelines over the same directories: the reference."""
    import transformers

    return {name: transformers.pipeline(MODELS[name][0], model=str(path)) for name, path in models.items()}


@pytest.fixture(scope="module")
def server(shared_server: RunningServer, models: dict[str, Path]) -> Iterator[RunningServer]:
    """Each model batched (16 requests to a pass at most); its task told by its architecture, as HF_TASK would."""
    with borrowed(shared_server) as running:
        for name, path in models.items():
            shutil.copytree(path, running.models / name)
            (running.models / name / "serving.properties").write_text("batch_size=16\nmax_batch_delay=50\n")
            response = running.load(name)
            assert response.status_code == 200, f"{name}: {response.text}\n{running.log_text()[-3000:]}"
        yield running


def invoke(server: RunningServer, name: str, body: Any, **kwargs: Any) -> requests.Response:
    return server.invoke(name, json.dumps(body), **kwargs)


def as_json(image: Any, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"inputs": hf_vision_models.base64_image(image), **({"parameters": parameters} if parameters else {})}


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("detr", {}),
        ("detr", {"threshold": 0.0}),
        ("segformer", {}),
        ("segformer", {"subtask": "semantic"}),
        ("clip", {"candidate_labels": ["cat", "dog", "a car on the road"]}),
        ("clip", {"candidate_labels": ["cat", "dog"], "hypothesis_template": "a drawing of {}"}),
    ],
)
def test_each_task_answers_what_the_pipeline_answers(
    server: RunningServer, pipelines: dict[str, Any], name: str, parameters: dict[str, Any]
) -> None:
    image = hf_vision_models.image(5, 56, 40)
    response = invoke(server, name, as_json(image, parameters))
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    assert hf_vision_models.same_answer(response.json(), pipelines[name](image, **parameters))
    several = invoke(server, name, {"inputs": [as_json(image)["inputs"]] * 2, "parameters": parameters})
    assert several.status_code == 200, several.text
    expected = pipelines[name](image, **parameters)
    assert len(several.json()) == 2 and all(hf_vision_models.same_answer(one, expected) for one in several.json())


@pytest.mark.parametrize(("name", "kind"), [("detr", "png"), ("segformer", "jpeg"), ("detr", "webp")])
def test_an_image_body_answers_as_the_pipeline_does(
    server: RunningServer, pipelines: dict[str, Any], name: str, kind: str
) -> None:
    import io

    from PIL import Image

    body = hf_vision_models.encoded(hf_vision_models.image(9, 64, 40), kind.upper())
    response = server.invoke(name, body, content_type=f"image/{kind}")
    assert response.status_code == 200, response.text
    assert hf_vision_models.same_answer(response.json(), pipelines[name](Image.open(io.BytesIO(body))))


def test_the_answers_have_the_aws_containers_shapes(server: RunningServer) -> None:
    image = hf_vision_models.image(3)
    [box, *_] = invoke(server, "detr", as_json(image, {"threshold": 0.0})).json()
    assert isinstance(box["score"], float) and isinstance(box["label"], str)
    assert set(box["box"]) == {"xmin", "ymin", "xmax", "ymax"} and all(isinstance(v, int) for v in box["box"].values())
    segments = invoke(server, "segformer", as_json(image)).json()
    assert all(set(segment) == {"score", "label", "mask"} and segment["score"] is None for segment in segments)
    assert hf_vision_models.mask_pixels(segments[0]["mask"]).shape == (48, 48)  # an L mask of the image's size
    labels = invoke(server, "clip", as_json(image, {"candidate_labels": ["cat", "dog"]})).json()
    assert [set(label) for label in labels] == [{"score", "label"}] * 2
    assert abs(sum(label["score"] for label in labels) - 1.0) < 1e-5
    csv = server.invoke("clip", json.dumps(as_json(image, {"candidate_labels": ["cat"]})), accept="text/csv")
    assert csv.status_code == 200 and csv.text.splitlines()[0] == "score,label"


@pytest.mark.parametrize(
    ("name", "body", "fragment"),
    [
        ("clip", {"inputs": "x"}, "base64"),
        ("clip", "image body", "candidate_labels"),
        ("clip", "json without labels", "candidate_labels"),
        ("clip", {"labels": ["cat"]}, '"inputs"'),
        ("detr", "threshold", "threshold must be a number"),
        ("detr", "unknown", "not ['top_k']"),
        ("detr", {"inputs": 3}, "object-detection takes an image body"),
        ("segformer", "panoptic", "does not segment by subtask 'panoptic'"),
    ],
)
def test_bad_input_is_the_clients_400(server: RunningServer, name: str, body: Any, fragment: str) -> None:
    image = hf_vision_models.image(1)
    if body == "image body":
        response = server.invoke(name, hf_vision_models.encoded(image), content_type="image/png")
    else:
        named = {
            "json without labels": as_json(image),
            "threshold": as_json(image, {"threshold": "high"}),
            "unknown": as_json(image, {"top_k": 2}),
            "panoptic": as_json(image, {"subtask": "panoptic"}),
        }
        response = invoke(server, name, named.get(body, body) if isinstance(body, str) else body)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["message"] and "Traceback" not in response.text


def test_a_content_type_it_does_not_read_is_415(server: RunningServer) -> None:
    response = server.invoke("detr", b"\x00\x01", content_type="application/octet-stream")
    assert response.status_code == 415, response.text


def test_sixteen_clients_with_mixed_images_and_parameters_share_passes_and_each_gets_its_own_answer(
    server: RunningServer, pipelines: dict[str, Any]
) -> None:
    """96 requests to the three models from 16 clients at once: images of four sizes, every parameter mixed, some
    requests bad. Each good one answers what the pipeline answers for its image alone; each bad one is a 400 alone."""
    cases: list[tuple[str, Any, dict[str, Any], bool]] = []  # (model, image, parameters, good)
    for index in range(32):
        image = hf_vision_models.image(100 + index, *SIZES[index % 4])
        detection = {"threshold": [0.0, 0.5, 0.55, 0.6][index % 4]} if index % 5 else {}
        segmentation = [{}, {"subtask": "semantic"}, {"mask_threshold": 0.3}][index % 3]
        zero_shot: dict[str, Any] = {"candidate_labels": LABELS[index % 4]}
        if index % 3 == 0:
            zero_shot["hypothesis_template"] = "{}"
        if index % 11 == 7:  # bad: refused as it arrives, or by the model once in a batch (no panoptic segments)
            detection, segmentation, zero_shot = {"threshold": "high"}, {"subtask": "panoptic"}, {}
        good = index % 11 != 7
        cases += [("detr", image, detection, good), ("segformer", image, segmentation, good)]
        cases.append(("clip", image, zero_shot, good))
    before = {name: batch_passes(server, name) for name in MODELS}

    def ask(case: tuple[str, Any, dict[str, Any], bool]) -> requests.Response:
        name, image, parameters, _ = case
        return invoke(server, name, as_json(image, parameters))

    with ThreadPoolExecutor(16) as clients:
        responses = list(clients.map(ask, cases))
    for (name, image, parameters, good), response in zip(cases, responses, strict=True):
        if not good:
            assert response.status_code == 400 and "Traceback" not in response.text, (name, response.text)
            continue
        assert response.status_code == 200, (name, parameters, response.text)
        assert hf_vision_models.same_answer(response.json(), pipelines[name](image, **parameters)), (name, parameters)
    for name in MODELS:
        passes, answered = (now - then for now, then in zip(batch_passes(server, name), before[name], strict=True))
        assert answered >= 29 and passes < answered, (name, passes, answered)  # requests shared passes
