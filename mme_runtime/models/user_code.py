"""A model's inference code, once ``code_fetcher`` found it (its own ``code/``, else
``SAGEMAKER_SUBMIT_DIRECTORY``, fetched from S3): installs its ``requirements.txt``, imports its
script by file path, and binds its contract functions once.

Each script is imported under a module name unique to the model, so two models whose scripts are
both called ``inference.py`` never see each other's functions. Whether a function takes ``context``
is decided here, once. Requirements are installed at LOAD, before the code is imported, once per
file content: into ``<cache>/<sha256 of the file>`` (reused by later loads, serialised by a file
lock) and onto this process's ``sys.path`` only, after the server's own packages, so they add
libraries and never replace torch or the serving stack (the server's installed versions are pip's
constraints). A model whose requirements the image does not already satisfy gets a device host of
its own (``loading.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from mme_runtime.base import failures
from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.base.locks import build_once
from mme_runtime.operations import metrics

logger = logging.getLogger(__name__)

REQUIREMENTS = "requirements.txt"
SUMMARY_LINES = 6


class RequirementsError(ModelLoadError):
    """pip could not install the model's requirements; the message summarises pip's error."""


def install_requirements(code_dir: Path, cache_dir: Path, timeout_seconds: int) -> Path | None:
    """Installs ``code_dir/requirements.txt`` if present and returns the directory to put on
    ``sys.path``."""
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
    """After the server's own packages, so a requirement can add a library but never swap torch
    underneath us."""
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
        raise RequirementsError(
            failures.timed_out(timeout_seconds, "MME_PIP_TIMEOUT_SECONDS", what)
        ) from exc
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
    lines = [
        line.strip()
        for line in output.splitlines()
        if line.strip() and "WARNING: Location" not in line
    ]
    errors = [line for line in lines if line.startswith("ERROR")] or lines
    return " | ".join(errors[-SUMMARY_LINES:])[:800] or "no output"


USER_MODULE_PREFIX = "mme_user_"
CONTRACT = (
    "model_fn",
    "input_fn",
    "predict_fn",
    "output_fn",
    "transform_fn",
    "pre_model_fn",
    "model_warmup_fn",
)
# Positional arguments each contract function takes before the optional trailing ``context``.
ARITY = {
    "model_fn": 1,
    "input_fn": 2,
    "predict_fn": 2,
    "output_fn": 2,
    "transform_fn": 4,
    "pre_model_fn": 1,
    "model_warmup_fn": 2,
}


class UserCodeError(Exception):
    """The user script cannot be imported or breaks the contract."""


@dataclass(frozen=True)
class UserFunction:
    """A contract function with its context convention decided at bind time, not per request."""

    name: str
    function: Callable[..., Any]
    takes_context: (
        bool  # called with the request's context as its last argument (serving/contract.py)
    )

    @classmethod
    def bind(cls, name: str, function: Callable[..., Any]) -> UserFunction:
        return cls(name, function, _takes_context(name, function))


def _takes_context(name: str, function: Callable[..., Any]) -> bool:
    """True when the function's trailing parameter is ``context``, or (toolkit rule) it has one
    extra parameter."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if positional and positional[-1].name == "context":
        return True
    expected = ARITY[name]
    if len(positional) == expected + 1:
        return True
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    if len(required) > expected:
        raise UserCodeError(
            f"{name} takes {len(required)} required arguments; expected {expected} (plus an "
            "optional context)"
        )
    return False


def module_name_for(model_name: str, script: Path) -> str:
    """A module name unique to the model and script: ``mme_user_<model>_<hash>``."""
    digest = hashlib.sha1(f"{model_name}\0{script.resolve()}".encode()).hexdigest()[:10]
    safe = re.sub(r"\W", "_", model_name)[:40]
    return f"{USER_MODULE_PREFIX}{safe}_{digest}"


def find_script(code_dir: Path | None, program: str) -> Path | None:
    """The user's script in the model's code directory, or None when there is none."""
    if code_dir is None:
        return None
    candidate = code_dir / program
    return candidate if candidate.is_file() else None


def import_script(model_name: str, script: Path) -> ModuleType:
    """Imports ``script`` under a name unique to the model; its directory goes on ``sys.path`` for
    its helpers."""
    code_dir = str(script.parent.resolve())
    if code_dir not in sys.path:
        sys.path.insert(0, code_dir)
    name = module_name_for(model_name, script)
    spec = importlib.util.spec_from_file_location(name, script)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"cannot import {script}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        # boundary: any failure in user code at import fails the LOAD with its cause
        del sys.modules[name]
        # code/inference.py, in the model or fetched from S3
        where = f"{script.parent.name}/{script.name}"
        if isinstance(exc, ImportError):
            raise UserCodeError(failures.import_error(exc, where)) from exc
        raise UserCodeError(failures.raised(f"importing {where}", exc)) from exc
    return module


def bind_functions(module: ModuleType | None) -> dict[str, UserFunction]:
    """The contract functions the script defines, each bound once."""
    if module is None:
        return {}
    functions: dict[str, UserFunction] = {}
    for name in CONTRACT:
        function = getattr(module, name, None)
        if function is None:
            continue
        if not callable(function):
            raise UserCodeError(f"{name} in {module.__file__} is not a function")
        functions[name] = UserFunction.bind(name, function)
    if "transform_fn" in functions and {"input_fn", "predict_fn", "output_fn"} & functions.keys():
        raise UserCodeError(
            "transform_fn cannot be combined with input_fn, predict_fn or output_fn"
        )
    return functions


def load_user_code(
    model_name: str, code_dir: Path | None, source: str, config: Config
) -> dict[str, UserFunction]:
    """The contract functions the script in the model's code directory defines (``locate_code``
    found it: ``source`` says where, for the log), its requirements installed first. Raises
    ``ModelLoadError`` naming what is wrong."""
    if code_dir is not None:
        packages = install_requirements(
            code_dir, config.cache_dir / "requirements", config.pip_timeout_seconds
        )
        if packages is not None:
            add_to_path(packages)
    try:
        script = find_script(code_dir, config.program)
        module = import_script(model_name, script) if script is not None else None
        user = bind_functions(module)
    except UserCodeError as exc:
        # what the script raised, if anything, is the traceback worth logging
        raise ModelLoadError(str(exc), trace=exc.__cause__) from exc
    logger.info(
        "model=%s code=%s script=%s functions=%s",
        model_name,
        source,
        script or f"none (no {config.program})",
        ",".join(sorted(user)) or "none",
    )
    return user
