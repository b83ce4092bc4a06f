"""Dynamic batching against the peers, same TorchScript files, one run.

    .venv/bin/python -m benchmarks batching [-- --rounds 2 --clients 16 --batch-size 16
                                                --max-batch-delay 10]

Stacks, each measured on the same model files:
  ours batched    this server, the model with serving.properties batch_size/max_batch_delay (the
                  default predict_fn on the collated rows; the server scales the model to batch_size
                  workers itself)
  ours unbatched  this server, the same model with no serving.properties (one worker, the default on
                  a CPU host)
  stock           MMS 1.1.11 + sagemaker-inference + the AWS PyTorch handler 1.5.1, one worker
                  (peers/stock_stack.py)
  TorchServe      TorchServe 0.12 with its own batching, batch_size/max_batch_delay, one worker
                  (peers/torchserve_stack.py; its handler collates the rows of a batch as ours does)

Models: the memory-bound MLP of the stock benchmark (--size-mb, one row of 2048 floats as JSON per
request) and a ResNet-18-shaped conv net (random weights, built here; one 1x3x224x224 float32 image
as NPY per request). Per stack, model and round: LOAD (or register), a few untimed requests,
--requests-1 sequential requests from one client (latency p50/p99, requests/s) and --requests-n
requests from --clients clients (requests/s, p50/p99), then UNLOAD. Tables show medians over
--rounds and ratios against ours batched; timings are never asserted.
"""

from __future__ import annotations

import argparse
import io
import json
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

import numpy as np
import requests
import torch

from benchmarks.benchlib import BATCH_CONNECTIONS_AT_LOAD, Server, our_server, percentile, table
from benchmarks.peers.stock_stack import ensure_venv as ensure_stock_venv
from benchmarks.peers.stock_stack import serve_isolated, stock_model_dir, stock_server
from benchmarks.peers.torchserve_stack import TorchServe, archive_model, serve_torchserve
from benchmarks.peers.torchserve_stack import ensure_venv as ensure_torchserve_venv
from benchmarks.preload import FEATURES, big_model

STACKS = ("ours batched", "ours unbatched", "stock", "TorchServe")
TIMEOUT_SECONDS = 120


@dataclass(frozen=True)
class Case:
    label: str
    model_dir: Path  # model.pt (TorchScript), shared by every stack
    body: bytes
    content_type: str
    requests_1: int
    requests_n: int


@dataclass
class Sample:
    latencies_1: list[float]
    rps_1: float
    latencies_n: list[float]
    rps_n: float
    failed: int


class BasicBlock(torch.nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(outputs)
        self.conv2 = torch.nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(outputs)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = torch.nn.Sequential(
                torch.nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                torch.nn.BatchNorm2d(outputs),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18_shaped(classes: int = 1000) -> torch.nn.Module:
    """ResNet-18's layers and sizes (11.7 M parameters), random weights: what torchvision would
    build."""
    layers: list[torch.nn.Module] = [
        torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2, 1),
    ]
    channels = 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(channels, width, stride), BasicBlock(width, width, 1)]
        channels = width
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(512, classes)]
    return torch.nn.Sequential(*layers).eval()


def build_cases(root: Path, size_mb: int, scale: float) -> list[Case]:
    rng = random.Random(0)
    mlp = big_model(root / "mlp", size_mb)
    row = json.dumps([[round(rng.uniform(-1, 1), 4) for _ in range(FEATURES)]]).encode()
    conv = root / "conv"
    conv.mkdir(parents=True)
    torch.manual_seed(0)
    torch.jit.script(resnet18_shaped()).save(str(conv / "model.pt"))
    image = io.BytesIO()
    np.save(image, np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32))
    mib = (mlp / "model.pt").stat().st_size / 2**20
    return [
        Case(
            f"MLP {mib:.0f} MiB", mlp, row, "application/json", int(200 * scale), int(1280 * scale)
        ),
        Case(
            "ResNet-18 224x224",
            conv,
            image.getvalue(),
            "application/x-npy",
            int(30 * scale),
            int(192 * scale),
        ),
    ]


