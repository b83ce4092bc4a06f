"""A model in the shared device hosts versus in a device host of its own
(``MME_SHARE_DEVICE=false``, what ``isolation=process`` gives one model): LOAD-to-ready time and the
memory a model adds to the server's process tree, by devices and workers.

    .venv/bin/python -m benchmarks preload [-- --size-mb 300 --setups 1x1 1x8 2x2 4x4 --repeat 2]

A setup ``DxW`` serves the model on D devices with W workers. This machine has no GPU, so D > 1
lists D GPUs through the test double of nvidia-smi (tests/fake_nvidia_smi.py): the frontend hands
out GPU ids and each worker binds one, and torch, finding no CUDA, runs them on the CPU; D = 1 is
the CPU itself.

Either way a CUDA-free loader runs ``model_fn`` once and hands the weights over in a shared-memory
file, and one host per device the model's workers are bound to serves it, mapping those pages: the
shared hosts (one per card; on the CPU a pool of two, the model on one), or hosts of the model's
own, one per device, whatever the worker count. What a host of its own costs is that process.

The default ``state_dict`` style saves the weights as a state dict with a ``code/inference.py`` that
rebuilds the network and calls ``load_state_dict``, as scripts written for the AWS containers do.
``torchscript`` is served by the default ``model_fn``, whose file the loader packs as it is.

Memory is measured the same way in both modes (benchlib): the memory of the server's whole process
tree, that is the PSS of its processes from /proc/PID/smaps_rollup, summed, plus the shared-memory
files they hold open but do not map (the package of a model, which the warm process keeps), read
before the LOAD and again after the model has answered 2 x W invokes, each after a 2 s pause; the
table shows the difference, so a model is charged for what it adds wherever it lives (copy-on-write
pages counted once). Each server first loads two unrelated tiny models with D workers each (kept
loaded), so the "before" reading already includes every shared host the measured model can use.
After each measurement the model is unloaded and its processes waited for.

Both servers of a setup run at once on the same machine; the table reports medians and shared/own
ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import requests
import torch

# tests/, which the benchmarks package puts on the path
from fake_nvidia_smi import install as fake_gpus
from model_factory import torchscript_model

from benchmarks.benchlib import (
    BASELINE_MODELS,
    SETTLE_SECONDS,
    Server,
    device_host_count,
    load_baseline,
    our_server,
    serve,
    table,
)

FEATURES = 2048


STATE_DICT_SCRIPT = """
import os

import torch


def model_fn(model_dir):
    model = torch.nn.Sequential(*[torch.nn.Linear({features}, {features}) for _ in range({layers})])
    model.load_state_dict(torch.load(os.path.join(model_dir, "model.pth"), map_location="cpu"))
    return model.eval()
