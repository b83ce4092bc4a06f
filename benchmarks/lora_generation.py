"""LoRA adapters for generation (issue #36): 8 adapters of one Llama-shaped base decoding in one
continuous batch, against one adapter, against batching off, and against the AWS Hugging Face stack
serving each adapter merged into a model of its own.

    .venv/bin/python -m benchmarks lora_generation [-- --requests 48 --slow-requests 16 --rounds 4]
    .venv/bin/python -m benchmarks lora_generation -- --quick    # a tiny base, one round (minutes)

Models, built here (no hub): a Llama-shaped causal LM of about 128 MB (hidden 768, 5 layers, MLP
2048, 12 heads over 4 key-value heads, untied embeddings), random weights drawn wide enough that
greedy text follows its prompt, and a byte-level BPE tokenizer trained here (tests/hf_models.py);
8 PEFT LoRA adapters of it, rank 16 on every linear layer (q, k, v, o, gate, up, down), task type
``CAUSAL_LM``, made with PEFT, A and B drawn at random so that each answers differently
(tests/lora_models.py); and, for the AWS stack, each adapter merged into a full model of its own
(PEFT's ``merge_and_unload``, then ``save_pretrained``), as a user serves a fine-tune there today.

Stacks, both running, taking turns round by round:
  ours       this server, no code: each adapter's serving.properties names ``base_model=../base``
             and ``batch_size=16``; the same adapters over a copy of the base with ``batch_size=1``
             (batching off); and the base itself as a text-generation model
  AWS HF     MMS 1.1.11 + sagemaker-huggingface-inference-toolkit 2.6.0 + transformers 4.57.6 in
             .hf-bench-venv (``benchmarks/hugging_face.py``), started in multi-model mode as
             ``benchmarks/peers/stock_stack.py`` starts the stock stack, the 8 merged models loaded
             into it. The toolkit supports MME (its ``mms_model_server`` in SAGEMAKER_MULTI_MODEL
             mode): one endpoint holding the 8 merged models, one worker each (the MME default),
             is what a user would run, cheaper than 8 single-model endpoints, which would add a
             frontend each. It has no batching to turn on.

Requests, the same for every stack: the AWS container's format (``{"inputs": ..., "parameters":
{"max_new_tokens": N, "do_sample": false}}``, answered ``[{"generated_text": ...}]``), prompts of 4
to 40 words and 16 to 64 new tokens, every 16 consecutive requests the same mix; 16 clients, each
on a kept-alive http.client connection, client ``c`` sending requests ``c``, ``c + 16``, ... to
model ``c % 8`` (request ``i`` to adapter ``i % 8``). Measured: the server tree's PSS per extra
adapter (7 loaded after the first, each LOADed and answering once); LOAD to the first token
(``max_new_tokens`` 1) of those 7, p50; then, in ``--rounds`` rounds, each configuration's req/s
(``--requests`` requests for the batched ones, ``--slow-requests`` for batching off and the AWS
stack), the median of the rounds, and each ratio as the median of the rounds' ratios (the VM's
load moves between rounds more than within one); and each answer to the first
``--slow-requests`` requests against PEFT's ``generate`` for its adapter alone (one row, no other
adapter), computed here before the servers start. Timings are never asserted; compare ratios
within one run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hf_models
import lora_models
from safetensors.torch import load_file

from benchmarks import benchlib
from benchmarks.benchlib import Server, our_server, serve, table
from benchmarks.hugging_face import HF_HANDLER, HF_PACKAGES, HF_REQUIREMENTS, HF_VENV, call, connect
from benchmarks.hugging_face_generation import workers_ready
from benchmarks.lora_adapters import adapters_memory
from benchmarks.peers.stock_stack import serve_isolated, stock_server

# hidden, layers, MLP, attention heads, key-value heads: about 128 MB of float32, and a tiny one
FULL_SHAPE = (768, 5, 2048, 12, 4)
QUICK_SHAPE = (128, 2, 256, 2, 1)
RANK = 16
ADAPTERS = 8
CLIENTS = 16
BATCHED = f"base_model=../base\nbatch_size={CLIENTS}\n"
UNBATCHED = "base_model=../base-unbatched\nbatch_size=1\n"
BASE_SERVED = f"task=text-generation\nbatch_size={CLIENTS}\n"
WORKERS_SECONDS = 120


def progress(message: str) -> None:
    print(f"[lora_generation] {message}", file=sys.stderr, flush=True)


def merged_model(base: Path, adapter: Path, directory: Path) -> Path:
    """The adapter merged into a full model of its own (PEFT's ``merge_and_unload``, then
    ``save_pretrained``: what the AWS stack serves), with the base's tokenizer."""
    lora_models.peft_causal(base, adapter).merge_and_unload().save_pretrained(str(directory))
    for path in base.iterdir():  # the tokenizer's files
        if not (directory / path.name).exists():
            os.link(path, directory / path.name)
    return directory


