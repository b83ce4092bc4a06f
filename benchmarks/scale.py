"""Thousands of models in one server: what each cost does as the models loaded grow (issue #37).

    .venv/bin/python -m benchmarks scale [-- --models 2000 --step 200 --plot docs/scale.png]

One server as it ships (two CPU device hosts). A probe model is loaded first and stays; then
``--models`` distinct tiny TorchScript models (other weights each, so nothing is shared but the
code) are loaded one by one, as an operator or SageMaker would. After every ``--step`` models the
benchmark measures, with nothing else running:

* LOAD p50 of the last step's LOADs, split in two: ours, from the stub's arrival in the warm
  process to the model ready in its host (``mme_model_load_seconds`` from the Prometheus exporter),
  and the rest (MMS's frontend, the JDK's launcher that starts the stub, the stub's own start);
* INVOKE p50 and p99 of ``--invokes`` requests to loaded models drawn at random, each on a
  kept-alive connection (``http.client``, so the client does not hide the server);
* LIST: every model listed exactly once, page by page (``limit`` and ``nextPageToken``);
* UNLOAD p50 at that many models: ``CHURN`` more models loaded, then unloaded one at a time, each
  timed, and how long after its answer its host logged it let go (its memory goes back within
  ``MemoryRelease``'s bound after that, at most 1 s);
* idle CPU over ``--idle-seconds`` with no request: our processes' (the entrypoint, the warm
  process, the device hosts and the stubs) and the Java frontend's, in % of one core;
* threads and open descriptors: ours (per model loaded, over the empty server) and the frontend's;
  and once more after the last step, when every model has been idle long enough for its batcher's
  threads to end (what an idle model costs);
* the memory of the server's processes, the entrypoint included (PSS, as every benchmark here
  counts a tree) per model loaded.

Then every model is unloaded by 4 clients as fast as the API answers (SageMaker evicting under
pressure) while the probe, warmed at its LOAD (its first call during a drain took 113 to 234 ms),
is invoked 5 times a second: its p99 then, the UNLOAD p50 (and that of the first ``--step``
UNLOADs against the last, each under the drain's load), and the memory
of our processes once the CPU host left with no model has ended (``MME_EMPTY_HOST_SECONDS`` after
the last UNLOAD) against the server with the probe alone, with the packages kept for a fast re-LOAD
(``MME_KEEP_UNLOADED_MB``) apart. Every ERROR line the server logged is counted. The table goes to
stdout; the plot of LOAD p50, INVOKE p50, memory and idle CPU against models loaded to ``--plot``
(matplotlib, headless).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch
from model_factory import tiny_net  # tests/, which the benchmarks package puts on the path
from serving import by_model, wait_until

from benchmarks.benchlib import (
    REPO,
    Server,
    device_host_count,
    our_server,
    percentile,
    pss_by_title,
    serve,
    table,
    unmapped_shared_memory_mib,
)
from mme_runtime.base.config import Config
from mme_runtime.serving.batcher import IDLE_SECONDS as BATCHER_IDLE_SECONDS

BODY = json.dumps([[1.0, 2.0, 3.0, 4.0]]).encode()
PROBE_RATE = 5.0  # invokes a second of the model that stays while the others go
UNLOAD_CLIENTS = 4
CHURN = 20  # models loaded and unloaded one at a time at each step: UNLOAD p50 at that many models
LET_GO = "model={} unloaded from the device host"  # processes/device_host.py logs it
EMPTY_HOST_SECONDS = Config.from_env({}).empty_host_seconds  # the default the server runs with


def make_models(root: Path, count: int) -> list[Path]:
    """``count`` TorchScript files of one tiny network, each with weights of its own (scripted
    once)."""
    scripted = torch.jit.script(tiny_net(0))
    generator = torch.Generator().manual_seed(1)
    directories = []
    with torch.no_grad():
        for index in range(count):
            for parameter in scripted.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            directory = root / f"m{index:05d}"
            directory.mkdir(parents=True)
            scripted.save(str(directory / "model.pt"))
            directories.append(directory)
    return directories


class Client:
    """One kept-alive HTTP connection to the server."""

    def __init__(self, server: Server) -> None:
        host, port = server.url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=120)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        self.connection.request(method, path, body=body, headers=headers)
        response = self.connection.getresponse()
        return response.status, response.read()

    def timed(self, method: str, path: str, body: bytes | None = None) -> tuple[int, float]:
        started = time.perf_counter()
        status, _ = self.request(method, path, body)
        return status, (time.perf_counter() - started) * 1000


def load(client: Client, name: str, path: Path) -> tuple[int, float]:
    body = json.dumps({"model_name": name, "url": str(path)}).encode()
    return client.timed("POST", "/models", body)


def listed(client: Client) -> list[str]:
    """Every model name LIST returns, page by page."""
    names: list[str] = []
    token = ""
    while True:
        query = "limit=100" + (f"&next_page_token={token}" if token else "")
        status, body = client.request("GET", f"/models?{query}")
        if status != 200:
            raise RuntimeError(f"LIST answered {status}: {body[:200]!r}")
        page = json.loads(body)
        names += [model["modelName"] for model in page.get("models", [])]
        token = page.get("nextPageToken") or ""
        if not token:
            return names


def ours(server: Server) -> list[psutil.Process]:
    """Our processes: the entrypoint and everything under it but the Java frontend (and MMS's own
    metrics collector)."""
    found = []
    for process in server.processes():
        try:
            if process.name() != "java" and "metric_collector" not in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def frontend(server: Server) -> psutil.Process:
    return next(process for process in server.tree() if process.name() == "java")


def counts(processes: Sequence[psutil.Process]) -> tuple[int, int]:
    """Threads and open descriptors of ``processes``, summed."""
    threads = fds = 0
    for process in processes:
        try:
            threads += process.num_threads()
            fds += process.num_fds()
        except psutil.Error:
            continue
    return threads, fds


def cpu_seconds(processes: Sequence[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def idle_cpu(server: Server, seconds: float) -> tuple[float, float]:
    """% of one core used by our processes and by the frontend over ``seconds`` without requests."""
    mine, java = ours(server), [frontend(server)]
    before = cpu_seconds(mine), cpu_seconds(java)
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    after = cpu_seconds(mine), cpu_seconds(java)
    return (after[0] - before[0]) / elapsed * 100, (after[1] - before[1]) / elapsed * 100


def invoke_latencies(client: Client, names: Sequence[str], count: int) -> list[float]:
    latencies = []
    for name in random.choices(names, k=count):
        status, ms = client.timed("POST", f"/models/{name}/invoke", BODY)
        if status != 200:
            raise RuntimeError(f"INVOKE {name} answered {status}")
        latencies.append(ms)
    return latencies


def timed_scrape(metrics_url: str) -> float:
    """Milliseconds from a ``/metrics`` request to the last byte of its answer (every model's
    series, merged by the entrypoint)."""
    started = time.monotonic()
    with urllib.request.urlopen(metrics_url, timeout=60) as answer:
        answer.read()
    return 1000 * (time.monotonic() - started)


def error_lines(server: Server) -> list[str]:
    return [
        line for line in server.log.read_text(errors="replace").splitlines() if " ERROR " in line
    ]


def unload_latencies(
    server: Server, client: Client, churn: Sequence[tuple[str, Path]]
) -> tuple[list[float], list[float]]:
    """LOADs ``churn``, then UNLOADs it one model at a time: each UNLOAD's latency, and the seconds
    from its answer to its host's log line that the model is let go (0 if logged before)."""
    for name, directory in churn:
        if (status := load(client, name, directory)[0]) != 200:
            raise RuntimeError(f"LOAD {name} answered {status}")
    time.sleep(1)  # as in use: a model unloaded long after its LOAD, its stub's entries freed
    latencies, let_go = [], []
    for name, _ in churn:
        offset = server.log.stat().st_size
        status, ms = client.timed("DELETE", f"/models/{name}")
        answered = time.monotonic()
        if status != 200:
            raise RuntimeError(f"UNLOAD {name} answered {status}")
        latencies.append(ms)
        let_go.append(logged_after(server, offset, LET_GO.format(name)) - answered)
    return latencies, [max(0.0, seconds) for seconds in let_go]


