"""Hostile input, crashes and readiness: a bad request hurts only itself, and a dead worker is replaced."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import model_factory
import numpy as np
import pytest
import requests
from serving import RunningServer, npy, start_server, wait_until

ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])
MAX_REQUEST_BYTES = 64 * 1024

SLOW_SCRIPT = """
import json
import time


def model_fn(model_dir):
    return None


def transform_fn(model, body, content_type, accept):
    time.sleep(json.loads(body).get("sleep", 0))
    return json.dumps({"ok": True})
"""

EXIT_AT_IMPORT = "import os\nos._exit(3)\n"
SEGFAULT_AT_IMPORT = "import ctypes\nctypes.string_at(0)\n"
SLOW_MODEL_FN = "import time\n\ndef model_fn(model_dir):\n    time.sleep(5)\n    return None\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    env = {"SAGEMAKER_MAX_REQUEST_SIZE": str(MAX_REQUEST_BYTES)}
    with start_server(tmp_path_factory.mktemp("reliability"), env) as running:
        for name in ("a", "b"):
            model_factory.torchscript_model(running.model_dir(name))
            assert running.load(name).status_code == 200
        model_factory.write_code(running.model_dir("slow"), SLOW_SCRIPT)
        assert running.load("slow").status_code == 200
        yield running


HOSTILE_INVOKES = [
    ("truncated JSON", b"[[1, 2, 3", "application/json", None, 400),
    ("JSON object without data", b'{"rows": [[1, 2, 3, 4]]}', "application/json", None, 400),
    ("JSON strings", b'[["a", "b", "c", "d"]]', "application/json", None, 400),
    ("ragged JSON", b"[[1, 2, 3, 4], [1]]", "application/json", None, 400),
    ("NaN", b"[[NaN, 1, 2, 3]]", "application/json", None, 400),
    ("infinity", b"[[Infinity, 1, 2, 3]]", "application/json", None, 400),
    ("CSV with text", b"1,2,three,4", "text/csv", None, 400),
    ("CSV ragged", b"1,2,3,4\n1,2", "text/csv", None, 400),
    ("truncated NPY", npy(np.ones((1, 4), dtype=np.float32))[:-3], "application/x-npy", None, 400),
    (
        "NPY of objects",
        b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
        "application/x-npy",
        None,
        400,
    ),
    ("wrong tensor shape", b"[[1, 2, 3]]", "application/json", None, 400),
    ("wrong NPY dtype", npy(np.ones((1, 4), dtype=np.int64)), "application/x-npy", None, 400),
    ("empty body", b"", "application/json", None, 400),
    ("unicode junk", "[[\u2603, \U0001f600]]".encode(), "application/json", None, 400),
    ("invalid UTF-8", b"\xc3\x28[[1,2,3,4]]", "application/json", None, 400),
    ("unknown content type", ROWS.encode(), "application/xml", None, 415),
    ("missing content type", ROWS.encode(), None, None, 415),
    ("content type with junk", ROWS.encode(), "application/\u00e9\u00e9", None, 415),
    ("Accept we cannot produce", ROWS.encode(), "application/json", "image/png", 406),
    ("Accept refusing everything", ROWS.encode(), "application/json", "*/*;q=0", 406),
]


@pytest.mark.parametrize(
    ("body", "content_type", "accept", "status"),
    [case[1:] for case in HOSTILE_INVOKES],
    ids=[case[0] for case in HOSTILE_INVOKES],
)
def test_hostile_invoke_gets_a_clear_4xx_and_hurts_nobody(
    server: RunningServer, body: bytes, content_type: str | None, accept: str | None, status: int
) -> None:
    started = time.monotonic()
    response = server.invoke("a", body, content_type, accept)
    assert time.monotonic() - started < 10
    assert response.status_code == status, response.text
    error = response.json()
    assert error["code"] == status and error["message"] and error["request_id"]
    assert "Traceback" not in response.text
    for name in ("a", "b"):
        assert server.invoke(name, ROWS).status_code == 200


def test_body_over_the_request_limit_is_refused_with_413(server: RunningServer) -> None:
    body = json.dumps([[1.0, 2.0, 3.0, 4.0]] * (MAX_REQUEST_BYTES // 20))
    assert MAX_REQUEST_BYTES < len(body) < 2 * MAX_REQUEST_BYTES
    response = server.invoke("a", body)
    assert response.status_code == 413
    assert "exceeds the limit" in response.json()["message"]
    # Far beyond the limit, MMS refuses the body before buffering it: still 413, with an empty body.
    assert server.invoke("a", body * 3).status_code == 413
    assert server.invoke("a", ROWS).status_code == 200


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"not json at all", 500),  # MMS 1.1.11 answers 500 JsonSyntaxException for a LOAD body it cannot parse
        (b"{}", 400),
        (b'{"model_name": "x"}', 400),
        (b'{"model_name": "x", "url": "/does/not/exist"}', 404),
    ],
)
def test_bad_load_bodies_are_refused(server: RunningServer, body: bytes, status: int) -> None:
    response = requests.post(
        f"{server.url}/models", data=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == status
    assert response.json()["message"]


@pytest.mark.parametrize("name", ["../../etc", "a/b", "..", "name with spaces", "x" * 300, "\u00e9t\u00e9"])
def test_model_names_that_look_like_paths_are_refused(server: RunningServer, name: str) -> None:
    response = server.load(name, server.model_dir("a"))
    # MMS answers 500 when our server refuses the name (it cannot carry our 400 without leaving the name
    # registered, see README "API"), or 404 where it refuses the name itself.
    assert response.status_code in (404, 500)
    assert wait_until(lambda: name not in json.dumps(requests.get(f"{server.url}/models", timeout=5).json()), 10)
    assert server.invoke("a", ROWS).status_code == 200


@pytest.mark.parametrize(
    ("url", "status"),
    [("/etc", 403), ("{root}/escape-link", 403), ("{root}/../..", 404)],  # MMS itself refuses ".." with 404
)
def test_load_outside_the_model_root_is_refused(server: RunningServer, url: str, status: int) -> None:
    link = server.models / "escape-link"
    if not link.is_symlink():
        link.symlink_to("/etc")
    cleared = server.log_text().count("unregistered outside, which MMS left")
    response = server.load("outside", url.format(root=server.models))
    assert response.status_code == status
    if status == 403:
        assert wait_until(lambda: "is outside the model root" in server.log_text(), 5)
        # The janitor clears what MMS leaves registered after a LOAD answered with our status.
        assert wait_until(lambda: server.log_text().count("unregistered outside, which MMS left") == cleared + 1, 10)
    assert server.describe("outside").status_code == 404
    assert server.invoke("a", ROWS).status_code == 200


@pytest.mark.parametrize(
    "query", ["limit=-1", "limit=abc", "limit=100000", "next_page_token=99999", "next_page_token=-5", "limit=0"]
)
def test_list_with_out_of_range_paging_still_answers(server: RunningServer, query: str) -> None:
    response = requests.get(f"{server.url}/models?{query}", timeout=10)
    assert response.status_code in (200, 400)
    assert "models" in response.json() or response.json()["message"]


def test_worker_killed_mid_request_fails_that_request_fast_and_is_replaced(server: RunningServer) -> None:
    [worker] = server.worker_pids("slow")
    result: dict[str, object] = {}

    def call() -> None:
        started = time.monotonic()
        response = server.invoke("slow", json.dumps({"sleep": 30}))
        result.update(status=response.status_code, seconds=time.monotonic() - started)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(1.0)
    os.kill(worker, signal.SIGKILL)
    caller.join(timeout=20)
    assert not caller.is_alive()
    assert 500 <= int(str(result["status"])) < 600
    assert float(str(result["seconds"])) < 10  # not a hang until the 60 s response timeout
    assert wait_until(lambda: server.invoke("slow", json.dumps({"sleep": 0})).status_code == 200, 30)
    assert server.invoke("a", ROWS).status_code == 200


@pytest.mark.parametrize(("name", "script"), [("exits", EXIT_AT_IMPORT), ("segfaults", SEGFAULT_AT_IMPORT)])
def test_code_that_kills_its_process_at_import_fails_the_load_cleanly(
    server: RunningServer, name: str, script: str
) -> None:
    model_factory.write_code(server.model_dir(name), script)
    response = server.load(name)
    assert response.status_code >= 500
    assert wait_until(lambda: server.describe(name).status_code == 404, 10)
    assert wait_until(lambda: server.backend_processes(name) == [], 10)  # its stub may take a moment to exit
    assert server.invoke("a", ROWS).status_code == 200
    # The name is free again once the code is fixed.
    model_factory.write_code(server.model_dir(name), SLOW_SCRIPT)
    assert wait_until(lambda: server.load(name).status_code == 200, 15)


def test_ping_stays_200_while_a_model_loads_and_after_one_fails(server: RunningServer) -> None:
    model_factory.write_code(server.model_dir("sleepy"), SLOW_MODEL_FN)
    loader = threading.Thread(target=server.load, args=("sleepy",))
    loader.start()
    pings = []
    while loader.is_alive():
        started = time.monotonic()
        pings.append((requests.get(f"{server.url}/ping", timeout=2).status_code, time.monotonic() - started))
        time.sleep(0.2)
    loader.join()
    assert len(pings) >= 5
    assert all(status == 200 and seconds < 2 for status, seconds in pings)
    model_factory.failing_model(server.model_dir("fails"))
    assert server.load("fails").status_code == 500
    assert requests.get(f"{server.url}/ping", timeout=2).status_code == 200
    assert "model=fails" in server.log_text() and "weights are corrupt" in server.log_text()


MEMORY_ERROR_SCRIPT = "def model_fn(model_dir):\n    raise MemoryError()\n"


def reload_until_200(server: RunningServer, name: str) -> bool:
    """After a 507 the janitor clears MMS's leftover registration within a moment; the name is then free."""
    return wait_until(lambda: server.load(name).status_code == 200, 10, interval=0.3)


