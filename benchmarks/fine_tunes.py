"""Fine-tunes of one base that differ only in their head: their memory with weights shared and not,
what hashing costs a LOAD, and the memory left after every model is unloaded.

Part of the ``sharing`` benchmark (``benchmarks/sharing.py`` prints its table). The base is a
BERT-shaped classifier of about 100 MB (5 layers, hidden 768, random weights) saved with
``save_pretrained``, with a tokenizer of BERT's size (30,522 entries:
``hf_models.bert_sized_vocabulary``; the texts use the first 300); each of ``--fine-tunes`` copies
(real copies: other files, the same bytes) has its classifier head drawn anew. Stacks, in one run:
  sharing on    this server as it ships
  sharing off   ``MME_SHARE_WEIGHTS=false``: no tensor is hashed or held once
Both keep no package after an UNLOAD (``MME_KEEP_UNLOADED_MB=0``), so what stays after one is what
leaks. Each fine-tune must answer as itself: all of them differently (their heads differ), and the
first two as transformers computes in this process for their directories (logits, to 1e-4);
otherwise the benchmark fails.

Measured per stack: the server tree's PSS (with the shared-memory files it holds unmapped) once each
CPU device host holds a fine-tune and after the others, per extra fine-tune (the part of it in MMS's
Java frontend too); the memory with none loaded (after two fine-tunes' LOAD and UNLOAD, so both CPU
device hosts run and transformers is imported) against after the LOAD and UNLOAD of all of them; and
LOAD to the first answer of a model of about 500 MB (15 layers, hidden 1024), the median of 5 fresh
copies, each unloaded before the next (nothing held that its tensors could match), the two stacks
taking turns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

import hf_models
from safetensors.torch import load_file

from benchmarks.benchlib import BASELINE_MODELS, Server, our_server, serve
from benchmarks.hugging_face import call, connect, load_until_first_answer

TEXT = "a good movie about paris"
CHECKED = 2  # fine-tunes whose answers are compared with transformers in this process
# every label's logit: softmax saturates at 1.0 on random heads
RAW = {"top_k": None, "function_to_apply": "none"}


def progress(message: str) -> None:
    print(f"[sharing] {message}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fine-tunes", type=int, default=20, help="fine-tunes of the 100 MB base")
    parser.add_argument(
        "--large-loads", type=int, default=5, help="LOADs of the 500 MB model per stack"
    )


def head_bytes(model_dir: Path) -> int:
    """The bytes of a fine-tune's classifier, its only tensors of its own."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    return sum(tensor.nbytes for name, tensor in tensors.items() if name.startswith("classifier."))


def label_scores(answer: object) -> dict[str, float]:
    """A text classifier's answer to one text as label -> score (a logit with ``RAW``; the answer
    may come nested one list deeper)."""
    if isinstance(answer, list) and answer and isinstance(answer[0], list):
        (answer,) = answer
    assert isinstance(answer, list), answer
    return {item["label"]: item["score"] for item in answer}


def in_process(model_dir: Path) -> dict[str, float]:
    import transformers

    return label_scores(
        transformers.pipeline("text-classification", model=str(model_dir))(TEXT, **RAW)
    )


def check_answers(server: Server, names: list[str], expected: list[dict[str, float]]) -> None:
    """Raises unless every fine-tune answers differently and the first ones as ``expected`` says, to
    1e-4."""
    body = json.dumps({"inputs": TEXT, "parameters": RAW}).encode()
    answers, connection = [], connect(server)
    for name in names:
        status, answer = call(connection, f"/models/{name}/invoke", body)
        if status != 200:
            raise RuntimeError(f"INVOKE {name}: {status} {answer[:300]!r}")
        answers.append(label_scores(json.loads(answer)))
    connection.close()
    if len({tuple(sorted(scores.items())) for scores in answers}) != len(names):
        raise RuntimeError(
            f"fine-tunes with different heads answered alike: {answers}; see {server.log}"
        )
    for name, got, want in zip(names, answers, expected, strict=False):
        if got.keys() != want.keys() or any(abs(got[label] - want[label]) > 1e-4 for label in want):
            raise RuntimeError(
                f"{name} answered {got}, transformers in process {want}; see {server.log}"
            )


