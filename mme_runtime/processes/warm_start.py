"""Warm start: a CUDA-free process with torch and the handler stack imported, from which every model process is
forked: the loaders and device hosts of shared models (``shared_models.py``), and the servers of isolated ones.

MMS still launches one process per model (the stub in MODEL_SERVER_HOME, ``warm_stub.py``); the stub hands its
command line, environment and stdio to the warm process over a unix socket (SCM_RIGHTS). An isolated model's server
watches the stub's connection and stops when the stub dies (MMS kills the stub on UNLOAD); a shared model leaves its
hosts the same way. User code is imported only after a fork.
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
from typing import TYPE_CHECKING, Any

from mme_runtime.base import failures
from mme_runtime.base.child_processes import exited_children, raise_descriptor_limit, readable
from mme_runtime.base.config import Config
from mme_runtime.base.parsing import MIB
from mme_runtime.base.settings import INHERITED_LISTEN_FD
from mme_runtime.huggingface.loading import is_hugging_face_directory
from mme_runtime.models import model_cache, sharing
from mme_runtime.models.loading import ModelSpec
from mme_runtime.processes.warm_protocol import receive, send

if TYPE_CHECKING:
    from mme_runtime.processes.shared_model import SharedModel

logger = logging.getLogger(__name__)

STDIO_FDS = 3
REQUEST_TIMEOUT_SECONDS = 5.0
WARM_MODULES = (
    "numpy",
    "torch",
    "mms.service",
    "mms.protocol.otf_message_handler",
    "sagemaker_inference.transformer",
    "handler_service",
    "inference_handler",
    "mme_runtime.processes.backend",
    "mme_runtime.serving.transformer",
)
# Imported where installed: the AWS SDK, which only code in S3 needs (the GPU proof's kit carries none).
OPTIONAL_WARM_MODULES = ("boto3",)


class WarmProcess:
    """Accepts stub connections and forks a model server for each, reporting each server's exit to its stub."""

    def __init__(self, listener: socket.socket, config: Config) -> None:
        from mme_runtime.processes.shared_models import SharedModels

        self.listener = listener
        self.config = config
        self.children: dict[int, socket.socket] = {}
        self.shared = SharedModels(config, self._isolate, self._descriptors)
        self.deaths = failures.Deaths()  # loaders and servers: a signal that kills one is logged with its model
        self._stopping = False

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        print(f"warm process ready pid={os.getpid()}", flush=True)
        while not self._stopping:
            for sock in readable([self.listener, *self.shared.watched()], 0.5):
                if sock is self.listener:
                    self._accept()
                else:
                    self.shared.readable(sock)
            self._reap()
        self.shared.stop()
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _on_stop(self, _signum: int, _frame: FrameType | None) -> None:
        self._stopping = True

    def _accept(self) -> None:
        from mme_runtime.base import devices

        connection, _ = self.listener.accept()
        connection.settimeout(REQUEST_TIMEOUT_SECONDS)  # a client that connects and stalls must not stall us
        try:
            request, fds = receive(connection, with_fds=STDIO_FDS)
        except (OSError, ValueError):
            connection.close()
            return
        connection.settimeout(None)
        if request is None or len(fds) != STDIO_FDS:
            for fd in fds:
                os.close(fd)
            connection.close()
            return
        # The warm process must stay CUDA-free for every later fork to be usable.
        if devices.cuda_initialized():
            raise RuntimeError("CUDA was initialised in the warm process; it cannot fork model servers")
        self._warm_imports(request["argv"])
        spec = _spec(request["argv"])
        reason = sharing.container_reason(spec.handler, self.config) if spec is not None else "no model named"
        if spec is not None and reason is None:
            try:
                self.shared.add(spec, request, connection, fds)
                loader = getattr(self.shared.models.get(spec.name), "loader", None)
                if loader is not None:
                    self.deaths.watch(loader, f"model={spec.name} load failed: its loader pid={loader}")
            except Exception:  # noqa: BLE001 - one model's arrival must never end the process every model needs
                logger.exception("model=%s could not be taken in: its LOAD fails", spec.name)
                if not self.shared.forget(spec.name):  # else the stub and its stdio went with the model: closed once
                    for fd in fds:
                        os.close(fd)
                    connection.close()
            return
        cached = self._prepare_cached_model(request["argv"])
        pid = self._fork_server(connection, request, fds)
        for fd in fds:
            os.close(fd)
        if cached is not None:
            model_cache.cache.add_user(cached, pid)
        self.children[pid] = connection
        send(connection, {"pid": pid})

    def _fork_server(
        self, lifeline: socket.socket, request: dict[str, Any], stdio: list[int], keep: tuple[int, ...] = ()
    ) -> int:
        """Forks a model server of today's shape (``backend.py``): its own process, executors per device."""
        close = [fd for fd in self._descriptors() if fd not in (lifeline.fileno(), *stdio, *keep)]
        sys.stdout.flush()  # or the child would replay our buffered output into the stub's pipe
        pid = os.fork()
        if pid == 0:
            for fd in close:
                os.close(fd)
            _become_server(lifeline, request, stdio)  # never returns
        self.deaths.watch(pid, f"model={getattr(_spec(request['argv']), 'name', '?')} backend server pid={pid}")
        return pid

    def _isolate(self, model: SharedModel, reason: str) -> int:
        """A shared model moved to a server of its own, which takes over its socket (the frontend reconnects)."""
        listen_fd = model.listener.fileno()
        request = {**model.request, "env": {**model.request["env"], INHERITED_LISTEN_FD: str(listen_fd)}}
        stdio = [os.dup(fd if fd >= 0 else own) for own, fd in enumerate(model.stdio)]  # else the container's log
        try:
            return self._fork_server(model.stub, request, stdio, keep=(listen_fd,))
        finally:
            for fd in stdio:
                os.close(fd)

    def _descriptors(self) -> list[int]:
        """What this process holds that a forked child must not keep open."""
        stubs = [connection.fileno() for connection in self.children.values()]
        return [self.listener.fileno(), *stubs, *self.shared.descriptors()]

    def _reap(self) -> None:
        for pid, code in exited_children():
            model_cache.cache.remove_user(pid)
            death = self.deaths.exited(pid, code)
            if death is not None:
                logger.error("%s", death)
            if self.shared.child_exited(pid, code):
                continue
            connection = self.children.pop(pid, None)
            if connection is None:
                continue
            try:
                send(connection, {"exit": code})
            except OSError:
                pass  # the stub is gone already
            connection.close()

    def _warm_imports(self, argv: list[str]) -> None:
        """Before the first model that needs one of ``LAZY_IMPORTS``, imports it here, once: every later such model's
        processes inherit it instead of importing it again. Containers that serve none never pay."""
        model_dir = _model_dir(argv)
        if model_dir is None:
            return
        for label, module, needs in LAZY_IMPORTS:
            try:
                if module in sys.modules or not needs(model_dir):
                    continue
                from mme_runtime.processes import fork_safety  # imports torch: not before the warm process has it

                started = time.monotonic()
                importlib.import_module(module)
                fork_safety.single_threaded()  # as after the imports at start: nothing for the forks to inherit
                logger.info("warm process: %s imported seconds=%.2f", label, time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - the warm process serves every model: the server imports it
                logger.warning("warm process: %s not imported for %s: %s", label, model_dir, exc)

    def _prepare_cached_model(self, argv: list[str]) -> model_cache.Entry | None:
        """Loads the model into the shared cache before the fork, when the defaults will load it."""
        model_dir = _model_dir(argv)
        if model_dir is None or self.config.model_cache_mb == 0:
            return None
        try:
            return model_cache.cache.prepare(model_dir, self.config.program, self.config.submit_directory)
        except OSError as exc:  # the server will load (and report) it itself
            logger.info("model cache: %s unavailable (%s)", model_dir, exc)
            return None


def _uses_pt2(model_dir: Path) -> bool:
    properties = model_dir / "serving.properties"
    compiles = properties.is_file() and b"compile" in properties.read_bytes()
    return (model_dir / "model.pt2").is_file() or compiles


# What only some models need, imported once before the first of them (``_warm_imports``).
LAZY_IMPORTS: tuple[tuple[str, str, Callable[[Path], bool]], ...] = (
    # torch.export's archive reader (model.pt2, compile=true): it brings torch's compiler (about 1.2 s and 70 MiB).
    ("PyTorch 2 loader", "torch.export.pt2_archive._package", _uses_pt2),
    # transformers and its pipelines, for a Hugging Face directory served with no code
    # (``huggingface/loading.py``).
    ("transformers", "transformers.pipelines", is_hugging_face_directory),
)


def _spec(argv: list[str]) -> ModelSpec | None:
    """The model MMS started this server for, from the arguments it passes (``--model-name``, ``--model-path``, ...)."""
    values = dict(zip(argv[1::2], argv[2::2], strict=False))
    try:
        return ModelSpec(values["--model-name"], values["--model-path"], values["--handler"], values["--tmp-dir"])
    except KeyError:
        return None


def _model_dir(argv: list[str]) -> Path | None:
    """The model directory in a model server's arguments (MMS passes ``--model-path``)."""
    if "--model-path" not in argv:
        return None
    return Path(argv[argv.index("--model-path") + 1])


def _become_server(lifeline: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: take the stub's stdio, arguments, environment and directory, then run the server."""
    import setproctitle

    status = 1
    try:
        # Forked processes keep the warm process's command line; name the model so ps (and tests) can tell.
        # Before the environment is replaced: setproctitle finds the argv memory through it.
        setproctitle.setproctitle(f"mme-backend {' '.join(request['argv'][1:])}")
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        from mme_runtime.processes.backend import main

        status = main(lifeline=lifeline)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the child must never return into the warm process's loop
        logging.getLogger(__name__).exception("model server failed")
    finally:
        sys.stdout.flush()
        os._exit(status)


def main() -> int:
    from mme_runtime.base.logs import configure_logging

    config = Config.from_process_env()
    configure_logging(config.log_level)
    for module in WARM_MODULES:
        __import__(module)
    for module in OPTIONAL_WARM_MODULES:
        with contextlib.suppress(ImportError):
            __import__(module)
    from mme_runtime.operations import metrics
    from mme_runtime.processes import fork_safety

    metrics.start_container(config)  # the model cache's lookups; each forked server then writes its own
    fork_safety.single_threaded()  # model servers are forked from here: no OpenMP pool for them to inherit
    # What the imports made lives as long as every process forked from here: out of the collector's way, so a full
    # collection in a device host (each UNLOAD runs one) walks the models' objects, not torch's.
    gc.freeze()
    model_cache.cache.limit_bytes = config.model_cache_mb * MIB
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
