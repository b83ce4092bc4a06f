"""What the SageMaker Python SDK sends and expects: its serializers' bodies in, its deserializers' types out.

SDK v3 (``sagemaker.core``, in the project venv) runs here; SDK v2, which existing notebooks use through
``Predictor(target_model=...)``, cannot share a venv with v3 and runs in ``.sdk-v2-venv/`` (``make install`` makes
it) through ``tests/sdk/v2_round_trip.py``. Both go through the real MMS frontend over HTTP.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import model_factory
import numpy as np
import pytest
import torch
from sagemaker.core.deserializers import CSVDeserializer, JSONDeserializer, NumpyDeserializer
from sagemaker.core.serializers import CSVSerializer, JSONSerializer, NumpySerializer
from serving import RunningServer, borrowed

REPO = Path(__file__).resolve().parents[2]
SDK_V2_PYTHON = Path(os.environ.get("MME_SDK_V2_PYTHON", REPO / ".sdk-v2-venv" / "bin" / "python"))
ROWS = [[0.5, -1.0, 2.0, 0.25], [1.0, 2.0, 3.0, 4.0]]
MODEL = "sdk-model"
PAIRS = [(s, d) for s in ("JSONSerializer", "CSVSerializer", "NumpySerializer") for d in ("JSON", "CSV", "Numpy")]


@pytest.fixture(scope="module")
def server(shared_server: RunningServer) -> Iterator[RunningServer]:
    with borrowed(shared_server) as running:
        model_factory.torchscript_model(running.model_dir(MODEL))
        assert running.load(MODEL).status_code == 200
        yield running


def expected() -> np.ndarray:
    with torch.inference_mode():
        return model_factory.tiny_net(0)(torch.tensor(ROWS)).numpy()


SERIALIZERS = {
    "JSONSerializer": JSONSerializer(),
    "CSVSerializer": CSVSerializer(),
    "NumpySerializer": NumpySerializer(),
}
DESERIALIZERS = {"JSON": JSONDeserializer(), "CSV": CSVDeserializer(), "Numpy": NumpyDeserializer()}


@pytest.mark.parametrize(("serializer_name", "deserializer_name"), PAIRS)
def test_sdk_v3_serializers_round_trip(server: RunningServer, serializer_name: str, deserializer_name: str) -> None:
    serializer, deserializer = SERIALIZERS[serializer_name], DESERIALIZERS[deserializer_name]
    data = np.array(ROWS, dtype=np.float32) if isinstance(serializer, NumpySerializer) else ROWS
    body = serializer.serialize(data)
    accept = deserializer.ACCEPT[0]
    response = server.invoke(MODEL, body, serializer.CONTENT_TYPE, accept)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == accept
    result = deserializer.deserialize(io.BytesIO(response.content), response.headers["Content-Type"])
    np.testing.assert_allclose(np.array(result, dtype=np.float32), expected(), rtol=1e-5)


@pytest.fixture(scope="module")
def v2_answers(server: RunningServer) -> dict[tuple[str, str], dict[str, Any]]:
    """Every v2 serializer and deserializer pair, run once by the v2 venv against the server."""
    if not SDK_V2_PYTHON.is_file():
        pytest.fail(f"no SDK v2 venv at {SDK_V2_PYTHON}: `make install` creates it (or set MME_SDK_V2_PYTHON)")
    completed = subprocess.run(
        [str(SDK_V2_PYTHON), str(REPO / "tests" / "sdk" / "v2_round_trip.py"), f"{server.url}/models/{MODEL}/invoke"]
        + [json.dumps(ROWS)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    results = [line.removeprefix("RESULT ") for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    lines = [json.loads(result) for result in results]
    return {(line["serializer"], line["deserializer"].removesuffix("Deserializer")): line for line in lines}


@pytest.mark.parametrize(("serializer_name", "deserializer_name"), PAIRS)
def test_sdk_v2_serializers_round_trip(
    v2_answers: dict[tuple[str, str], dict[str, Any]], serializer_name: str, deserializer_name: str
) -> None:
    answer = v2_answers[(serializer_name, deserializer_name)]
    assert answer["status"] == 200, answer
    assert answer["content_type"] == DESERIALIZERS[deserializer_name].ACCEPT[0]
    np.testing.assert_allclose(np.array(answer["result"], dtype=np.float32), expected(), rtol=1e-5)
