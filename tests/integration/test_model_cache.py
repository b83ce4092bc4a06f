"""The package cache serves isolated models (MME_SHARE_DEVICE=false: a device host of their own) as it serves shared
ones (test_device_host.py): the same artifacts under two names are loaded once, and a re-LOAD takes the package kept
since the UNLOAD. Either way a model stays where its loader said it runs: in a host of its own."""

from __future__ import annotations

import json
from collections.abc import Iterator

import model_factory
import pytest
from serving import RunningServer, start_server, wait_until

ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(tmp_path_factory.mktemp("isolated-cache"), {"MME_SHARE_DEVICE": "false"}) as running:
        yield running


def test_same_artifacts_under_two_names_load_once_each_in_its_own_host(server: RunningServer) -> None:
    model_dir = model_factory.torchscript_model(server.model_dir("artifacts"))
    assert server.load("first", model_dir).status_code == 200
    assert server.load("second", model_dir).status_code == 200
    answers = [server.invoke(name, ROWS).json() for name in ("first", "second")]
    assert answers[0] == answers[1]
    log = server.log_text()
    assert f"model cache hit {model_dir / 'model.pt'}: model=second shares its package" in log
    assert "model=second served by a device host of its own: MME_SHARE_DEVICE=false" in log
    assert server.worker_pids("first") != server.worker_pids("second")
    assert not server.shares_device_host("first") and not server.shares_device_host("second")

    assert server.unload("first").status_code == 200
    assert server.invoke("second", ROWS).json() == answers[0]  # still shared, still served
    assert server.unload("second").status_code == 200
    assert wait_until(lambda: f"model cache keeps {model_dir / 'model.pt'}" in server.log_text(), 10)


def test_a_re_load_takes_its_kept_package_and_its_own_host_again(server: RunningServer) -> None:
    model_factory.state_dict_model(server.model_dir("again"))  # inference code: kept under its name and files
    body = json.dumps({"inputs": [[1.0, 2.0, 3.0, 4.0]]})
    assert server.load("again").status_code == 200
    first = server.invoke("again", body).json()
    assert server.unload("again").status_code == 200

    assert server.load("again").status_code == 200
    assert server.invoke("again", body).json() == first
    assert "model=again takes its package, kept since its UNLOAD" in server.log_text()  # no loader ran
    assert not server.shares_device_host("again")
    assert server.unload("again").status_code == 200