def test_model_larger_than_memory_answers_507_and_the_name_stays_usable(server: RunningServer) -> None:
    model_dir = model_factory.torchscript_model(server.model_dir("huge"))
    with open(model_dir / "weights.bin", "wb") as sparse:  # 1 TiB on paper, nothing on disk
        sparse.truncate(1 << 40)
    started = time.monotonic()
    response = server.load("huge")
    assert response.status_code == 507
    assert time.monotonic() - started < 10
    assert wait_until(
        lambda: "model=huge gpu=None load failed status=507: out of host memory: needs about" in server.log_text(), 5
    )
    (model_dir / "weights.bin").unlink()
    assert reload_until_200(server, "huge")
    assert server.invoke("huge", ROWS).status_code == 200
    # the janitor logs once its DELETE is answered, which can come after MMS took the LOAD that follows
    assert wait_until(lambda: "unregistered huge, which MMS left registered" in server.log_text(), 5)


def test_memory_error_in_model_fn_answers_507(server: RunningServer) -> None:
    model_factory.write_code(server.model_dir("oom"), MEMORY_ERROR_SCRIPT)
    assert server.load("oom").status_code == 507
    model_factory.write_code(server.model_dir("oom"), SLOW_SCRIPT)
    assert reload_until_200(server, "oom")
    assert requests.get(f"{server.url}/ping", timeout=2).status_code == 200
