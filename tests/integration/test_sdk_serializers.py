"""What the SageMaker Python SDK sends and expects: its serializers' bodies in, its deserializers' types out."""

from __future__ import annotations

import io
from collections.abc import Iterator

import model_factory
import numpy as np
import pytest
import torch
from sagemaker.deserializers import CSVDeserializer, JSONDeserializer, NumpyDeserializer
from sagemaker.serializers import CSVSerializer, JSONSerializer, NumpySerializer
from serving import RunningServer, start_server

ROWS = [[0.5, -1.0, 2.0, 0.25], [1.0, 2.0, 3.0, 4.0]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(tmp_path_factory.mktemp("sdk")) as running:
        model_factory.torchscript_model(running.model_dir("model"))
        assert running.load("model").status_code == 200
        yield running


def expected() -> np.ndarray:
    with torch.inference_mode():
        return model_factory.tiny_net(0)(torch.tensor(ROWS)).numpy()


SERIALIZERS = [JSONSerializer(), CSVSerializer(), NumpySerializer()]
DESERIALIZERS = [JSONDeserializer(), CSVDeserializer(), NumpyDeserializer()]


@pytest.mark.parametrize("serializer", SERIALIZERS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("deserializer", DESERIALIZERS, ids=lambda d: type(d).__name__)
def test_sdk_serializers_round_trip(server: RunningServer, serializer: object, deserializer: object) -> None:
    data = np.array(ROWS, dtype=np.float32) if isinstance(serializer, NumpySerializer) else ROWS
    body = serializer.serialize(data)  # type: ignore[attr-defined]
    accept = deserializer.ACCEPT[0]  # type: ignore[attr-defined]
    response = server.invoke("model", body, serializer.CONTENT_TYPE, accept)  # type: ignore[attr-defined]
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == accept
    result = deserializer.deserialize(io.BytesIO(response.content), response.headers["Content-Type"])  # type: ignore[attr-defined]
    np.testing.assert_allclose(np.array(result, dtype=np.float32), expected(), rtol=1e-5)
