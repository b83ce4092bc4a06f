"""Generative Hugging Face models with no code, the part of ``python -m benchmarks hugging_face``
that generates: ours, whose scheduler decodes every client's rows together step by step, against the
AWS Hugging Face stack.

    .venv/bin/python -m benchmarks hugging_face -- --part generation [--clients 16
                                                                      --gen-requests 160
                                                                      --gen-lone 40]

Models, built here with random weights and tokenizers trained here (tests/hf_models.py), the same
files (hard links) for both stacks: a GPT-2-shaped causal LM (4 layers, hidden 256) as
text-generation, and a T5-shaped encoder-decoder (4 layers, hidden 256) as text2text-generation,
once greedy and once (a model of its own) with 4 beams, the text-to-text default, which ours
decodes as beam groups in the batch and the AWS stack through ``generate`` for each request.
Requests, in one fixed order for both stacks: prompts of 4 to 40 words, 16 to 96 new tokens, greedy
(``"do_sample": false, "num_beams": 1``, which both stacks take as generate does) or with
``"num_beams": 4``. Ours serves each model with ``batch_size`` = ``--clients`` in its
serving.properties (that many rows per step, and frontend connections); the AWS stack serves one
task per container (``HF_TASK``), so it is started once per model.

Measured per stack and model, both stacks running and taking turns (a machine busier at one moment
weighs on both alike): LOAD until the first answer; one client's p50 and p99 over ``--gen-lone``
requests on one kept-alive connection, the stacks answering each request in turn; ``--clients``
clients sending ``--gen-requests`` requests in all, each on its own connection, in 4 rounds taking
turns (req/s, their mean); and how many of the lone client's answers both stacks gave alike (the
same text from transformers 5.23 here and 4.57.6 there). Timings are never asserted; compare
ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import hf_models
import requests

from benchmarks.benchlib import (
    BATCH_CONNECTIONS_AT_LOAD,
    Server,
    our_server,
    percentile,
    serve,
    table,
)
from benchmarks.peers.stock_stack import serve_isolated, stock_server

# name -> (builder, task, extra parameters of every request)
MODELS = {
    "gpt2": (hf_models.gpt2, "text-generation", {"return_full_text": False}),
    "t5": (hf_models.t5, "text2text-generation", {}),
    "t5-beams": (hf_models.t5, "text2text-generation", {"num_beams": 4}),
}
LABELS = {
    "gpt2": "GPT-2 (text-generation)",
    "t5": "T5 (text2text-generation)",
    "t5-beams": "T5, 4 beams",
}
WORKERS_SECONDS = 120
ROUNDS = 4  # each stack's rounds of one client and of many, taking turns with the other's


def progress(message: str) -> None:
    from benchmarks.hugging_face import progress as say

    say(f"generation: {message}")


def bodies(name: str, count: int) -> list[bytes]:
    """Prompts of 4 to 40 words and 16 to 96 new tokens, greedy unless the model's extra parameters
    say otherwise, in a fixed order."""
    extra = MODELS[name][2]
    made = []
    for index in range(count):
        parameters = {
            "max_new_tokens": 16 + (index * 37) % 81,
            "do_sample": False,
            "num_beams": 1,
            **extra,
        }
        text = hf_models.text_of_tokens(4 + (index * 53) % 37, index)
        made.append(json.dumps({"inputs": text, "parameters": parameters}).encode())
    return made


def workers_ready(server: Server, name: str, count: int) -> bool:
    """Our model has ``count`` frontend connections (the entrypoint scales it to ``batch_size``
    after its LOAD)."""
    try:
        described = requests.get(f"{server.url}/models/{name}", timeout=10).json()
        workers = (described[0] if isinstance(described, list) else described)["workers"]
    except (requests.RequestException, ValueError, KeyError, IndexError):
        return False
    return len(workers) >= count and all(worker["status"] == "READY" for worker in workers)


def answers(server: Server, name: str, texts: list[bytes]) -> list[Any]:
    from benchmarks.hugging_face import call, connect

    connection = connect(server)
    found = []
    for body in texts:
        status, answer = call(connection, f"/models/{name}/invoke", body)
        found.append(json.loads(answer) if status == 200 else status)
    return found


def measure(
    servers: dict[str, Server], name: str, paths: dict[str, Path], args: argparse.Namespace
) -> dict[str, Any]:
    """Both stacks on one model taking turns, so that a machine busier at one moment weighs on both
    alike: the lone client's requests one by one, then ``ROUNDS`` rounds of many clients each."""
    from benchmarks.hugging_face import (
        call,
        connect,
        load_until_first_answer,
        lone_client,
        many_clients,
    )

    texts = bodies(name, max(args.gen_requests, args.gen_lone))
    rows: dict[str, dict[str, Any]] = {}
    for stack, server in servers.items():
        progress(f"{name}, {stack}: LOAD")
        rows[stack] = {
            "load": load_until_first_answer(server, name, paths[stack], texts[0]),
            "lone": [],
            "rates": [],
        }
        lone_client(server, name, texts, 5)  # warm-up
        rows[stack]["answers"] = answers(server, name, texts[: args.gen_lone])
    deadline = time.monotonic() + WORKERS_SECONDS
    while not workers_ready(servers["ours"], name, args.clients) and time.monotonic() < deadline:
        time.sleep(0.5)
    for server in servers.values():
        # warm-up: every connection once
        many_clients(server, name, texts, args.clients, args.clients)
    connections = {stack: connect(server) for stack, server in servers.items()}
    progress(f"{name}: one client, the stacks taking turns request by request")
    for index in range(args.gen_lone):
        order = list(servers) if index % 2 == 0 else list(reversed(servers))
        for stack in order:
            started = time.perf_counter()
            status, _ = call(connections[stack], f"/models/{name}/invoke", texts[index])
            rows[stack]["lone"].append(time.perf_counter() - started)
            rows[stack]["failures"] = rows[stack].get("failures", 0) + (status != 200)
    for turn in range(ROUNDS):
        for stack, server in servers.items():
            progress(f"{name}, {stack}: {args.clients} clients, round {turn + 1} of {ROUNDS}")
            rate, failed = many_clients(
                server, name, texts, args.clients, max(args.clients, args.gen_requests // ROUNDS)
            )
            rows[stack]["rates"].append(rate)
            rows[stack]["failures"] += failed
    for row in rows.values():
        row["p50"], row["p99"] = (
            percentile(row["lone"], 50) * 1000,
            percentile(row["lone"], 99) * 1000,
        )
        row["throughput"] = sum(row["rates"]) / len(row["rates"])
    return rows


def run(args: argparse.Namespace, root: Path, with_aws: bool) -> str:
    """Both stacks over both models; returns the table."""
    from benchmarks.hugging_face import HF_HANDLER, HF_PACKAGES, HF_VENV, link_model

    sources = {
        name: builder(root / f"gen-{name}", layers=4, hidden=256)
        for name, (builder, _, _) in MODELS.items()
    }
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    command, env, port = our_server(root / "gen-ours", BATCH_CONNECTIONS_AT_LOAD)
    with serve(command, env, root / "gen-ours", port) as ours:
        for name, (_, task, _) in MODELS.items():
            properties = {"serving.properties": f"task={task}\nbatch_size={args.clients}\n"}
            paths = {"ours": link_model(sources[name], root / f"gen-ours-{name}", properties)}
            if not with_aws:
                rows[("ours", name)] = measure({"ours": ours}, name, paths, args)["ours"]
                continue
            work = root / f"gen-aws-{name}"
            command, env, port, versions = stock_server(
                work, HF_VENV, {"HF_TASK": task}, HF_HANDLER, HF_PACKAGES
            )
            progress(f"AWS stack ({task}): {versions}")
            with serve_isolated("AWS HF", command, env, work, port) as aws:
                paths["AWS"] = link_model(sources[name], root / f"gen-aws-model-{name}")
                measured = measure({"ours": ours, "AWS": aws}, name, paths, args)
            rows.update({(stack, name): row for stack, row in measured.items()})
    return report(rows, args)


def report(rows: dict[tuple[str, str], dict[str, Any]], args: argparse.Namespace) -> str:
    stacks = [stack for stack in ("ours", "AWS") if any(key[0] == stack for key in rows)]
    headers = [""]
    for name in MODELS:
        headers += [f"{LABELS[name]}, {stack}" for stack in stacks]
        if len(stacks) == 2:
            headers.append("ours/AWS")
    lines = []
    for label, key, fmt in (
        ("LOAD until the first answer, s", "load", "{:.2f}"),
        ("1 client, p50, ms", "p50", "{:.1f}"),
        ("1 client, p99, ms", "p99", "{:.1f}"),
        (f"{args.clients} clients, req/s", "throughput", "{:.1f}"),
        (f"{args.clients} clients, failed requests", "failures", "{:.0f}"),
    ):
        cells = [label]
        for name in MODELS:
            values = [rows[(stack, name)][key] for stack in stacks]
            cells += [fmt.format(value) for value in values]
            if len(stacks) == 2:
                cells.append(
                    "" if key == "failures" or not values[1] else f"{values[0] / values[1]:.2f}"
                )
        lines.append(cells)
    if len(stacks) == 2:
        same = ["same answer as the other stack, of the lone client's"]
        for name in MODELS:
            ours, aws = rows[("ours", name)]["answers"], rows[("AWS", name)]["answers"]
            agreed = sum(1 for mine, theirs in zip(ours, aws, strict=True) if mine == theirs)
            same += [f"{agreed}/{len(ours)}", f"{agreed}/{len(ours)}", ""]
        lines.append(same)
    return table(headers, lines)
