"""Profile of one invoke inside the backend: MMS's Service.predict around the handler, without the
Java frontend.

    .venv/bin/python -m benchmarks handler [-- --requests 3000]   # ours, then the AWS PyTorch
                                                                  # handler 1.5.1
    .venv/bin/python -m benchmarks handler -- --ours              # ours alone: nothing to install
    .bench-venv/bin/python -m benchmarks handler -- --stock       # the AWS handler alone, in the
                                                                  # stock stack's venv

Times --requests calls of ``mms.service.Service.predict`` on the message MMS sends for a JSON invoke
of the tiny model, after 200 untimed ones, with one torch thread as MMS's worker has. The AWS
handler can only be imported in the stock stack's venv (.bench-venv/, created on first use as for
the stock benchmark), so its calls are timed by that venv's interpreter, in a process of its own.
Prints a table of the median and p99 in microseconds; the top functions by cumulative time
(cProfile) of each go to stderr, since a profile is for reading at the terminal, not for the docs.
This module imports nothing at the top that the stock stack's venv lacks.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

STOCK_MODEL_FN = """
import torch


def model_fn(model_dir):
    return torch.jit.load(model_dir + "/model.pt", map_location="cpu")
"""


def message(body: bytes) -> list[dict[str, object]]:
    """The batch of one request as mms.protocol decodes it."""
    headers = [
        {"name": b"Content-Type", "value": b"application/json"},
        {"name": b"Accept", "value": b"application/json"},
    ]
    return [
        {
            "requestId": b"0f1e2d3c-0000-4000-8000-000000000000",
            "parameters": [{"name": "body", "contentType": "application/json", "value": body}],
            "headers": headers,
        }
    ]


STOCK_LABEL = "AWS PyTorch handler 1.5.1"
# Run by the stock stack's interpreter from the repository root: the AWS handler's timings, as JSON
# on stdout.
_STOCK_PROBE = (
    "import json, sys; from benchmarks.handler import measure; print(json.dumps(measure(True, "
    "int(sys.argv[1]))))"
)


def measure(stock: bool, requests: int) -> tuple[float, float]:
    """Median and p99, in microseconds, of ``requests`` calls of Service.predict through one handler
    (ours, or the AWS handler where it can be imported); its profile goes to stderr."""
    import model_factory
    import torch
    from mms.service import Service

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as MMS's worker does (OMP_NUM_THREADS=1) and as the warm path runs
    model_dir = model_factory.torchscript_model(Path(tempfile.mkdtemp()) / "tiny")
    if stock:
        model_factory.write_code(model_dir, STOCK_MODEL_FN)
        sys.path.insert(0, str(model_dir / "code"))
        from sagemaker_pytorch_serving_container import handler_service
    else:
        import handler_service
    service_object = handler_service.HandlerService()
    service = Service("tiny", str(model_dir), None, service_object.handle, None, 1)
    service_object.initialize(service.context)

    batch = message(json.dumps([[1.0, 2.0, 3.0, 4.0]]).encode())
    for _ in range(200):
        service.predict(batch)
    timings = []
    for _ in range(requests):
        started = time.perf_counter_ns()
        service.predict(batch)
        timings.append((time.perf_counter_ns() - started) / 1000)
    timings.sort()

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        service.predict(batch)
    profile.disable()
    print(f"{STOCK_LABEL if stock else 'ours'}:", file=sys.stderr)
    pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(12)
    # benchmarks run in one process: leave torch as the next one expects it
    torch.set_num_threads(threads)
    return statistics.median(timings), timings[int(len(timings) * 0.99)]


def measure_in_stock_venv(requests: int) -> tuple[float, float]:
    """:func:`measure` of the AWS handler, run by the stock stack's interpreter (installed first if
    need be)."""
    from benchmarks.benchlib import REPO, venv_python
    from benchmarks.peers.stock_stack import STOCK_VENV, ensure_venv

    ensure_venv()
    command = [str(venv_python(STOCK_VENV)), "-c", _STOCK_PROBE, str(requests)]
    probe = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, text=True, check=True)
    median, p99 = json.loads(probe.stdout.splitlines()[-1])
    return median, p99


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks handler --",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ours", action="store_true", help="time this project's handler alone")
    which.add_argument(
        "--stock",
        action="store_true",
        help="time the AWS handler alone, in this interpreter (the stock stack's venv)",
    )
    parser.add_argument("--requests", type=int, default=3000, help="timed calls per handler")
    args = parser.parse_args(list(argv))
    if args.requests < 1:
        parser.error("--requests must be >= 1")

    if args.stock:
        # the stock stack's venv has neither requests nor pytest: no table from benchlib here
        median, p99 = measure(True, args.requests)
        print(
            f"{STOCK_LABEL}: Service.predict median {median:.0f} us, p99 {p99:.0f} us over "
            f"{args.requests} calls"
        )
        return 0
    from benchmarks.benchlib import table

    rows: list[tuple[str, float, float]] = [("ours", *measure(False, args.requests))]
    if not args.ours:
        rows.append((STOCK_LABEL, *measure_in_stock_venv(args.requests)))
    print(
        "one JSON invoke of the tiny model through MMS's Service.predict, no Java frontend: "
        f"median and p99 of {args.requests} calls after 200 untimed, one torch thread"
    )
    print()
    print(
        table(
            ["handler", "median, us", "p99, us"],
            [[name, f"{m:.0f}", f"{p:.0f}"] for name, m, p in rows],
        )
    )
    return 0
