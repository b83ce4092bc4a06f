"""A re-LOAD after an UNLOAD: the package kept since the UNLOAD against none kept, the same 100 MB
models, one run.

    .venv/bin/python -m benchmarks reload [-- --loads 5]

What SageMaker does when a model it unloaded (for memory, or idleness) is asked for again: LOAD it
anew. Stacks:
  kept      this server as it ships: the model's package stays in host memory after its UNLOAD
            (within ``MME_KEEP_UNLOADED_MB``), so a LOAD of the same name and files runs no loader
            and no ``model_fn``
  not kept  ``MME_KEEP_UNLOADED_MB=0``: every LOAD runs the model's loader and ``model_fn`` and
            packs the result
Models, about 100 MB each:
  state dict + inference.py   an MLP's ``model.pth`` and a ``model_fn`` that builds the module and
                              loads it (the shape of a model packed for the AWS PyTorch container)
  Hugging Face, no code       a BERT-shaped text classifier (5 layers, hidden 768) saved with
                              ``save_pretrained``
Measured: LOAD to the first answer (a kept-alive client), after the model's first LOAD and UNLOAD;
the median of ``--loads``, the stacks taking turns. Each answer after a re-LOAD must equal the
model's first answer, or the benchmark fails. The goal is issue #29's: kept <= 0.2x not kept.
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

import hf_models
import model_factory
import torch

from benchmarks.benchlib import Server, our_server, serve, table
from benchmarks.hugging_face import call, connect

WIDTH = 2048
LAYERS = 6  # 6 x 2048 x 2048 float32: 100 MB
MLP_SCRIPT = """
import json
import os

import torch


def model_fn(model_dir):
    layers = [torch.nn.Linear(16, {width})]
    layers += [torch.nn.Linear({width}, {width}) for _ in range({layers})]
    model = torch.nn.Sequential(*layers, torch.nn.Linear({width}, 4))
    model.load_state_dict(torch.load(os.path.join(model_dir, "model.pth")))
    return model.eval()


def input_fn(body, content_type):
    return torch.tensor(json.loads(body), dtype=torch.float32)
"""
HEADERS = ("model (about 100 MB)", "not kept, ms", "kept, ms", "kept/not kept", "goal")


def progress(message: str) -> None:
    print(f"[reload] {message}", file=sys.stderr, flush=True)


def mlp_model(model_dir: Path) -> Path:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, WIDTH), *[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 4))
    model_dir.mkdir(parents=True)
    torch.save(model.state_dict(), model_dir / "model.pth")
    model_factory.write_code(model_dir, MLP_SCRIPT.format(width=WIDTH, layers=LAYERS))
    return model_dir


def answer(server: Server, name: str, body: bytes) -> bytes:
    status, reply = call(connect(server), f"/models/{name}/invoke", body)
    if status != 200:
        raise RuntimeError(f"INVOKE {name}: {status} {reply[:300]!r}; see {server.log}")
    return reply


def re_loads(
    servers: dict[str, Server], name: str, model_dir: Path, body: bytes, loads: int
) -> dict[str, float]:
    """The median LOAD to first answer after the first LOAD and UNLOAD, per stack, ms (the stacks
    take turns)."""
    first = {}
    for label, server in servers.items():
        if server.load(name, model_dir).status_code != 200:
            raise RuntimeError(f"LOAD {name} failed; see {server.log}")
        first[label] = answer(server, name, body)
        server.unload_and_wait(name)
    seconds: dict[str, list[float]] = {label: [] for label in servers}
    for _ in range(loads):
        for label, server in servers.items():
            started = time.monotonic()
            loaded = server.load(name, model_dir)
            if loaded.status_code != 200:
                raise RuntimeError(
                    f"LOAD {name}: {loaded.status_code} {loaded.text[:300]}; see {server.log}"
                )
            reply = answer(server, name, body)
            seconds[label].append(time.monotonic() - started)
            if reply != first[label]:
                raise RuntimeError(
                    f"{name} answered {reply[:200]!r} after a re-LOAD, {first[label][:200]!r} first"
                )
            server.unload_and_wait(name)
    return {label: statistics.median(values) * 1000 for label, values in seconds.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks reload", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--loads", type=int, default=5, help="re-LOADs per model and stack")
    args = parser.parse_args(argv)
    if args.loads < 1:
        parser.error("needs --loads >= 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-reload-") as work_dir, ExitStack() as stack:
        work = Path(work_dir)
        progress("making a 100 MB state-dict model and a 100 MB BERT")
        models = [
            (
                "state dict + inference.py",
                mlp_model(work / "mlp"),
                json.dumps([[0.1] * 16]).encode(),
            ),
            (
                "Hugging Face, no code",
                hf_models.bert(work / "bert", hidden=768, layers=5),
                json.dumps({"inputs": "a good movie about paris"}).encode(),
            ),
        ]
        servers = {}
        for label, env in (("not kept", {"MME_KEEP_UNLOADED_MB": "0"}), ("kept", {})):
            command, full_env, port = our_server(work / label.replace(" ", "-"), env)
            servers[label] = stack.enter_context(
                serve(command, full_env, work / label.replace(" ", "-"), port)
            )
        for index, (title, model_dir, body) in enumerate(models):
            progress(f"{title}: {args.loads} re-LOADs on each stack, in turns")
            medians = re_loads(servers, f"model-{index}", model_dir, body, args.loads)
            ratio = medians["kept"] / medians["not kept"]
            rows.append(
                [
                    title,
                    f"{medians['not kept']:.0f}",
                    f"{medians['kept']:.0f}",
                    f"{ratio:.2f}",
                    "<= 0.2",
                ]
            )
    print(table(HEADERS, rows))
    print()
    print(
        f"LOAD to first answer after the model's first LOAD and UNLOAD, median of {args.loads}, "
        "one client on a kept-alive connection; the CPU device hosts of both servers started "
        "before the first timing."
    )
    return 0
