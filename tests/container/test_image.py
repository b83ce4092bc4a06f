"""Builds the image and runs it through scripts/test-image: PING, LOAD, INVOKE, UNLOAD and a clean SIGTERM stop.

Marked `container` (by directory, in conftest.py): runs only with --run-container. See README.md beside this file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.container

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test-image"
TAG = "localhost/mme-gpu:pytest"


def run_test_image(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--tag", TAG, *args], capture_output=True, text=True)


def report(result: subprocess.CompletedProcess[str]) -> str:
    return f"scripts/test-image exited {result.returncode}; last output:\n" + "\n".join(
        (result.stdout + result.stderr).splitlines()[-80:]
    )


@pytest.fixture(scope="module")
def built() -> subprocess.CompletedProcess[str]:
    """One build per session (minutes), tested as the image's default user (root)."""
    return run_test_image()


def test_image_builds_and_serves_load_invoke_unload_then_stops_cleanly(built: subprocess.CompletedProcess[str]) -> None:
    assert built.returncode == 0, report(built)
    assert "test-image: PASS" in built.stdout


def test_image_serves_as_non_root_user(built: subprocess.CompletedProcess[str]) -> None:
    # SageMaker runs us as root, but nothing should quietly depend on it (STYLE.md, "Run as root").
    if built.returncode != 0:
        pytest.fail("the image did not build and pass as root; see the test above")
    result = run_test_image("--no-build", "--user", "1000:1000")
    assert result.returncode == 0, report(result)
