"""What the GPU proof measures on a card: the README's GPU claims, one part at a time
(scripts/gpu-proof runs each part within a time budget of its own).

    .venv/bin/python -m benchmarks gpu [-- --part models --part crash]

Parts, each starting a server of its own:
  models      memory on the card per extra model (tiny TorchScript models; fine-tunes of a 100 MB
              BERT that differ only in their head), the processes holding a CUDA context however
              many models, LOAD to first answer
  batching    the 96 MiB MLP (TorchScript) with batch_size 16 against unbatched: 16 clients, and one
  adapters    8 rank-8 LoRA adapters of the 100 MB BERT against one of them, 16 clients,
              batch_size 16
  generation  a GPT-2-shaped model (4 layers, hidden 256): one client, 16 clients, and whether each
              client's greedy answer under 16 clients is the one it gets alone
  crash       a model that aborts its device host: how long until the 10 models beside it on the
              card answer again
Memory on the card is nvidia-smi's memory.used, summed over the cards, a second after the last
answer. Without a GPU every part runs on the CPU and card memory reads n/a: a check of this
benchmark, not a GPU number. Clients keep their connection alive (http.client). Timings are never
asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import hf_models
from model_factory import torchscript_model
from safetensors.torch import load_file

from benchmarks.benchlib import (
    BATCH_CONNECTIONS_AT_LOAD,
    Server,
    our_server,
    percentile,
    serve,
    table,
)
from benchmarks.hugging_face import call, connect, link_model, load_until_first_answer, lone_client
from benchmarks.hugging_face_generation import bodies as generation_bodies
from benchmarks.hugging_face_generation import workers_ready
from benchmarks.lora_adapters import clients, make_models, texts
from benchmarks.preload import FEATURES, big_model
from mme_runtime.base.nvidia import gpu_count

HEADERS = ("measurement", "value", "what it shows")
CLIENTS = 16
ROW = json.dumps([[0.5] * 4]).encode()  # the tiny TorchScript models' input
CRASHING_SCRIPT = """
import json
import os


def model_fn(model_dir):
    return os.path.basename(model_dir)


def transform_fn(model, body, content_type, accept):
    if (body.decode() if isinstance(body, (bytes, bytearray)) else str(body)) == "abort":
        os.abort()
    return json.dumps({"model": model}), "application/json"
