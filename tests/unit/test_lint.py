"""The style the project promises (ruff, mypy strict on mme_runtime), checked with every test run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy", "mme_runtime"]],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_code_passes(command: list[str], mypy_beside_the_tests: subprocess.Popen[str] | None) -> None:
    if command[0] == "mypy" and mypy_beside_the_tests is not None:  # started with the session (tests/conftest.py)
        output, _ = mypy_beside_the_tests.communicate()
        assert mypy_beside_the_tests.returncode == 0, output
        return
    result = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
