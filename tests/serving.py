"""A real server for tests: ``dockerd-entrypoint.py serve`` on a free port, driven over HTTP.

As in gunicorn's signal tests: its own session, output to a file (never a PIPE that can fill), polled until
``/ping`` answers, ``pytest.fail`` with the log when it does not, and stopped by SIGTERM then SIGKILL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import requests
from ports import free_port

ENTRYPOINT = Path(__file__).resolve().parent.parent / "dockerd-entrypoint.py"
START_TIMEOUT_SECONDS = 120
STUB_TITLE = "mme-model-stub"  # mme_runtime.processes.warm_stub
HOST_TITLE = "mme-device-host"  # mme_runtime.processes.device_host
REQUEST_TIMEOUT_SECONDS = 90


@dataclass
class RunningServer:
    url: str
    home: Path
    models: Path
    log: Path
    process: subprocess.Popen[bytes]
    metrics_port: int = 0
    log_start: int = 0  # where log_text starts reading: a module sharing the server sees its own lines (borrowed)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def model_dir(self, name: str) -> Path:
        return self.models / name

    def load(self, name: str, model_dir: Path | None = None, **extra: Any) -> requests.Response:
        """LOADs ``name`` and waits for a batching model's connections (``wait_for_batching_workers``)."""
        response = self._post_load(name, model_dir, **extra)
        if response.status_code == 200:
            self.wait_for_batching_workers(name)
        return response

    def _post_load(self, name: str, model_dir: Path | None = None, **extra: Any) -> requests.Response:
        """The LOAD request alone."""
        body = {"model_name": name, "url": str(model_dir or self.model_dir(name)), **extra}
        return requests.post(f"{self.url}/models", json=body, timeout=REQUEST_TIMEOUT_SECONDS)

    def load_all(self, names: Iterable[str]) -> None:
        """LOADs each of ``names`` (each must answer 200), then waits for the batching connections of all: the scaler
        adds a model's about a second after its LOAD, for every model that asked by then."""
        names = list(names)
        for name in names:
            response = self._post_load(name)
            assert response.status_code == 200, f"{name}: {response.text}\n{self.log_text()[-3000:]}"
        for name in names:
            self.wait_for_batching_workers(name)

    def wait_for_batching_workers(self, name: str, timeout: float = 10) -> None:
        """A batching model gets the connections that fill its batches from the entrypoint's scaler shortly after its
        LOAD answers (``operations/scaler.py``): wait until they are asked for, so that a test's first burst batches."""
        request = self.home / "run" / "worker-requests" / urllib.parse.quote(name, safe="")
        wait_until(lambda: not request.exists(), timeout)

    def invoke(
        self,
        name: str,
        body: bytes | str,
        content_type: str | None = "application/json",
        accept: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> requests.Response:
        all_headers = dict(headers or {})
        if content_type is not None:
            all_headers["Content-Type"] = content_type
        if accept is not None:
            all_headers["Accept"] = accept
        return requests.post(
            f"{self.url}/models/{name}/invoke", data=body, headers=all_headers, timeout=REQUEST_TIMEOUT_SECONDS
        )

    def unload(self, name: str) -> requests.Response:
        return requests.delete(f"{self.url}/models/{name}", timeout=REQUEST_TIMEOUT_SECONDS)

    def describe(self, name: str) -> requests.Response:
        return requests.get(f"{self.url}/models/{name}", timeout=REQUEST_TIMEOUT_SECONDS)

    def log_text(self) -> str:
        with open(self.log, "rb") as log:
            log.seek(self.log_start)
            return log.read().decode(errors="replace")

    def model_names(self) -> set[str]:
        """Every model LIST names, all pages."""
        names: set[str] = set()
        token = None
        while True:
            params = {"limit": 100, **({"next_page_token": token} if token else {})}
            page = requests.get(f"{self.url}/models", params=params, timeout=REQUEST_TIMEOUT_SECONDS).json()
            names |= {model["modelName"] for model in page["models"]}
            token = page.get("nextPageToken")
            if not token:
                return names

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def backend_server(self, model_name: str) -> psutil.Process | None:
        """The process MMS started for the model: its stub."""
        return find_backend_server(self.descendants(), model_name)

    def shares_device_host(self, model_name: str) -> bool:
        """Whether the model is served by the shared hosts: it has no device host of its own."""
        processes = self.backend_processes(model_name)
        return len(processes) == 1 and is_stub(processes[0])

    def worker_pids(self, model_name: str) -> set[int]:
        """The pids of the processes that serve the model: its device hosts. The model must be loaded."""
        assert self.backend_server(model_name) is not None, f"no process for {model_name}"
        return self.hosts_of(model_name)

    def hosts_of(self, model_name: str) -> set[int]:
        """The device hosts serving ``model_name``: each keeps the model's metrics in a directory named by its pid."""
        hosts = {process.pid for process in device_hosts(self.descendants())}
        directory = self.home / "run" / "metrics" / "models" / urllib.parse.quote(model_name, safe="")
        named = {int(path.name) for path in directory.iterdir() if path.name.isdigit()} if directory.is_dir() else set()
        return hosts & named

    def backend_processes(self, model_name: str) -> list[psutil.Process]:
        """The processes the model has of its own: its stub, and its device host if it has one of its own (whose
        title names the model as the stub's does)."""
        found = []
        for process in alive(self.descendants()):
            with contextlib.suppress(psutil.Error):
                words = " ".join(process.cmdline()).split()
                if "--model-name" in words and words[words.index("--model-name") + 1] == model_name:
                    found.append(process)
        return found


def label_scores(server: RunningServer, name: str, text: str) -> list[float]:
    """A text classifier's score for every label of ``text``, sorted: what its answer says, whatever the order (the
    answer to one text may come nested one list deeper)."""
    response = server.invoke(name, json.dumps({"inputs": text, "parameters": {"top_k": None}}))
    assert response.status_code == 200, response.text
    answers = response.json()
    if answers and isinstance(answers[0], list):
        (answers,) = answers
    return sorted(answer["score"] for answer in answers)


def answers_as_expected_under_clients(
    server: RunningServer, expected: Mapping[tuple[str, str], list[float]], rounds: int = 4, clients: int = 16
) -> None:
    """Asks every (model, text) of ``expected`` ``rounds`` times from ``clients`` concurrent clients; each answer's
    label scores must be that model's for that text (1e-4): every client gets its own answer."""
    calls = [call for _ in range(rounds) for call in expected]
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda call: label_scores(server, *call), calls))
    for call, answer in zip(calls, answers, strict=True):
        assert answer == pytest.approx(expected[call], abs=1e-4), call


