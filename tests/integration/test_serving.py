"""The serving core end to end: the real entrypoint, the real MMS frontend, real TorchScript and state-dict models."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import model_factory
import numpy as np
import pytest
import torch
from serving import RunningServer, alive, borrowed, invoke_many, is_stub, npy, wait_until

ROWS = [[0.5, -1.0, 2.0, 0.25], [1.0, 2.0, 3.0, 4.0]]


@pytest.fixture(scope="module")
def server(shared_server: RunningServer) -> Iterator[RunningServer]:
    with borrowed(shared_server) as running:
        models = running.models
        model_factory.torchscript_model(models / "torchscript")
        model_factory.state_dict_model(models / "state_dict", seed=1)
        model_factory.transform_model(models / "transform", seed=2)
        model_factory.context_model(models / "context")
        model_factory.user_error_model(models / "user_error")
        for name in ("torchscript", "state_dict", "transform", "context", "user_error"):
            response = running.load(name)
            assert response.status_code == 200, response.text
        yield running


def expected(seed: int, rows: list[list[float]]) -> np.ndarray:
    """The same model run in-process: what the server must answer."""
    with torch.inference_mode():
        return model_factory.tiny_net(seed)(torch.tensor(rows, dtype=torch.float32)).numpy()


def test_describe_reports_the_model_and_its_workers(server: RunningServer) -> None:
    response = server.describe("torchscript")
    assert response.status_code == 200
    description = response.json()
    assert description["modelName"] == "torchscript"
    assert description["modelUrl"] == str(server.model_dir("torchscript"))
    assert [worker["status"] for worker in description["workers"]] == ["READY"]


def test_torchscript_json_in_json_out_matches_in_process_model(server: RunningServer) -> None:
    response = server.invoke("torchscript", json.dumps(ROWS), accept="application/json")
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    np.testing.assert_allclose(np.array(response.json()), expected(0, ROWS), rtol=1e-5)


def test_torchscript_csv_in_csv_out(server: RunningServer) -> None:
    body = "\n".join(",".join(str(v) for v in row) for row in ROWS)
    response = server.invoke("torchscript", body, content_type="text/csv", accept="text/csv")
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/csv")
    got = np.loadtxt(io.StringIO(response.text), delimiter=",", ndmin=2)
    np.testing.assert_allclose(got, expected(0, ROWS), rtol=1e-5)


def test_torchscript_npy_in_npy_out(server: RunningServer) -> None:
    body = npy(np.array(ROWS, dtype=np.float32))
    response = server.invoke("torchscript", body, "application/x-npy", accept="application/x-npy")
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == "application/x-npy"
    got = np.load(io.BytesIO(response.content))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected(0, ROWS), rtol=1e-5)


@pytest.mark.parametrize(
    ("accept", "content_type"),
    [
        ("text/csv;q=0.5, application/x-npy;q=0.9", "application/x-npy"),
        ("application/xml, text/*", "text/csv"),
        ("*/*", "application/json"),
        ("application/json; charset=utf-8", "application/json"),
    ],
)
def test_accept_header_negotiation(server: RunningServer, accept: str, content_type: str) -> None:
    response = server.invoke("torchscript", json.dumps(ROWS), accept=accept)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == content_type


def test_state_dict_model_with_aws_style_script(server: RunningServer) -> None:
    response = server.invoke("state_dict", json.dumps({"inputs": ROWS}), accept="application/json")
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(np.array(response.json()["predictions"]), expected(1, ROWS), rtol=1e-5)


def test_transform_fn_answers_its_own_content_type(server: RunningServer) -> None:
    response = server.invoke("transform", json.dumps(ROWS))
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == "application/vnd.argmax+json"
    assert response.json() == {"argmax": expected(2, ROWS).argmax(axis=-1).tolist()}


def test_context_reaches_user_functions(server: RunningServer) -> None:
    response = server.invoke(
        "context",
        b"{}",
        headers={"X-Amzn-SageMaker-Custom-Attributes": "tenant=a,trace=1"},
    )
    assert response.status_code == 200, response.text
    seen = response.json()
    assert seen["model_name"] == "context"
    assert seen["model_dir"] == seen["system_model_dir"] == str(server.model_dir("context"))
    assert seen["gpu_id"] is None and seen["system_gpu_id"] is None  # no GPU on this machine
    assert seen["device"] == "cpu"
    assert seen["batch_size"] == 1
    assert seen["custom_attributes"] == seen["legacy_custom_attributes"] == "tenant=a,trace=1"
    assert seen["request_id"]
    assert seen["content_type"] == "application/json"


def test_list_pages_with_limit_and_next_page_token(server: RunningServer) -> None:
    import requests

    names: list[str] = []
    token = None
    for _ in range(10):
        params = {"limit": 2, **({"next_page_token": token} if token else {})}
        page = requests.get(f"{server.url}/models", params=params, timeout=10)
        assert page.status_code == 200
        body = page.json()
        assert len(body["models"]) <= 2
        names += [model["modelName"] for model in body["models"]]
        assert all(model["modelUrl"] for model in body["models"])
        token = body.get("nextPageToken")
        if not token:
            break
    assert {"torchscript", "state_dict", "transform", "context", "user_error"} <= set(names)
    assert len(names) == len(set(names))


def test_second_load_of_a_name_answers_409(server: RunningServer) -> None:
    response = server.load("torchscript")
    assert response.status_code == 409


def test_unknown_model_answers_404(server: RunningServer) -> None:
    assert server.invoke("nope", "[]").status_code == 404
    assert server.describe("nope").status_code == 404
    assert server.unload("nope").status_code == 404


@pytest.mark.parametrize(
    ("body", "content_type", "accept", "status"),
    [
        ("[[1, 2, 3", "application/json", None, 400),
        ('{"rows": 1}', "application/json", None, 400),
        ("1,2,x,4", "text/csv", None, 400),
        (b"\x93NUMPY garbage", "application/x-npy", None, 400),
        ("", "application/json", None, 400),
        (b"\xff\xfe[1]", "application/json", None, 400),
        ("[[1,2,3,4]]", "application/xml", None, 415),
        ("[[1,2,3,4]]", "application/json", "application/xml", 406),
        ("[[1,2,3,4]]", "application/json", "application/json;q=0", 406),
    ],
)
def test_bad_requests_get_a_clear_json_error(
    server: RunningServer, body: str | bytes, content_type: str, accept: str | None, status: int
) -> None:
    response = server.invoke("torchscript", body, content_type, accept)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["code"] == status
    assert error["type"] and error["message"] and error["request_id"]
    assert "Traceback" not in response.text
    # The model is unharmed.
    assert server.invoke("torchscript", json.dumps(ROWS)).status_code == 200


def test_user_code_picks_its_own_4xx(server: RunningServer) -> None:
    response = server.invoke("user_error", json.dumps({"raise": "quota"}))
    assert response.status_code == 429
    assert response.json()["message"] == "tenant over quota"


def test_failure_inside_user_code_is_500_without_traceback(server: RunningServer) -> None:
    response = server.invoke("user_error", json.dumps({"raise": "bug"}))
    assert response.status_code == 500
    error = response.json()
    assert error["type"] == "KeyError"
    assert "transform_fn" in error["message"] and "missing_feature" in error["message"]
    assert "Traceback" not in response.text
    assert wait_until(lambda: "Traceback" in server.log_text(), 5)


def test_failing_model_fn_fails_load_and_others_keep_serving(server: RunningServer) -> None:
    model_factory.failing_model(server.model_dir("broken"))
    response = server.load("broken")
    assert response.status_code == 500
    assert wait_until(lambda: "weights are corrupt: checksum mismatch" in server.log_text(), 5)
    assert server.describe("broken").status_code == 404  # not left half-registered
    assert server.invoke("torchscript", json.dumps(ROWS)).status_code == 200
    model_factory.torchscript_model(server.model_dir("broken"))  # fixed artifacts load under the same name
    (server.model_dir("broken") / "code" / "inference.py").unlink()
    assert server.load("broken").status_code == 200
    assert server.unload("broken").status_code == 200


def test_unload_removes_the_model_and_its_processes(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("temporary"))
    assert server.load("temporary").status_code == 200
    assert server.invoke("temporary", json.dumps(ROWS)).status_code == 200
    processes = server.backend_processes("temporary")
    assert [is_stub(process) for process in processes] == [True]  # its one process: the device host serves it
    assert server.unload("temporary").status_code == 200
    assert server.invoke("temporary", json.dumps(ROWS)).status_code == 404
    assert wait_until(lambda: not alive(processes), 10)
    assert wait_until(lambda: "model=temporary unloaded from the device host" in server.log_text(), 10)


def test_concurrent_requests_all_succeed(server: RunningServer) -> None:
    assert len(invoke_many(server, "torchscript", json.dumps(ROWS), 40)) == 40  # every answer a 200


def test_batch_items_get_their_own_status(server: RunningServer) -> None:
    """MMS batches concurrent requests; a bad item must not fail its neighbours."""
    model_factory.torchscript_model(server.model_dir("batched"))
    assert server.load("batched", batch_size=4, max_batch_delay=500).status_code == 200
    good = json.dumps(ROWS)
    csv = "1,2,3,4"
    bodies = [(good, "application/json"), ("[[1,2", "application/json"), (csv, "text/csv"), (good, "text/plain")]
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda b: server.invoke("batched", b[0], b[1]), bodies))
    assert [r.status_code for r in responses] == [200, 400, 200, 415]
    np.testing.assert_allclose(np.array(responses[0].json()), expected(0, ROWS), rtol=1e-5)
    np.testing.assert_allclose(np.array(responses[2].json()), expected(0, [[1, 2, 3, 4]]), rtol=1e-5)
    assert server.unload("batched").status_code == 200


def test_batches_reach_user_code_with_per_item_headers(server: RunningServer) -> None:
    model_factory.context_model(server.model_dir("batched_context"))
    assert server.load("batched_context", batch_size=4, max_batch_delay=1000).status_code == 200

    def call(index: int) -> dict[str, object]:
        response = server.invoke(
            "batched_context",
            b"{}",
            content_type=f"application/x-item-{index}",
            headers={"X-Amzn-SageMaker-Custom-Attributes": f"item={index}"},
        )
        assert response.status_code == 200, response.text
        return dict(response.json())

    with ThreadPoolExecutor(4) as pool:
        seen = list(pool.map(call, range(4)))
    assert [s["content_type"] for s in seen] == [f"application/x-item-{i}" for i in range(4)]
    assert [s["custom_attributes"] for s in seen] == [f"item={i}" for i in range(4)]
    assert all(s["batch_size"] == 4 for s in seen)
    assert max(int(str(s["batch_items"])) for s in seen) > 1  # the frontend really batched them
    assert server.unload("batched_context").status_code == 200


@pytest.mark.parametrize(
    ("body", "cause"),
    [("{not json", "JSONDecodeError"), ('{"rows": [[1, 2, 3, 4]]}', "KeyError: 'inputs'")],
    ids=["malformed", "missing-key"],
)
def test_an_aws_style_input_fn_that_cannot_decode_answers_400(server: RunningServer, body: str, cause: str) -> None:
    """The AWS-style inference.py, unchanged: json.loads(request_body)["inputs"] raising is the client's error."""
    response = server.invoke("state_dict", body, accept="application/json")
    assert response.status_code == 400, response.text
    assert f"input_fn raised {cause}" in response.json()["message"]


