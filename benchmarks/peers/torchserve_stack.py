"""TorchServe 0.12 as a benchmark peer: a TorchScript model.pt behind TorchServe's own dynamic
batching.

Lives in its own virtual environment (never the project's, nor the stock stack's) and is started
isolated: its own properties file (inference, management, metrics and gRPC addresses on free ports
of 127.0.0.1), model store, logs and temporary directory, so it can run beside our server and the
stock stack on a shared machine. Benchmark support only.

    ensure_venv()
    mar = archive_model(model_dir, work_dir / "store", "mlp")
    with serve_torchserve(work_dir) as ts:
        ts.register("mlp", mar, batch_size=16, max_batch_delay_ms=10).raise_for_status()
        ts.predict("mlp", b"[[0.1, 0.2, 0.3, 0.4]]").json()  # -> [[...]]
        ts.unregister("mlp")
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests
from ports import free_port

from benchmarks import benchlib
from benchmarks.benchlib import REPO, Server, venv_python
from benchmarks.peers.stock_stack import serve_isolated

TORCHSERVE_VENV = REPO / ".torchserve-venv"
# torch is pinned exactly: 2.13.0 resolves to the local CPU wheel, anything looser downloads
# gigabytes of CUDA. torchserve 0.12.0 declares only psutil, Pillow, packaging and wheel, yet every
# worker imports yaml (its metrics cache); numpy is for our handler's NPY bodies. nvgpu/pynvml are
# imported only for GPU system metrics, which we turn off (and this machine has no GPU).
TORCHSERVE_REQUIREMENTS = (
    "torch==2.13.0",
    "torchserve==0.12.0",
    "torch-model-archiver==0.12.0",
    "pyyaml",
    "numpy",
)
_PACKAGES = ("torch", "torchserve", "torch-model-archiver", "numpy")
# TorchServe imports the handler by its file name: keep it unlikely to clash
HANDLER_MODULE = "bench_ts_handler"
REQUEST_TIMEOUT_SECONDS = 600

# The handler every archive gets. TorchServe calls handle(None, context) once when a worker starts,
# then handle(batch, context) with up to batch_size requests. The frontend's worker has already
# decoded JSON bodies (Content-Type application/json) into Python objects; other bodies arrive as
# bytes. Requests whose inputs share a trailing shape and dtype run as one forward pass; each
# answers only its own rows, or a 400 of its own.
HANDLER_SOURCE = '''"""TorchServe handler for benchmarks: TorchScript model.pt; JSON rows or NPY in,
JSON rows out."""
import io
import json
import os

import numpy as np
import torch

_model = None


def _decode(request):
    body = request.get("body")
    if body is None:
        body = request.get("data")
    if isinstance(body, (bytes, bytearray)):
        if bytes(body[:6]) == b"\\x93NUMPY":
            array = np.load(io.BytesIO(body), allow_pickle=False)
            return torch.from_numpy(np.ascontiguousarray(array))
        body = json.loads(body)
    elif isinstance(body, str):
        body = json.loads(body)
    tensor = torch.tensor(body, dtype=torch.float32)
    return tensor.unsqueeze(0) if tensor.dim() == 1 else tensor  # a flat list is one row


def handle(data, context):
    global _model
    if data is None:  # worker start
        model_dir = context.system_properties["model_dir"]
        _model = torch.jit.load(os.path.join(model_dir, "model.pt"), map_location="cpu").eval()
        return None
    answers = [None] * len(data)
    groups = {}
    for index, request in enumerate(data):
        try:
            tensor = _decode(request)
            if tensor.dim() == 0:
                raise ValueError("expected rows, got a scalar")
        except Exception as error:  # this request only
            context.set_response_status(400, f"cannot decode the body: {error}", index)
            answers[index] = json.dumps({"error": str(error)})
            continue
        groups.setdefault((tuple(tensor.shape[1:]), tensor.dtype), []).append((index, tensor))
    for members in groups.values():
        indexes = [index for index, _ in members]
        tensors = [tensor for _, tensor in members]
        with torch.inference_mode():
            output = _model(tensors[0] if len(tensors) == 1 else torch.cat(tensors))
        for index, rows in zip(indexes, output.split([t.shape[0] for t in tensors])):
            answers[index] = json.dumps(rows.tolist())
    for index in range(len(data)):
        context.set_response_content_type(index, "application/json")
    return answers
'''

# ``torchserve --foreground`` is a Python launcher that starts the Java frontend as a child and
# waits for it; SIGTERM ends the launcher at once and leaves the JVM to be SIGKILLed by
# benchlib.stop. So we run the launcher's own code (its checks and its JVM command line) but exec
# the JVM in its place: SIGTERM then reaches TorchServe itself, whose shutdown hook stops its
# workers.
_LAUNCHER = """
import os, sys
from ts import model_server

