#!/usr/bin/env python3
"""Profile of one invoke inside the backend: MMS's Service.predict around the handler, without the Java frontend.

    .venv/bin/python scripts/bench_handler.py                    # this project's handler
    .bench-venv/bin/python scripts/bench_handler.py --stock      # the AWS PyTorch handler 1.5.1 (bench.py --setup)

Times N calls of ``mms.service.Service.predict`` on the message MMS sends for a JSON invoke of the tiny model,
and prints the median and p99 in microseconds, plus the top functions by cumulative time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stock", action="store_true", help="profile sagemaker-pytorch-inference 1.5.1")
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()

    import model_factory
    import torch
    from mms.service import Service

    torch.set_num_threads(1)  # as MMS's worker does (OMP_NUM_THREADS=1) and as the warm path runs
    model_dir = model_factory.torchscript_model(Path(tempfile.mkdtemp()) / "tiny")
    if args.stock:
        model_factory.write_code(model_dir, STOCK_MODEL_FN)
        sys.path.insert(0, str(model_dir / "code"))
        from sagemaker_pytorch_serving_container import handler_service
    else:
        import handler_service  # type: ignore[no-redef]
    service_object = handler_service.HandlerService()
    service = Service("tiny", str(model_dir), None, service_object.handle, None, 1)
    service_object.initialize(service.context)

    batch = message(json.dumps([[1.0, 2.0, 3.0, 4.0]]).encode())
    for _ in range(200):
        service.predict(batch)
    timings = []
    for _ in range(args.requests):
        started = time.perf_counter_ns()
        service.predict(batch)
        timings.append((time.perf_counter_ns() - started) / 1000)
    timings.sort()
    name = "stock (AWS PyTorch handler 1.5.1)" if args.stock else "ours"
    print(
        f"{name}: Service.predict median {statistics.median(timings):.0f} us, "
        f"p99 {timings[int(len(timings) * 0.99)]:.0f} us over {args.requests} calls"
    )

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        service.predict(batch)
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
