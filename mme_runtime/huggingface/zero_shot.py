"""Zero-shot classification's requests, checked before they join a batch: ``candidate_labels`` (a
list, or one string of comma-separated labels, as the pipeline splits it), ``multi_label`` and
``hypothesis_template``. What the task runs is transformers' own zero-shot pipeline
(``tasks.py``): each (text, label) pair is one row, and the rows of every request of a batch share
the padded forward passes; the pipeline's postprocessing scores each text's labels.

A request at fault here answers 400 alone, where inside the pipeline its error would have failed
the whole batch's pass first (the batcher then splits it to find whose it was).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from mme_runtime.base.errors import InvalidInput

TASK = "zero-shot-classification"
# (text, label) pairs of one request, each a row of the model: 6 MB of JSON could name millions (a
# thousand one-letter texts times a thousand labels), tokenized in the device's shared process and
# run in passes its batch waits on.
MAX_PAIRS = 10_000
# Characters the tokenizer reads for one request: each pair's text and hypothesis are tokenized
# alone (1.5 million characters a second on one core here), so a 3 MB text times a thousand labels
# was an hour of it.
MAX_CHARACTERS = 10_000_000


def check_parameters(parameters: dict[str, Any], texts: Sequence[str] = ("",)) -> None:
    """Raises ``InvalidInput`` naming what the request (for ``texts``) got wrong."""
    if "candidate_labels" not in parameters:
        raise InvalidInput(
            'zero-shot-classification needs "parameters": {"candidate_labels": ["label", ...]} (or '
            '"label,label")'
        )
    labels = parameters["candidate_labels"]
    if isinstance(labels, str):
        labels = [label.strip() for label in labels.split(",") if label.strip()]
    if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
        raise InvalidInput(
            "candidate_labels must be a list of strings or one comma-separated string, not "
            f"{labels!r}"
        )
    if not labels:
        raise InvalidInput("candidate_labels names no label")
    if len(texts) * len(labels) > MAX_PAIRS:
        raise InvalidInput(
            f"{len(texts)} texts times {len(labels)} candidate labels make "
            f"{len(texts) * len(labels)} (text, label) pairs, each a row of the model's passes; at "
            f"most {MAX_PAIRS} in one request"
        )
    multi_label = parameters.get("multi_label", False)
    if not isinstance(multi_label, bool):
        # the pipeline reads any truthy value as true: "false" would be true
        raise InvalidInput(f"multi_label must be true or false, not {multi_label!r}")
    template = parameters.get("hypothesis_template", "This example is {}.")
    if not isinstance(template, str):
        raise InvalidInput(f"hypothesis_template must be a string, not {template!r}")
    hypotheses = hypothesis_characters(template, labels)
    characters = sum(len(text) for text in texts) * len(labels) + len(texts) * hypotheses
    if characters > MAX_CHARACTERS:
        raise InvalidInput(
            f"each text is read once per label with its hypothesis: {characters} characters in "
            f"all, at most {MAX_CHARACTERS} in one request"
        )
    try:
        filled = template.format(labels[0])
    except (IndexError, KeyError, ValueError, AttributeError, TypeError) as exc:
        raise InvalidInput(
            f"hypothesis_template {template!r} cannot be filled with a label: {exc}"
        ) from exc
    if filled == template:
        raise InvalidInput(f"hypothesis_template {template!r} has no {{}} where the label goes")


def hypothesis_characters(template: str, labels: list[str]) -> int:
    """The characters of every label's hypothesis, counted before any is filled: a format spec
    (``"{:100000000}"`` pads each hypothesis to 100 MB) is refused. The image zero-shot task fills
    its templates alike (``vision``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InvalidInput(
            f"hypothesis_template {template!r} cannot be filled with a label: {exc}"
        ) from exc
    if any(spec or conversion for _, name, spec, conversion in parsed if name is not None):
        raise InvalidInput(
            f"hypothesis_template {template!r} may hold {{}} for the label, with no conversion or "
            "format spec"
        )
    fields = sum(name is not None for _, name, _, _ in parsed)
    return sum(len(template) + fields * len(label) for label in labels)
