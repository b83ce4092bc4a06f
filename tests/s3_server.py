"""A real S3-compatible server for tests: ``python -m moto.server`` on a free port, reached with boto3.

Its log lists every request it served, which is how tests count GETs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import requests
from ports import free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3Server:
    url: str
    log: Path

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through boto3, and nothing real."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": self.url}

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def requests_for(self, method: str, bucket: str, key: str) -> int:
        """How many ``method`` requests for ``bucket/key`` the server has answered."""
        pattern = re.compile(rf'"{method} /{re.escape(bucket)}/{re.escape(key)}(\?[^ ]*)? HTTP')
        return sum(1 for line in self.log.read_text(errors="replace").splitlines() if pattern.search(line))


@contextmanager
def start_s3(home: Path, extra_env: dict[str, str] | None = None) -> Iterator[S3Server]:
    port = free_port()
    log = home / "moto.out"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            cwd=home,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **CREDENTIALS, **(extra_env or {})},
        )
    server = S3Server(f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{server.url}/moto-api/", timeout=2).status_code < 500:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"moto server did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield server
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
