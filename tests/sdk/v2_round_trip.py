"""Runs in .sdk-v2-venv/ (SageMaker Python SDK v2, which cannot share a venv with v3): what a notebook written for
v2 sends and reads back, against a running server.

    .sdk-v2-venv/bin/python tests/sdk/v2_round_trip.py URL ROWS_JSON

For every v2 serializer and deserializer pair: the serializer's body POSTed to URL (a model's invoke URL) with its
content type and the deserializer's Accept, and one line out, ``RESULT`` and JSON: the pair, the HTTP status, the
answer's content type and what the deserializer made of the body (as a nested list of floats). The SDK prints lines
of its own to stdout (its configuration notices), hence the prefix.
"""

from __future__ import annotations

import io
import json
import sys
import urllib.error
import urllib.request

import numpy as np
from sagemaker.deserializers import CSVDeserializer, JSONDeserializer, NumpyDeserializer
from sagemaker.serializers import CSVSerializer, JSONSerializer, NumpySerializer

PREFIX = "RESULT "


def main(url: str, rows: list[list[float]]) -> int:
    for serializer in (JSONSerializer(), CSVSerializer(), NumpySerializer()):
        for deserializer in (JSONDeserializer(), CSVDeserializer(), NumpyDeserializer()):
            data = np.array(rows, dtype=np.float32) if isinstance(serializer, NumpySerializer) else rows
            body = serializer.serialize(data)
            accept = deserializer.ACCEPT[0]
            encoded = body if isinstance(body, bytes) else body.encode()
            request = urllib.request.Request(url, data=encoded, method="POST")
            request.add_header("Content-Type", serializer.CONTENT_TYPE)
            request.add_header("Accept", accept)
            line = {"serializer": type(serializer).__name__, "deserializer": type(deserializer).__name__}
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    content_type = response.headers["Content-Type"]
                    result = deserializer.deserialize(io.BytesIO(response.read()), content_type)
                line.update(status=200, content_type=content_type, result=np.array(result, dtype=np.float32).tolist())
            except urllib.error.HTTPError as exc:
                line.update(status=exc.code, content_type=exc.headers.get("Content-Type"), result=None)
            print(PREFIX + json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