class _ExecInstead:
    def __init__(self, command, *args, **kwargs):
        os.execvp(command[0], command)

model_server.subprocess.Popen = _ExecInstead
sys.argv[0] = "torchserve"
model_server.start()
"""

# Run by the TorchServe venv's interpreter: the installed versions, without importing torch.
_PROBE = (
    "import json, sys; from importlib.metadata import version; print(json.dumps({n: version(n) for "
    "n in sys.argv[1:]}))"
)


def ensure_venv(venv: Path = TORCHSERVE_VENV, force: bool = False) -> None:
    benchlib.ensure_venv(venv, TORCHSERVE_REQUIREMENTS, "TorchServe", force)


def installed_versions(venv: Path = TORCHSERVE_VENV) -> dict[str, str]:
    """Versions of torch, torchserve, torch-model-archiver and numpy in ``venv``; raises if torch is
    not 2.13.0."""
    probe = subprocess.run(
        [str(venv_python(venv)), "-c", _PROBE, *_PACKAGES],
        check=True,
        capture_output=True,
        text=True,
    )
    versions: dict[str, str] = json.loads(probe.stdout)
    if not versions["torch"].startswith("2.13.0"):
        raise RuntimeError(
            f"{venv} has torch {versions['torch']}, not 2.13.0; rerun ensure_venv(force=True)"
        )
    return versions


def archive_model(
    model_dir: Path,
    model_store: Path,
    name: str,
    venv: Path = TORCHSERVE_VENV,
    archive_format: str = "default",
) -> Path:
    """``model_dir``'s TorchScript model.pt and :data:`HANDLER_SOURCE` as ``model_store/name.mar``;
    its path.

    ``archive_format`` is torch-model-archiver's: "default" (a deflated zip, which TorchServe unzips
    into its temporary directory at every registration), "zip-store" (the same, not compressed) or
    "no-archive" (a plain directory ``model_store/name``, registered without unpacking).
    """
    model_store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ts-handler-") as scratch:
        handler = Path(scratch) / f"{HANDLER_MODULE}.py"
        handler.write_text(HANDLER_SOURCE, encoding="utf-8")
        subprocess.run(
            [
                str(venv / "bin" / "torch-model-archiver"),
                "--model-name",
                name,
                "--version",
                "1.0",
                "--serialized-file",
                str(model_dir / "model.pt"),
                "--handler",
                str(handler),
                "--export-path",
                str(model_store),
                "--archive-format",
                archive_format,
                "--force",
            ],
            check=True,
        )
    return model_store / (name if archive_format == "no-archive" else f"{name}.mar")


@dataclass
class TorchServe:
    """A running TorchServe: its process (``server``), inference and management URLs."""

    server: Server
    inference_url: str
    management_url: str
    model_store: Path

    def register(
        self,
        name: str,
        archive: Path,
        batch_size: int = 1,
        max_batch_delay_ms: int = 100,
        workers: int = 1,
        timeout_s: int = 120,
    ) -> requests.Response:
        """Registers ``archive`` (in the model store) as ``name``; answers once its ``workers`` are
        up (200)."""
        params: dict[str, str | int] = {
            "url": archive.relative_to(self.model_store).as_posix(),
            "model_name": name,
            "batch_size": batch_size,
            "max_batch_delay": max_batch_delay_ms,
            "initial_workers": workers,  # also min and max: no scaling
            "response_timeout": timeout_s,
            "synchronous": "true",
        }
        return requests.post(
            f"{self.management_url}/models", params=params, timeout=REQUEST_TIMEOUT_SECONDS
        )

    def unregister(self, name: str) -> requests.Response:
        return requests.delete(
            f"{self.management_url}/models/{name}", timeout=REQUEST_TIMEOUT_SECONDS
        )

    def predictions_url(self, name: str) -> str:
        return f"{self.inference_url}/predictions/{name}"

    def predict(
        self,
        name: str,
        body: bytes,
        content_type: str = "application/json",
        session: requests.Session | None = None,
    ) -> requests.Response:
        post = (session or requests).post
        return post(
            self.predictions_url(name),
            data=body,
            headers={"Content-Type": content_type},
            timeout=REQUEST_TIMEOUT_SECONDS,
        )

    def model_processes(self, name: str) -> list[psutil.Process]:
        """The model's worker processes (and anything under them), by the pids its DESCRIBE lists.

        Workers are ``python ts/model_service_worker.py`` children of the Java frontend; their
        command lines do not name the model, the management API does."""
        described = requests.get(
            f"{self.management_url}/models/{name}", timeout=REQUEST_TIMEOUT_SECONDS
        )
        described.raise_for_status()
        processes = []
        for version in described.json():
            for worker in version.get("workers", []):
                try:
                    process = psutil.Process(int(worker["pid"]))
                    processes += [process, *process.children(recursive=True)]
                except (KeyError, ValueError, psutil.Error):
                    continue
        return processes


def torchserve_properties(
    work_dir: Path, ports: Mapping[str, int], extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The config.properties settings we start with (``extra`` overrides them)."""
    return {
        "inference_address": f"http://127.0.0.1:{ports['inference']}",
        "management_address": f"http://127.0.0.1:{ports['management']}",
        "metrics_address": f"http://127.0.0.1:{ports['metrics']}",
        # gRPC servers always start, on 7070 and 7071 unless told otherwise: a second instance would
        # fail.
        "grpc_inference_address": "127.0.0.1",
        "grpc_management_address": "127.0.0.1",
        "grpc_inference_port": str(ports["grpc_inference"]),
        "grpc_management_port": str(ports["grpc_management"]),
        "model_store": str(work_dir / "store"),
        # 0.12 turns both on by default: the model API off (no register/unregister), token
        # authorization on.
        "enable_model_api": "true",
        "disable_token_authorization": "true",
        # default: one per CPU core (or GPU); register() sets it anyway
        "default_workers_per_model": "1",
        # default 100: requests beyond it answer 503 under high concurrency
        "job_queue_size": "1000",
        "max_request_size": str(100 * 2**20),  # default 6553500 bytes
        "max_response_size": str(100 * 2**20),
        "vmargs": "-Xmx1g -XX:+ExitOnOutOfMemoryError",
        # else a Python process is started every minute to collect them
        "disable_system_metrics": "true",
        "install_py_dep_per_model": "false",
        **(extra or {}),
    }


