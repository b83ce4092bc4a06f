"""Many models on one host: the device hosts (sharing on: two CPU hosts by default, and one),
against a process per model (sharing off, MME_SHARE_DEVICE=false) and the stock stack, in one run.

    .venv/bin/python -m benchmarks device_host [-- --models 50 --churn-seconds 30
                                                   --stacks shared one-host isolated stock]

Per stack, one server, these scenarios in order (every model is the tests' tiny TorchScript net, one
row of 4 floats; the stock stack's copies carry the code/inference.py its handler needs, see
peers/stock_stack.py):

* memory: --models models loaded one after another; PSS of the server's whole process tree (Java
  frontend, warm process, hosts, stubs, servers, workers) with 1 model and with all, and the extra
  per model; processes per model likewise. LOAD p50 is the median LOAD time over those loads.
* crash: a model whose code aborts the process it runs in, with all --models loaded: seconds until
  every other model answers 200 again (with a process per model: at once).
* cycles: --cycles LOAD, INVOKE, UNLOAD cycles of mixed models, one after another: PSS growth of the
  whole tree.
* churn: 4 clients, each looping LOAD, INVOKE, UNLOAD on models of its own for --churn-seconds (what
  SageMaker does with ModelCacheSetting=Disabled): completed cycles per second.
* 8 models x 2 clients: 8 tiny models, 2 clients each, all at once, --burst-seconds: requests per
  second.
* noisy neighbour: 16 clients saturate model A while one client times model B: B's p50 latency.
* 3 workers, 50 ms: a model whose predict_fn sleeps 50 ms, 3 workers, 12 clients: requests per
  second.

Single-client timings use http.client on a kept-alive connection (requests costs 2 ms a call here).
Ratios are against sharing off and the stock stack of the same run. Timings are never asserted:
machines here are noisy.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from model_factory import state_dict_model, torchscript_model, transform_model, write_code
from serving import device_hosts, pss_mib

from benchmarks.benchlib import Server, our_server, percentile, serve, table
from benchmarks.peers.stock_stack import STOCK_MODEL_FN, ensure_venv, serve_isolated, stock_server

STACKS = ("shared", "one-host", "isolated", "stock")
# Our server's settings per stack: the default (two CPU hosts), one CPU host for every model,
# sharing off.
OUR_STACKS = {
    "shared": {},
    "one-host": {"MME_CPU_HOSTS": "1"},
    "isolated": {"MME_SHARE_DEVICE": "false"},
}
ROW = json.dumps([[1.0, 2.0, 3.0, 4.0]]).encode()
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
SLEEP_SCRIPT = """
import os
import time

import torch


def model_fn(model_dir):
    return torch.jit.load(os.path.join(model_dir, "model.pt"), map_location="cpu")


def predict_fn(data, model):
    time.sleep(0.05)
    with torch.no_grad():
        return model(data)
"""


class Client:
    """One kept-alive HTTP connection to the server."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=120)

    def call(self, method: str, path: str, body: bytes | None = None) -> int:
        headers = HEADERS if body is not None else {}
        try:
            self.connection.request(method, path, body=body, headers=headers)
            response = self.connection.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException):
            self.connection.close()
            return 0

    def invoke(self, name: str) -> int:
        return self.call("POST", f"/models/{name}/invoke", ROW)

    def load(self, name: str, path: Path, **extra: object) -> int:
        return self.call(
            "POST", "/models", json.dumps({"model_name": name, "url": str(path), **extra}).encode()
        )

    def unload(self, name: str) -> int:
        return self.call("DELETE", f"/models/{name}")


def model(root: Path, name: str, stack: str, code: str | None = None) -> Path:
    """A tiny TorchScript model; the stock stack's carries the model_fn its handler needs."""
    model_dir = torchscript_model(root / stack / name)
    if stack == "stock" or code is not None:
        write_code(model_dir, code or STOCK_MODEL_FN)
    return model_dir


def whole_tree(server: Server) -> list[psutil.Process]:
    return [psutil.Process(server.process.pid), *server.tree()]


ABORT_SCRIPT = """
import os


def model_fn(model_dir):
    return None


def transform_fn(model, body, content_type, accept):
    os.abort()
"""


def memory(server: Server, root: Path, stack: str, count: int) -> dict[str, float]:
    client = Client(server.url)
    loads = []
    first: tuple[float, int] = (0.0, 0)
    for index in range(count):
        name = f"small{index}"
        path = model(root, name, stack)
        started = time.perf_counter()
        status = client.load(name, path)
        loads.append(time.perf_counter() - started)
        if status != 200 or client.invoke(name) != 200:
            raise RuntimeError(f"{stack}: {name} did not load and answer ({status})")
        if index == 0:
            time.sleep(2)
            first = (pss_mib(whole_tree(server)), len(whole_tree(server)))
    time.sleep(2)
    total, processes = pss_mib(whole_tree(server)), len(whole_tree(server))
    recovery = crash_recovery(server, root, stack, [f"small{index}" for index in range(count)])
    for index in range(count):
        client.unload(f"small{index}")
    return {
        "pss_1": first[0],
        "pss_n": total,
        "per_model": (total - first[0]) / (count - 1),
        "processes_per_model": (processes - first[1]) / (count - 1),
        "load_p50_ms": statistics.median(loads) * 1000,
        "recovery_s": recovery,
    }


