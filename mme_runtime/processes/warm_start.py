"""Warm start: a CUDA-free process with torch and the handler stack imported, from which every model
process is forked: the loaders and the device hosts (``shared_models.py``).

MMS still launches one process per model (the stub in MODEL_SERVER_HOME, ``warm_stub.py``); the stub
hands its command line, environment and stdio to the warm process over a unix socket (SCM_RIGHTS),
then becomes ``head -c 1`` reading that connection. MMS kills the stub to UNLOAD: the model leaves
its hosts when the connection closes. User code is imported only after a fork.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from mme_runtime.base import failures
from mme_runtime.base.child_processes import Watcher, exited_children
from mme_runtime.base.config import Config
from mme_runtime.base.descriptor_table import raise_descriptor_limit
from mme_runtime.huggingface.loading import is_hugging_face_directory
from mme_runtime.models.loading import ModelSpec
from mme_runtime.operations.memory import release_memory
from mme_runtime.processes.warm_protocol import receive

logger = logging.getLogger(__name__)

STDIO_FDS = 3
REQUEST_TIMEOUT_SECONDS = 5.0
TRIM_AFTER_SECONDS = 1.0
WARM_MODULES = (
    "numpy",
    "torch",
    "mms.service",
    "mms.protocol.otf_message_handler",
    "sagemaker_inference.transformer",
    "handler_service",
    "inference_handler",
    "mme_runtime.processes.device_host",
    "mme_runtime.serving.served_model",
)
# Imported where installed: the AWS SDK, which only code in S3 needs (the GPU proof's kit carries
# none).
OPTIONAL_WARM_MODULES = ("boto3",)


class WarmProcess:
    """Accepts stub connections and takes each model in (``shared_models.py``): its loader, its
    connections, its hosts."""

    def __init__(self, listener: socket.socket, config: Config) -> None:
        from mme_runtime.processes.launcher_entries import LauncherEntries
        from mme_runtime.processes.shared_models import SharedModels

        self.listener = listener
        self.config = config
        self.watcher = Watcher()
        self.watcher.watch(listener, self._accept)
        self.launcher_entries = LauncherEntries(config.child_environment())
        self.shared = SharedModels(config, self.watcher, self.launcher_entries.forget)
        self.deaths = failures.Deaths()  # loaders: a signal that kills one is logged with its model
        self._stopping = False
        self._trimmed_at = 0.0  # monotonic
        self._environment: dict[str, str] = {}  # the last stub's, whose values the next one shares

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        self.launcher_entries.start()
        print(f"warm process ready pid={os.getpid()}", flush=True)
        while not self._stopping:
            self.watcher.run_once(0.5)
            self._reap()
            self.shared.tend_hosts()
            self._trim_after_unloads()
        self.launcher_entries.close()
        self.shared.stop()

    def _trim_after_unloads(self) -> None:
        """The heap a burst of UNLOADs freed goes back to the system once the burst is over (glibc
        keeps freed memory unless asked; a trim takes a few ms): ``TRIM_AFTER_SECONDS`` after the
        last UNLOAD. Never in a thread of its own: every fork from here would copy its locks."""
        last = self.shared.last_unload
        if last > self._trimmed_at and time.monotonic() - last > TRIM_AFTER_SECONDS:
            release_memory(None)
            self._trimmed_at = time.monotonic()

    def _on_stop(self, _signum: int, _frame: FrameType | None) -> None:
        self._stopping = True

    def _accept(self) -> None:
        from mme_runtime.base import devices

        connection, _ = self.listener.accept()
        # a client that connects and stalls must not stall us
        connection.settimeout(REQUEST_TIMEOUT_SECONDS)
        try:
            request, fds = receive(connection, with_fds=STDIO_FDS)
        except (OSError, ValueError):
            connection.close()
            return
        connection.settimeout(None)
        if request is not None and isinstance(request.get("env"), dict):
            self._environment = request["env"] = _shared(request["env"], self._environment)
        spec = None if request is None else _spec(request["argv"])
        if request is None or spec is None or len(fds) != STDIO_FDS:
            for fd in fds:
                os.close(fd)
            connection.close()
            return
        # The warm process must stay CUDA-free for every later fork to be usable.
        if devices.cuda_initialized():
            raise RuntimeError(
                "CUDA was initialised in the warm process; it cannot fork model processes"
            )
        self._warm_imports(request["argv"])
        try:
            self.shared.add(spec, request, connection, fds)
            model = self.shared.models.get(spec.name)
            if model is not None and model.loader is not None:
                label = f"model={spec.name} load failed: its loader pid={model.loader}"
                self.deaths.watch(model.loader, label, model.oom_kills)
        except Exception:  # noqa: BLE001
            # one model's arrival must never end the process every model needs
            logger.exception("model=%s could not be taken in: its LOAD fails", spec.name)
            if not self.shared.forget(spec.name):
                # else the stub and its stdio went with the model: closed once
                for fd in fds:
                    os.close(fd)
                connection.close()

    def _reap(self) -> None:
        for pid, code in exited_children():
            if self.launcher_entries.exited(pid):
                continue
            death = self.deaths.exited(pid, code)
            if death is not None:
                logger.error("%s", death)
            self.shared.child_exited(pid, code)

    def _warm_imports(self, argv: list[str]) -> None:
        """Before the first model that needs one of ``LAZY_IMPORTS``, imports it here, once: every
        later such model's processes inherit it instead of importing it again. Containers that serve
        none never pay."""
        model_dir = _model_dir(argv)
        if model_dir is None:
            return
        for label, module, needs in LAZY_IMPORTS:
            try:
                if module in sys.modules or not needs(model_dir):
                    continue
                # imports torch: not before the warm process has it
                from mme_runtime.base import devices

                started = time.monotonic()
                importlib.import_module(module)
                # as after the imports at start: nothing for the forks to inherit
                devices.single_threaded()
                logger.info(
                    "warm process: %s imported seconds=%.2f", label, time.monotonic() - started
                )
            except Exception as exc:  # noqa: BLE001
                # the warm process serves every model: the loader imports it
                logger.warning("warm process: %s not imported for %s: %s", label, model_dir, exc)


def _uses_pt2(model_dir: Path) -> bool:
    properties = model_dir / "serving.properties"
    compiles = properties.is_file() and b"compile" in properties.read_bytes()
    return (model_dir / "model.pt2").is_file() or compiles


# What only some models need, imported once before the first of them (``_warm_imports``).
LAZY_IMPORTS: tuple[tuple[str, str, Callable[[Path], bool]], ...] = (
    # torch.export's archive reader (model.pt2, compile=true): it brings torch's compiler (about 1.2
    # s and 70 MiB).
    ("PyTorch 2 loader", "torch.export.pt2_archive._package", _uses_pt2),
    # transformers and its pipelines, for a Hugging Face directory served with no code
    # (``huggingface/loading.py``).
    ("transformers", "transformers.pipelines", is_hugging_face_directory),
)


def _spec(argv: list[str]) -> ModelSpec | None:
    """The model MMS started this server for, from the arguments it passes (``--model-name``,
    ``--model-path``, ...)."""
    values = dict(zip(argv[1::2], argv[2::2], strict=False))
    try:
        return ModelSpec(
            values["--model-name"], values["--model-path"], values["--handler"], values["--tmp-dir"]
        )
    except KeyError:
        return None


def _model_dir(argv: list[str]) -> Path | None:
    """The model directory in a model process's arguments (MMS passes ``--model-path``)."""
    if "--model-path" not in argv:
        return None
    return Path(argv[argv.index("--model-path") + 1])


