"""The entrypoint as a container runs it: `serve` with its properties, a clean stop, and any other command exec'd."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import model_factory
import psutil
import pytest
import requests
from ports import free_port
from serving import ENTRYPOINT, alive, start_server


@pytest.mark.parametrize(
    ("share", "processes"),
    [
        ("true", 5),  # the warm process, java, a stub per model, the device host
        ("false", 6),  # the warm process, java, a stub and a device host of its own per model
    ],
)
def test_sigterm_stops_mms_and_every_worker_and_exits_0(tmp_path: Path, share: str, processes: int) -> None:
    with start_server(tmp_path, {"SAGEMAKER_MODEL_SERVER_WORKERS": "2", "MME_SHARE_DEVICE": share}) as server:
        model_factory.torchscript_model(server.model_dir("a"))
        model_factory.state_dict_model(server.model_dir("b"))
        assert server.load("a").status_code == 200
        assert server.load("b").status_code == 200
        assert server.invoke("a", json.dumps([[1, 2, 3, 4]])).status_code == 200
        assert server.invoke("b", json.dumps({"inputs": [[1, 2, 3, 4]]})).status_code == 200
        tree = server.descendants()
        assert len(tree) >= processes  # (and the metrics collector, at times)

        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        status = server.process.wait(timeout=30)
        elapsed = time.monotonic() - started

        assert status == 0
        assert elapsed < 30
        assert alive(tree) == []
        assert "MMS stopped" in server.log_text()


def test_preload_property_is_written_exactly_once(tmp_path: Path) -> None:
    for _ in range(2):
        with start_server(tmp_path) as server:
            properties = (server.home / "run" / "mme-mms.properties").read_text()
    assert properties.splitlines().count("preload_model_gpu=true") == 1
    # The file MMS reads carries our handler and derived keys, not our own key.
    mms_properties = (tmp_path / "run" / "mms.properties").read_text()
    assert "default_service_handler=handler_service:handle" in mms_properties
    assert "preload_model_gpu" not in mms_properties


def test_effective_configuration_is_logged_once(tmp_path: Path) -> None:
    with start_server(tmp_path, {"SAGEMAKER_MODEL_SERVER_TIMEOUT": "77"}) as server:
        lines = [line for line in server.log_text().splitlines() if "effective configuration" in line]
        [java] = [process for process in server.descendants() if process.name() == "java"]
        assert "-XX:MaxRAMPercentage=10.0" in java.cmdline()  # the frontend's heap, capped
    assert len(lines) == 1
    assert "response_timeout_seconds=77" in lines[0] and "share_device=True" in lines[0]


@pytest.mark.parametrize(
    ("chosen", "entrypoint", "children"), [(None, "malloc", None), ("pymalloc", "pymalloc", "pymalloc")]
)
def test_the_entrypoint_alone_runs_on_glibc_s_allocator_unless_the_user_chose_one(
    tmp_path: Path, chosen: str | None, entrypoint: str, children: str | None
) -> None:
    with start_server(tmp_path, {"PYTHONMALLOC": chosen} if chosen else {}) as server:
        model_factory.torchscript_model(server.model_dir("a"))
        assert server.load("a").status_code == 200
        # the process started, executed again with its allocator: its scrapes' heap goes back after each
        assert psutil.Process(server.process.pid).environ().get("PYTHONMALLOC") == entrypoint
        # the programs it starts, and those MMS starts (the model's stub); the processes forked from the warm process
        # have its allocator, whatever their environment says
        allocators = {}
        for process in server.descendants():
            with contextlib.suppress(psutil.NoSuchProcess):
                command = " ".join(process.cmdline())
                for program in ("java", "warm_start", "mme-model-stub"):
                    if program in command:
                        allocators[program] = process.environ().get("PYTHONMALLOC")
    assert allocators == dict.fromkeys(("java", "warm_start", "mme-model-stub"), children)


def test_an_entrypoint_that_cannot_execute_itself_again_serves_on_as_it_is(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = importlib.util.spec_from_file_location("entrypoint", ENTRYPOINT)
    assert spec is not None and spec.loader is not None
    entrypoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entrypoint)

    def refused(*_: object) -> None:
        raise PermissionError("execve refused")

    monkeypatch.setattr(os, "execve", refused)
    entrypoint.execute_again({"PYTHONMALLOC": "malloc"})
    monkeypatch.setattr(sys, "executable", "")
    entrypoint.execute_again({"PYTHONMALLOC": "malloc"})
    assert [record.getMessage().split(":")[0] for record in caplog.records] == ["Python's allocator kept"] * 2


def test_other_commands_run_as_given() -> None:
    result = subprocess.run(
        [sys.executable, str(ENTRYPOINT), sys.executable, "-c", "import sys; print('hello'); sys.exit(7)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 7
    assert result.stdout.strip() == "hello"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SAGEMAKER_BIND_TO_PORT", "40000", "32767"),
        ("SAGEMAKER_MODEL_SERVER_WORKERS", "0", "SAGEMAKER_MODEL_SERVER_WORKERS"),
        ("SAGEMAKER_MULTI_MODEL", "maybe", "SAGEMAKER_MULTI_MODEL"),
        ("MME_WARM_START", "false", "MME_WARM_START=false is no longer read: the warm process serves every model"),
    ],
)
def test_bad_configuration_exits_with_a_clear_message(tmp_path: Path, variable: str, value: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ENTRYPOINT), "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "MME_RUNTIME_DIR": str(tmp_path), variable: value},
    )
    assert result.returncode == 2
    assert message in result.stdout and value in result.stdout


def test_failed_start_is_retried_then_reported(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as busy:  # MMS cannot bind: every start attempt fails
        busy.bind(("0.0.0.0", port))
        busy.listen()
        result = subprocess.run(
            [sys.executable, str(ENTRYPOINT), "serve"],
            capture_output=True,
            text=True,
            timeout=240,
            env={
                **os.environ,
                "SAGEMAKER_BIND_TO_PORT": str(port),
                "MME_RUNTIME_DIR": str(tmp_path),
                "MME_START_ATTEMPTS": "2",
                "SAGEMAKER_STARTUP_TIMEOUT": "60",
            },
        )
    assert result.returncode == 3, result.stdout[-3000:]
    assert result.stdout.count("starting MMS") == 2
    assert "MMS start failed, retrying" in result.stdout
    assert "MMS did not start after 2 attempts" in result.stdout


def test_single_model_mode_serves_invocations(tmp_path: Path) -> None:
    model_dir = model_factory.torchscript_model(tmp_path / "model")
    env = {"SAGEMAKER_MULTI_MODEL": "false", "MME_LOAD_MODELS": f"model={model_dir}"}
    with start_server(tmp_path, env) as server:
        response = requests.post(
            f"{server.url}/invocations",
            data=json.dumps([[1, 2, 3, 4]]),
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert len(response.json()[0]) == 3


def test_a_second_server_in_the_same_runtime_directory_is_refused_and_the_first_serves_on(tmp_path: Path) -> None:
    # Both would use one warm process socket: each would then serve the other's models (seen with /tmp/mme).
    with start_server(tmp_path) as first:
        model_factory.torchscript_model(first.model_dir("mine"))
        second = subprocess.run(
            [sys.executable, str(ENTRYPOINT), "serve"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "MME_RUNTIME_DIR": str(tmp_path / "run"), "SAGEMAKER_BIND_TO_PORT": str(free_port())},
        )
        assert second.returncode == 2
        port = first.url.rsplit(":", 1)[1]
        assert f"in use by another server (pid {first.process.pid}, port {port})" in second.stdout
        assert first.load("mine").status_code == 200
        assert first.invoke("mine", json.dumps([[1, 2, 3, 4]])).status_code == 200
        assert "shares its device host" in first.log_text()  # served by the first server's own processes