def crash_recovery(server: Server, root: Path, stack: str, names: list[str]) -> float:
    """A model whose code aborts the process it runs in: seconds until every other model answers 200
    again."""
    client = Client(server.url)
    assert client.load("aborting", model(root, "aborting", stack, ABORT_SCRIPT)) == 200
    crashed = time.monotonic()
    client.invoke("aborting")
    waiting = list(names)
    while waiting and time.monotonic() - crashed < 120:
        waiting = [name for name in waiting if client.invoke(name) != 200]
    client.unload("aborting")
    return time.monotonic() - crashed


def cycles(server: Server, root: Path, stack: str, count: int) -> tuple[float, float | None]:
    """PSS growth, MiB, of the whole tree and of the device hosts (None where there are none), over
    ``count`` LOAD, INVOKE, UNLOAD cycles of mixed models (TorchScript, a state dict with its
    script, a transform_fn script; the stock stack's all TorchScript with its model_fn)."""
    client = Client(server.url)
    builders = (
        [torchscript_model, state_dict_model, transform_model]
        if stack != "stock"
        else [torchscript_model]
    )
    bodies = [ROW, json.dumps({"inputs": [[1.0, 2.0, 3.0, 4.0]]}).encode(), ROW]
    paths = []
    for index, builder in enumerate(builders):
        path = builder(root / stack / f"cycle{index}")
        if stack == "stock":
            write_code(path, STOCK_MODEL_FN)
        paths.append(path)

    def cycle(index: int) -> None:
        kind = index % len(paths)
        name = f"cycle{kind}"
        assert client.load(name, paths[kind]) == 200
        assert client.call("POST", f"/models/{name}/invoke", bodies[kind]) == 200
        assert client.unload(name) == 200

    for index in range(len(paths)):  # every kind once first: what a first load imports is no growth
        cycle(index)
    time.sleep(2)
    before, hosts_before = pss_mib(whole_tree(server)), pss_mib(device_hosts(whole_tree(server)))
    for index in range(count):
        cycle(index)
    time.sleep(2)
    hosts = device_hosts(whole_tree(server))
    return pss_mib(whole_tree(server)) - before, pss_mib(hosts) - hosts_before if hosts else None


def churn(server: Server, root: Path, stack: str, seconds: float, clients: int = 4) -> float:
    paths = [model(root, f"churn{index}", stack) for index in range(clients)]
    done = [0] * clients
    deadline = time.monotonic() + seconds

    def loop(index: int) -> None:
        client = Client(server.url)
        name = f"churn{index}"
        while time.monotonic() < deadline:
            ok = client.load(name, paths[index]) == 200 and client.invoke(name) == 200
            ok = client.unload(name) == 200 and ok
            done[index] += ok

    started = time.monotonic()
    run_threads([lambda i=i: loop(i) for i in range(clients)])
    return sum(done) / (time.monotonic() - started)


def run_threads(targets: list[Callable[[], object]]) -> None:
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def hammer(
    url: str,
    name: str,
    stop: threading.Event,
    counts: list[int],
    latencies: list[float] | None = None,
) -> None:
    client = Client(url)
    while not stop.is_set():
        started = time.perf_counter()
        if client.invoke(name) == 200:
            counts.append(1)
            if latencies is not None:
                latencies.append(time.perf_counter() - started)


