"""Markers by directory, and the GPU and container gates."""

from __future__ import annotations

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
