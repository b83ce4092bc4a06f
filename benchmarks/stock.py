"""Our server against the stock stack, same models, same worker count, one run.

    .venv/bin/python -m benchmarks stock [-- --rounds 5 --requests 300 --concurrent-requests 640
                                             --workers 1 --scrape-interval 1]

Our server runs twice: with its Prometheus metrics on, scraped every --scrape-interval seconds while
it serves (a scraper's usual interval is 15 to 60 s: this is the worst case), and with them off
(MME_METRICS_PORT=0), so the table shows what metrics cost.

Stock stack: MMS 1.1.11 + sagemaker-inference 1.10.1 + the AWS PyTorch handler
(sagemaker-pytorch-inference 1.5.1, HandlerService from
sagemaker_pytorch_serving_container.handler_service), installed into .bench-venv/ on first use (or
with --setup; about a minute and 1.2 GB, torch from the local CPU wheel). It runs the command and
properties that sagemaker_inference.model_server.start_model_server would, isolated in its own
TMPDIR and port so it can run beside our server (benchmarks/peers/stock_stack.py says how, and why
not through start_model_server itself).

Models: the tiny TorchScript model of the tests (one row of 4 floats per request) and a TorchScript
MLP of --size-mb MB (one row of 2048 floats). Our server serves them with no code/ (its defaults).
The AWS handler 1.5.1's default model_fn refuses to load outside Elastic Inference, so its copy of
each model gets a code/inference.py with only a model_fn (torch.jit.load to CPU); input_fn,
predict_fn and output_fn stay its defaults.

Per stack, model and round: LOAD-to-first-response (POST /models until the first invoke answers
200), --warmup untimed invokes, --requests sequential invokes (latency p50/p99, and requests/s with
1 client), --concurrent-requests invokes spread over --clients threads (requests/s), failed requests
(non-200 or no answer), and the memory the model adds; then UNLOAD, and a wait until the model's
processes are gone and our device hosts have let it go. All servers run for the whole benchmark;
rounds alternate which one goes first. --warmup-rounds rounds run first and are not reported: the
first requests a JVM serves run interpreted, before its JIT compiles the frontend's hot paths, and
the first LOADs read cold files. The table shows medians over --rounds (failed requests: the total).
Timings are never asserted: compare within one run. Default: about 3 minutes on 2 cores, plus 4 s
per model, stack and round for the pauses before the memory readings.

Memory added by the model is measured the same way on every stack (benchlib): the memory of the
server's whole process tree (every descendant of the process started: frontend JVM, and for ours the
warm process, device hosts, stubs and any isolated servers; for stock its workers), that is the PSS
of its processes from /proc/PID/smaps_rollup, summed, plus the shared-memory files they hold open
but do not map (our warm process keeps a TorchScript model's package so: PSS alone would miss it),
read just before the LOAD and again after the first response and the --warmup invokes, each after a
2 s pause with no requests; the row is the difference. It is taken before the timed phases, so it is
the model's footprint once it has answered, not what --clients concurrent requests add. Before the
first round every server loads two unrelated tiny models (baseline0 and baseline1, its own copies,
kept loaded), so the "before" reading already includes our two CPU device hosts (a shareable model
goes to the one with the fewer models; each is forked on first use) and a stock worker process with
torch imported: the row is what one more model costs a server that already serves some, on either
stack. A device host lives on across models, so its allocator's state counts: once glibc has freed
one large block it raises its mmap threshold (up to 32 MiB), and later loads may leave their
temporaries as free heap under the weights until the UNLOAD, so a model can add more from the second
load on than on the first (hence the warm-up round).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import requests
from model_factory import IN_FEATURES, torchscript_model
from ports import free_port

from benchmarks.benchlib import (
    BASELINE_MODELS,
    SETTLE_SECONDS,
    Server,
    device_host_count,
    load_baseline,
    our_server,
    percentile,
    table,
)
from benchmarks.peers.stock_stack import (
    STOCK_VENV,
    ensure_venv,
    serve_isolated,
    stock_model_dir,
    stock_server,
)
from benchmarks.preload import FEATURES, big_model

STACKS = ("ours", "ours-metrics-off", "stock")
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
REQUEST_TIMEOUT_SECONDS = 60  # SageMaker's own limit for one invocation
Key = tuple[str, str]  # (model label, stack)


@dataclass(frozen=True)
class ModelCase:
    label: str
    dirs: dict[str, Path]  # stack -> model directory
    body: bytes


@dataclass
class Sample:
    """One stack, one model, one round."""

    load_call_s: float  # POST /models alone
    load_to_first_s: float  # POST /models until the first 200 from invoke
    latencies_ms: list[float]
    rps_1: float
    rps_n: float
    failed: int
    # the server tree's PSS + unmapped shm after the warm-up invokes, minus before the LOAD
    memory_added_mib: float
    first_body: object


def invoke(session: requests.Session, url: str, body: bytes) -> requests.Response | None:
    """None when no answer came back (connection reset, timeout): counted as a failed request."""
    try:
        return session.post(url, data=body, headers=HEADERS, timeout=REQUEST_TIMEOUT_SECONDS)
    except requests.RequestException:
        return None


def load_until_first_response(
    server: Server, name: str, model_dir: Path, body: bytes, timeout_s: float
) -> tuple[float, float, object]:
    """Seconds for the LOAD call, seconds until the first successful invoke, and that invoke's
    answer."""
    url = f"{server.url}/models/{name}/invoke"
    with requests.Session() as session:
        started = time.perf_counter()
        loaded = server.load(name, model_dir)
        load_call = time.perf_counter() - started
        if loaded.status_code != 200:
            raise RuntimeError(
                f"LOAD {name} answered {loaded.status_code}: {loaded.text[:300]}; see {server.log}"
            )
        # MMS answers LOAD once its workers are up, but retry anyway: "first response" is what a
        # caller sees.
        while time.perf_counter() - started < timeout_s:
            reply = invoke(session, url, body)
            if reply is not None and reply.status_code == 200:
                return load_call, time.perf_counter() - started, reply.json()
            time.sleep(0.05)
    raise RuntimeError(
        f"{name}: no successful invoke within {timeout_s:.0f} s of LOAD; see {server.log}"
    )


def sequential(url: str, body: bytes, count: int) -> tuple[list[float], float, int]:
    """Latencies (ms) of successful requests, requests/s over the whole phase, failures."""
    latencies: list[float] = []
    failed = 0
    with requests.Session() as session:
        phase_start = time.perf_counter()
        for _ in range(count):
            started = time.perf_counter()
            reply = invoke(session, url, body)
            if reply is not None and reply.status_code == 200:
                latencies.append((time.perf_counter() - started) * 1000)
            else:
                failed += 1
        elapsed = time.perf_counter() - phase_start
    return latencies, len(latencies) / elapsed, failed


def concurrent(url: str, body: bytes, clients: int, total: int) -> tuple[float, int]:
    """Successful requests/s with ``clients`` threads sharing ``total`` requests, and failures."""
    shares = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    # Every client opens its connection with one untimed request, then all start together, so the
    # timed phase measures serving, not TCP setup or thread start-up.
    ready = threading.Barrier(clients + 1)

    def client(share: int) -> tuple[int, int]:
        ok = failed = 0
        with requests.Session() as session:
            invoke(session, url, body)
            ready.wait()
            for _ in range(share):
                reply = invoke(session, url, body)
                if reply is not None and reply.status_code == 200:
                    ok += 1
                else:
                    failed += 1
        return ok, failed

    with ThreadPoolExecutor(max_workers=clients) as pool:
        futures = [pool.submit(client, share) for share in shares]
        ready.wait()
        started = time.perf_counter()
        results = [future.result() for future in futures]
        elapsed = time.perf_counter() - started
    return sum(ok for ok, _ in results) / elapsed, sum(failed for _, failed in results)


class Scraper:
    """Scrapes ``/metrics`` every ``interval`` seconds from a thread while the ``with`` block
    runs."""

    def __init__(self, url: str | None, interval: float) -> None:
        self.url = url
        self.interval = interval
        self.scrapes = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        if self.url is not None:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        assert self.url is not None
        with requests.Session() as session:
            while not self._stop.wait(self.interval):
                try:
                    ok = session.get(self.url, timeout=10).status_code == 200
                except requests.RequestException:
                    ok = False
                self.scrapes += 1
                self.failed += 0 if ok else 1


def measure(
    server: Server,
    name: str,
    case: ModelCase,
    stack: str,
    args: argparse.Namespace,
    metrics_url: str | None,
) -> Sample:
    before = server.tree_memory_mib()
    load_call, load_to_first, first_body = load_until_first_response(
        server, name, case.dirs[stack], case.body, args.load_timeout
    )
    workers = requests.get(f"{server.url}/models/{name}", timeout=30).json()["workers"]
    if len(workers) != args.workers:  # the comparison is only fair with equal workers
        raise RuntimeError(
            f"{stack} runs {len(workers)} workers for {name}, not {args.workers}; see {server.log}"
        )
    url = f"{server.url}/models/{name}/invoke"
    # Untimed: TorchScript's profiling executor optimises a graph over its first calls.
    with requests.Session() as session:
        warm_failed = sum(
            1
            for _ in range(args.warmup)
            if (r := invoke(session, url, case.body)) is None or r.status_code != 200
        )
    added = server.tree_memory_mib() - before
    with Scraper(metrics_url, args.scrape_interval) as scraper:
        latencies, rps_1, seq_failed = sequential(url, case.body, args.requests)
        rps_n, conc_failed = concurrent(url, case.body, args.clients, args.concurrent_requests)
    if scraper.failed:
        raise RuntimeError(
            f"{scraper.failed} of {scraper.scrapes} scrapes of {metrics_url} failed; see "
            f"{server.log}"
        )
    server.unload_and_wait(name)
    return Sample(
        load_call,
        load_to_first,
        latencies,
        rps_1,
        rps_n,
        warm_failed + seq_failed + conc_failed,
        added,
        first_body,
    )


def build_models(root: Path, size_mb: int) -> list[ModelCase]:
    rng = random.Random(0)

    def row(width: int) -> bytes:
        return json.dumps([[round(rng.uniform(-1, 1), 4) for _ in range(width)]]).encode()

    tiny = torchscript_model(root / "ours" / "tiny")
    big = big_model(root / "ours" / "mlp", size_mb)
    big_mib = (big / "model.pt").stat().st_size / 2**20
    return [
        ModelCase(
            "tiny",
            {"ours": tiny, "stock": stock_model_dir(tiny, root / "stock" / "tiny")},
            row(IN_FEATURES),
        ),
        ModelCase(
            f"MLP {big_mib:.0f} MiB",
            {"ours": big, "stock": stock_model_dir(big, root / "stock" / "mlp")},
            row(FEATURES),
        ),
    ]


def build_baseline(root: Path) -> dict[str, list[Path]]:
    """The unrelated tiny models every server loads first and keeps (benchlib.load_baseline), per
    stack."""
    ours = [
        torchscript_model(root / "ours" / f"baseline{index}", seed=index + 1)
        for index in range(BASELINE_MODELS)
    ]
    stock = [stock_model_dir(path, root / "stock" / path.name) for path in ours]
    return {"ours": ours, "stock": stock}


def same_answer(a: object, b: object) -> bool:
    """Both stacks should compute the same numbers (float32 printed to JSON may differ in the last
    digits)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_answer(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    return a == b


def report(
    cases: list[ModelCase], samples: dict[Key, list[Sample]], rounds: int, clients: int
) -> str:
    metrics: list[tuple[str, Callable[[Sample], float], str]] = [
        ("LOAD to first response, s", lambda s: s.load_to_first_s, "{:.2f}"),
        ("  of which the LOAD call, s", lambda s: s.load_call_s, "{:.2f}"),
        ("warm latency p50, ms", lambda s: percentile(s.latencies_ms, 50), "{:.1f}"),
        ("warm latency p99, ms", lambda s: percentile(s.latencies_ms, 99), "{:.1f}"),
        ("throughput, 1 client, req/s", lambda s: s.rps_1, "{:.0f}"),
        (f"throughput, {clients} clients, req/s", lambda s: s.rps_n, "{:.0f}"),
        (
            "memory added by the model (PSS + unmapped shm), MiB",
            lambda s: s.memory_added_mib,
            "{:.0f}",
        ),
    ]
    rows: list[list[object]] = []
    for case in cases:
        for metric, value, fmt in metrics:
            ours, off, stock = (
                statistics.median(value(s) for s in samples[(case.label, stack)])
                for stack in STACKS
            )
            formatted = [fmt.format(v) for v in (ours, off, stock)]
            rows.append([case.label, metric, *formatted, _ratio(ours, stock), _ratio(ours, off)])
        failed = [sum(s.failed for s in samples[(case.label, stack)]) for stack in STACKS]
        rows.append([case.label, f"failed requests (all {rounds} rounds)", *failed, "-", "-"])
    headers = [
        "model",
        "metric",
        "ours",
        "ours, metrics off",
        "stock",
        "ours/stock",
        "metrics on/off",
    ]
    return table(headers, rows)


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}" if reference else "-"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks stock --",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--setup",
        action="store_true",
        help=f"(re)install the stock stack into --stock-venv and exit (default {STOCK_VENV})",
    )
    parser.add_argument(
        "--stock-venv",
        type=Path,
        default=STOCK_VENV,
        help="virtual environment of the stock stack; created on first use",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds per stack and model; medians are reported"
    )
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="rounds run first and not reported (JVM JIT, page cache)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=300,
        help="sequential requests per round (latency p50/p99 and 1-client throughput)",
    )
    parser.add_argument(
        "--concurrent-requests",
        type=int,
        default=640,
        help="requests per round shared by the concurrent clients",
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=16,
        help="concurrent clients (threads) for N-client throughput",
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="untimed requests after the first response"
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="seconds between scrapes of our /metrics while it serves",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="MMS workers per model, both stacks (SAGEMAKER_MODEL_SERVER_WORKERS)",
    )
    parser.add_argument(
        "--size-mb", type=int, default=100, help="size of the MLP's float32 weights"
    )
    parser.add_argument(
        "--load-timeout",
        type=float,
        default=300,
        help="seconds from LOAD to a first successful invoke before the benchmark gives up",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (models, server logs)"
    )
    args = parser.parse_args(list(argv))
    if (
        min(args.rounds, args.requests, args.clients, args.workers, args.size_mb) < 1
        or args.concurrent_requests < 1
    ):
        parser.error(
            "--rounds, --requests, --concurrent-requests, --clients, --workers and --size-mb must "
            "be >= 1"
        )
    if args.warmup < 0 or args.warmup_rounds < 0:
        parser.error("--warmup and --warmup-rounds must be >= 0")
    if args.scrape_interval <= 0:
        parser.error("--scrape-interval must be > 0")
    if args.concurrent_requests < args.clients:
        parser.error("--concurrent-requests must be at least --clients")
    return args


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_rounds(
    servers: dict[str, Server], cases: list[ModelCase], args: argparse.Namespace, metrics_url: str
) -> dict[Key, list[Sample]]:
    """Every model on every stack, round after round; warm-up rounds (negative indexes) are measured
    but not kept."""
    samples: dict[Key, list[Sample]] = {}
    for round_index in range(-args.warmup_rounds, args.rounds):
        shift = round_index % len(STACKS)
        order = STACKS[shift:] + STACKS[:shift]  # rotate who goes first
        round_label = f"{round_index + 1}/{args.rounds}" if round_index >= 0 else "warm-up"
        for case_index, case in enumerate(cases):
            for stack in order:
                # never reused: no LOAD 409
                name = f"m{case_index}-r{round_index + args.warmup_rounds}"
                scraped = metrics_url if stack == "ours" else None
                sample = measure(
                    servers[stack], name, case, stack.replace("-metrics-off", ""), args, scraped
                )
                if round_index >= 0:
                    samples.setdefault((case.label, stack), []).append(sample)
                progress(
                    f"round {round_label:>7} {case.label:>12} {stack:>16}: first response "
                    f"{sample.load_to_first_s:.2f} s, p50 "
                    f"{percentile(sample.latencies_ms, 50):.1f} ms, "
                    f"{sample.rps_1:.0f}/{sample.rps_n:.0f} req/s, failed {sample.failed}"
                )
    return samples


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(argv)
    ensure_venv(args.stock_venv, force=args.setup)
    if args.setup:
        return 0
    began = time.perf_counter()
    with ExitStack() as resources:
        # Short path under /tmp: MMS puts its worker sockets in it, and Unix socket paths are
        # limited to 108 bytes.
        if args.keep:
            root = Path(tempfile.mkdtemp(prefix="bench-", dir="/tmp"))
        else:
            root = Path(
                resources.enter_context(tempfile.TemporaryDirectory(prefix="bench-", dir="/tmp"))
            )
        cases = build_models(root / "models", args.size_mb)
        workers_env = {"SAGEMAKER_MODEL_SERVER_WORKERS": str(args.workers)}
        metrics_port = free_port()
        launches = {
            "ours": our_server(
                root / "ours", {**workers_env, "MME_METRICS_PORT": str(metrics_port)}
            ),
            "ours-metrics-off": our_server(
                root / "ours-off", {**workers_env, "MME_METRICS_PORT": "0"}
            ),
        }
        stock_command, stock_env, stock_port, versions = stock_server(
            root / "stock", args.stock_venv, workers_env
        )
        launches["stock"] = (stock_command, stock_env, stock_port)
        servers: dict[str, Server] = {}
        start_seconds: dict[str, float] = {}
        for stack, (command, env, port) in launches.items():
            started = time.perf_counter()
            servers[stack] = resources.enter_context(
                serve_isolated(stack, command, env, root / stack, port)
            )
            start_seconds[stack] = time.perf_counter() - started
            progress(
                f"{stack}: serving on port {port} after {start_seconds[stack]:.1f} s "
                f"({servers[stack].log})"
            )
        baseline_dirs = build_baseline(root / "models")
        baseline_body = json.dumps([[1.0] * IN_FEATURES]).encode()
        for stack, server in servers.items():
            baseline = load_baseline(
                server, baseline_dirs[stack.replace("-metrics-off", "")], baseline_body
            )
            progress(
                f"{stack}: {BASELINE_MODELS} baseline models loaded: tree memory {baseline:.0f} "
                f"MiB, {len(server.tree())} processes, {device_host_count(server)} device hosts"
            )
        samples = run_rounds(servers, cases, args, f"http://127.0.0.1:{metrics_port}/metrics")
        for server in servers.values():
            # MMS stopped by SIGTERM leaves its workers behind (serve_isolated kills them)
            for index in range(BASELINE_MODELS):
                server.unload_and_wait(f"baseline{index}")
    for case in cases:
        agree = same_answer(
            samples[(case.label, "ours")][0].first_body,
            samples[(case.label, "stock")][0].first_body,
        )
        progress(f"{case.label}: the two stacks' answers {'agree' if agree else 'DIFFER'}")

    print(
        f"medians of {args.rounds} rounds (after {args.warmup_rounds} warm-up); {args.workers} "
        f"worker(s) per model; {args.requests} sequential and {args.concurrent_requests} over "
        f"{args.clients} clients per round; ours scraped every {args.scrape_interval:g} s; CPU only"
    )
    print(
        "stock stack: "
        + ", ".join(f"{package}=={version}" for package, version in versions.items())
    )
    print(
        "memory added by the model: PSS of every process under the server plus the shared-memory "
        f"files they hold but do not map, after the first response and {args.warmup} warm-up "
        f"invokes minus before the LOAD (each after a {SETTLE_SECONDS:g} s pause), with "
        f"{BASELINE_MODELS} unrelated tiny models already loaded on every server (so our device "
        "hosts, and a stock worker, already run)"
    )
    print()
    print(report(cases, samples, args.rounds, args.clients))
    print()
    print(
        f"server start to /ping: ours {start_seconds['ours']:.1f} s, metrics off "
        f"{start_seconds['ours-metrics-off']:.1f} s, stock {start_seconds['stock']:.1f} s; "
        f"benchmark took {time.perf_counter() - began:.0f} s"
    )
    if args.keep:
        print(f"work directory kept: {root}")
    return 0