def linked(source: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for path in source.iterdir():
        os.link(path, dest / path.name)
    return dest


def fine_tunes_memory(
    server: Server, tunes: list[Path], body: bytes, expected: list[dict[str, float]]
) -> dict[str, float]:
    names = [f"tune-{index}" for index in range(len(tunes))]
    for index in range(BASELINE_MODELS):
        # each CPU device host started (a host stays once forked), then none left
        load_until_first_answer(server, f"warm-up-{index}", tunes[index], body)
    for index in range(BASELINE_MODELS):
        server.unload_and_wait(f"warm-up-{index}")
    empty = server.tree_memory_mib()
    # Counted once every device host holds a fine-tune (they go to the host with the fewest models):
    # each host holds the tokenizer they share once, a cost per host, not per fine-tune.
    held = BASELINE_MODELS
    for name, tune in zip(names[:held], tunes[:held], strict=True):
        load_until_first_answer(server, name, tune, body)
    first, first_frontend = server.tree_memory_mib(), server.frontend_memory_mib()
    for name, tune in zip(names[held:], tunes[held:], strict=True):
        load_until_first_answer(server, name, tune, body)
    everything, frontend = server.tree_memory_mib(), server.frontend_memory_mib()
    check_answers(server, names, expected)
    for name in names:
        server.unload_and_wait(name)
    after = server.tree_memory_mib()
    extra = len(tunes) - held
    return {
        "per_tune": (everything - first) / extra,
        "frontend_per_tune": (frontend - first_frontend) / extra,
        "empty": empty,
        "after": after,
    }


def large_loads(
    servers: dict[str, Server], large: Path, models: Path, count: int, body: bytes
) -> dict[str, float]:
    """LOAD to first answer of fresh copies of ``large``, the stacks taking turns (drift on a noisy
    machine hits both alike), each copy unloaded before the next; the median per stack, ms."""
    seconds: dict[str, list[float]] = {label: [] for label in servers}
    for index in range(count):
        for label, server in servers.items():
            copy = linked(large, models / f"large-{label}-{index}")
            seconds[label].append(load_until_first_answer(server, f"large-{index}", copy, body))
            server.unload_and_wait(f"large-{index}")
    return {label: statistics.median(values) * 1000 for label, values in seconds.items()}


def measure(work: Path, args: argparse.Namespace) -> list[list[object]]:
    """The fine-tunes' rows of the sharing table: measurement, on, off, on/off, goal."""
    models = work / "fine-tune-models"
    progress(f"making a 100 MB base, {args.fine_tunes} fine-tunes and a 500 MB model")
    base = hf_models.bert_sized_vocabulary(hf_models.bert(models / "base", hidden=768, layers=5))
    tunes = [
        hf_models.fine_tune(base, models / f"tune-{index}", index)
        for index in range(args.fine_tunes)
    ]
    large = hf_models.bert(models / "large", hidden=1024, layers=15)
    large_mb = sum(path.stat().st_size for path in large.glob("*.safetensors")) / 1e6
    body = json.dumps({"inputs": TEXT}).encode()
    expected = [in_process(tune) for tune in tunes[:CHECKED]]
    results, servers = {}, {}
    with ExitStack() as stack:
        # Nothing kept after an UNLOAD (operations.md): "after UNLOAD of everything" is then what
        # leaks, and a fresh 500 MB copy finds no kept package whose tensors it could share.
        stacks = (("on", {}), ("off", {"MME_SHARE_WEIGHTS": "false"}))
        for label, env in stacks:
            env = {**env, "MME_KEEP_UNLOADED_MB": "0"}
            command, full_env, port = our_server(work / f"tunes-{label}", env)
            servers[label] = stack.enter_context(
                serve(command, full_env, work / f"tunes-{label}", port)
            )
            progress(f"sharing {label}: {args.fine_tunes} fine-tunes")
            results[label] = fine_tunes_memory(servers[label], tunes, body, expected)
        progress(f"{args.large_loads} LOADs of the {large_mb:.0f} MB model on each stack, in turns")
        for label, median in large_loads(servers, large, models, args.large_loads, body).items():
            results[label]["large"] = median
    on, off = results["on"], results["off"]

    def returned(row: dict[str, float]) -> str:
        extra = row["after"] - row["empty"]
        return f"{extra:+.1f} ({'within' if extra <= 0.02 * row['empty'] + 16 else 'beyond'})"

    head_mib = head_bytes(tunes[0]) / 2**20
    return [
        ["head of a fine-tune, MiB", f"{head_mib:.3f}", f"{head_mib:.3f}", "", ""],
        [
            f"PSS per extra fine-tune ({args.fine_tunes} of a 100 MB BERT), MiB",
            f"{on['per_tune']:.1f}",
            f"{off['per_tune']:.1f}",
            f"{on['per_tune'] / off['per_tune']:.3f}",
            f"<= {head_mib + 2:.2f} (head + 2 MiB)",
        ],
        [
            "  of which MMS's frontend (its Java process), MiB",
            f"{on['frontend_per_tune']:.2f}",
            f"{off['frontend_per_tune']:.2f}",
            "",
            "",
        ],
        [
            f"LOAD to first answer, {large_mb:.0f} MB model, median of {args.large_loads}, ms",
            f"{on['large']:.0f}",
            f"{off['large']:.0f}",
            f"{on['large'] / off['large']:.3f}",
            "<= 1.05 (hashing)",
        ],
        ["memory with no model, MiB", f"{on['empty']:.0f}", f"{off['empty']:.0f}", "", ""],
        [
            "after UNLOAD of everything, MiB more than with no model",
            returned(on),
            returned(off),
            "",
            "within 2% + 16 MiB",
        ],
    ]