def drive(url: str, case: Case, clients: int, total: int) -> tuple[list[float], float, int]:
    """``total`` requests from ``clients`` threads: latencies (ms) of the successful ones,
    requests/s, failures."""
    headers = {"Content-Type": case.content_type, "Accept": "application/json"}
    shares = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    ready = threading.Barrier(clients + 1)

    def client(share: int) -> tuple[list[float], int]:
        latencies, failed = [], 0
        with requests.Session() as session:
            # opens the connection
            session.post(url, data=case.body, headers=headers, timeout=TIMEOUT_SECONDS)
            ready.wait()
            for _ in range(share):
                started = time.perf_counter()
                try:
                    ok = session.post(
                        url, data=case.body, headers=headers, timeout=TIMEOUT_SECONDS
                    ).ok
                except requests.RequestException:
                    ok = False
                if ok:
                    latencies.append((time.perf_counter() - started) * 1000)
                else:
                    failed += 1
        return latencies, failed

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, share) for share in shares]
        ready.wait()
        started = time.perf_counter()
        results = [future.result() for future in futures]
        elapsed = time.perf_counter() - started
    latencies = [value for values, _ in results for value in values]
    return latencies, len(latencies) / elapsed, sum(failed for _, failed in results)


def measure(url: str, case: Case, clients: int, warmup: int) -> Sample:
    drive(url, case, 1, warmup)
    latencies_1, rps_1, failed_1 = drive(url, case, 1, case.requests_1)
    latencies_n, rps_n, failed_n = drive(url, case, clients, case.requests_n)
    return Sample(latencies_1, rps_1, latencies_n, rps_n, failed_1 + failed_n)


class Stacks:
    """LOAD, URL and UNLOAD of one model on each stack."""

    def __init__(
        self,
        ours: Server,
        stock: Server,
        torchserve: TorchServe,
        root: Path,
        args: argparse.Namespace,
    ):
        self.ours, self.stock, self.torchserve, self.root, self.args = (
            ours,
            stock,
            torchserve,
            root,
            args,
        )

    def load(self, stack: str, case: Case, name: str) -> str:
        """Loads ``case`` on ``stack`` as ``name``; returns its invoke URL."""
        if stack == "TorchServe":
            store = self.torchserve.model_store
            archive = archive_model(case.model_dir, store, name, archive_format="no-archive")
            registered = self.torchserve.register(
                name,
                archive,
                batch_size=self.args.batch_size,
                max_batch_delay_ms=self.args.max_batch_delay,
            )
            _check(registered, f"TorchServe register {name}")
            return self.torchserve.predictions_url(name)
        server, model_dir = (
            (self.stock, self.root / "stock" / name) if stack == "stock" else (self.ours, None)
        )
        if stack == "stock":
            stock_model_dir(case.model_dir, model_dir)  # type: ignore[arg-type]
        else:
            model_dir = self.root / "ours" / name
            model_dir.mkdir(parents=True)
            (model_dir / "model.pt").hardlink_to(case.model_dir / "model.pt")
            if stack == "ours batched":
                properties = (
                    f"batch_size={self.args.batch_size}\n"
                    f"max_batch_delay={self.args.max_batch_delay}\n"
                )
                (model_dir / "serving.properties").write_text(properties)
        _check(server.load(name, model_dir), f"{stack} LOAD {name}")  # type: ignore[arg-type]
        if stack == "ours batched":
            # the server adds the connections that fill a batch right after LOAD
            self._wait_for_workers(server, name, self.args.batch_size)
        return f"{server.url}/models/{name}/invoke"

    def unload(self, stack: str, name: str) -> None:
        if stack == "TorchServe":
            _check(self.torchserve.unregister(name), f"TorchServe unregister {name}")
        else:
            _check(
                (self.stock if stack == "stock" else self.ours).unload(name),
                f"{stack} UNLOAD {name}",
            )

    @staticmethod
    def _wait_for_workers(server: Server, name: str, count: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = requests.get(f"{server.url}/models/{name}", timeout=30).json()["workers"]
            if len(workers) >= count and all(worker["status"] == "READY" for worker in workers):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not reach {count} workers; see {server.log}")


def _check(response: requests.Response, what: str) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"{what} answered {response.status_code}: {response.text[:300]}")