def batch_passes(server: RunningServer, model: str) -> tuple[float, float]:
    """(forward passes, requests in them) that the batcher recording into ``model``'s series has run, from
    ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.metrics_url, timeout=30).text
    found = {"count": 0.0, "sum": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("mme_batch_size_count", "mme_batch_size_sum") and sample.labels.get("model") == model:
                found[sample.name.rsplit("_", 1)[1]] += sample.value
    return found["count"], found["sum"]


def host_memory_bytes(server: RunningServer) -> dict[str, float]:
    """``mme_model_host_memory_bytes`` by model, as the metrics endpoint says now."""
    return by_model(server.metrics_url, "mme_model_host_memory_bytes")


def by_model(metrics_url: str, sample_name: str) -> dict[str, float]:
    """A per-model series' value by model, as the Prometheus endpoint at ``metrics_url`` says now (the benchmarks
    read it too)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(metrics_url, timeout=60).text
    return {
        sample.labels["model"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == sample_name
    }


def npy(value: Any, allow_pickle: bool = True) -> bytes:
    """``value`` as an ``application/x-npy`` body, as the SageMaker SDK's NumpySerializer writes it."""
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(value), allow_pickle=allow_pickle)
    return buffer.getvalue()


def invoke_many(server: RunningServer, name: str, body: str, count: int, clients: int = 8) -> list[dict[str, Any]]:
    """``count`` invocations from ``clients`` threads at once; every answer must be 200. Returns the JSON bodies."""
    with ThreadPoolExecutor(clients) as pool:
        responses = list(pool.map(lambda _: server.invoke(name, body), range(count)))
    assert [r.status_code for r in responses] == [200] * count, [r.text for r in responses if r.status_code != 200]
    return [r.json() for r in responses]


def find_backend_server(processes: list[psutil.Process], model_name: str) -> psutil.Process | None:
    """The process MMS started for the model among ``processes``: its stub (``cat`` once the warm process took the
    model), which MMS kills to UNLOAD."""
    for process in processes:
        try:
            words = " ".join(process.cmdline()).split()
            parent = process.parent()
        except psutil.Error:
            continue
        if "--model-name" not in words or words[words.index("--model-name") + 1] != model_name:
            continue
        if parent is not None and parent.name() == "java":
            return process
    return None