@dataclass(frozen=True)
class Models:
    base: Path
    adapters: list[Path]  # batch_size 16 over base/
    unbatched: list[Path]  # the same adapters, batch_size 1, over a copy of the base
    base_served: Path  # the base as a model of its own (text-generation)
    merged: list[Path]  # for the AWS stack
    adapter_mib: float  # one adapter's tensors
    merged_mib: float  # one merged model's tensors


def make_models(root: Path, shape: tuple[int, int, int, int, int], with_aws: bool) -> Models:
    from benchmarks.hugging_face import link_model

    hidden, layers, mlp, heads, kv_heads = shape
    base = hf_models.llama(root / "base", hidden, layers, mlp, heads, kv_heads)
    link_model(base, root / "base-unbatched")
    adapters, unbatched, merged = [], [], []
    for index in range(ADAPTERS):
        progress(f"adapter {index + 1} of {ADAPTERS}")
        adapter = lora_models.causal_adapter(base, root / f"adapter-{index}", index, RANK)
        # linked before the adapter has a serving.properties: each gets a file of its own
        files = {"serving.properties": UNBATCHED}
        unbatched.append(link_model(adapter, root / f"unbatched-{index}", files))
        (adapter / "serving.properties").write_text(BATCHED)
        adapters.append(adapter)
        if with_aws:
            merged.append(merged_model(base, adapter, root / f"merged-{index}"))
    served = link_model(base, root / "base-served", {"serving.properties": BASE_SERVED})

    def mib(path: Path) -> float:
        return sum(tensor.nbytes for tensor in load_file(str(path)).values()) / 2**20

    return Models(
        base,
        adapters,
        unbatched,
        served,
        merged,
        mib(adapters[0] / "adapter_model.safetensors"),
        mib(base / "model.safetensors"),
    )