def report(cases: list[Case], samples: dict[tuple[str, str], list[Sample]], clients: int) -> str:
    metrics: list[tuple[str, Callable[[Sample], float], str]] = [
        ("1 client: p50, ms", lambda s: percentile(s.latencies_1, 50), "{:.1f}"),
        ("1 client: p99, ms", lambda s: percentile(s.latencies_1, 99), "{:.1f}"),
        ("1 client: req/s", lambda s: s.rps_1, "{:.0f}"),
        (f"{clients} clients: req/s", lambda s: s.rps_n, "{:.0f}"),
        (f"{clients} clients: p50, ms", lambda s: percentile(s.latencies_n, 50), "{:.1f}"),
        (f"{clients} clients: p99, ms", lambda s: percentile(s.latencies_n, 99), "{:.1f}"),
    ]
    rows: list[list[object]] = []
    for case in cases:
        for metric, value, fmt in metrics:
            medians = {
                stack: statistics.median(value(s) for s in samples[(case.label, stack)])
                for stack in STACKS
            }
            base = medians["ours batched"]
            ratios = [
                f"{base / medians[stack]:.2f}" if medians[stack] else "-" for stack in STACKS[1:]
            ]
            rows.append(
                [case.label, metric, *(fmt.format(medians[stack]) for stack in STACKS), *ratios]
            )
        failed = [sum(s.failed for s in samples[(case.label, stack)]) for stack in STACKS]
        rows.append([case.label, "failed requests", *failed, "-", "-", "-"])
    headers = ["model", "metric", *STACKS, *(f"batched/{stack}" for stack in STACKS[1:])]
    return table(headers, rows)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks batching --",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds per stack and model; medians are reported"
    )
    parser.add_argument(
        "--warmup-rounds", type=int, default=1, help="rounds run first and not reported"
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16, help="ours batched and TorchServe")
    parser.add_argument(
        "--max-batch-delay", type=int, default=10, help="milliseconds; ours batched and TorchServe"
    )
    parser.add_argument(
        "--size-mb", type=int, default=100, help="size of the MLP's float32 weights"
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiplies every request count (0.2: a quick look)",
    )
    parser.add_argument("--warmup", type=int, default=10, help="untimed requests after each LOAD")
    args = parser.parse_args(list(argv))
    if min(args.rounds, args.clients, args.batch_size) < 1 or args.scale <= 0 or args.warmup < 1:
        parser.error("--rounds, --clients, --batch-size and --warmup must be >= 1, --scale > 0")
    return args


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(argv)
    ensure_stock_venv()
    ensure_torchserve_venv()
    began = time.perf_counter()
    with ExitStack() as resources:
        root = Path(
            resources.enter_context(
                tempfile.TemporaryDirectory(prefix="bench-batching-", dir="/tmp")
            )
        )
        cases = build_cases(root / "models", args.size_mb, args.scale)
        # ours batched scales itself to --batch-size
        one_worker = {"SAGEMAKER_MODEL_SERVER_WORKERS": "1"}
        ours_command, ours_env, ours_port = our_server(
            root / "ours", {**one_worker, **BATCH_CONNECTIONS_AT_LOAD}
        )
        stock_command, stock_env, stock_port, _ = stock_server(root / "stock", env=one_worker)
        ours = resources.enter_context(
            serve_isolated("ours", ours_command, ours_env, root / "ours", ours_port)
        )
        stock = resources.enter_context(
            serve_isolated("stock", stock_command, stock_env, root / "stock", stock_port)
        )
        torchserve = resources.enter_context(serve_torchserve(root / "torchserve"))
        stacks = Stacks(ours, stock, torchserve, root, args)
        samples: dict[tuple[str, str], list[Sample]] = {}
        for round_index in range(-args.warmup_rounds, args.rounds):
            order = STACKS if round_index % 2 == 0 else STACKS[::-1]
            for case_index, case in enumerate(cases):
                for stack in order:
                    name = f"b{case_index}r{round_index + args.warmup_rounds}{STACKS.index(stack)}"
                    url = stacks.load(stack, case, name)
                    sample = measure(url, case, args.clients, args.warmup)
                    stacks.unload(stack, name)
                    if round_index >= 0:
                        samples.setdefault((case.label, stack), []).append(sample)
                    print(
                        f"round {round_index + 1:>2} {case.label:>18} {stack:>14}: 1 client p50 "
                        f"{percentile(sample.latencies_1, 50):.1f} ms, "
                        f"{sample.rps_1:.0f}/{sample.rps_n:.0f} req/s, failed {sample.failed}",
                        file=sys.stderr,
                        flush=True,
                    )
    print(
        f"medians of {args.rounds} rounds (after {args.warmup_rounds} warm-up); "
        f"batch_size={args.batch_size}, max_batch_delay={args.max_batch_delay} ms for ours batched "
        f"and TorchServe; CPU only, {args.clients} clients"
    )
    print()
    print(report(cases, samples, args.clients))
    print()
    print(f"benchmark took {time.perf_counter() - began:.0f} s")
    return 0
