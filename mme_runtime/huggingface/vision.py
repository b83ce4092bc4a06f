"""Vision tasks served with no code, over a batch of requests: object-detection, image-segmentation
and zero-shot-image-classification, answered as the AWS Hugging Face container answers them (the
transformers pipeline's answer; a segment's mask as a base64 PNG, as that container's JSON encoder
writes a PIL image).

Each image is prepared on its own by the task's pipeline, with its request's parameters, and images
whose prepared inputs have one shape share a forward pass. A processor that resizes to a fixed size
(SegFormer's, CLIP's) gives every image one shape; DETR's keeps the aspect ratio, so its images
share a pass per shape: padding them to the largest with their pixel mask changed a DETR's logits by
5e-3 in a check here (its convolutions see the padding). Zero-shot: the images of a shape and their
requests' candidate labels (each distinct label text once) go through one pass of the model, and
each image is scored against its own labels only, as the pipeline scores them.
"""

from __future__ import annotations

import base64
import io
import math
from typing import TYPE_CHECKING, Any

import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface import zero_shot

if TYPE_CHECKING:
    from mme_runtime.huggingface.requests import TaskRequest

ZERO_SHOT = "zero-shot-image-classification"
# Each task's parameters, as its transformers pipeline takes them (but "timeout", which fetches
# images from URLs).
PARAMETERS = {
    "object-detection": frozenset({"threshold"}),
    "image-segmentation": frozenset(
        {"subtask", "threshold", "mask_threshold", "overlap_mask_area_threshold"}
    ),
    ZERO_SHOT: frozenset({"candidate_labels", "hypothesis_template"}),
}
TASKS = frozenset(PARAMETERS)
NUMBERS = frozenset({"threshold", "mask_threshold", "overlap_mask_area_threshold"})
SUBTASKS = ("panoptic", "instance", "semantic")
# Set apart from the tensors a pass stacks: each row keeps its own.
ROW_KEYS = frozenset({"target_size", "candidate_labels", "text_inputs"})
# Candidate labels of one zero-shot request: every distinct label of a batch is a row of one pass of
# the text model (ImageNet's 1,000 classes fit; a few bytes each, 6 MB of JSON named millions).
MAX_LABELS = 4096


