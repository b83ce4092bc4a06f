"""LoRA adapters over one base: their memory, their LOADs, and their requests sharing the base's
passes.

    .venv/bin/python -m benchmarks sharing [-- --adapters 50 --adapters-off 8 --requests 640]

Part of the ``sharing`` benchmark (``benchmarks/sharing.py`` prints its table). One BERT-shaped
classifier of about 100 MB (5 layers, hidden 768, random weights) with a tokenizer of BERT's size
(30,522 entries) is the base; each adapter is a rank-8 PEFT LoRA adapter of its query and value
layers with a classifier of its own (PEFT's ``modules_to_save``), about 400 KB, made here with PEFT.
Stacks, in one run:
  sharing on    this server: adapters of one base take its one package (``base_model=../base``)
  sharing off   ``MME_SHARE_WEIGHTS=false`` and ``MME_MODEL_CACHE_MB=0``: each adapter's LOAD loads
                and holds a base of its own (what serving each adapter as a merged model costs)
Measured: the server tree's PSS per extra adapter (``--adapters`` on, ``--adapters-off`` off); LOAD
to the first answer of each adapter after the first (p50, and the last against the second); then 16
clients on a kept-alive connection each (http.client), ``--requests`` in all, on one adapter with
``batch_size`` 16, spread over 8 adapters with ``batch_size`` 16 (their rows share passes), and over
8 adapters of a copy of the base without batching (one request a pass).
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hf_models
import lora_models
from safetensors.torch import load_file

from benchmarks.benchlib import Server, our_server, serve
from benchmarks.hugging_face import call, connect, load_until_first_answer

BATCHED = "base_model=../base\nbatch_size=16\nmax_batch_delay=10\n"
UNBATCHED = "base_model=../base-unbatched\n"


def progress(message: str) -> None:
    print(f"[sharing] {message}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", type=int, default=50, help="adapters loaded with sharing on")
    parser.add_argument(
        "--adapters-off", type=int, default=8, help="adapters loaded with sharing off"
    )
    parser.add_argument(
        "--requests", type=int, default=640, help="requests per throughput run (16 clients)"
    )


def make_models(root: Path, count: int) -> tuple[Path, list[Path], int]:
    """The base, ``count`` adapters of it and their bytes each; a copy of the base for the unbatched
    adapters."""
    base = hf_models.bert_sized_vocabulary(hf_models.bert(root / "base", hidden=768, layers=5))
    shutil.copytree(base, root / "base-unbatched")
    adapters = []
    for index in range(count):
        directory = lora_models.adapter(
            base, root / f"adapter-{index}", seed=index, targets=("query", "value")
        )
        (directory / "serving.properties").write_text(BATCHED)
        adapters.append(directory)
    nbytes = sum(
        tensor.nbytes
        for tensor in load_file(str(adapters[0] / "adapter_model.safetensors")).values()
    )
    return base, adapters, nbytes


def texts(count: int) -> list[bytes]:
    return [
        json.dumps({"inputs": hf_models.text_of_tokens(24, seed)}).encode() for seed in range(count)
    ]


def adapters_memory(
    server: Server, adapters: list[Path], count: int, body: bytes
) -> tuple[float, float, list[float]]:
    """PSS per extra adapter (``count`` loaded, each answering once), the frontend's part of it, and
    each LOAD's time to its first answer."""
    loads = [load_until_first_answer(server, "adapter-0", adapters[0], body)]
    before, frontend_before = server.tree_memory_mib(), server.frontend_memory_mib()
    for index in range(1, count):
        loads.append(load_until_first_answer(server, f"adapter-{index}", adapters[index], body))
    after, frontend_after = server.tree_memory_mib(), server.frontend_memory_mib()
    extra = max(1, count - 1)
    return (after - before) / extra, (frontend_after - frontend_before) / extra, loads


def clients(server: Server, names: list[str], bodies: list[bytes], total: int) -> float:
    """Requests per second from 16 clients, client ``i`` calling ``names[i % len(names)]``, after a
    round of 64 that opens the connections of each adapter's batch (they open when its requests
    first overlap)."""
    _clients(server, names, bodies, 64)
    time.sleep(1)
    return _clients(server, names, bodies, total)


