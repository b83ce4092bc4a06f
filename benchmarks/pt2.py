"""PyTorch 2 artifacts against TorchScript, on this server, one run.

    .venv/bin/python -m benchmarks pt2 [-- --rounds 2 --size-mb 100]

For the MLP of the stock benchmark and the ResNet-18-shaped conv net of the batching benchmark, four
ways to ship the same weights, all served with no code and batch_size=16 in serving.properties:
  TorchScript       model.pt (torch.jit.script)
  ExportedProgram   model.pt2 from torch.export.save, first dimension dynamic
  AOTInductor       model.pt2 from torch._inductor.aoti_compile_and_package, compiled here for the
                    CPU
  compile=true      the ExportedProgram with compile=true: each LOAD compiles, or loads the compile
                    cache

Per variant and round: LOAD cold (a fresh compile cache for compile=true) and LOAD cached (the same
artifacts under another name: the median of 3 LOADs of fresh copies), warm p50 from one client, and
requests/s from 16 clients. "cached / eager LOAD" divides by the ExportedProgram's LOAD cached (the
same program, eager; its first LOAD also pays the warm process's one import of torch's PT2 loader,
which every later PT2 model inherits); "p50 / TorchScript" by TorchScript's p50. Medians over
--rounds; timings are never asserted.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import requests
import torch

from benchmarks.batching import Case, drive, resnet18_shaped
from benchmarks.benchlib import Server, our_server, percentile, table
from benchmarks.peers.stock_stack import serve_isolated
from benchmarks.preload import FEATURES

VARIANTS = ("TorchScript", "ExportedProgram", "AOTInductor", "compile=true")
WARMUP = 5


def mlp(size_mb: int) -> torch.nn.Module:
    layers = max(1, round(size_mb * 2**20 / (4 * (FEATURES * FEATURES + FEATURES))))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(FEATURES, FEATURES) for _ in range(layers)]).eval()


def build_variants(
    root: Path, label: str, model: torch.nn.Module, example: torch.Tensor, sample: bytes
) -> dict[str, Path]:
    """The four model directories for one network (``sample``: a request body, NPY, for warm-up and
    tracing)."""
    dirs = {variant: root / f"{label}-{index}" for index, variant in enumerate(VARIANTS)}
    for directory in dirs.values():
        (directory / "code").mkdir(parents=True)
        (directory / "code" / "warmup.npy").write_bytes(sample)
    properties = "batch_size=16\nmax_batch_delay=10\n"
    torch.jit.script(model).save(str(dirs["TorchScript"] / "model.pt"))
    rows = torch.export.Dim("rows", min=1, max=1 << 16)
    with torch.no_grad():
        program = torch.export.export(model, (example,), dynamic_shapes=({0: rows},))
    torch.export.save(program, str(dirs["ExportedProgram"] / "model.pt2"))
    shutil.copy(dirs["ExportedProgram"] / "model.pt2", dirs["compile=true"] / "model.pt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(dirs["AOTInductor"] / "model.pt2")
        )
    for variant, directory in dirs.items():
        extra = "compile=true\n" if variant == "compile=true" else ""
        (directory / "serving.properties").write_text(properties + extra)
    return dirs


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


CACHED_LOADS = 3


def timed_load(server: Server, name: str, model_dir: Path) -> float:
    started = time.perf_counter()
    response = server.load(name, model_dir)
    if response.status_code != 200:
        raise RuntimeError(f"LOAD {name} answered {response.status_code}; see {server.log}")
    return time.perf_counter() - started


def measure(server: Server, model_dir: Path, case: Case, tag: str) -> dict[str, float]:
    cold = timed_load(server, f"{tag}-cold", model_dir)
    server.unload(f"{tag}-cold")
    # A later LOAD is short and noisy: the median of CACHED_LOADS, each of a fresh copy (new files,
    # as a new download would be); the last stays loaded for the latency and throughput runs.
    cached_loads = []
    for index in range(CACHED_LOADS):
        cached_dir = model_dir.parent / f"{model_dir.name}-again-{tag}-{index}"
        shutil.copytree(model_dir, cached_dir)
        cached_loads.append(timed_load(server, f"{tag}-cached", cached_dir))
        if index < CACHED_LOADS - 1:
            server.unload(f"{tag}-cached")
    cached = statistics.median(cached_loads)
    url = f"{server.url}/models/{tag}-cached/invoke"
    deadline = time.monotonic() + 60
    while len(requests.get(f"{server.url}/models/{tag}-cached", timeout=30).json()["workers"]) < 16:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{tag} did not reach 16 workers")
        time.sleep(0.1)
    drive(url, case, 1, WARMUP)
    latencies, _, failed_1 = drive(url, case, 1, case.requests_1)
    _, rps, failed_n = drive(url, case, 16, case.requests_n)
    server.unload(f"{tag}-cached")
    return {
        "cold": cold,
        "cached": cached,
        "p50": percentile(latencies, 50),
        "rps": rps,
        "failed": failed_1 + failed_n,
    }


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks pt2 --",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--size-mb", type=int, default=100)
    args = parser.parse_args(list(argv))
    began = time.perf_counter()
    rng = np.random.default_rng(0)
    nets = {
        f"MLP {args.size_mb} MB": (mlp(args.size_mb), (2, FEATURES), 200, 640),
        "ResNet-18 224x224": (resnet18_shaped().eval(), (2, 3, 224, 224), 30, 192),
    }
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with ExitStack() as resources:
        root = Path(
            resources.enter_context(tempfile.TemporaryDirectory(prefix="bench-pt2-", dir="/tmp"))
        )
        cases = {}
        for label, (model, shape, requests_1, requests_n) in nets.items():
            body = npy(rng.standard_normal((1, *shape[1:])).astype(np.float32))
            dirs = build_variants(
                root / "models", label.split()[0], model, torch.randn(*shape), body
            )
            cases[label] = (
                Case(label, dirs["TorchScript"], body, "application/x-npy", requests_1, requests_n),
                dirs,
            )
            print(f"built {label}", file=sys.stderr, flush=True)
        for round_index in range(args.rounds):
            # A fresh server and compile cache each round: "cold" is a first compile, "cached" a
            # second LOAD.
            work = root / f"server-{round_index}"
            # A first compile counts against the LOAD's time limit (360 s by default: docs/api.md,
            # Long LOADs).
            env_extra = {
                "MME_CACHE_DIR": str(work / "cache"),
                "SAGEMAKER_MODEL_SERVER_TIMEOUT": "600",
            }
            command, env, port = our_server(work, env_extra)
            with serve_isolated("ours", command, env, work, port) as server:
                for label, (case, dirs) in cases.items():
                    for index, variant in enumerate(VARIANTS):
                        sample = measure(
                            server, dirs[variant], case, f"r{round_index}v{index}{label[0]}"
                        )
                        results.setdefault((label, variant), []).append(sample)
                        print(
                            f"round {round_index + 1} {label} {variant}: {json.dumps(sample)}",
                            file=sys.stderr,
                        )
    rows = []
    for label in nets:
        eager_load = statistics.median(s["cached"] for s in results[(label, "ExportedProgram")])
        script_p50 = statistics.median(s["p50"] for s in results[(label, "TorchScript")])
        for variant in VARIANTS:
            samples = results[(label, variant)]
            med = {
                key: statistics.median(s[key] for s in samples)
                for key in ("cold", "cached", "p50", "rps")
            }
            rows.append(
                [
                    label,
                    variant,
                    f"{med['cold']:.2f}",
                    f"{med['cached']:.2f}",
                    f"{med['cached'] / eager_load:.2f}",
                    f"{med['p50']:.1f}",
                    f"{med['p50'] / script_p50:.2f}",
                    f"{med['rps']:.0f}",
                    sum(int(s["failed"]) for s in samples),
                ]
            )
    print(f"medians of {args.rounds} rounds; batch_size=16, max_batch_delay=10 ms; CPU only")
    print()
    headers = [
        "model",
        "artifact",
        "LOAD cold, s",
        "LOAD cached, s",
        "cached / eager LOAD",
        "1 client p50, ms",
        "p50 / TorchScript",
        "16 clients, req/s",
        "failed",
    ]
    print(table(headers, rows))
    print()
    print(f"benchmark took {time.perf_counter() - began:.0f} s")
    return 0