"""


def progress(message: str) -> None:
    print(f"[gpu] {message}", file=sys.stderr, flush=True)


def card_mib(settle: float = 1.0) -> float | None:
    """GPU memory in use, MiB, summed over the cards, after ``settle`` seconds; None without a
    GPU."""
    if not gpu_count():
        return None
    time.sleep(settle)
    output = _smi("--query-gpu=memory.used", "--format=csv,noheader,nounits")
    return float(sum(int(line) for line in output.split()))


def compute_apps() -> list[int]:
    """The pids holding a CUDA context, as the driver lists them (none without a GPU)."""
    if not gpu_count():
        return []
    output = _smi("--query-compute-apps=pid", "--format=csv,noheader")
    return [int(pid) for pid in output.split() if pid.isdigit()]


def _smi(*arguments: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *arguments], capture_output=True, text=True, check=True
    ).stdout


def mib(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def per_extra(used: list[float | None]) -> float | None:
    """Growth per model after the first, from readings taken after each LOAD."""
    if used[0] is None or used[-1] is None or len(used) < 2:
        return None
    return (used[-1] - used[0]) / (len(used) - 1)


@contextmanager
def ours(work: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    command, full_env, port = our_server(work, env)
    with serve(command, full_env, work, port) as server:
        yield server


def load_all(
    server: Server, prefix: str, dirs: Sequence[Path], body: bytes
) -> tuple[list[float], list[float | None]]:
    """LOADs each directory and waits for its first answer: the seconds that took, and the card's
    memory after."""
    seconds, used = [], []
    for index, directory in enumerate(dirs):
        seconds.append(load_until_first_answer(server, f"{prefix}-{index}", directory, body))
        used.append(card_mib(settle=0.5))
    return seconds, used


def ours_among(pids: list[int], server: Server) -> int:
    tree = {process.pid for process in server.tree()}
    return sum(1 for pid in pids if pid in tree)


def models_part(work: Path, args: argparse.Namespace) -> list[list[object]]:
    progress(
        f"making {args.models} tiny models, a 100 MB BERT and {args.fine_tunes} fine-tunes of it"
    )
    tiny = [
        torchscript_model(work / "tiny" / f"tiny-{index}", seed=index)
        for index in range(args.models)
    ]
    base = hf_models.bert_sized_vocabulary(
        hf_models.bert(work / "bert" / "base", hidden=768, layers=5)
    )
    tunes = [
        hf_models.fine_tune(base, work / "bert" / f"tune-{i}", i) for i in range(args.fine_tunes)
    ]
    head = sum(
        t.nbytes
        for n, t in load_file(str(tunes[0] / "model.safetensors")).items()
        if "classifier" in n
    )
    text = json.dumps({"inputs": "a good movie about paris"}).encode()
    with ours(work / "server") as server:
        empty = card_mib()
        progress(f"LOAD of {args.models} tiny models, then {args.fine_tunes} fine-tunes")
        tiny_seconds, tiny_used = load_all(server, "tiny", tiny, ROW)
        tune_seconds, tune_used = load_all(server, "tune", tunes, text)
        apps = compute_apps()
        held = ours_among(apps, server)
    first = None if empty is None or tiny_used[0] is None else tiny_used[0] - empty
    body = None if tiny_used[-1] is None or tune_used[0] is None else tune_used[0] - tiny_used[-1]
    loaded = args.models + args.fine_tunes
    return [
        ["card memory, server up, no model, MiB", mib(empty, 0), "no CUDA context before a model"],
        ["first model: a CUDA context and a device host, MiB", mib(first, 0), "once per card"],
        ["per extra tiny TorchScript model, MiB", mib(per_extra(tiny_used), 2), "its weights (KB)"],
        ["first fine-tune: the 100 MB BERT body, MiB", mib(body, 0), "held once"],
        [
            f"per extra fine-tune (head {head / 1024:.1f} KiB), MiB",
            mib(per_extra(tune_used), 2),
            "the head only, not the body",
        ],
        [
            f"processes with a CUDA context, {loaded} models",
            f"{len(apps)} ({held} ours)",
            "one per card",
        ],
        [
            "LOAD to first answer, tiny, p50, ms",
            f"{statistics.median(tiny_seconds) * 1000:.0f}",
            "",
        ],
        [
            "LOAD to first answer, first fine-tune, ms",
            f"{tune_seconds[0] * 1000:.0f}",
            "loads the body",
        ],
        [
            "LOAD to first answer, later fine-tunes, p50, ms",
            f"{statistics.median(tune_seconds[1:]) * 1000:.0f}",
            "the body is held",
        ],
    ]


def alternate(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The mean of ``rounds`` of each measure, taking turns so that a busier moment weighs on all
    alike."""
    found: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            found[name].append(measure())
    return {name: statistics.mean(values) for name, values in found.items()}


def batching_part(work: Path, args: argparse.Namespace) -> list[list[object]]:
    progress("making the 96 MiB MLP")
    mlp = big_model(work / "mlp", 96)
    size = (mlp / "model.pt").stat().st_size / 2**20
    properties = {"serving.properties": f"batch_size={CLIENTS}\nmax_batch_delay=5\n"}
    batched = link_model(mlp, work / "mlp-batched", properties)
    unbatched = link_model(mlp, work / "mlp-unbatched")
    row = json.dumps([[0.01 * (i % 100) for i in range(FEATURES)]]).encode()
    with ours(work / "server", BATCH_CONNECTIONS_AT_LOAD) as server:
        for name, directory in (("batched", batched), ("unbatched", unbatched)):
            load_until_first_answer(server, name, directory, row)
        progress(f"{CLIENTS} clients, {args.rounds} rounds each, taking turns")
        rates = alternate(
            {
                name: lambda name=name: clients(server, [name], [row], args.requests)
                for name in ("batched", "unbatched")
            },
            args.rounds,
        )
        lone = {name: percentile(lone_client(server, name, [row], 50), 50) * 1000 for name in rates}
    return [
        [
            f"{CLIENTS} clients, batched (batch_size {CLIENTS}), req/s",
            f"{rates['batched']:.0f}",
            "",
        ],
        [f"{CLIENTS} clients, unbatched, req/s", f"{rates['unbatched']:.0f}", ""],
        [
            "batched / unbatched",
            f"{rates['batched'] / rates['unbatched']:.2f}x",
            "passes shared on the card",
        ],
        ["1 client, batched, p50, ms", f"{lone['batched']:.2f}", "max_batch_delay 5 ms"],
        ["1 client, unbatched, p50, ms", f"{lone['unbatched']:.2f}", f"MLP of {size:.0f} MiB"],
    ]


