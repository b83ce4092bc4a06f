"""A real moto server for the AWS helper scripts, and an environment that points boto3 at it and nowhere else.

The scripts in scripts/ are files, not a package: this directory is put on sys.path so the tests import them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

REGION = "us-east-1"
STARTUP_TIMEOUT_SECONDS = 60.0


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen[bytes], grace_seconds: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    # The server runs in its own session, so TERM reaches it and only it.
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a moto server (`python -m moto.server`) shared by the session; tests reset it through `aws`."""
    home = tmp_path_factory.mktemp("moto")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "server.out"
    # The recorder file lives here, not in the current directory; recording itself stays off until a test starts it.
    env = {**os.environ, "MOTO_RECORDER_FILEPATH": str(home / "recording.jsonl")}
    with log.open("wb") as out:  # a file, not a PIPE that could fill up and block the server
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            cwd=home,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto server did not start on {url}:\n{_log_tail(log)}")
                time.sleep(0.1)
            yield url
        finally:
            _stop(proc)


MotoApi = Callable[..., bytes]


def _call_moto_api(url: str, path: str, payload: dict[str, Any] | None = None) -> bytes:
    """Calls moto's own control API under /moto-api/: GET for downloads, POST for everything else."""
    data = None if payload is None else json.dumps(payload).encode()
    method = "GET" if path.startswith("recorder/download") else "POST"
    request = urllib.request.Request(f"{url}/moto-api/{path}", data=data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        return bytes(response.read())


def _isolate_from_local_aws_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No profile, config file, metadata service or endpoint override from the developer's machine applies."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("MME_SAGEMAKER_ROLE", raising=False)


@pytest.fixture
def aws(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """An empty moto account, with boto3 pointed at it by the environment; returns the server URL."""
    _call_moto_api(moto_server, "reset")
    _isolate_from_local_aws_config(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    return moto_server


@pytest.fixture
def no_aws_credentials(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A region and an endpoint, but no credentials anywhere botocore looks: calls fail before leaving the host."""
    _isolate_from_local_aws_config(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)


@pytest.fixture
def moto_api(aws: str) -> MotoApi:
    """``moto_api(path, payload=None)``: moto's control API, e.g. to queue invoke_endpoint results or record calls."""

    def call(path: str, payload: dict[str, Any] | None = None) -> bytes:
        return _call_moto_api(aws, path, payload)

    return call
