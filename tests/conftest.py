"""Markers by directory, the GPU and container gates, and mypy beside the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mme_runtime.base.nvidia import gpu_count

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
MARKED_DIRECTORIES = {"integration": "integration", "gpu": "gpu", "container": "container"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-container", action="store_true", help="build the image and run the container suite")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = None
    for item in items:
        parts = Path(str(item.fspath)).relative_to(TESTS).parts
        marker = MARKED_DIRECTORIES.get(parts[0]) if parts else None
        if marker is not None:
            item.add_marker(getattr(pytest.mark, marker))
        if item.get_closest_marker("gpu") is not None:  # not a keyword: a parameter may be named gpu
            gpus = gpu_count() if gpus is None else gpus  # nvidia-smi: never torch.cuda at collection
            if gpus == 0:
                item.add_marker(pytest.mark.skip(reason="no CUDA device (nvidia-smi -L lists none)"))
        if "container" in item.keywords and not config.getoption("--run-container"):
            item.add_marker(pytest.mark.skip(reason="container suite runs only with --run-container"))


@pytest.fixture(scope="session", autouse=True)
def mypy_beside_the_tests(request: pytest.FixtureRequest) -> Iterator[subprocess.Popen[str] | None]:
    """mypy from a cold cache takes about 13 s of one core: when the session runs its lint test, mypy starts with the
    first test and runs beside the tests before that one, which waits for it (tests/unit/test_lint.py). Not in a
    pytest-xdist worker: each collects every test, and only one runs the lint test, which runs mypy itself while the
    other worker goes on."""
    command = [str(Path(sys.executable).parent / "mypy"), "mme_runtime"]
    wanted = any(item.nodeid.endswith("test_code_passes[mypy]") for item in request.session.items)
    in_a_worker = "PYTEST_XDIST_WORKER" in os.environ
    if not wanted or in_a_worker or not Path(command[0]).exists():  # its test runs it, and fails, alone
        yield None
        return
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield process
    finally:
        if process.returncode is None:  # its test did not run, or did not wait for it
            process.kill()
            process.communicate()
