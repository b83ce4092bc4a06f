"""CloudWatch's Embedded Metric Format, as its specification states it, for checking the lines the container prints.

The schema is the document structure of the specification (CloudWatch_Embedded_Metric_Format_Specification in the
CloudWatch user guide): a root with ``_aws``; its ``Timestamp`` in milliseconds and ``CloudWatchMetrics``, an array of
MetricDirective objects (``Namespace``, ``Dimensions``: arrays of at most 30 dimension keys, ``Metrics``: at most 100
MetricDefinition objects, each a ``Name`` with an optional ``Unit`` and ``StorageResolution``); objects the
specification defines hold no other members. What a schema cannot say is checked after it: every dimension key and
metric name is a member of the root (a "target member"), a dimension's value a string, a metric's a number or an array
of at most 100 numbers.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

UNITS = [
    "Seconds",
    "Microseconds",
    "Milliseconds",
    "Bytes",
    "Kilobytes",
    "Megabytes",
    "Gigabytes",
    "Terabytes",
    "Bits",
    "Kilobits",
    "Megabits",
    "Gigabits",
    "Terabits",
    "Percent",
    "Count",
    "Bytes/Second",
    "Kilobytes/Second",
    "Megabytes/Second",
    "Gigabytes/Second",
    "Terabytes/Second",
    "Bits/Second",
    "Kilobits/Second",
    "Megabits/Second",
    "Gigabits/Second",
    "Terabits/Second",
    "Count/Second",
    "None",
]

EMF_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "Root node",
    "type": "object",
    "required": ["_aws"],
    "properties": {
        "_aws": {
            "title": "Metadata",
            "type": "object",
            "required": ["Timestamp", "CloudWatchMetrics"],
            "properties": {
                "Timestamp": {"type": "integer", "minimum": 0},
                "CloudWatchMetrics": {
                    "type": "array",
                    "items": {
                        "title": "MetricDirective",
                        "type": "object",
                        "required": ["Namespace", "Dimensions", "Metrics"],
                        "additionalProperties": False,
                        "properties": {
                            "Namespace": {"type": "string", "minLength": 1, "maxLength": 255},
                            "Dimensions": {
                                "type": "array",
                                "items": {
                                    "title": "DimensionSet",
                                    "type": "array",
                                    "maxItems": 30,
                                    "items": {"title": "DimensionReference", "type": "string", "minLength": 1},
                                },
                            },
                            "Metrics": {
                                "type": "array",
                                "maxItems": 100,
                                "items": {
                                    "title": "MetricDefinition",
                                    "type": "object",
                                    "required": ["Name"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "Name": {"type": "string", "minLength": 1, "maxLength": 1024},
                                        "Unit": {"type": "string", "enum": UNITS},
                                        "StorageResolution": {"type": "integer", "enum": [1, 60]},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        }
    },
}


def check_emf(line: str) -> dict[str, Any]:
    """The line's document, once it is one EMF document by the specification; raises AssertionError or
    ``jsonschema.ValidationError`` saying what is wrong."""
    assert line == line.strip() and "\n" not in line, "an EMF log event is the JSON alone"
    document = json.loads(line)
    jsonschema.validate(document, EMF_SCHEMA, cls=jsonschema.Draft7Validator)
    for directive in document["_aws"]["CloudWatchMetrics"]:
        for dimension_set in directive["Dimensions"]:
            for key in dimension_set:
                assert isinstance(document.get(key), str), f"dimension {key!r} needs a string target member"
        for metric in directive["Metrics"]:
            value = document.get(metric["Name"])
            values = value if isinstance(value, list) else [value]
            assert len(values) <= 100, f"metric {metric['Name']!r} has more than 100 values"
            assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in values), (
                f"metric {metric['Name']!r} needs a numeric target member, not {value!r}"
            )
    return document


def emf_documents(text: str) -> list[dict[str, Any]]:
    """The EMF documents among ``text``'s lines (a server's output, say), each checked."""
    return [check_emf(line) for line in text.splitlines() if line.startswith("{") and '"_aws"' in line]