def request(index: int, max_new_tokens: int | None = None) -> dict[str, Any]:
    """Request ``index``: every 16 consecutive ones hold each of 16 prompt lengths (4 to 40 words)
    and each of 16 ``max_new_tokens`` (16 to 64), paired differently from block to block."""
    step = (index * 7) % CLIENTS
    words = 4 + round(((index * 5 + index // CLIENTS) % CLIENTS) * 36 / (CLIENTS - 1))
    new = max_new_tokens or 16 + round(step * 48 / (CLIENTS - 1))
    return {
        "inputs": hf_models.text_of_tokens(words, index),
        "parameters": {"max_new_tokens": new, "do_sample": False},
    }


def references(models: Models, count: int) -> list[str]:
    """PEFT's answer to each of the first ``count`` requests, for its adapter (``i % 8``) alone, as
    the text-generation pipeline words it: the prompt, then the new tokens decoded."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(models.base))
    texts: dict[int, str] = {}
    for which, adapter in enumerate(models.adapters):
        model = lora_models.peft_causal(models.base, adapter)
        for index in range(which, count, ADAPTERS):
            body = request(index)
            prompt = tokenizer(body["inputs"])["input_ids"]
            new = lora_models.peft_generate(model, prompt, body["parameters"]["max_new_tokens"])
            texts[index] = body["inputs"] + tokenizer.decode(new, skip_special_tokens=True)
    return [texts[index] for index in range(count)]


@dataclass(frozen=True)
class Loads:
    """What the 8 models (adapters, or merged models) cost one stack."""

    mib: float  # the server tree's PSS per model after the first
    frontend_mib: float  # of which MMS's Java frontend
    first_token_ms: float  # LOAD to the first token, models after the first, p50


def load_eight(server: Server, paths: list[Path], body: bytes) -> Loads:
    """Loads ``paths`` as adapter-0 ... adapter-7, each answering ``body`` once."""
    mib, frontend_mib, seconds = adapters_memory(server, paths, ADAPTERS, body)
    return Loads(mib, frontend_mib, statistics.median(seconds[1:]) * 1000)


@dataclass(frozen=True)
class Configuration:
    label: str
    stack: str  # "ours" or "AWS"
    names: list[str]  # client c calls names[c % len(names)]
    requests: int
    connections: int  # what each of its models needs open (batching: the rows it gets)
    checked: bool  # request i goes to adapter i % 8: its answers are compared with PEFT's


def configurations(args: argparse.Namespace, adapters: bool, aws: bool) -> list[Configuration]:
    eight = [f"adapter-{index}" for index in range(ADAPTERS)]
    unbatched = [f"unbatched-{index}" for index in range(ADAPTERS)]
    made = [
        Configuration("ours, 8 adapters", "ours", eight, args.requests, 2, True),
        Configuration("ours, one adapter", "ours", ["adapter-0"], args.requests, CLIENTS, False),
        Configuration("ours, the base itself", "ours", ["base"], args.requests, CLIENTS, False),
        Configuration("ours, batching off", "ours", unbatched, args.slow_requests, 1, True),
        Configuration("AWS, 8 merged models", "AWS", eight, args.slow_requests, 1, True),
    ]
    return [c for c in made if (adapters or c.names == ["base"]) and (aws or c.stack == "ours")]


@dataclass
class Outcome:
    """One configuration's rounds: req/s of each, failures, and each request's answers (text, or
    the status of a failure)."""

    rates: list[float] = field(default_factory=list)
    failures: int = 0
    answers: dict[int, list[str | int]] = field(default_factory=dict)

    def mismatches(self, expected: list[str]) -> tuple[int, int, str]:
        """Answers unlike PEFT's, answers compared, and the first unlike one (for the log)."""
        wrong, compared, example = 0, 0, ""
        for index, answers in sorted(self.answers.items()):
            for answer in answers if index < len(expected) else ():
                compared += 1
                if answer != expected[index]:
                    wrong += 1
                    example = example or f"request {index}: {answer!r}, PEFT {expected[index]!r}"
        return wrong, compared, example


def clients(server: Server, names: Sequence[str], total: int, outcome: Outcome) -> None:
    """16 clients, client ``c`` sending requests ``c``, ``c + 16``, ... to ``names[c %
    len(names)]``; their req/s, answers and failures go to ``outcome``."""

    def client(offset: int) -> list[tuple[int, str | int]]:
        connection: http.client.HTTPConnection = connect(server)
        name, got = names[offset % len(names)], []
        for index in range(offset, total, CLIENTS):
            body = json.dumps(request(index)).encode()
            status, answer = call(connection, f"/models/{name}/invoke", body)
            got.append(
                (index, json.loads(answer)[0]["generated_text"] if status == 200 else status)
            )
        connection.close()
        return got

    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = [pair for got in pool.map(client, range(CLIENTS)) for pair in got]
    outcome.rates.append(total / (time.monotonic() - started))
    for index, answer in results:
        outcome.failures += isinstance(answer, int)
        outcome.answers.setdefault(index, []).append(answer)


def warm_up(server: Server, configuration: Configuration) -> None:
    """Two short rounds, whose overlapping requests open a batching model's connections, then a wait
    until each of its models has what it needs."""
    names = configuration.names
    bodies = [json.dumps(request(index, max_new_tokens=4)).encode() for index in range(CLIENTS)]

    def client(offset: int) -> None:
        connection = connect(server)
        for _ in range(2):
            call(connection, f"/models/{names[offset % len(names)]}/invoke", bodies[offset])
        connection.close()

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    deadline = time.monotonic() + WORKERS_SECONDS
    for name in dict.fromkeys(names):
        while (
            not workers_ready(server, name, configuration.connections)
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)


def load_ours(server: Server, models: Models, body: bytes) -> tuple[Loads | None, str]:
    """The 8 adapters (their memory and LOADs), then the same adapters with batching off and the
    base as a model; the adapters' measurements, or None and the reason the server logged."""
    from benchmarks.hugging_face import load_until_first_answer

    try:
        loads: Loads | None = load_eight(server, models.adapters, body)
    except RuntimeError as error:  # a server that does not serve adapters for generation
        logged = [line for line in server.log.read_text().splitlines() if "not served" in line]
        refused = logged[-1].split("failed ", 1)[-1] if logged else str(error)
        loads = None
    else:
        refused = ""
        for index, path in enumerate(models.unbatched):
            load_until_first_answer(server, f"unbatched-{index}", path, body)
    load_until_first_answer(server, "base", models.base_served, body)
    return loads, refused


def run(root: Path, args: argparse.Namespace) -> str:
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    progress(f"making a base of shape {shape} and {ADAPTERS} adapters")
    models = make_models(root / "models", shape, with_aws=not args.no_aws)
    progress(f"PEFT's answers to {args.slow_requests} requests, each adapter alone")
    expected = references(models, args.slow_requests)
    first_token = json.dumps(request(0, max_new_tokens=1)).encode()
    command, env, port = our_server(root / "ours")
    with ExitStack() as stack:
        servers = {"ours": stack.enter_context(serve(command, env, root / "ours", port))}
        progress("ours: LOADs and memory")
        loads, refused = load_ours(servers["ours"], models, first_token)
        if refused:
            progress(f"ours did not serve the adapters: {refused}")
        loaded = {"ours": loads}
        if not args.no_aws:
            work = root / "aws"
            command, env, port, versions = stock_server(
                work, HF_VENV, {"HF_TASK": "text-generation"}, HF_HANDLER, HF_PACKAGES
            )
            progress(f"AWS stack: {versions}")
            servers["AWS"] = stack.enter_context(serve_isolated("AWS HF", command, env, work, port))
            progress("AWS: LOADs and memory")
            loaded["AWS"] = load_eight(servers["AWS"], models.merged, first_token)
        chosen = configurations(args, loads is not None, "AWS" in servers)
        for configuration in chosen:
            progress(f"{configuration.label}: warm-up")
            warm_up(servers[configuration.stack], configuration)
        outcomes = {configuration.label: Outcome() for configuration in chosen}
        for turn in range(args.rounds):  # taking turns: a busier moment weighs on all alike
            for configuration in chosen:
                progress(f"{configuration.label}: round {turn + 1} of {args.rounds}")
                server = servers[configuration.stack]
                clients(
                    server,
                    configuration.names,
                    configuration.requests,
                    outcomes[configuration.label],
                )
    text = report(models, loaded, chosen, outcomes, expected, args)
    return text + (f"\n\nOurs did not serve the adapters: {refused}" if refused else "")


def report(
    models: Models,
    loaded: dict[str, Loads | None],
    chosen: list[Configuration],
    outcomes: dict[str, Outcome],
    expected: list[str],
    args: argparse.Namespace,
) -> str:
    rate = {label: statistics.median(outcome.rates) for label, outcome in outcomes.items()}
    eight, one = rate.get("ours, 8 adapters"), rate.get("ours, one adapter")
    off, merged = rate.get("ours, batching off"), rate.get("AWS, 8 merged models")
    ours, aws = loaded["ours"], loaded.get("AWS")

    def paired(label: str, other: str) -> str:
        """The median of the rounds' ratios: what a busier moment of the VM moves least."""
        if label not in outcomes or other not in outcomes:
            return ""
        rounds = zip(outcomes[label].rates, outcomes[other].rates, strict=True)
        return f"{statistics.median(mine / theirs for mine, theirs in rounds):.2f}x"

    def show(value: float | None, digits: int = 2, suffix: str = "") -> str:
        return "" if value is None else f"{value:.{digits}f}{suffix}"

    def ratio(mine: float | None, theirs: float | None) -> str:
        return "" if mine is None or not theirs else f"{mine / theirs:.3f}"

    memory = [None if loads is None else loads.mib for loads in (ours, aws)]
    frontend = [None if loads is None else loads.frontend_mib for loads in (ours, aws)]
    first = [None if loads is None else loads.first_token_ms for loads in (ours, aws)]
    own = models.adapter_mib
    checks: dict[str, list[str]] = {"ours": [], "AWS": []}
    for configuration in (c for c in chosen if c.checked):
        wrong, compared, example = outcomes[configuration.label].mismatches(expected)
        label = configuration.label.split(", ", 1)[1]
        checks[configuration.stack].append(f"{wrong}/{compared} ({label})")
        if example:
            progress(f"{configuration.label}, unlike PEFT's: {example}")
    failed = {s: sum(outcomes[c.label].failures for c in chosen if c.stack == s) for s in checks}
    rows = [
        [
            "a model's own tensors, MiB",
            f"{own:.2f}",
            show(None if aws is None else models.merged_mib),
            "",
            "",
        ],
        [
            f"PSS per extra adapter ({ADAPTERS - 1} after the first), MiB",
            show(memory[0]),
            show(memory[1], 1),
            ratio(memory[0], memory[1]),
            f"<= 0.02x; ours <= {1.1 * own + 2:.2f} (1.1x own + 2 MiB)",
        ],
        [
            "  of which MMS's frontend (its Java process), MiB",
            show(frontend[0]),
            show(frontend[1]),
            "",
            "",
        ],
        [
            "LOAD to first token, adapters after the first, p50, ms",
            show(first[0], 0),
            show(first[1], 0),
            ratio(first[0], first[1]),
            "<= 150",
        ],
        [
            f"{CLIENTS} clients over {ADAPTERS} adapters, req/s",
            show(eight),
            show(merged),
            paired("ours, 8 adapters", "AWS, 8 merged models"),
            ">= 3x",
        ],
        [f"{CLIENTS} clients on one adapter, req/s", show(one), "", "", ""],
        [
            f"  {ADAPTERS} adapters / one adapter",
            paired("ours, 8 adapters", "ours, one adapter"),
            "",
            "",
            ">= 0.8x",
        ],
        [
            f"{CLIENTS} clients over {ADAPTERS} adapters, batching off (batch_size=1), req/s",
            show(off),
            "",
            "",
            "",
        ],
        [
            f"  {ADAPTERS} adapters, batched / batching off",
            paired("ours, 8 adapters", "ours, batching off"),
            "",
            "",
            ">= 3x",
        ],
        [
            f"{CLIENTS} clients on the base itself (no adapter), req/s",
            show(rate.get("ours, the base itself")),
            "",
            "",
            "",
        ],
        [
            "answers unlike PEFT's generate for the adapter alone",
            ", ".join(checks["ours"]),
            ", ".join(checks["AWS"]),
            "",
            "0",
        ],
        ["failed requests", str(failed["ours"]), str(failed["AWS"]) if aws else "", "", "0"],
    ]
    hidden, layers, mlp, heads, kv_heads = QUICK_SHAPE if args.quick else FULL_SHAPE
    return "\n".join(
        [
            table(("measurement", "ours", "AWS HF, merged models", "ours/AWS", "goal"), rows),
            "",
            f"A Llama-shaped base of {models.merged_mib:.0f} MiB (hidden {hidden}, {layers} "
            f"layers, MLP {mlp}, {heads} heads over {kv_heads} key-value heads); {ADAPTERS} PEFT "
            f"LoRA adapters of rank {RANK} on q, k, v, o, gate, up and down; {CLIENTS} clients on "
            "kept-alive connections, greedy, prompts of 4 to 40 words, 16 to 64 new tokens; "
            f"{args.rounds} rounds of {args.requests} requests ({args.slow_requests} with batching "
            "off and on the AWS stack): req/s the median of the rounds, a ratio the median of the "
            "rounds' ratios. The AWS stack: one multi-model server holding "
            "each adapter merged into a model of its own, one worker each. PSS counts the whole "
            "server tree, the frontend's Java heap included.",
        ]
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks lora_generation --", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--requests", type=int, default=48, help="requests of a batched round")
    parser.add_argument(
        "--slow-requests",
        type=int,
        default=16,
        help="requests of a round with batching off and on the AWS stack; the first this many are "
        "compared with PEFT's answers",
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a tiny base, 16 requests, one round")
    parser.add_argument(
        "--no-aws", action="store_true", help="leave the AWS stack out (nothing to install)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.slow_requests, args.rounds = 16, 16, 1
    if min(args.requests, args.slow_requests) < CLIENTS or args.rounds < 1:
        parser.error(f"needs --requests and --slow-requests >= {CLIENTS}, --rounds >= 1")
    return args


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(argv)
    if not args.no_aws:
        benchlib.ensure_venv(HF_VENV, HF_REQUIREMENTS, "the AWS Hugging Face stack")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-lora-generation-") as scratch:
        print(run(Path(scratch), args))
    progress(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