def run_for(seconds: float, stop: threading.Event, threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()


def burst(server: Server, root: Path, stack: str, seconds: float) -> float:
    """8 models, 2 clients each, all at once: requests per second."""
    loader = Client(server.url)
    names = [f"burst{index}" for index in range(8)]
    for name in names:
        assert loader.load(name, model(root, name, stack)) == 200 and loader.invoke(name) == 200
    stop, counts = threading.Event(), []  # list.append is atomic: one list for all clients
    run_for(
        seconds,
        stop,
        [
            threading.Thread(target=hammer, args=(server.url, name, stop, counts))
            for name in names * 2
        ],
    )
    for name in names:
        loader.unload(name)
    return len(counts) / seconds


def noisy_neighbour(server: Server, root: Path, stack: str, seconds: float) -> float:
    """B's p50 latency in ms while 16 clients saturate A."""
    loader = Client(server.url)
    for name in ("noisy_a", "quiet_b"):
        assert (
            loader.load(
                name, model(root, name, stack), initial_workers=4 if name == "noisy_a" else 1
            )
            == 200
        )
    stop, counts, latencies = threading.Event(), [], []
    threads = [
        threading.Thread(target=hammer, args=(server.url, "noisy_a", stop, counts))
        for _ in range(16)
    ]
    threads.append(
        threading.Thread(target=hammer, args=(server.url, "quiet_b", stop, [], latencies))
    )
    run_for(seconds, stop, threads)
    for name in ("noisy_a", "quiet_b"):
        loader.unload(name)
    return percentile(latencies, 50) * 1000


def slow_predict(server: Server, root: Path, stack: str, seconds: float) -> float:
    """3 workers, predict_fn sleeps 50 ms, 12 clients: requests per second."""
    client = Client(server.url)
    assert (
        client.load("sleepy", model(root, "sleepy", stack, SLEEP_SCRIPT), initial_workers=3) == 200
    )
    stop, counts = threading.Event(), []
    with ThreadPoolExecutor(12) as pool:
        for _ in range(12):
            pool.submit(hammer, server.url, "sleepy", stop, counts)
        time.sleep(seconds)
        stop.set()
    client.unload("sleepy")
    return len(counts) / seconds


def run_stack(stack: str, root: Path, args: argparse.Namespace) -> dict[str, float | None]:
    work = root / f"server-{stack}"
    if stack == "stock":
        command, env, port, _ = stock_server(work)
        context = serve_isolated("stock", command, env, work, port)
    else:
        command, env, port = our_server(work, OUR_STACKS[stack])
        context = serve(command, env, work, port)
    with context as server:
        print(f"{stack}: memory with {args.models} models", file=sys.stderr, flush=True)
        results: dict[str, float | None] = dict(memory(server, root, stack, args.models))
        print(
            f"{stack}: churn, 8x2, noisy neighbour, 3 workers x 50 ms", file=sys.stderr, flush=True
        )
        results["growth"], results["host_growth"] = cycles(server, root, stack, args.cycles)
        results["churn"] = churn(server, root, stack, args.churn_seconds)
        results["burst"] = burst(server, root, stack, args.burst_seconds)
        results["neighbour_ms"] = noisy_neighbour(server, root, stack, args.burst_seconds)
        results["slow"] = slow_predict(server, root, stack, args.burst_seconds)
    return results


# Rows whose shared/other ratio means nothing (a difference near zero; a crash that costs the others
# nothing there).
NO_RATIO = ("growth", "host_growth", "recovery_s")


def report(results: dict[str, dict[str, float | None]]) -> str:
    rows = []
    metrics = [
        ("host PSS per extra model, MiB", "per_model", "{:.1f}"),
        ("processes per extra model", "processes_per_model", "{:.2f}"),
        ("LOAD p50 of a small model, ms", "load_p50_ms", "{:.0f}"),
        ("a model aborts: s until all others answer 200", "recovery_s", "{:.2f}"),
        ("PSS growth over the LOAD/INVOKE/UNLOAD cycles, MiB", "growth", "{:+.1f}"),
        ("  of which the device hosts', MiB", "host_growth", "{:+.1f}"),
        ("churn, LOAD+INVOKE+UNLOAD cycles/s (4 clients)", "churn", "{:.2f}"),
        ("8 models x 2 clients, req/s", "burst", "{:.0f}"),
        ("noisy neighbour: B's p50 while A is saturated, ms", "neighbour_ms", "{:.1f}"),
        ("3 workers, 50 ms predict_fn, 12 clients, req/s", "slow", "{:.1f}"),
    ]
    stacks = [stack for stack in STACKS if stack in results]
    for label, key, form in metrics:
        row = [
            label,
            *(
                form.format(results[stack][key]) if results[stack][key] is not None else "-"
                for stack in stacks
            ),
        ]
        if "shared" in results:
            for other in ("isolated", "stock"):
                ours, theirs = results["shared"][key], results.get(other, {}).get(key)
                if other in results:
                    row.append(
                        "" if key in NO_RATIO or not ours or not theirs else f"{ours / theirs:.2f}"
                    )
        rows.append(row)
    ratios = [
        f"shared/{other}"
        for other in ("isolated", "stock")
        if other in results and "shared" in results
    ]
    return table(["", *stacks, *ratios], rows)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks device_host --",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", type=int, default=50)
    parser.add_argument("--churn-seconds", type=float, default=30.0)
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--burst-seconds", type=float, default=10.0)
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    args = parser.parse_args(list(argv))
    if "stock" in args.stacks:
        ensure_venv()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-device-host-") as tmp:
        for stack in args.stacks:
            results[stack] = run_stack(stack, Path(tmp), args)
    print(
        f"{args.models} tiny TorchScript models; churn {args.churn_seconds:.0f} s; bursts "
        f"{args.burst_seconds:.0f} s"
    )
    print()  # a Markdown table starts after a blank line
    print(report(results))
    return 0