SIZED_ANSWER_SCRIPT = """
import json


def model_fn(model_dir):
    return None


def input_fn(request_body, content_type):
    return json.loads(request_body)


def predict_fn(data, model):
    return data


def output_fn(prediction, accept):
    return "x" * prediction["length"], accept
"""


def test_a_large_answer_after_many_small_ones_is_answered_whatever_its_content_type(server: RunningServer) -> None:
    """MMS's frontend reads an answer in pieces sized by the answers before (a multiple of 16 bytes), and takes a piece
    cut inside a request's header map or status as a corrupt answer (the worker dies: 500 "Worker died."). Sixteen
    Content-Type lengths in a row put the status at each place a piece can end."""
    model_factory.write_code(server.model_dir("sized"), SIZED_ANSWER_SCRIPT)
    assert server.load("sized").status_code == 200
    for length in range(36, 52):
        for _ in range(80):  # the frontend's next read shrinks to about the size of these
            small = server.invoke("sized", json.dumps({"length": 1}), accept="text/csv")
            assert small.status_code == 200, small.text
            assert small.headers["Content-Type"] == "text/csv"
        content_type = "application/x-" + "a" * (length - len("application/x-"))
        large = server.invoke("sized", json.dumps({"length": 3000}), accept=content_type)
        assert large.status_code == 200, f"Content-Type of {length} characters: {large.text}"
        assert large.headers["Content-Type"] == content_type
        assert large.text == "x" * 3000
    assert server.unload("sized").status_code == 200
