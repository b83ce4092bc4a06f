"""A model's ``code/requirements.txt``: installed at LOAD, before its code is imported, once per file content.

Packages go to ``<cache>/<sha256 of the file>`` (reused by later loads, serialised by a file lock) and onto this
model's ``sys.path`` only, after the server's own packages: user requirements add libraries, they cannot replace
torch or the serving stack. Installed versions of the server's packages are passed to pip as constraints.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from mme_runtime.base import failures
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.base.locks import build_once
from mme_runtime.operations import metrics

logger = logging.getLogger(__name__)

REQUIREMENTS = "requirements.txt"
SUMMARY_LINES = 6


class RequirementsError(ModelLoadError):
    """pip could not install the model's requirements; the message summarises pip's error."""


def install_requirements(code_dir: Path, cache_dir: Path, timeout_seconds: int) -> Path | None:
    """Installs ``code_dir/requirements.txt`` if present and returns the directory to put on ``sys.path``."""
    requirements = code_dir / REQUIREMENTS
    if not requirements.is_file():
        return None
    target = cache_dir / hashlib.sha256(requirements.read_bytes()).hexdigest()[:24]
    built = build_once(target, lambda staging: _pip_install(requirements, staging, timeout_seconds))
    metrics.record_cache_lookup("requirements", hit=not built)
    if built:
        logger.info("requirements %s installed at %s", requirements, target)
    else:
        logger.info("requirements %s already installed at %s", requirements, target)
    return target


def add_to_path(directory: Path) -> None:
    """After the server's own packages, so a requirement can add a library but never swap torch underneath us."""
    entry = str(directory)
    if entry not in sys.path:
        sys.path.append(entry)


def _pip_install(requirements: Path, staging: Path, timeout_seconds: int) -> Path:
    constraints = staging / "constraints.txt"
    constraints.write_text(_installed_pins())
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-input",
        "--disable-pip-version-check",
        "--target",
        str(staging / "site"),
        "--constraint",
        str(constraints),
        "--requirement",
        str(requirements),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_seconds)
    except subprocess.TimeoutExpired as exc:
        what = f"pip install -r {requirements}"
        raise RequirementsError(failures.timed_out(timeout_seconds, "MME_PIP_TIMEOUT_SECONDS", what)) from exc
    if result.returncode != 0:
        summary = _summary(result.stderr or result.stdout)
        raise RequirementsError(f"pip install -r {requirements} failed: {summary}")
    return staging / "site"


def _installed_pins() -> str:
    pins = {}
    for distribution in metadata.distributions():
        name = distribution.metadata["Name"]
        if name:
            pins[name.lower()] = f"{name}=={distribution.version}"
    return "\n".join(sorted(pins.values())) + "\n"


def _summary(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip() and "WARNING: Location" not in line]
    errors = [line for line in lines if line.startswith("ERROR")] or lines
    return " | ".join(errors[-SUMMARY_LINES:])[:800] or "no output"
