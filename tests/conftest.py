"""Markers by directory, the GPU and container gates, and helpers every suite shares."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from mme_runtime.nvidia import gpu_count

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
        if "gpu" in item.keywords:
            gpus = gpu_count() if gpus is None else gpus  # nvidia-smi: never torch.cuda at collection
            if gpus == 0:
                item.add_marker(pytest.mark.skip(reason="no CUDA device (nvidia-smi -L lists none)"))
        if "container" in item.keywords and not config.getoption("--run-container"):
            item.add_marker(pytest.mark.skip(reason="container suite runs only with --run-container"))


def free_port() -> int:
    """A free TCP port below 32767: MMS 1.1.11 refuses higher ones, and Linux hands out ephemeral ports above."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port between 20000 and 32000")