def is_stub(process: psutil.Process) -> bool:
    """Whether ``process`` is the stub of a model that shares the device hosts (``cat``, titled after the model)."""
    try:
        return process.cmdline()[0].startswith(STUB_TITLE)
    except (psutil.Error, IndexError):
        return False


def device_hosts(processes: list[psutil.Process]) -> list[psutil.Process]:
    hosts = []
    for process in processes:
        try:
            if process.cmdline() and process.cmdline()[0].startswith(HOST_TITLE):
                hosts.append(process)
        except psutil.Error:
            continue
    return hosts


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (a zombie has exited: only its parent has not collected it yet)."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            continue
    return running


def pss_mib(processes: list[psutil.Process]) -> float:
    """Proportional set size: shared (copy-on-write) pages are split between the processes sharing them."""
    total = 0
    for process in processes:
        try:
            total += process.memory_full_info().pss
        except psutil.Error:
            continue
    return total / 2**20


def wait_until(predicate: Any, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@contextmanager
def start_server(home: Path, env: Mapping[str, str] | None = None) -> Iterator[RunningServer]:
    """Starts the entrypoint with its runtime directory and model root under ``home``."""
    port = free_port()
    # Never the default 9090: tests run servers side by side, and the CI machine may use that port.
    metrics_port = int((env or {}).get("MME_METRICS_PORT") or free_port())
    models = home / "models"
    models.mkdir(parents=True, exist_ok=True)
    share_inductor_cache(home)
    log = home / "server.out"
    full_env = {
        **os.environ,
        "SAGEMAKER_BIND_TO_PORT": str(port),
        "MME_RUNTIME_DIR": str(home / "run"),
        "MME_MODEL_ROOT": str(models),
        "TMPDIR": str(home),
        # Tests that count forward passes burst at a batching model as soon as it loads: they get the connections
        # of its whole batch at LOAD. test_batching checks the default, connections opened as requests overlap.
        "MME_BATCH_CONNECTIONS_AT_LOAD": "1024",
        **(env or {}),
        "MME_METRICS_PORT": str(metrics_port),
    }
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(ENTRYPOINT), "serve"],
            cwd=home,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = RunningServer(f"http://127.0.0.1:{port}", home, models, log, process, metrics_port)
    try:
        if not wait_until(lambda: _ping(server) or process.poll() is not None, START_TIMEOUT_SECONDS, 0.25):
            pytest.fail(f"server did not answer /ping in {START_TIMEOUT_SECONDS} s:\n{_tail(log)}")
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode} before answering /ping:\n{_tail(log)}")
        yield server
    finally:
        stop_server(server)


def share_inductor_cache(tmpdir: Path) -> None:
    """Points torch's compile cache under ``tmpdir`` (a server's TMPDIR) at this process's, as a container's processes
    share theirs: else each server compiles its kernels and precompiles torch's headers (280 MB) cold, 15 to 50 s for
    its first compile=true LOAD. A symlink, not TORCHINDUCTOR_CACHE_DIR: torch puts the headers under
    ``tempfile.gettempdir()`` whatever that says (``_HEADER_DIR`` in torch/_inductor/codecache.py). The server's own
    compile cache (MME_CACHE_DIR) stays the server's."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    link = tmpdir / Path(default_cache_dir()).name
    if not link.exists():
        link.symlink_to(cache_dir(), target_is_directory=True)


@contextmanager
def borrowed(server: RunningServer) -> Iterator[RunningServer]:
    """``server`` for tests that share it (a module, or one test): its ``log_text`` starts here, and every model
    loaded meanwhile is unloaded at the end, so that the next borrower finds the server as it was. Borrowers give
    their models names no other borrower uses."""
    before = server.model_names()
    try:
        yield dataclasses.replace(server, log_start=server.log.stat().st_size)
    finally:
        for name in sorted(server.model_names() - before):
            server.unload(name)


def stop_server(server: RunningServer, grace: float = 30) -> int | None:
    """SIGTERM the entrypoint, wait, then SIGKILL whatever of its tree is left. Returns its exit status."""
    tree = server.descendants()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        status: int | None = server.process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        status = None
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()
    return status


def _ping(server: RunningServer) -> bool:
    try:
        return requests.get(f"{server.url}/ping", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _tail(log: Path, lines: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
