"""A model's LOAD as a loader and a device host share it: the model's spec, which host it needs
(shared, or one of its own, and why), the checks before a load, the load itself, and how a failed
LOAD is answered.

A model gets a host of its own when the container turns sharing off (``MME_SHARE_DEVICE=false``),
when its handler is not ours (MMS's ``module:function``), when its ``serving.properties`` says
``isolation=process``, when its ``requirements.txt`` asks for anything the image does not already
satisfy, or when its own ``code/`` holds Python modules beside its script (imported by plain names,
which one interpreter holds once; ``isolation=shared`` says they are unique). Runs in the CUDA-free
loader as well as in device hosts: it never touches CUDA itself (user code may).

A LOAD resolves its model once (``resolve_model``: settings and code, fetched from S3 if need be),
in the first process that needs it, and hands the result on in its messages: the loader decides
sharing and loads from it, and the host takes it with the package. Only a host taking a package kept
since an UNLOAD resolves the model itself.
"""

from __future__ import annotations

import importlib
import logging
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from mms.protocol.otf_message_handler import create_load_model_response
from mms.service import Service
from packaging.requirements import InvalidRequirement, Requirement

from mme_runtime.base import devices, failures
from mme_runtime.base.config import Config
from mme_runtime.base.errors import InsufficientMemory, ModelLoadError
from mme_runtime.base.janitor import mark_failed_load
from mme_runtime.models.code_fetcher import CodeFetcher, locate_code
from mme_runtime.models.serving_properties import ServingSettings, read_settings
from mme_runtime.models.user_code import REQUIREMENTS
from mme_runtime.operations import memory

logger = logging.getLogger(__name__)

# SageMaker's model names are opaque hashes; anything path-like is refused before it reaches a log,
# a module name or a file name.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
LOG_DRAIN_SECONDS = 0.3
# MMS 1.1.11 interrupts a worker thread when its connection closes (WorkerThread.connect's
# closeFuture listener): one interrupted before it took our LOAD reply from its queue answers 500
# "Worker died." instead of our status.
REPLY_LINGER_SECONDS = 0.05
# LOAD failures answered with their own status: 400 (the model is wrong, not the server: a LoRA
# adapter whose base is not found or does not fit it, or model_fn's own 400), 403 (outside the model
# root) and 507 (SageMaker evicts and retries). MMS 1.1.11 answers each with its own words, "Failed
# to start workers": the cause is in the log. A bad name is not among them: the janitor could not
# address a name holding "/" to clean it up.
REPLIED_STATUSES = frozenset({400, 403, 507})
OUR_HANDLER = "handler_service"  # the module MMS names for this container's handler


@dataclass(frozen=True)
class ModelSpec:
    """What MMS tells the server about its model (command line and first LOAD message)."""

    name: str
    model_dir: str
    handler: str
    tmp_dir: str


@dataclass(frozen=True)
class ResolvedModel:
    """What a LOAD resolves of a model's directory once: its serving settings and where its code
    is."""

    settings: ServingSettings
    # its own code/, else SAGEMAKER_SUBMIT_DIRECTORY's (fetched); None: the defaults
    code_dir: Path | None
    code_source: str  # for the log: that directory, the S3 URI it came from, or "defaults"

    def message(self) -> dict[str, Any]:
        """As a warm-process message carries it (JSON)."""
        code_dir = None if self.code_dir is None else str(self.code_dir)
        return {
            "settings": asdict(self.settings),
            "code_dir": code_dir,
            "code_source": self.code_source,
        }

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ResolvedModel:
        code_dir = message["code_dir"]
        settings = ServingSettings(**message["settings"])
        return cls(settings, None if code_dir is None else Path(code_dir), message["code_source"])


def resolve_model(model_dir: Path, config: Config) -> ResolvedModel:
    """The model's settings and code, fetching its code from S3 when it comes from there (cached by
    ETag). Raises ``ModelLoadError`` naming what could not be read: the LOAD's failure."""
    try:
        settings = read_settings(model_dir, config)
    except ModelLoadError as exc:
        raise ModelLoadError(f"reading serving settings failed: {exc.message}") from exc
    fetcher = CodeFetcher(config.cache_dir / "code", config.s3_timeout_seconds)
    code_dir, source = locate_code(model_dir, config.submit_directory, fetcher)
    return ResolvedModel(settings, code_dir, source)


