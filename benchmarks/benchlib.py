"""Shared pieces of the benchmarks: start a server on a free port, drive it, measure its process
tree, print a table.

Memory is measured one way for every stack: the memory of the server's whole process tree
(``Server.tree()``: every descendant of the process the benchmark started) is the PSS of its
processes (``Pss`` from /proc/PID/smaps_rollup, summed) plus the shared-memory files (memfd,
/dev/shm) they hold open but none of them maps, which PSS cannot see (our warm process keeps a
TorchScript model's package so, while the host holds the loaded copy). What a model costs is how
much that grows from before its LOAD to after it has answered, each reading taken after
``SETTLE_SECONDS`` without requests (``Server.tree_memory_mib``). A tree delta sees the model
wherever it lives: in processes of its own (an isolated model of ours, a stock MMS worker) or in
processes that were already running (our device hosts, which serve every shareable model; MMS's
per-model process is then a stub that holds nothing). Copy-on-write and shared-library pages count
once, split between the processes that map them (processes of other servers included), so a new
process is charged only for what it adds. ``load_baseline`` loads unrelated tiny models first, so
that the device hosts the measured model will use are already running and in the "before" reading.

Benchmarks print tables; they never assert timings (machines here are noisy: compare ratios within
one run).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
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
from serving import device_hosts, is_stub, pss_mib

REPO = Path(__file__).resolve().parent.parent
# before each memory reading: let exits, frees and the device hosts' unloads finish
SETTLE_SECONDS = 2.0
# Unrelated tiny models loaded before any memory is measured: one per CPU device host
# (MME_CPU_HOSTS, 2 by default), since a shareable model goes to the host with the fewest models and
# each host is forked on first use.
BASELINE_MODELS = 2
# Throughput benchmarks compare steady states: a batching model of ours opens its batch's
# connections at LOAD, as a peer starts its workers, instead of the first time its requests overlap
# (docs/batching.md#enough-connections).
BATCH_CONNECTIONS_AT_LOAD = {"MME_BATCH_CONNECTIONS_AT_LOAD": "1024"}


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

    def processes(self) -> list[psutil.Process]:
        """The process the benchmark started (our entrypoint: the supervisor's sweeps and the
        metrics exporter run there) and ``tree()``."""
        try:
            return [psutil.Process(self.process.pid), *self.tree()]
        except psutil.NoSuchProcess:
            return self.tree()

    def tree_memory_mib(self, settle: float = SETTLE_SECONDS, entrypoint: bool = False) -> float:
        """The memory of the processes in ``tree()`` (with ``entrypoint``, of ``processes()``),
        MiB, read after ``settle`` seconds of quiet: their PSS, summed, plus the shared-memory files
        they hold but do not map."""
        time.sleep(settle)
        processes = self.processes() if entrypoint else self.tree()
        return pss_mib(processes) + unmapped_shared_memory_mib(processes)

    def frontend_memory_mib(self) -> float:
        """The PSS of MMS's frontend (its Java process), MiB: the part of ``tree_memory_mib`` that
        MMS itself costs (read right after it)."""
        frontend = []
        for process in self.tree():
            try:
                if process.name() == "java":
                    frontend.append(process)
            except psutil.Error:
                continue
        return pss_mib(frontend)

    def model_processes(self, name: str) -> list[psutil.Process]:
        """The processes whose command line names the model (``--model-name NAME``): MMS's process
        for it (a stock worker, our stub or our isolated model's server) and, for our isolated
        model, its executors."""
        named = []
        for process in self.tree():
            try:
                # a retitled process's command line is one string
                words = " ".join(process.cmdline()).split()
            except psutil.Error:
                continue
            if "--model-name" in words[:-1] and words[words.index("--model-name") + 1] == name:
                named.append(process)
        return named

    def unload_and_wait(self, name: str, timeout: float = 60) -> None:
        """UNLOAD, then wait until the model's memory is given back, so that the next "before"
        reading does not include it: until no process names the model, and for a model of our device
        hosts (its process is a stub) until every host that logged it ready has logged it unloaded
        (a host drops a model after its stub exits)."""
        shared = any(is_stub(process) for process in self.model_processes(name))
        unloaded = self.unload(name)
        if unloaded.status_code != 200:
            raise RuntimeError(
                f"UNLOAD {name} answered {unloaded.status_code}: {unloaded.text[:300]}; see "
                f"{self.log}"
            )
        deadline = time.monotonic() + timeout
        while self.model_processes(name) or (shared and not self._hosts_unloaded(name)):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name}: not unloaded {timeout:.0f} s after UNLOAD; see {self.log}"
                )
            time.sleep(0.1)

    def _hosts_unloaded(self, name: str) -> bool:
        """Whether each device host that logged ``model=NAME device=... ready`` has logged
        ``model=NAME unloaded from the device host`` (mme_runtime.serving.served_model and
        mme_runtime.processes.device_host)."""
        text = self.log.read_text(errors="replace")
        model = re.escape(f"model={name} ")
        ready = len(re.findall(model + "device=", text))
        return len(re.findall(model + "unloaded from the device host", text)) >= max(ready, 1)

    def load_and_answer(
        self, name: str, path: Path, body: bytes, timeout: float = 300, **extra: object
    ) -> None:
        """LOAD, then invoke until the model answers 200 (MMS answers LOAD once its workers are up,
        but a caller counts from the first answer)."""
        loaded = self.load(name, path, **extra)
        if loaded.status_code != 200:
            raise RuntimeError(
                f"LOAD {name} answered {loaded.status_code}: {loaded.text[:300]}; see {self.log}"
            )
        deadline = time.monotonic() + timeout
        url = f"{self.url}/models/{name}/invoke"
        with requests.Session() as session:
            while time.monotonic() < deadline:
                try:
                    reply = session.post(
                        url, data=body, headers={"Content-Type": "application/json"}, timeout=60
                    )
                    if reply.status_code == 200:
                        return
                except requests.RequestException:
                    pass
                time.sleep(0.05)
        raise RuntimeError(
            f"{name}: no successful invoke within {timeout:.0f} s of LOAD; see {self.log}"
        )


def load_baseline(
    server: Server, model_dirs: Sequence[Path], body: bytes, workers: int | None = None
) -> float:
    """Loads the unrelated models in ``model_dirs`` as ``baseline0``, ``baseline1``, ... (each its
    own directory: our server puts another name for the same files on the same host), with
    ``workers`` workers each (None: the server's default), has each answer ``body`` once, and leaves
    them loaded: every later "before" reading includes them and the device hosts they started.
    Returns the tree's memory with them loaded, MiB."""
    extra = {} if workers is None else {"initial_workers": workers}
    for index, model_dir in enumerate(model_dirs):
        server.load_and_answer(f"baseline{index}", model_dir, body, **extra)
    return server.tree_memory_mib()


SHARED_MEMORY = ("/memfd:", "/dev/shm/")


def unmapped_shared_memory_mib(processes: Sequence[psutil.Process]) -> float:
    """The allocated size, MiB, of the shared-memory files (memfd, /dev/shm) that ``processes`` hold
    open and none of them maps. Their pages are RAM that no process's PSS includes; a file that one
    of them maps is left to PSS (a file mapped only in part is counted by its mapped part alone)."""
    held: dict[tuple[int, int], int] = {}  # (device, inode) -> bytes allocated
    mapped: set[tuple[int, int]] = set()
    for process in processes:
        directory = f"/proc/{process.pid}/fd"
        try:
            descriptors = os.listdir(directory)
            with open(f"/proc/{process.pid}/maps") as maps:
                lines = maps.readlines()
        except OSError:
            continue  # gone, or not ours to read
        for descriptor in descriptors:
            path = f"{directory}/{descriptor}"
            try:
                if os.readlink(path).startswith(SHARED_MEMORY):
                    stat = os.stat(path)
                    held[(stat.st_dev, stat.st_ino)] = stat.st_blocks * 512
            except OSError:
                continue  # closed meanwhile
        for line in lines:  # address perms offset major:minor inode path
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(SHARED_MEMORY):
                major, minor = (int(part, 16) for part in fields[3].split(":"))
                mapped.add((os.makedev(major, minor), int(fields[4])))
    return sum(size for key, size in held.items() if key not in mapped) / 2**20


def pss_by_title(processes: Sequence[psutil.Process]) -> dict[str, float]:
    """PSS, MiB, of each of ``processes`` but the stubs, by its command line's start."""
    found = {}
    for process in processes:
        with contextlib.suppress(psutil.Error, IndexError):
            if not is_stub(process):
                found[f"{process.pid} {' '.join(process.cmdline())[:48]}"] = pss_mib([process])
    return found


def device_host_count(server: Server) -> int:
    """Our device hosts in the server's tree (processes titled ``mme-device-host ...``); 0 for any
    other stack."""
    return len(device_hosts(server.tree()))


@contextmanager
def serve(
    command: Sequence[str], env: Mapping[str, str], work_dir: Path, port: int
) -> Iterator[Server]:
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
    """Creates or refreshes a peer's own virtual environment; a marker file records what was
    installed, so a run with the same requirements installs nothing."""
    marker = venv / ".bench-installed"
    wanted = "\n".join(requirements)
    if (
        not force
        and marker.exists()
        and marker.read_text() == wanted
        and venv_python(venv).exists()
    ):
        return
    print(f"installing {label} into {venv} (a minute or so)", file=sys.stderr, flush=True)
    if not venv_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip>=24"], check=True)
    subprocess.run([*pip, *requirements], check=True)
    marker.write_text(wanted)


def our_server(
    work_dir: Path, env: Mapping[str, str] | None = None
) -> tuple[list[str], dict[str, str], int]:
    """Command, environment and port that start this project's server."""
    port = free_port()
    full_env = {
        "SAGEMAKER_BIND_TO_PORT": str(port),
        "MME_RUNTIME_DIR": str(work_dir / "run"),
        # benchmarks load from their own temporary directories
        "MME_ALLOW_ANY_MODEL_LOCATION": "true",
        "TMPDIR": str(work_dir),
        "MME_METRICS_PORT": str(free_port()),  # not 9090: benchmarks run servers side by side
        **(env or {}),
    }
    return [sys.executable, str(REPO / "dockerd-entrypoint.py"), "serve"], full_env, port


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: a value that was actually observed (NaN when every request
    failed)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table, so ``python -m benchmarks --write-docs`` copies the output into the docs as
    it is."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
