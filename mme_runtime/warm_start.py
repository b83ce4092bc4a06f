"""Warm start: a CUDA-free process with torch and the handler stack imported, from which model servers are forked.

MMS still launches one process per model (the stub in MODEL_SERVER_HOME); the stub hands its command line,
environment and stdio to the warm process over a unix socket (SCM_RIGHTS) and then mirrors the forked server:
it forwards SIGTERM and SIGINT to it and exits with its status. The server watches the stub's connection and stops
when the stub dies (MMS kills the stub on UNLOAD). User code is imported only after the fork.

This module is imported by the stub too: keep its top-level imports light (no torch).
"""

from __future__ import annotations

import array
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from mme_runtime import model_cache
from mme_runtime.config import MIB, Config, process_environment
from mme_runtime.processes import exited_children

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!I")
STDIO_FDS = 3
MAX_MESSAGE = 1 << 20
REQUEST_TIMEOUT_SECONDS = 5.0
# torch.export's archive reader (torch.export.load, AOTInductor packages): it imports torch._inductor and _dynamo.
PT2_LOADER = "torch.export.pt2_archive._package"
WARM_MODULES = (
    "numpy",
    "torch",
    "boto3",
    "mms.service",
    "mms.protocol.otf_message_handler",
    "sagemaker_inference.transformer",
    "handler_service",
    "inference_handler",
    "mme_runtime.backend",
    "mme_runtime.transformer",
)


def _send(sock: socket.socket, payload: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(payload).encode()
    message = HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(message)


def _receive(sock: socket.socket, with_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One framed JSON message (and up to ``with_fds`` descriptors); None when the peer closed."""
    fds: list[int] = []
    ancillary = socket.CMSG_SPACE(with_fds * array.array("i").itemsize) if with_fds else 0
    header, ancdata, _, _ = sock.recvmsg(HEADER.size, ancillary)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[: len(data) - len(data) % array.array("i").itemsize]))
    while header and len(header) < HEADER.size:  # a stream may split even four bytes
        chunk = sock.recv(HEADER.size - len(header))
        if not chunk:
            break
        header += chunk
    if len(header) < HEADER.size:
        return None, fds
    (length,) = HEADER.unpack(header)
    if length > MAX_MESSAGE:
        raise ValueError(f"warm-start message of {length} bytes refused")
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


# ---------------------------------------------------------------------------------------------------------------
# The stub side: runs in the process MMS started, with nothing heavy imported.


def run_via_warm_process(socket_path: str) -> int | None:
    """Asks the warm process to fork our model server and mirrors it; None if there is no warm process."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(socket_path)
    except OSError:
        client.close()
        return None
    request = {"argv": sys.argv, "env": process_environment(), "cwd": os.getcwd()}
    _send(client, request, [0, 1, 2])
    reply, _ = _receive(client)
    if reply is None or "pid" not in reply:
        return None
    server_pid = int(reply["pid"])

    def forward(signum: int, _frame: FrameType | None) -> None:
        try:
            os.kill(server_pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    while True:
        try:
            message, _ = _receive(client)
        except InterruptedError:
            continue
        if message is None:  # the warm process died: so did our server's supervisor, treat it as a crash
            return 1
        if "exit" in message:
            return int(message["exit"])


# ---------------------------------------------------------------------------------------------------------------
# The warm process side.


class WarmProcess:
    """Accepts stub connections and forks a model server for each, reporting each server's exit to its stub."""

    def __init__(self, listener: socket.socket, config: Config) -> None:
        self.listener = listener
        self.config = config
        self.children: dict[int, socket.socket] = {}
        self._stopping = False

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        print(f"warm process ready pid={os.getpid()}", flush=True)
        while not self._stopping:
            readable, _, _ = select.select([self.listener], [], [], 0.5)
            if readable:
                self._accept()
            self._reap()
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _on_stop(self, _signum: int, _frame: FrameType | None) -> None:
        self._stopping = True

    def _accept(self) -> None:
        from mme_runtime import devices

        connection, _ = self.listener.accept()
        connection.settimeout(REQUEST_TIMEOUT_SECONDS)  # a client that connects and stalls must not stall us
        try:
            request, fds = _receive(connection, with_fds=STDIO_FDS)
        except (OSError, ValueError):
            connection.close()
            return
        connection.settimeout(None)
        if request is None or len(fds) != STDIO_FDS:
            for fd in fds:
                os.close(fd)
            connection.close()
            return
        cached = self._prepare_cached_model(request["argv"])
        self._warm_pt2_loader(request["argv"])
        # The warm process must stay CUDA-free for every later fork to be usable.
        if devices.cuda_initialized():
            raise RuntimeError("CUDA was initialised in the warm process; it cannot fork model servers")
        sys.stdout.flush()  # or the child would replay our buffered output into the stub's pipe
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            _become_server(connection, request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        if cached is not None:
            model_cache.cache.add_user(cached, pid)
        self.children[pid] = connection
        _send(connection, {"pid": pid})

    def _reap(self) -> None:
        for pid, code in exited_children():
            model_cache.cache.remove_user(pid)
            connection = self.children.pop(pid, None)
            if connection is None:
                continue
            try:
                _send(connection, {"exit": code})
            except OSError:
                pass  # the stub is gone already
            connection.close()

    def _warm_pt2_loader(self, argv: list[str]) -> None:
        """Before the first model that uses PyTorch 2 artifacts (``model.pt2``, or ``compile=true``), imports torch's
        loader for them here, once: it brings torch's compiler with it (about 1.2 s and 70 MiB), which every later
        such model's server then inherits instead of importing it again. Containers that serve none never pay."""
        model_dir = _model_dir(argv)
        if PT2_LOADER in sys.modules or model_dir is None:
            return
        try:
            properties = model_dir / "serving.properties"
            compiles = properties.is_file() and b"compile" in properties.read_bytes()
            if not ((model_dir / "model.pt2").is_file() or compiles):
                return
            from mme_runtime import fork_safety  # imports torch: not before the warm process has it

            started = time.monotonic()
            __import__(PT2_LOADER)
            fork_safety.single_threaded()  # as after the imports at start: nothing for the forks to inherit
            logger.info("warm process: PyTorch 2 loader imported seconds=%.2f", time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - the warm process serves every model: the server imports it itself
            logger.warning("warm process: PyTorch 2 loader not imported for %s: %s", model_dir, exc)

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
        from mme_runtime.backend import main

        status = main(lifeline=lifeline)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the child must never return into the warm process's loop
        logging.getLogger(__name__).exception("model server failed")
    finally:
        sys.stdout.flush()
        os._exit(status)


def main() -> int:
    from mme_runtime.logs import configure_logging

    config = Config.from_process_env()
    configure_logging(config.log_level)
    for module in WARM_MODULES:
        __import__(module)
    from mme_runtime import fork_safety, metrics

    metrics.start_container(config)  # the model cache's lookups; each forked server then writes its own
    fork_safety.single_threaded()  # model servers are forked from here: no OpenMP pool for them to inherit
    model_cache.cache.limit_bytes = config.model_cache_mb * MIB
    path = Path(config.warm_socket)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    WarmProcess(listener, config).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