def torchserve_server(
    work_dir: Path, venv: Path = TORCHSERVE_VENV, properties: Mapping[str, str] | None = None
) -> tuple[list[str], dict[str, str], dict[str, int]]:
    """Command, environment and ports that start TorchServe in the foreground, isolated under
    ``work_dir``.

    The process started is the launcher's code, which becomes the JVM (see ``_LAUNCHER``); its
    workers share the session ``benchlib.serve`` starts. ``TMPDIR`` isolates Python's temporary
    files; ``TEMP`` becomes the JVM's java.io.tmpdir: the workers' Unix sockets
    (``.ts.sock.9000``...) and unpacked archives go there, so two instances never meet. Logs go to
    ``work_dir/logs`` (its log4j2.xml reads ``LOG_LOCATION``).
    """
    for sub in ("store", "tmp", "logs"):
        (work_dir / sub).mkdir(parents=True, exist_ok=True)
    ports: dict[str, int] = {}
    for role in ("inference", "management", "metrics", "grpc_inference", "grpc_management"):
        port = free_port()
        while port in ports.values():
            port = free_port()
        ports[role] = port
    config = work_dir / "config.properties"
    settings = torchserve_properties(work_dir, ports, properties)
    config.write_text(
        "".join(f"{key}={value}\n" for key, value in settings.items()), encoding="utf-8"
    )
    command = [
        str(venv_python(venv)),
        "-c",
        _LAUNCHER,
        "--start",
        "--foreground",
        "--ts-config",
        str(config),
        "--model-store",
        settings["model_store"],
        "--ncs",  # no config snapshots (they would restore models at the next start)
        "--disable-token-auth",
        "--enable-model-api",
    ]
    env = {
        "TMPDIR": str(work_dir / "tmp"),
        "TEMP": str(work_dir / "tmp"),
        "LOG_LOCATION": str(work_dir / "logs"),
        "METRICS_LOCATION": str(work_dir / "logs"),
    }
    return command, env, ports


@contextmanager
def serve_torchserve(
    work_dir: Path, venv: Path = TORCHSERVE_VENV, properties: Mapping[str, str] | None = None
) -> Iterator[TorchServe]:
    """TorchServe started isolated under ``work_dir`` (answering /ping); stopped, with every process
    it started killed, on exit. Archives go in ``work_dir/store`` (:func:`archive_model`)."""
    command, env, ports = torchserve_server(work_dir, venv, properties)
    with serve_isolated("torchserve", command, env, work_dir, ports["inference"]) as server:
        yield TorchServe(
            server=server,
            inference_url=f"http://127.0.0.1:{ports['inference']}",
            management_url=f"http://127.0.0.1:{ports['management']}",
            model_store=work_dir / "store",
        )