@dataclass
class LoadedModel:
    """A model's handler and MMS service, as loaded in a loader (``preload``) or a device host."""

    # A device host's ``HandlerService`` of the model's own, the loader's module-level
    # ``handler_service``, or the module of a handler that is not ours (MMS's ``module:function``):
    # each has what MMS calls.
    module: Any
    service: Service


class LoadFailure(Exception):
    """Loading failed: the status and message every frontend connection's LOAD reply carries."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_memory(
    spec: ModelSpec,
    config: Config,
    gpu: int | None,
    host: bool = True,
    device_bytes: int | None = None,
) -> None:
    """507 before loading what will not fit: host memory where the model is loaded, GPU memory where
    it goes (in a process whose CUDA context exists, a device host, as that context sees it:
    ``device_bytes`` there, when known, is what the model adds to the card beyond the tensors it
    shares with models already on it)."""
    try:
        if host:
            memory.check_host_memory(Path(spec.model_dir), config.memory_headroom_mb)
        model_dir, headroom = Path(spec.model_dir), config.memory_headroom_mb
        if gpu is not None and not memory.check_context_memory(model_dir, headroom, device_bytes):
            card = devices.visible_gpu(gpu, config.cuda_visible_devices)
            memory.check_gpu_memory(Path(spec.model_dir), card, config.memory_headroom_mb)
    except InsufficientMemory as exc:
        raise fail_load(spec, gpu, exc) from exc


def check_location(spec: ModelSpec, config: Config) -> LoadFailure | None:
    """A model name must be a plain name, and in multi-model mode a LOAD may name only a directory
    under the model root (after resolving links and ``..``); URLs MMS downloaded land in its temp
    directory and are refused."""
    if not MODEL_NAME.fullmatch(spec.name):
        message = (
            f"model name {spec.name!r} must be letters, digits, '.', '_' or '-' (at most 255), not "
            "a path"
        )
        logger.error("load failed status=500: %s", message)
        return LoadFailure(500, message)
    if not config.multi_model or config.allow_any_model_location:
        return None
    model_dir = Path(spec.model_dir).resolve()
    root = config.model_root.resolve()
    if model_dir.is_relative_to(root):
        return None
    message = f"{spec.model_dir} is outside the model root {root} (MME_MODEL_ROOT)"
    logger.error("model=%s load failed status=403: %s", spec.name, message)
    return LoadFailure(403, f"model {spec.name}: {message}")


def load_model(
    spec: ModelSpec,
    batch_size: int,
    phase: str,
    gpu: int | None = None,
    cuda_ordinal: int | None = None,
    resolved: ResolvedModel | None = None,
) -> LoadedModel:
    """Imports the handler and runs its load step: ``preload`` in a loader (of the model
    ``resolved``); in a device host, ``attach``, or ``handle(None, context)`` for a handler that is
    not ours (found, as MMS's worker finds it, beside the model or in the directory its name gives).

    ``gpu`` is the frontend's assignment, ``cuda_ordinal`` the device naming that GPU in this
    process.
    """
    try:
        module_name, _, function_name = spec.handler.partition(":")
        if not is_our_handler(spec.handler):  # only ever in a host of its own (above)
            for directory in (spec.model_dir, str(Path(module_name).parent)):
                if directory not in (".", "") and directory not in sys.path:
                    sys.path.append(directory)
        module = importlib.import_module(Path(module_name).stem)
        entry_point: Callable[..., Any] = getattr(module, function_name or "handle")
        service = Service(spec.name, spec.model_dir, None, entry_point, cuda_ordinal, batch_size)
        devices.record_gpu(service.context.system_properties, gpu, cuda_ordinal)
        if phase == "preload" and hasattr(module, "preload"):
            module.preload(service.context, resolved)
        elif hasattr(module, "attach"):
            module.attach(service.context)
        else:
            entry_point(None, service.context)
    except Exception as exc:
        # boundary: the LOAD reply carries the status and cause; the traceback is logged
        raise fail_load(spec, gpu, exc) from exc
    return LoadedModel(module, service)


def fail_load(spec: ModelSpec, gpu: int | None, exc: BaseException) -> LoadFailure:
    """The LOAD's failure for ``exc``, logged once: ``model=NAME gpu=G load failed status=S:
    CAUSE``, in the words of ``base/failures.py``, then the traceback of what user code raised
    (never sent to the client)."""
    if isinstance(exc, LoadFailure):
        return exc  # logged where it was decided
    status, cause, trace = describe(exc)
    logger.error(
        "model=%s gpu=%s load failed status=%d: %s", spec.name, gpu, status, cause, exc_info=trace
    )
    return LoadFailure(status, f"model {spec.name}: {cause}")


def describe(exc: BaseException) -> tuple[int, str, BaseException | None]:
    """A LOAD's failure as (status, cause, what to show the traceback of): our errors carry their
    status, their words and what user code raised (``ContainerError.trace``); anything else is its
    type and message."""
    if hasattr(exc, "status_code"):
        return (
            int(exc.status_code),
            str(getattr(exc, "message", None) or exc),
            getattr(exc, "trace", None),
        )
    if failures.is_out_of_memory(exc):
        return 507, failures.out_of_memory(exc, "loading"), exc
    return 500, failures.raised("loading", exc), exc


def refuse_load(
    connection: socket.socket,
    failure: LoadFailure,
    spec: ModelSpec,
    config: Config,
    drain: bool = True,
) -> None:
    """Fails a frontend connection's LOAD with ``failure`` (its LOAD message already read) and
    closes it. ``drain=False`` where the cause was logged by a process that has ended (its output is
    read already)."""
    # The cause is in the log: give the frontend's log reader a moment to take it before our answer
    # or disconnect makes it stop reading.
    sys.stdout.flush()
    if drain:
        time.sleep(LOG_DRAIN_SECONDS)
    try:
        if failure.status in REPLIED_STATUSES:
            # Statuses the platform acts on are answered; MMS then leaves the model half-registered,
            # which the entrypoint's janitor unregisters (mme_runtime/base/janitor.py).
            mark_failed_load(config.runtime_dir, spec.name, failure.status)
            connection.sendall(create_load_model_response(failure.status, failure.message))
            time.sleep(REPLY_LINGER_SECONDS)
        # Otherwise close without a reply: MMS fails the LOAD with 500 and unregisters the model
        # cleanly.
    except OSError as exc:
        logger.info("model=%s frontend gone before its LOAD was refused: %s", spec.name, exc)
    finally:
        connection.close()


def is_our_handler(handler: str) -> bool:
    """Whether MMS names this container's handler (``handler_service``, with or without
    ``:handle``)."""
    return Path(handler.partition(":")[0]).stem == OUR_HANDLER


def container_reason(handler: str, config: Config) -> str | None:
    """Why no model of this container (or with this handler) can share a host; None when it can."""
    if not config.share_device:
        return "MME_SHARE_DEVICE=false"
    if not is_our_handler(handler):
        return f"its handler {handler} is not this container's"
    return None


def model_reason(model_dir: Path, resolved: ResolvedModel, config: Config) -> str | None:
    """Why this model needs a host of its own; None when it can share."""
    isolation, code_dir = resolved.settings.isolation, resolved.code_dir
    if isolation == "process":
        return "serving.properties sets isolation=process"
    if code_dir is None:
        return None
    if (code_dir / REQUIREMENTS).is_file():
        unmet = unmet_requirements(
            (code_dir / REQUIREMENTS).read_text(encoding="utf-8", errors="replace")
        )
        if unmet:
            return (
                f"its {REQUIREMENTS} asks for what the image does not have: {', '.join(unmet[:3])}"
            )
    helpers = helper_modules(code_dir, config.program)
    if helpers and isolation != "shared" and code_dir == model_dir / "code":
        return (
            f"its code/ holds modules beside {config.program} ({', '.join(helpers[:3])}), imported "
            "by names another model of a shared host could hold (isolation=shared in "
            "serving.properties shares it all the same)"
        )
    return None


def helper_modules(code_dir: Path, program: str) -> list[str]:
    """The importable modules and packages in ``code_dir`` other than the script itself."""
    names = []
    for path in sorted(code_dir.iterdir()):
        if path.suffix == ".py" and path.name != program:
            names.append(path.name)
        elif path.is_dir() and (path / "__init__.py").is_file():
            names.append(f"{path.name}/")
    return names


def unmet_requirements(text: str) -> list[str]:
    """The lines of a requirements file that the installed packages do not satisfy. Options, URLs
    and anything pip alone understands count as unmet: only what can be checked here is trusted."""
    unmet = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            unmet.append(line)
            continue
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # not for this platform: pip would skip it too
        if requirement.url or requirement.extras or not _installed_satisfies(requirement):
            unmet.append(line)
    return unmet


def _installed_satisfies(requirement: Requirement) -> bool:
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return False
    return requirement.specifier.contains(version, prereleases=True)