def _clients(server: Server, names: list[str], bodies: list[bytes], total: int) -> float:

    def client(offset: int) -> None:
        connection: http.client.HTTPConnection = connect(server)
        name = names[offset % len(names)]
        for index in range(offset, total, 16):
            status, answer = call(connection, f"/models/{name}/invoke", bodies[index % len(bodies)])
            if status != 200:
                raise RuntimeError(f"{name}: {status} {answer[:200]!r}")

    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(client, range(16)))
    return total / (time.monotonic() - started)


def measure(work: Path, args: argparse.Namespace) -> list[list[object]]:
    """The adapters' rows of the sharing table: measurement, on, off, on/off, goal."""
    count = max(args.adapters, args.adapters_off, 9)
    progress(f"making a base and {count} adapters")
    models = work / "lora-models"
    base, adapters, adapter_bytes = make_models(models, count)
    bodies = texts(64)
    results: dict[str, dict[str, float]] = {}
    for label, env, loaded in (
        ("on", {}, args.adapters),
        ("off", {"MME_SHARE_WEIGHTS": "false", "MME_MODEL_CACHE_MB": "0"}, args.adapters_off),
    ):
        command, full_env, port = our_server(work / f"lora-{label}", env)
        with serve(command, full_env, work / f"lora-{label}", port) as server:
            progress(f"sharing {label}: {loaded} adapters")
            per_adapter, frontend, loads = adapters_memory(server, adapters, loaded, bodies[0])
            row = {
                "memory": per_adapter,
                "frontend": frontend,
                "load_p50": statistics.median(loads[1:]) * 1000,
            }
            row.update(early=statistics.median(loads[1:6]), late=statistics.median(loads[-5:]))
            if label == "on":
                progress("16 clients: one adapter, 8 adapters, 8 adapters unbatched")
                row["one"] = clients(server, ["adapter-0"], bodies, args.requests)
                row["eight"] = clients(
                    server, [f"adapter-{i}" for i in range(8)], bodies, args.requests
                )
                for index in range(8):
                    plain = models / f"unbatched-{index}"
                    if not plain.exists():
                        shutil.copytree(adapters[index], plain)
                        (plain / "serving.properties").write_text(UNBATCHED)
                    load_until_first_answer(server, f"unbatched-{index}", plain, bodies[0])
                row["unbatched"] = clients(
                    server, [f"unbatched-{i}" for i in range(8)], bodies, args.requests
                )
            results[label] = row
    on, off = results["on"], results["off"]
    own_mib = adapter_bytes / 2**20
    return [
        ["adapter's own tensors, MiB", f"{own_mib:.2f}", f"{own_mib:.2f}", "", ""],
        [
            "PSS per extra adapter, MiB",
            f"{on['memory']:.2f}",
            f"{off['memory']:.1f}",
            f"{on['memory'] / off['memory']:.3f}",
            f"<= {1.1 * own_mib + 1:.2f} (1.1x own + 1 MiB)",
        ],
        [
            "  of which MMS's frontend (its Java process), MiB",
            f"{on['frontend']:.2f}",
            f"{off['frontend']:.2f}",
            "",
            "",
        ],
        [
            "LOAD to first answer, adapters after the first, p50, ms",
            f"{on['load_p50']:.0f}",
            f"{off['load_p50']:.0f}",
            f"{on['load_p50'] / off['load_p50']:.2f}",
            "<= 100",
        ],
        [
            "LOAD p50: last 5 adapters / first 5 after the first",
            f"{on['late'] / on['early']:.2f}",
            f"{off['late'] / off['early']:.2f}",
            "",
            "<= 1.10",
        ],
        ["16 clients, one adapter, batching on, req/s", f"{on['one']:.0f}", "", "", ""],
        [
            "16 clients over 8 adapters, batching on, req/s",
            f"{on['eight']:.0f}",
            "",
            f"{on['eight'] / on['one']:.2f} of one adapter",
            ">= 0.8x one adapter",
        ],
        [
            "16 clients over 8 adapters, unbatched, req/s",
            f"{on['unbatched']:.0f}",
            "",
            f"batched: {on['eight'] / on['unbatched']:.2f}x",
            "batched >= 2x",
        ],
    ]
