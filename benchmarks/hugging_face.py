"""Hugging Face models with no code: ours batched and unbatched against the AWS Hugging Face stack,
one run.

    .venv/bin/python -m benchmarks hugging_face [-- --models 20 --clients 16 --requests 320
                                                    --lone 100]
    .venv/bin/python -m benchmarks hugging_face -- --part generation   # the generative models alone

Stacks, each on the same files (hard links) of one BERT-shaped classifier (4 layers, hidden 256,
random weights, a WordPiece tokenizer trained here) and the same texts, 4 to 200 tokens long:
  ours batched    this server, no code, ``batch_size`` 16 in serving.properties: texts padded into
                  shared passes
  ours unbatched  this server, no code, no serving.properties
  AWS HF          MMS 1.1.11 + sagemaker-huggingface-inference-toolkit 2.6.0 + transformers 4.57.6
                  (the newest it runs with), in .hf-bench-venv (made on first use), started as
                  benchmarks/peers/stock_stack.py starts the stock stack

Measured per stack: LOAD until the first answer; one client's p50 and p99 over ``--lone`` requests
on one kept-alive connection (http.client: the requests library would add about 2 ms a call here);
``--clients`` clients sending ``--requests`` requests in all, each on its own connection. Then
memory: the server's whole process tree (PSS) before and after loading ``--models`` more copies, per
extra model, for our no-code models, the same models through an ``inference.py`` with a
``requirements.txt`` naming transformers (which the image ships: they share the host too), the same
with ``isolation=process`` (what such a model cost before the image shipped transformers: processes
of its own), and the AWS stack. Timings are never asserted; compare ratios within one run. Then the
generative models, GPT-2- and T5-shaped, ours against the AWS stack
(``hugging_face_generation.py``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hf_models
from serving import pss_mib

from benchmarks import benchlib
from benchmarks.benchlib import (
    BATCH_CONNECTIONS_AT_LOAD,
    Server,
    our_server,
    percentile,
    serve,
    table,
)
from benchmarks.peers.stock_stack import serve_isolated, stock_server

HF_VENV = benchlib.REPO / ".hf-bench-venv"
# The toolkit's newest release imports is_tf_available, which transformers 5 removed: 4.57.6 is the
# newest it runs with. torch is pinned exactly (the local CPU wheel); setuptools<81 keeps
# pkg_resources for sagemaker-inference.
HF_REQUIREMENTS = (
    "torch==2.13.0",
    "multi-model-server==1.1.11",
    "sagemaker-inference==1.10.1",
    "sagemaker-huggingface-inference-toolkit==2.6.0",
    "transformers==4.57.6",
    "tokenizers==0.22.2",
    "pillow",
    "setuptools<81",
)
HF_HANDLER = "sagemaker_huggingface_inference_toolkit.handler_service"
HF_PACKAGES = (
    "torch",
    "multi-model-server",
    "sagemaker-huggingface-inference-toolkit",
    "transformers",
)
INFERENCE_PY = '''"""The same model through code of one's own: what a user writes without
zero-code loading."""
import json

from transformers import pipeline


def model_fn(model_dir):
    return pipeline("text-classification", model=model_dir, device="cpu")


def input_fn(body, content_type):
    return json.loads(body)


def predict_fn(data, model):
    return model(data["inputs"], **data.get("parameters", {}))


def output_fn(prediction, accept):
    return json.dumps(prediction)
'''


def progress(message: str) -> None:
    print(f"[hugging_face] {message}", file=sys.stderr, flush=True)


def link_model(source: Path, dest: Path, extra: dict[str, str] | None = None) -> Path:
    """``source``'s files hard-linked into ``dest`` (one page-cache copy for every stack), plus
    ``extra`` files."""
    dest.mkdir(parents=True)
    for path in source.iterdir():
        os.link(path, dest / path.name)
    for name, text in (extra or {}).items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text(text)
    return dest


def bodies(count: int) -> list[bytes]:
    """Texts of 4 to 200 tokens, in a fixed order that every stack gets."""
    lengths = [4 + (index * 53) % 197 for index in range(count)]
    return [
        json.dumps({"inputs": hf_models.text_of_tokens(n, seed)}).encode()
        for seed, n in enumerate(lengths)
    ]


def uniform(texts: Sequence[bytes]) -> list[bytes]:
    """As many texts as ``texts``, all of their mean length."""
    lengths = [len(json.loads(text)["inputs"].split()) for text in texts]
    mean = round(sum(lengths) / len(lengths))
    return [
        json.dumps({"inputs": hf_models.text_of_tokens(mean, seed)}).encode()
        for seed in range(len(texts))
    ]


def call(connection: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
    connection.request("POST", path, body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


def connect(server: Server) -> http.client.HTTPConnection:
    host, port = server.url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=600)


def load_until_first_answer(server: Server, name: str, path: Path, body: bytes) -> float:
    started = time.monotonic()
    response = server.load(name, path)
    if response.status_code != 200:
        raise RuntimeError(f"LOAD {name}: {response.status_code} {response.text[:300]}")
    status, answer = call(connect(server), f"/models/{name}/invoke", body)
    if status != 200:
        raise RuntimeError(f"first INVOKE {name}: {status} {answer[:300]!r}")
    return time.monotonic() - started


def lone_client(server: Server, name: str, texts: Sequence[bytes], count: int) -> list[float]:
    connection = connect(server)
    timings = []
    for index in range(count):
        started = time.perf_counter()
        status, _ = call(connection, f"/models/{name}/invoke", texts[index % len(texts)])
        timings.append(time.perf_counter() - started)
        if status != 200:
            raise RuntimeError(f"{name}: {status}")
    return timings


def many_clients(
    server: Server, name: str, texts: Sequence[bytes], clients: int, total: int
) -> tuple[float, int]:
    """Requests per second with ``clients`` connections, and how many failed."""

    def client(offset: int) -> int:
        connection = connect(server)
        failures = 0
        for index in range(offset, total, clients):
            status, _ = call(connection, f"/models/{name}/invoke", texts[index % len(texts)])
            failures += status != 200
        return failures

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        failures = sum(pool.map(client, range(clients)))
    return total / (time.monotonic() - started), failures


def memory_per_model(
    server: Server, make: Callable[[int], Path], count: int, prefix: str, body: bytes
) -> float:
    """PSS of the server's tree per extra model, ``count`` models loaded (and answering once) on top
    of what runs."""
    settle = 2.0
    time.sleep(settle)
    before = pss_mib([*server.tree()])
    for index in range(count):
        load_until_first_answer(server, f"{prefix}{index}", make(index), body)
    time.sleep(settle)
    after = pss_mib([*server.tree()])
    for index in range(count):
        server.unload(f"{prefix}{index}")
    return (after - before) / count


def measure(
    server: Server, name: str, path: Path, texts: list[bytes], args: argparse.Namespace
) -> dict[str, float]:
    progress(f"{name}: LOAD")
    row = {"load": load_until_first_answer(server, name, path, texts[0])}
    lone_client(server, name, texts, 10)  # warm-up: every length the pass may see
    progress(f"{name}: one client")
    lone = lone_client(server, name, texts, args.lone)
    row["p50"], row["p99"] = percentile(lone, 50) * 1000, percentile(lone, 99) * 1000
    progress(f"{name}: {args.clients} clients")
    row["throughput"], row["failures"] = many_clients(
        server, name, texts, args.clients, args.requests
    )
    # The same tokens in texts of one length: what padding costs a batch of mixed lengths (what
    # bucketing could win).
    progress(f"{name}: {args.clients} clients, one length")
    row["uniform"], failed = many_clients(server, name, uniform(texts), args.clients, args.requests)
    row["failures"] += failed
    return row


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks hugging_face --", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--models", type=int, default=20, help="models loaded for the memory rows")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument(
        "--requests", type=int, default=320, help="requests of the many-clients round, in all"
    )
    parser.add_argument("--lone", type=int, default=100, help="requests of the one-client round")
    parser.add_argument(
        "--no-aws", action="store_true", help="leave the AWS stack out (nothing to install)"
    )
    parser.add_argument("--part", choices=("all", "classifier", "generation"), default="all")
    parser.add_argument(
        "--gen-requests",
        type=int,
        default=160,
        help="generations of the many-clients round, in all",
    )
    parser.add_argument(
        "--gen-lone", type=int, default=60, help="generations of the one-client round"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(argv)
    if not args.no_aws:
        benchlib.ensure_venv(HF_VENV, HF_REQUIREMENTS, "the AWS Hugging Face stack")
    texts = bodies(64)
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as scratch:
        root = Path(scratch)
        if args.part != "classifier":
            from benchmarks import hugging_face_generation  # it imports this module's helpers

            generation = hugging_face_generation.run(args, root, with_aws=not args.no_aws)
            if args.part == "generation":
                print(generation)
                return 0
        source = hf_models.bert(root / "source", "text-classification", layers=4, hidden=256)
        rows: dict[str, dict[str, float]] = {}
        memory: dict[str, float] = {}
        command, env, port = our_server(root / "ours", BATCH_CONNECTIONS_AT_LOAD)
        with serve(command, env, root / "ours", port) as ours:
            batched = link_model(
                source,
                root / "batched",
                {"serving.properties": "batch_size=16\nmax_batch_delay=10\n"},
            )
            rows["ours batched"] = measure(ours, "batched", batched, texts, args)
            rows["ours unbatched"] = measure(
                ours, "unbatched", link_model(source, root / "unbatched"), texts, args
            )
            code = {
                "code/inference.py": INFERENCE_PY,
                "code/requirements.txt": "transformers==5.23.0\n",
            }
            isolated = {**code, "serving.properties": "isolation=process\n"}
            for label, extra in (
                ("no code", None),
                ("inference.py", code),
                ("inference.py, own processes", isolated),
            ):
                progress(f"memory: {args.models} models, {label}")
                prefix = label.replace(" ", "-").replace(",", "").replace(".", "") + "-"
                make = lambda i, p=prefix, e=extra: link_model(source, root / f"{p}{i}", e)  # noqa: E731
                memory[f"ours, {label}"] = memory_per_model(
                    ours, make, args.models, prefix, texts[0]
                )
        if not args.no_aws:
            command, env, port, versions = stock_server(
                root / "aws", HF_VENV, {"HF_TASK": "text-classification"}, HF_HANDLER, HF_PACKAGES
            )
            progress(f"AWS stack: {versions}")
            with serve_isolated("AWS HF", command, env, root / "aws", port) as aws:
                rows["AWS HF"] = measure(
                    aws, "aws", link_model(source, root / "aws-model"), texts, args
                )
                progress(f"memory: {args.models} models, AWS stack")
                make = lambda i: link_model(source, root / f"aws-{i}")  # noqa: E731
                memory["AWS HF stack"] = memory_per_model(
                    aws, make, args.models, "aws-mem-", texts[0]
                )
    print(report(rows, memory, args))
    if args.part == "all":
        print(f"\nGenerative models ({args.clients} clients, greedy and 4 beams):\n\n{generation}")
    return 0


def report(
    rows: dict[str, dict[str, float]], memory: dict[str, float], args: argparse.Namespace
) -> str:
    names = list(rows)
    batched, unbatched, aws = rows["ours batched"], rows["ours unbatched"], rows.get("AWS HF")

    def ratio(value: float, reference: dict[str, float] | None, key: str) -> str:
        return (
            ""
            if reference is None or not reference[key] or key == "failures"
            else f"{value / reference[key]:.2f}"
        )

    lines = [
        table(
            ["", *names, "batched/unbatched", "batched/AWS"],
            [
                [
                    label,
                    *(fmt.format(rows[n][key]) for n in names),
                    ratio(batched[key], unbatched, key),
                    ratio(batched[key], aws, key),
                ]
                for label, key, fmt in (
                    ("LOAD until the first answer, s", "load", "{:.2f}"),
                    ("1 client, p50, ms", "p50", "{:.1f}"),
                    ("1 client, p99, ms", "p99", "{:.1f}"),
                    (f"{args.clients} clients, req/s", "throughput", "{:.1f}"),
                    (f"{args.clients} clients, texts of one length, req/s", "uniform", "{:.1f}"),
                    (f"{args.clients} clients, failed requests", "failures", "{:.0f}"),
                )
            ],
        ),
        "",
        table(
            ["memory per extra model (PSS, " + str(args.models) + " models loaded)", "MiB"],
            [[label, f"{value:.1f}"] for label, value in memory.items()],
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
