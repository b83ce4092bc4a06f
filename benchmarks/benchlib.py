"""Shared pieces of the benchmarks: start a server on a free port, drive it, measure its process tree, print a table.

Benchmarks print tables; they never assert timings (machines here are noisy: compare ratios within one run).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests
from ports import free_port  # tests/, which the benchmarks package puts on the path
from serving import model_tree

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def load(self, name: str, path: Path, **extra: object) -> requests.Response:
        body = {"model_name": name, "url": str(path), **extra}
        return requests.post(f"{self.url}/models", json=body, timeout=600)

    def unload(self, name: str) -> requests.Response:
        return requests.delete(f"{self.url}/models/{name}", timeout=600)

    def tree(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def model_tree(self, name: str) -> list[psutil.Process]:
        """The model's backend server and everything under it."""
        return model_tree(self.tree(), name)


@contextmanager
def serve(command: Sequence[str], env: Mapping[str, str], work_dir: Path, port: int) -> Iterator[Server]:
    work_dir.mkdir(parents=True, exist_ok=True)
    log = work_dir / "server.out"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            list(command),
            env={**os.environ, **env},
            cwd=work_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited early; see {log}")
            try:
                if requests.get(f"{server.url}/ping", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError(f"server did not answer /ping; see {log}")
        yield server
    finally:
        stop(server)


def stop(server: Server) -> None:
    tree = server.tree()
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            pass
    for process in [*tree]:
        try:
            process.kill()
        except psutil.Error:
            pass
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, requirements: Sequence[str], label: str, force: bool = False) -> None:
    """Creates or refreshes a peer's own virtual environment; a marker file records what was installed, so a run
    with the same requirements installs nothing."""
    marker = venv / ".bench-installed"
    wanted = "\n".join(requirements)
    if not force and marker.exists() and marker.read_text() == wanted and venv_python(venv).exists():
        return
    print(f"installing {label} into {venv} (a minute or so)", file=sys.stderr, flush=True)
    if not venv_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip>=24"], check=True)
    subprocess.run([*pip, *requirements], check=True)
    marker.write_text(wanted)


def our_server(work_dir: Path, env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str], int]:
    """Command, environment and port that start this project's server."""
    port = free_port()
    full_env = {
        "SAGEMAKER_BIND_TO_PORT": str(port),
        "MME_RUNTIME_DIR": str(work_dir / "run"),
        "MME_ALLOW_ANY_MODEL_LOCATION": "true",  # benchmarks load from their own temporary directories
        "TMPDIR": str(work_dir),
        "MME_METRICS_PORT": str(free_port()),  # not 9090: benchmarks run servers side by side
        **(env or {}),
    }
    return [sys.executable, str(REPO / "dockerd-entrypoint.py"), "serve"], full_env, port


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: a value that was actually observed (NaN when every request failed)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table, so ``python -m benchmarks --write-docs`` copies the output into the docs as it is."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