def logged_after(server: Server, offset: int, text: str, timeout: float = 30) -> float:
    """When ``text`` appeared in the server's log past ``offset`` (``time.monotonic()``), polled."""

    def logged() -> bool:
        with server.log.open("rb") as log:
            log.seek(offset)
            return text.encode() in log.read()

    if not wait_until(logged, timeout, interval=0.005):
        raise RuntimeError(f"{text!r} not logged {timeout:.0f} s after; see {server.log}")
    return time.monotonic()


def unload_all(server: Server, names: Sequence[str]) -> tuple[list[float], list[float], int]:
    """UNLOADs of ``names`` from ``UNLOAD_CLIENTS`` clients while the probe is invoked
    ``PROBE_RATE`` times a second: the UNLOADs' latencies in the order they were sent, the
    probe's, and how many UNLOADs failed."""
    stop = threading.Event()
    probe: list[float] = []

    def invoke_probe() -> None:
        client = Client(server)
        while not stop.is_set():
            started = time.monotonic()
            status, ms = client.timed("POST", "/models/probe/invoke", BODY)
            probe.append(ms if status == 200 else float("inf"))
            stop.wait(max(0.0, 1 / PROBE_RATE - (time.monotonic() - started)))

    def unload_share(share: Sequence[str]) -> list[tuple[float, int, float]]:
        client = Client(server)
        return [(time.monotonic(), *client.timed("DELETE", f"/models/{name}")) for name in share]

    prober = threading.Thread(target=invoke_probe)
    prober.start()
    try:
        with ThreadPoolExecutor(UNLOAD_CLIENTS) as pool:
            shares = [names[index::UNLOAD_CLIENTS] for index in range(UNLOAD_CLIENTS)]
            results = sorted(r for share in pool.map(unload_share, shares) for r in share)
    finally:
        stop.set()
        prober.join()
    failed = sum(1 for _, status, _ in results if status != 200)
    return [ms for _, _, ms in results], probe, failed


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [row["models"] for row in rows]
    panels = [
        ("load_p50", "LOAD p50, ms"),
        ("invoke_p50", "INVOKE p50 and UNLOAD p50 (dashed), ms"),
        ("memory_mib", "server tree PSS, MiB"),
        ("idle_ours", "idle CPU, % of one core (ours)"),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for axis, (key, label) in zip(axes.flat, panels, strict=True):
        axis.plot(models, [row[key] for row in rows], marker="o")
        if key == "invoke_p50":
            axis.plot(models, [row["unload_p50"] for row in rows], marker="o", linestyle="--")
        axis.set_title(label)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    for axis in axes[1]:
        axis.set_xlabel("models loaded")
    figure.suptitle("mme-gpu: costs against models loaded (2-core VM, tiny TorchScript models)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks scale --",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", type=int, default=2000)
    parser.add_argument("--step", type=int, default=200)
    parser.add_argument("--invokes", type=int, default=200)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "scale.png")
    args = parser.parse_args(list(argv))
    random.seed(0)

    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        root = Path(tmp)
        print(f"making {args.models} models", file=sys.stderr, flush=True)
        directories = make_models(root / "models", args.models + 1 + CHURN)
        probe_directory = directories[args.models]
        churn = [(f"churn{index:02d}", d) for index, d in enumerate(directories[args.models + 1 :])]
        command, env, port = our_server(root / "server")
        metrics_url = f"http://127.0.0.1:{env['MME_METRICS_PORT']}/metrics"
        with serve(command, env, root / "server", port) as server:
            client = Client(server)
            status, _ = load(client, "probe", probe_directory)
            if status != 200:
                raise RuntimeError(f"LOAD of the probe answered {status}")
            # A model's first call in its host does work once (TorchScript's first run in a process:
            # 24 ms alone; 113 to 234 ms for a first call during a drain): warmed here, so that the
            # drain's probe measures the drain
            invoke_latencies(client, ["probe"], 3)
            time.sleep(2)
            empty_memory = server.tree_memory_mib(entrypoint=True)
            empty_frontend = server.frontend_memory_mib()
            empty_threads, empty_fds = counts(ours(server))
            empty_hosts = device_host_count(server)
            # The frontend's first UNLOADs run before the JVM has compiled that path (a drain's
            # first took 6 to 10 ms against 3): one round of the churn first, so that the first
            # step's UNLOAD p50 is not the compiler's
            unload_latencies(server, client, churn)
            rows: list[dict[str, float]] = []
            loaded: list[str] = []
            load_ms: list[float] = []
            let_go: list[float] = []
            for index, directory in enumerate(directories[: args.models]):
                name = f"m{index:05d}"
                status, ms = load(client, name, directory)
                if status != 200:
                    raise RuntimeError(f"LOAD {name} answered {status}")
                loaded.append(name)
                load_ms.append(ms)
                if len(loaded) % args.step:
                    continue
                names = set(listed(client))
                if names != {*loaded, "probe"}:
                    raise RuntimeError(f"LIST has {len(names)} models, not {len(loaded) + 1}")
                step = loaded[-args.step :]
                # ours: from the stub's arrival in the warm process to the model ready in its host
                exported = by_model(metrics_url, "mme_model_load_seconds")
                scrape_ms = timed_scrape(metrics_url)  # the entrypoint's, not the parsing
                if missing := [name for name in step if name not in exported]:
                    raise RuntimeError(f"no mme_model_load_seconds for {len(missing)} models")
                ours_ms = [1000 * exported[name] for name in step]
                latencies = invoke_latencies(client, loaded, args.invokes)
                idle_ours, idle_java = idle_cpu(server, args.idle_seconds)
                threads, fds = counts(ours(server))
                java_threads, java_fds = counts([frontend(server)])
                memory = server.tree_memory_mib(settle=0, entrypoint=True)
                step_unload_ms, step_let_go = unload_latencies(server, client, churn)
                let_go += step_let_go
                row = {
                    "models": len(loaded),
                    "load_p50": statistics.median(load_ms[-args.step :]),
                    "load_ours_p50": statistics.median(ours_ms),
                    "load_rest_p50": statistics.median(
                        total - mine
                        for total, mine in zip(load_ms[-args.step :], ours_ms, strict=True)
                    ),
                    "invoke_p50": percentile(latencies, 50),
                    "invoke_p99": percentile(latencies, 99),
                    "unload_p50": statistics.median(step_unload_ms),
                    "idle_ours": idle_ours,
                    "idle_java": idle_java,
                    "fds": (fds - empty_fds) / len(loaded),
                    "threads": (threads - empty_threads) / len(loaded),
                    "java_threads": java_threads,
                    "java_fds": java_fds,
                    "memory_mib": memory,
                    "mib_per_model": (memory - empty_memory) / len(loaded),
                    "scrape_ms": scrape_ms,
                }
                rows.append(row)
                print(f"{len(loaded)} models: {row}", file=sys.stderr, flush=True)
            # Idle means idle: once a batcher's threads have ended too, what an idle model costs.
            long_idle_ours, _ = idle_cpu(server, BATCHER_IDLE_SECONDS + args.idle_seconds)
            idle_threads, idle_fds = counts(ours(server))
            drain_started = time.monotonic()
            unload_ms, probe_ms, failed = unload_all(server, loaded)
            drain_seconds = time.monotonic() - drain_started
            time.sleep(EMPTY_HOST_SECONDS + 2)  # the host left with no model ends
            deadline = time.monotonic() + 60  # and a host recycled after the drain is replaced
            while device_host_count(server) > empty_hosts and time.monotonic() < deadline:
                time.sleep(0.5)
            after_memory = server.tree_memory_mib(entrypoint=True)
            print(f"ours after: {pss_by_title(ours(server))}", file=sys.stderr, flush=True)
            kept_packages = unmapped_shared_memory_mib(ours(server))
            after_frontend = server.frontend_memory_mib()
            errors = error_lines(server)
            listed_after = listed(client)
    headers = [
        "models",
        "LOAD p50, ms",
        "of it ours, ms",
        "the rest, ms",
        "INVOKE p50, ms",
        "INVOKE p99, ms",
        "UNLOAD p50, ms",
        "idle CPU ours, %",
        "idle CPU frontend, %",
        "our fds / model",
        "our threads / model",
        "frontend threads",
        "frontend fds",
        "tree PSS, MiB",
        "MiB / model",
        "/metrics scrape, ms",
    ]
    keys = list(rows[0]) if rows else []
    formats = [
        "{:.0f}",
        "{:.1f}",
        "{:.1f}",
        "{:.1f}",
        "{:.2f}",
        "{:.2f}",
        "{:.2f}",
        "{:.1f}",
        "{:.1f}",
        "{:.2f}",
        "{:.2f}",
        "{:.0f}",
    ]
    formats += ["{:.0f}", "{:.0f}", "{:.2f}", "{:.0f}"]
    print(
        f"{args.models} tiny TorchScript models loaded one by one beside a probe model; "
        f"a row every {args.step}"
    )
    print()
    print(
        table(
            headers,
            [
                [fmt.format(row[key]) for fmt, key in zip(formats, keys, strict=True)]
                for row in rows
            ],
        )
    )
    print()
    first, last = rows[0], rows[-1]
    probe_p99 = percentile(probe_ms, 99)
    print(
        f"* LOAD p50 of the last {args.step} / the first {args.step}: "
        f"{last['load_p50'] / first['load_p50']:.2f} (of it ours, from the stub's arrival in the "
        f"warm process to the model ready: {last['load_ours_p50'] / first['load_ours_p50']:.2f}; "
        "the rest, MMS's frontend, the JDK's launcher that starts the stub and the stub's start: "
        f"{last['load_rest_p50'] / first['load_rest_p50']:.2f}); "
        f"INVOKE p50 at {last['models']:.0f} / at "
        f"{first['models']:.0f}: {last['invoke_p50'] / first['invoke_p50']:.2f}; UNLOAD p50 "
        f"likewise ({CHURN} more loaded and unloaded one at a time at each step): "
        f"{last['unload_p50'] / first['unload_p50']:.2f}, each let go by its host at most "
        f"{max(let_go, default=0):.2f} s after its answer (p50 {percentile(let_go, 50):.2f} s)"
    )
    print(
        f"* UNLOAD of all {len(unload_ms)} from {UNLOAD_CLIENTS} clients in {drain_seconds:.1f} s: "
        f"p50 {percentile(unload_ms, 50):.1f} ms, "
        f"p99 {percentile(unload_ms, 99):.1f} ms, {failed} failed; p50 of the first {args.step} "
        f"(from {len(unload_ms)} models) / the last {args.step}: "
        f"{percentile(unload_ms[: args.step], 50) / percentile(unload_ms[-args.step :], 50):.2f}; "
        f"the probe, invoked {PROBE_RATE:g} times a second meanwhile ({len(probe_ms)} calls): "
        f"p50 {percentile(probe_ms, 50):.1f} ms, p99 {probe_p99:.1f} ms"
    )
    print(
        f"* after {BATCHER_IDLE_SECONDS + args.idle_seconds:.0f} s with no request (a batcher's "
        f"threads end after {BATCHER_IDLE_SECONDS:.0f} s idle): our CPU over them "
        f"{long_idle_ours:.1f}% of one core, our threads "
        f"{(idle_threads - empty_threads) / max(1, len(loaded)):.2f} per model, fds "
        f"{(idle_fds - empty_fds) / max(1, len(loaded)):.2f} per model"
    )
    ours_added = (after_memory - after_frontend) - (empty_memory - empty_frontend)
    print(
        f"* server tree after UNLOAD of all: {after_memory - empty_memory:+.1f} MiB "
        "against the server with the "
        f"probe alone ({empty_memory:.0f} MiB): our processes {ours_added:+.1f} MiB "
        f"({ours_added - kept_packages:+.1f} MiB without the {kept_packages:.1f} MiB of packages "
        "kept for a re-LOAD), MMS's frontend "
        f"{after_frontend - empty_frontend:+.1f} MiB; LIST then: {len(listed_after)} model(s)"
    )
    print(f"* ERROR lines in the server's log over the whole run: {len(errors)}")
    for line in errors[:5]:
        print(f"  {line[:160]}")
    if rows:
        plot(rows, args.plot)
        print(
            "* plot: "
            f"{args.plot.relative_to(REPO) if args.plot.is_relative_to(REPO) else args.plot}"
        )
    return 0
