"""The CloudWatch lines of a real server: with a one-second interval, the EMF lines in the entrypoint's output add up
to exactly the requests the test made, across an UNLOAD and a re-LOAD, each line an EMF document by the
specification's schema (``emf_schema.py``)."""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.parse
from typing import Any

import model_factory
import pytest
from emf_schema import emf_documents
from serving import start_server, stop_server, wait_until

pytestmark = pytest.mark.integration

ROW = json.dumps([[0.5] * model_factory.IN_FEATURES])
INTERVAL_SECONDS = 1
RACES = 8


def total(documents: list[dict[str, Any]], metric: str, model: str | None) -> float:
    """``metric`` summed over the lines of ``model`` (None: the container's line)."""
    return sum(document.get(metric, 0) for document in documents if document.get("ModelName") == model)


def test_the_lines_count_each_request_once(tmp_path_factory: pytest.TempPathFactory) -> None:
    env = {"MME_CLOUDWATCH_METRICS_SECONDS": str(INTERVAL_SECONDS), "MME_CLOUDWATCH_NAMESPACE": "mme-test"}
    with start_server(tmp_path_factory.mktemp("cloudwatch"), env) as server:
        model_factory.torchscript_model(server.model_dir("plain"))
        model_factory.torchscript_model(server.model_dir("racing"))
        assert server.load("plain").status_code == 200
        statuses = [server.invoke("plain", ROW).status_code for _ in range(4)]
        statuses.append(server.invoke("plain", "{not json").status_code)
        assert statuses == [200, 200, 200, 200, 400]

        def lines() -> list[dict[str, Any]]:
            return emf_documents(server.log_text())

        wait_until(lambda: total(lines(), "Invocations", "plain") >= 5, 30)
        time.sleep(3 * INTERVAL_SECONDS)  # more lines, which must add nothing
        documents = lines()
        assert total(documents, "Invocations", "plain") == 5, server.log_text()[-3000:]
        assert total(documents, "Invocation4XXErrors", "plain") == 1
        assert total(documents, "Invocation5XXErrors", "plain") == 0
        assert {document["_aws"]["CloudWatchMetrics"][0]["Namespace"] for document in documents} == {"mme-test"}
        assert any("HostMemory" in document for document in documents if document.get("ModelName") == "plain")
        assert any(document.get("ModelsLoaded") == 1 for document in documents if "ModelName" not in document)

        # Two requests just before an UNLOAD, two after the model is back: each counted once.
        assert [server.invoke("plain", ROW).status_code for _ in range(2)] == [200, 200]
        assert server.unload("plain").status_code == 200
        assert server.load("plain").status_code == 200
        assert [server.invoke("plain", ROW).status_code for _ in range(2)] == [200, 200]
        wait_until(lambda: total(lines(), "Invocations", "plain") >= 9, 30)
        time.sleep(3 * INTERVAL_SECONDS)
        documents = lines()
        assert total(documents, "Invocations", "plain") == 9, server.log_text()[-3000:]
        assert total(documents, "ModelLoads", None) == 2
        assert total(documents, "ModelUnloads", None) == 1

        # A model's first request answered, and its UNLOAD right after (a kept-alive client: no
        # time between them), again and again: each request counted, no value lost.
        address = urllib.parse.urlsplit(server.url)
        with contextlib.closing(http.client.HTTPConnection(address.hostname, address.port, timeout=30)) as client:
            for _ in range(RACES):
                assert server.load("racing").status_code == 200
                for method, path, body in (("POST", "/models/racing/invoke", ROW), ("DELETE", "/models/racing", None)):
                    client.request(method, path, body, {"Content-Type": "application/json"})
                    answer = client.getresponse()
                    assert answer.status == 200, answer.read()
                    answer.read()
        # a lost count shows as fewer (more than one line per request is the checks' above)
        wait_until(lambda: total(lines(), "Invocations", "racing") >= RACES, 30)
        assert total(lines(), "Invocations", "racing") == RACES
        assert "not recorded" not in server.log_text()
        assert stop_server(server) == 0
        assert total(lines(), "Invocations", "plain") == 9  # the last lines, at the stop, repeat nothing
