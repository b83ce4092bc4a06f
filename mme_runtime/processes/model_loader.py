"""The loader: a short-lived child of the warm process that runs one model's ``model_fn``,
CUDA-free, and packs the result for its device hosts (``model_package``), then exits: the package
outlives it in the warm process.

It resolves the model once (``loading.resolve_model``) and reports one message to the warm process:
``package`` (with the shared-memory file), ``host_loads`` (the model cannot leave this process: the
host runs ``model_fn`` itself, and the reason is logged) or ``failure`` (the LOAD fails with this
status and message); with ``resolved`` for the hosts, and ``private`` when the model needs a device
host of its own (and why). What a model's requirements install and its code imports here ends with
this process. Its output is the model's log.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mme_runtime.base import devices
from mme_runtime.base.child_processes import fork_child
from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.base.logs import configure_logging
from mme_runtime.huggingface.loading import HuggingFaceModel
from mme_runtime.models.loading import (
    LoadFailure,
    ModelSpec,
    ResolvedModel,
    check_location,
    check_memory,
    container_reason,
    fail_load,
    is_our_handler,
    load_model,
    model_reason,
    resolve_model,
)
from mme_runtime.models.model_package import (
    NotPackable,
    is_torchscript,
    model_file,
    pack,
    pack_torchscript_file,
    unpack,
)
from mme_runtime.models.pt2 import pt2_file
from mme_runtime.operations import metrics
from mme_runtime.processes.warm_protocol import send

logger = logging.getLogger(__name__)

# How long a failed LOAD waits after logging its cause, before MMS hears of the failure
# (_let_the_cause_be_read).
CAUSE_READ_SECONDS = 0.2


def start_loader(
    spec: ModelSpec, request: dict[str, Any], stdio: list[int]
) -> tuple[int, socket.socket]:
    """Forks the model's loader with the stub's stdio, directory and environment (``request``);
    returns its pid and the socket its report arrives on."""
    result, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    run = functools.partial(_run_loader, theirs, spec, request["cwd"])
    title = f"mme-loader {spec.name}"
    try:
        pid = fork_child(title, run, request["env"], stdio, keep=[theirs.fileno()])
    finally:
        theirs.close()
    return pid, result


def _run_loader(result: socket.socket, spec: ModelSpec, cwd: str) -> int:
    """In the forked child, its stdio already the model's: load, report. Returns its exit status."""
    # a crash in model_fn prints its stack to the model's log
    faulthandler.enable(all_threads=False)
    os.chdir(cwd)
    config = Config.from_process_env()
    configure_logging(config.log_level)
    metrics.start_model(config, spec.name, os.getpid())  # counted as loading until it reports
    report, fds = _load(spec, config)
    # what it counted for the container stays; the model's series are the host's
    metrics.stop_model(config)
    if "failure" in report:
        _let_the_cause_be_read()
    send(result, report, fds)
    return 0


def _load(spec: ModelSpec, config: Config) -> tuple[dict[str, Any], list[int]]:
    refused = check_location(spec, config)
    if refused is not None:
        return _failure(refused), []
    private = container_reason(spec.handler, config)
    if not is_our_handler(spec.handler):
        return {
            "host_loads": f"its handler {spec.handler} is MMS's module:function, "
            "which the host initialises",
            "private": private,
        }, []
    model_dir = Path(spec.model_dir)
    try:
        resolved = resolve_model(model_dir, config)
    except ModelLoadError as exc:
        return _failure(fail_load(spec, None, exc)), []
    private = private or model_reason(model_dir, resolved, config)
    report, fds = _load_here(spec, config, resolved)
    if "failure" not in report:
        report["resolved"] = resolved.message()
    if private is not None and "failure" not in report:
        report["private"] = private
        if "package" in report and torch.get_num_threads() != 1:
            # model_fn chose it: its own host runs with it
            report["threads"] = torch.get_num_threads()
    return report, fds


def _load_here(
    spec: ModelSpec, config: Config, resolved: ResolvedModel
) -> tuple[dict[str, Any], list[int]]:
    """``model_fn`` run here, its model packed; or why the host must run it, or why the LOAD
    fails."""
    code = None if resolved.code_dir is None else str(resolved.code_dir)
    try:
        check_memory(spec, config, gpu=None)
        archive = _plain_torchscript(Path(spec.model_dir), resolved, config)
        if archive is not None:  # what the default model_fn would load: its bytes are the package
            started = time.monotonic()
            package = pack_torchscript_file(archive, spec.name)
            logger.info(
                "model=%s loaded seconds=%.2f (TorchScript, packed as it is)",
                spec.name,
                time.monotonic() - started,
            )
            return {"package": {**package.layout, "code": code}}, [package.fd]
        loaded = load_model(spec, batch_size=1, phase="preload", resolved=resolved)
    except LoadFailure as failure:
        if devices.cuda_initialized():
            # on whichever card it took here (all are visible): the host has its own
            return {
                "host_loads": f"model_fn initialised CUDA and failed here ({failure.message}): it "
                "runs in the device host, on the host's GPU"
            }, []
        return _failure(failure), []
    if devices.cuda_initialized():
        return {
            "host_loads": "model_fn initialised CUDA: it runs in the device host, on the host's GPU"
        }, []
    served = loaded.module.service().served
    model = served.model
    if isinstance(model, HuggingFaceModel) and model.remote_code:
        return {
            "host_loads": "its classes come from its directory (trust_remote_code): the host "
            "imports them"
        }, []
    share = config.share_weights and served.settings.share_weights
    try:
        started = time.monotonic()
        package = pack(model, spec.name, hashed=share)
        packed = time.monotonic() - started
    except NotPackable as exc:
        return {"host_loads": str(exc)}, []
    try:
        unpack(package, trial=True)
    except Exception as exc:  # noqa: BLE001 - any reason means the host must load it itself
        package.close()
        return {
            "host_loads": f"{type(model).__name__} does not unpickle: {type(exc).__name__}: {exc}"
        }, []
    logger.info(
        "model=%s packed seconds=%.3f tensors=%d bytes=%d hashed=%s",
        spec.name,
        packed,
        len(package.blobs),
        sum(blob.nbytes for blob in package.blobs),
        share,
    )
    code = None if served.code_dir is None else str(served.code_dir)
    return {"package": {**package.layout, "code": code}, "share_weights": share}, [package.fd]


def _plain_torchscript(model_dir: Path, resolved: ResolvedModel, config: Config) -> Path | None:
    """The model's TorchScript archive, when the defaults alone serve it (no inference script, no
    ``model.pt2``)."""
    code_dir = resolved.code_dir
    if (code_dir is not None and (code_dir / config.program).is_file()) or pt2_file(model_dir):
        return None
    path = model_file(model_dir)
    return path if path is not None and is_torchscript(path) else None


def _let_the_cause_be_read() -> None:
    """The cause of a failed LOAD is logged to the model's stdout, which MMS reads on a thread of
    its own; once our failure reaches MMS it kills the model's process and stops that thread,
    dropping lines it had not read yet (it lost the cause now and then on a busy machine). A failed
    LOAD waits a moment for it: no other model waits."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(CAUSE_READ_SECONDS)


def _failure(failure: LoadFailure) -> dict[str, Any]:
    return {"failure": {"status": failure.status, "message": failure.message}}