def adapters_part(work: Path, args: argparse.Namespace) -> list[list[object]]:
    progress("making the 100 MB BERT and 8 LoRA adapters")
    _, adapters, adapter_bytes = make_models(work / "lora", 8)
    bodies = texts(64)
    with ours(work / "server") as server:
        seconds, used = load_all(server, "adapter", adapters, bodies[0])
        progress(f"{CLIENTS} clients: one adapter, 8 adapters, taking turns")
        names = [f"adapter-{index}" for index in range(8)]
        rates = alternate(
            {
                "one": lambda: clients(server, names[:1], bodies, args.requests),
                "eight": lambda: clients(server, names, bodies, args.requests),
            },
            args.rounds,
        )
    return [
        [f"{CLIENTS} clients on one adapter, req/s", f"{rates['one']:.0f}", "batch_size 16"],
        [
            f"{CLIENTS} clients over 8 adapters, req/s",
            f"{rates['eight']:.0f}",
            "their rows share passes",
        ],
        ["8 adapters / one", f"{rates['eight'] / rates['one']:.2f}x", "goal >= 0.8x"],
        [
            f"card memory per extra adapter (own {adapter_bytes / 2**20:.2f} MiB), MiB",
            mib(per_extra(used), 2),
            "no second base",
        ],
        [
            "LOAD to first answer, adapters after the first, p50, ms",
            f"{statistics.median(seconds[1:]) * 1000:.0f}",
            "",
        ],
    ]


def answers_under_clients(server: Server, name: str, bodies: Sequence[bytes]) -> list[object]:
    """Each body's answer, ``CLIENTS`` clients sending them at once."""

    def client(offset: int) -> list[tuple[int, object]]:
        connection = connect(server)
        found = []
        for index in range(offset, len(bodies), CLIENTS):
            status, answer = call(connection, f"/models/{name}/invoke", bodies[index])
            found.append((index, json.loads(answer) if status == 200 else status))
        return found

    with ThreadPoolExecutor(CLIENTS) as pool:
        pairs = [pair for found in pool.map(client, range(CLIENTS)) for pair in found]
    return [answer for _, answer in sorted(pairs, key=lambda pair: pair[0])]