def check_parameters(task: str, parameters: dict[str, Any]) -> None:
    """What the task refuses in a request's parameters, as a 400 naming it (before the request joins
    a batch)."""
    unknown = set(parameters) - PARAMETERS[task]
    if unknown:
        raise InvalidInput(
            f"{task} takes the parameters {sorted(PARAMETERS[task])}, not {sorted(unknown)}"
        )
    for key in NUMBERS & set(parameters):
        value = parameters[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise InvalidInput(f"{key} must be a number, not {value!r}")
    if parameters.get("subtask") not in (None, *SUBTASKS):
        raise InvalidInput(
            f"subtask must be one of {list(SUBTASKS)}, not {parameters['subtask']!r}"
        )
    if task == ZERO_SHOT:
        labels = parameters.get("candidate_labels")
        if labels is None:
            raise InvalidInput(
                'zero-shot-image-classification needs "parameters": {"candidate_labels": [...]}: '
                'send the image as base64 in JSON, {"inputs": "<base64>", "parameters": '
                '{"candidate_labels": ["cat", "dog"]}}'
            )
        if (
            not isinstance(labels, list)
            or not labels
            or not all(isinstance(label, str) for label in labels)
        ):
            raise InvalidInput(
                f"candidate_labels must be a non-empty list of strings, not {labels!r}"
            )
        if len(labels) > MAX_LABELS:
            raise InvalidInput(
                f"candidate_labels names {len(labels)} labels; at most {MAX_LABELS} here"
            )
        template = parameters.get("hypothesis_template", "{}")
        if not isinstance(template, str):
            raise InvalidInput(
                "hypothesis_template must be a string such as 'This is a photo of {}.', not "
                f"{template!r}"
            )
        if zero_shot.hypothesis_characters(template, labels) > zero_shot.MAX_CHARACTERS:
            raise InvalidInput(
                f"the hypotheses of these labels hold over {zero_shot.MAX_CHARACTERS} characters"
            )


def run(pipeline: Any, requests: list[TaskRequest]) -> list[Any]:
    """Each image's answer, in order (one per input of every request). Raises ``InvalidInput`` for a
    request the model cannot answer (a subtask it lacks, a label longer than it reads), before any
    pass."""
    task = pipeline.task
    rows: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []  # each row's postprocess parameters
    for request in requests:
        check_parameters(task, request.parameters)
        _check_subtask(pipeline, request.parameters.get("subtask"))
        before, _, post = pipeline._sanitize_parameters(**request.parameters)
        for image in request.inputs:
            rows.append(_prepare(pipeline, image, before))
            after.append(post)
    if task == ZERO_SHOT:
        for row in rows:
            _check_label_length(pipeline, row)
    outputs: list[Any] = [None] * len(rows)
    for group in _shape_groups(rows).values():
        run_group = _zero_shot_pass if task == ZERO_SHOT else _pass
        for index, output in zip(
            group, run_group(pipeline, [rows[index] for index in group]), strict=True
        ):
            outputs[index] = output
    return [
        _postprocess(pipeline, output, parameters)
        for output, parameters in zip(outputs, after, strict=True)
    ]


def _check_subtask(pipeline: Any, subtask: str | None) -> None:
    """A subtask the model's image processor has no post-processing for (a semantic segmenter asked
    for panoptic segments): refused before the pass, where the pipeline would fail after it."""
    if subtask is None or hasattr(pipeline.image_processor, f"post_process_{subtask}_segmentation"):
        return
    served = [
        name
        for name in SUBTASKS
        if hasattr(pipeline.image_processor, f"post_process_{name}_segmentation")
    ]
    raise InvalidInput(f"this model does not segment by subtask {subtask!r}; it does {served}")


def _check_label_length(pipeline: Any, row: dict[str, Any]) -> None:
    text_config = getattr(pipeline.model.config, "text_config", None)
    limit = getattr(text_config, "max_position_embeddings", None)
    width = int(row["text_inputs"][0]["input_ids"].shape[-1])
    if isinstance(limit, int) and width > limit:
        raise InvalidInput(
            f"a candidate label has {width} tokens with its template; the model reads at most "
            f"{limit}"
        )


def _prepare(pipeline: Any, image: Any, parameters: dict[str, Any]) -> dict[str, Any]:
    try:
        return dict(pipeline.preprocess(image, **parameters))
    except Exception as exc:  # noqa: BLE001
        # what the processor refuses in this image is this request's fault
        raise InvalidInput(f"the image could not be prepared for the model: {exc}") from exc


def _shape_groups(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[int]]:
    """Rows by the shapes of their tensors: the rows of a group stack into one pass. Zero-shot rows
    whose label texts have no attention mask also group by their width, since padding them further
    would change them."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, row in enumerate(rows):
        key: tuple[Any, ...] = tuple(
            (name, tuple(value.shape), value.dtype)
            for name, value in sorted(row.items())
            if isinstance(value, torch.Tensor) and name not in ROW_KEYS
        )
        texts = row.get("text_inputs")
        if texts is not None and "attention_mask" not in texts[0]:
            key += (("text width", int(texts[0]["input_ids"].shape[-1])),)
        groups.setdefault(key, []).append(index)
    return groups


def _pass(pipeline: Any, rows: list[dict[str, Any]]) -> list[Any]:
    """One pass over rows of one shape, handed back row by row as a pass over each alone gives
    it."""
    if len(rows) == 1:
        return [pipeline.forward(rows[0])]
    batch: dict[str, Any] = {}
    for name, value in rows[0].items():
        if isinstance(value, torch.Tensor):
            batch[name] = torch.cat([row[name] for row in rows])
        elif isinstance(value, list):
            batch[name] = [item for row in rows for item in row[name]]
        else:
            batch[name] = value
    outputs = pipeline.forward(batch)
    split = []
    for index, row in enumerate(rows):
        own = _row(outputs, index, len(rows))
        own["target_size"] = row["target_size"]  # a segmenter's is a list of sizes: each row's own
        split.append(own)
    return split


def _zero_shot_pass(pipeline: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The images of ``rows`` and every distinct label text of theirs in one pass; each row's logits
    are its own image's against its own labels, in its order."""
    from transformers import BatchEncoding

    columns: dict[tuple[Any, ...], int] = {}
    texts: list[dict[str, torch.Tensor]] = []
    row_columns: list[list[int]] = []
    for row in rows:
        encoding = row["text_inputs"][0]
        own = []
        for label in range(int(encoding["input_ids"].shape[0])):
            text = _trimmed({name: value[label] for name, value in encoding.items()})
            key = tuple((name, tuple(value.tolist())) for name, value in sorted(text.items()))
            if key not in columns:
                columns[key] = len(texts)
                texts.append(text)
            own.append(columns[key])
        row_columns.append(own)
    pad_id = getattr(pipeline.tokenizer, "pad_token_id", None) or 0
    width = max(int(text["input_ids"].shape[0]) for text in texts)
    padded = {
        name: torch.stack(
            [_pad(text[name], width, pad_id if name == "input_ids" else 0) for text in texts]
        )
        for name in texts[0]
    }
    pixels = torch.cat([row["pixel_values"] for row in rows])
    outputs = pipeline.forward(
        {"pixel_values": pixels, "text_inputs": [BatchEncoding(padded)], "candidate_labels": None}
    )
    logits = outputs["logits"]
    return [
        {"candidate_labels": row["candidate_labels"], "logits": logits[index : index + 1, own]}
        for index, (row, own) in enumerate(zip(rows, row_columns, strict=True))
    ]


def _trimmed(text: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One label's tokens without the padding on their right (the attention mask says where it
    starts), so that a label is one text whatever the labels beside it in its request were padded
    to."""
    mask = text.get("attention_mask")
    if mask is None:
        return text
    length = int(mask.sum())
    if not bool(mask[:length].all()):  # padded on the left: kept as it is
        return text
    return {name: value[:length] for name, value in text.items()}


def _pad(value: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    return torch.cat([value, torch.full((width - value.shape[0],), fill, dtype=value.dtype)])


def _row(value: Any, index: int, rows: int) -> Any:
    """Row ``index`` of a pass's outputs over ``rows`` images, as a pass over that image alone gives
    them."""
    if isinstance(value, torch.Tensor):
        return value[index : index + 1] if value.dim() > 0 and value.shape[0] == rows else value
    if isinstance(value, dict):
        return type(value)({name: _row(item, index, rows) for name, item in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_row(item, index, rows) for item in value)
    return value


def _postprocess(pipeline: Any, output: Any, parameters: dict[str, Any]) -> Any:
    try:
        answer = pipeline.postprocess(output, **parameters)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidInput(f"the answer could not be made with these parameters: {exc}") from exc
    return [_with_png_mask(item) for item in answer] if isinstance(answer, list) else answer


def _with_png_mask(item: Any) -> Any:
    """A segment's mask (a PIL image) as the AWS container's JSON encoder writes it: a PNG, in
    base64."""
    mask = item.get("mask") if isinstance(item, dict) else None
    if mask is None or not hasattr(mask, "save"):
        return item
    buffer = io.BytesIO()
    mask.save(buffer, format="PNG")
    return {**item, "mask": base64.b64encode(buffer.getvalue()).decode("utf-8")}