def _shared(environment: dict[str, str], previous: dict[str, str]) -> dict[str, str]:
    """``environment`` with the values it shares with ``previous`` (the last stub's) taken from
    there. Every stub sends the same environment, which the warm process keeps for each model's
    hosts: one copy of each value for all of them (about 10 KiB a model otherwise, and a high-water
    mark the heap keeps after they go: issue #37); an equal environment is the last one itself
    (hosts only read it). Not interned: a value goes with the models that have it, where an
    interned string may live for good (Python 3.12)."""
    if environment == previous:
        return previous
    return {
        name: known if (known := previous.get(name)) == value else value
        for name, value in environment.items()
    }


def main() -> int:
    from mme_runtime.base.logs import configure_logging

    config = Config.from_process_env()
    configure_logging(config.log_level)
    for module in WARM_MODULES:
        __import__(module)
    for module in OPTIONAL_WARM_MODULES:
        with contextlib.suppress(ImportError):
            __import__(module)
    from mme_runtime.base import devices
    from mme_runtime.operations import metrics

    # what this process counts; each forked loader and host writes its own
    metrics.start_container(config)
    # loaders and hosts are forked from here: no OpenMP pool for them to inherit
    devices.single_threaded()
    # What the imports made lives as long as every process forked from here: out of the collector's
    # way, so a full collection in a device host (an UNLOAD runs one when a cycle holds what it let
    # go of) walks the models' objects, not torch's.
    gc.freeze()
    raise_descriptor_limit()
    path = Path(config.warm_socket)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    WarmProcess(listener, config).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