def generation_part(work: Path, args: argparse.Namespace) -> list[list[object]]:
    progress("making a GPT-2-shaped model")
    source = hf_models.gpt2(work / "gpt2-source", layers=4, hidden=256)
    properties = {"serving.properties": f"task=text-generation\nbatch_size={CLIENTS}\n"}
    model = link_model(source, work / "gpt2", properties)
    prompts = generation_bodies("gpt2", max(args.requests // 4, 2 * CLIENTS))
    with ours(work / "server", BATCH_CONNECTIONS_AT_LOAD) as server:
        load = load_until_first_answer(server, "gpt2", model, prompts[0])
        deadline = time.monotonic() + 60
        while not workers_ready(server, "gpt2", CLIENTS) and time.monotonic() < deadline:
            time.sleep(0.5)
        alone = [
            json.loads(call(connect(server), "/models/gpt2/invoke", body)[1])
            for body in prompts[:CLIENTS]
        ]
        lone = lone_client(server, "gpt2", prompts, 20)
        progress(f"{CLIENTS} clients, {len(prompts)} requests")
        started = time.monotonic()
        together = answers_under_clients(server, "gpt2", prompts)
        rate = len(prompts) / (time.monotonic() - started)
    failed = sum(1 for answer in together if isinstance(answer, int))
    alike = sum(1 for mine, theirs in zip(alone, together, strict=False) if mine == theirs)
    return [
        ["LOAD to first answer, s", f"{load:.2f}", ""],
        ["1 client, p50, ms", f"{percentile(lone, 50) * 1000:.1f}", "16 to 96 new tokens"],
        [f"{CLIENTS} clients, req/s", f"{rate:.1f}", f"{failed} failed"],
        [
            f"answers under {CLIENTS} clients equal to alone",
            f"{alike}/{len(alone)}",
            "greedy: should be all",
        ],
    ]


def crash_part(work: Path, args: argparse.Namespace) -> list[list[object]]:
    neighbours = [torchscript_model(work / f"neighbour-{index}", seed=index) for index in range(10)]
    crasher = work / "crasher"
    (crasher / "code").mkdir(parents=True)
    (crasher / "code" / "inference.py").write_text(CRASHING_SCRIPT)
    with ours(work / "server") as server:
        load_all(server, "neighbour", neighbours, ROW)
        load_until_first_answer(server, "crasher", crasher, b"fine")
        before = compute_apps()
        progress("the crasher aborts its device host")
        crashed = time.monotonic()
        status, _ = call(connect(server), "/models/crasher/invoke", b"abort")
        answered = time.monotonic() - crashed
        names = [f"neighbour-{index}" for index in range(10)]
        while not all(call(connect(server), f"/models/{n}/invoke", ROW)[0] == 200 for n in names):
            if time.monotonic() - crashed > 60:
                raise RuntimeError(
                    f"the neighbours did not answer again within 60 s; see {server.log}"
                )
            time.sleep(0.1)
        back = time.monotonic() - crashed
        after = compute_apps()
    return [
        ["the aborting request's answer", f"{status} after {answered:.2f} s", "an error, at once"],
        [
            "10 models beside it answer again after, s",
            f"{back:.2f}",
            "reloaded from their packages",
        ],
        [
            "processes with a CUDA context, before / after",
            f"{len(before)} / {len(after)}",
            "the dead one's freed",
        ],
    ]


PARTS: dict[str, Callable[[Path, argparse.Namespace], list[list[object]]]] = {
    "models": models_part,
    "batching": batching_part,
    "adapters": adapters_part,
    "generation": generation_part,
    "crash": crash_part,
}


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks gpu", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--part", action="append", choices=list(PARTS), help="run these parts (default: all)"
    )
    parser.add_argument(
        "--work", type=Path, help="where models and servers go (default: a temporary folder)"
    )
    parser.add_argument("--models", type=int, default=10, help="tiny models in the models part")
    parser.add_argument("--fine-tunes", type=int, default=5, help="fine-tunes in the models part")
    parser.add_argument(
        "--requests", type=int, default=320, help="requests per round of 16 clients"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds per stack, taking turns")
    args = parser.parse_args(argv)
    if args.models < 2 or args.fine_tunes < 2:
        parser.error(
            "--models and --fine-tunes need 2 or more: memory is counted per model after the first"
        )
    where = (
        "on the CPU: no GPU here, so card memory reads n/a"
        if not gpu_count()
        else f"{gpu_count()} GPU(s)"
    )
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as scratch:
        for name in args.part or PARTS:
            work = (args.work or Path(scratch)) / name
            work.mkdir(parents=True, exist_ok=True)
            progress(f"{name}, {where}")
            print(f"### {name}\n\n{table(HEADERS, PARTS[name](work, args))}\n", flush=True)
    print(f"torch {_torch_version()}, {where}; {CLIENTS} clients on kept-alive connections.")
    return 0


def _torch_version() -> str:
    # the benchmark's own process: the server's processes decide about CUDA for themselves
    import torch

    return (
        f"{torch.__version__} (CUDA {torch.version.cuda})"
        if torch.version.cuda
        else torch.__version__
    )