"""


def big_model(model_dir: Path, size_mb: int, style: str = "torchscript") -> Path:
    """An MLP of about ``size_mb`` MB of float32 weights, as TorchScript or as a state dict with its
    script."""
    layers = max(1, round(size_mb * 2**20 / (4 * (FEATURES * FEATURES + FEATURES))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(FEATURES, FEATURES) for _ in range(layers)]
    ).eval()
    model_dir.mkdir(parents=True, exist_ok=True)
    if style == "torchscript":
        torch.jit.script(model).save(str(model_dir / "model.pt"))
        return model_dir
    torch.save(model.state_dict(), model_dir / "model.pth")
    (model_dir / "code").mkdir()
    (model_dir / "code" / "inference.py").write_text(
        STATE_DICT_SCRIPT.format(features=FEATURES, layers=layers)
    )
    return model_dir


def measure(server: Server, name: str, model_dir: Path, workers: int) -> tuple[float, float]:
    """Seconds the LOAD call took, and the memory (MiB) the model adds to the server's process tree
    once it has answered 2 x ``workers`` invokes; then UNLOAD, and a wait until none of its
    processes is left."""
    before = server.tree_memory_mib()
    started = time.perf_counter()
    response = server.load(name, model_dir, initial_workers=workers)
    load_seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"LOAD failed: {response.status_code} {response.text}")
    body = json.dumps([[0.0] * FEATURES])
    for _ in range(workers * 2):
        reply = requests.post(
            f"{server.url}/models/{name}/invoke",
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=120,
        )
        reply.raise_for_status()
    added = server.tree_memory_mib() - before
    server.unload_and_wait(name)
    return load_seconds, added


def parse_setup(text: str) -> tuple[int, int]:
    devices, _, workers = text.partition("x")
    if not (devices.isdigit() and workers.isdigit() and int(devices) >= 1 and int(workers) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not DEVICESxWORKERS, like 2x4")
    return int(devices), int(workers)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks preload --",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-mb", type=int, default=300)
    parser.add_argument(
        "--setups", type=parse_setup, nargs="+", default=[(1, 1), (1, 8), (2, 2), (4, 4)]
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--style", choices=["state_dict", "torchscript"], default="state_dict")
    args = parser.parse_args(list(argv))

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-preload-") as tmp:
        root = Path(tmp)
        model_dir = big_model(root / "models" / "big", args.size_mb, args.style)
        size = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file()) / 2**20
        baseline_dirs = [
            torchscript_model(root / "models" / f"baseline{index}", seed=index + 1)
            for index in range(BASELINE_MODELS)
        ]
        baseline_body = json.dumps([[1.0] * 4]).encode()
        for devices, workers in args.setups:
            gpus = fake_gpus(root / f"gpus-{devices}", devices) if devices > 1 else {}
            results: dict[str, list[tuple[float, float]]] = {"shared": [], "own": []}
            with ExitStack() as stack:
                servers = {}
                for mode, flag in (("shared", "true"), ("own", "false")):
                    work = root / f"{mode}-{devices}x{workers}"
                    command, env, port = our_server(work, {"MME_SHARE_DEVICE": flag, **gpus})
                    servers[mode] = stack.enter_context(serve(command, env, work, port))
                    baseline = load_baseline(
                        servers[mode], baseline_dirs, baseline_body, workers=devices
                    )
                    print(
                        f"{devices}x{workers} {mode} host: baseline tree memory {baseline:.0f} "
                        f"MiB, {len(servers[mode].tree())} processes, "
                        f"{device_host_count(servers[mode])} device hosts",
                        file=sys.stderr,
                        flush=True,
                    )
                for round_index in range(args.repeat):
                    for mode, server in servers.items():
                        name = f"big_{mode}_{round_index}"
                        results[mode].append(measure(server, name, model_dir, workers))
            on_load, off_load = (
                statistics.median(r[0] for r in results[mode]) for mode in ("shared", "own")
            )
            on_mem, off_mem = (
                statistics.median(r[1] for r in results[mode]) for mode in ("shared", "own")
            )
            rows.append(
                [
                    devices,
                    workers,
                    f"{on_load:.2f}",
                    f"{off_load:.2f}",
                    f"{on_load / off_load:.2f}",
                    f"{on_mem:.0f}",
                    f"{off_mem:.0f}",
                    # a difference: never divide by ~0
                    f"{on_mem / off_mem:.2f}" if off_mem > 0 else "-",
                ]
            )
    style = "TorchScript" if args.style == "torchscript" else "state dict + load_state_dict script,"
    print(
        f"model: {style} MLP, {size:.0f} MiB on disk; median of {args.repeat} runs; hosts on the "
        "CPU"
    )
    print(
        "MiB added: PSS of every process under the server plus the shared-memory files they hold "
        "but do not map, after the model's 2 x W answers minus before its LOAD (each after a "
        f"{SETTLE_SECONDS:g} s pause), with {BASELINE_MODELS} unrelated tiny models already loaded "
        "(D workers each), so the device hosts already run"
    )
    print()  # a Markdown table starts after a blank line
    headers = [
        "devices",
        "workers",
        "LOAD s (shared)",
        "LOAD s (own host)",
        "shared/own",
        "MiB added (shared)",
        "MiB added (own host)",
        "shared/own",
    ]
    print(table(headers, rows))
    return 0
