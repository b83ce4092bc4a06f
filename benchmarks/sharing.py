"""Weights shared across models: fine-tunes of one base, and LoRA adapters of one base, with sharing
on and off.

    .venv/bin/python -m benchmarks sharing [-- --fine-tunes 20 --adapters 50 --adapters-off 8
                                               --requests 640]

Two parts, each starting its own pair of servers (sharing on, sharing off) in one run:
``fine_tunes.py`` (memory per fine-tune that differs only in its head, hashing's cost on a 500 MB
LOAD, memory after everything is unloaded) and ``lora_adapters.py`` (memory per adapter, adapter
LOADs, 16 clients over 8 adapters against one adapter and against the same adapters unbatched). One
table; the goals are issue #27's. Timings are never asserted.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks import fine_tunes, lora_adapters
from benchmarks.benchlib import table

HEADERS = ("measurement", "sharing on", "sharing off", "on/off", "goal")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks sharing", description=__doc__.split("\n\n")[0]
    )
    fine_tunes.add_arguments(parser)
    lora_adapters.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.fine_tunes < 3 or args.large_loads < 1 or args.adapters < 8 or args.adapters_off < 2:
        parser.error(
            "needs --fine-tunes >= 3, --large-loads >= 1, --adapters >= 8 (16 clients over 8), "
            "--adapters-off >= 2"
        )
    with tempfile.TemporaryDirectory(prefix="bench-sharing-") as work:
        rows = fine_tunes.measure(Path(work), args)
        rows += lora_adapters.measure(Path(work), args)
    print(table(HEADERS, rows))
    print()
    print(
        f"{args.fine_tunes} fine-tunes of one BERT differing only in their classifier head; "
        f"{args.adapters} rank-8 LoRA adapters of one BERT with sharing on ({args.adapters_off} "
        "with it off: each holds a base of its own); 16 clients on kept-alive connections. PSS "
        "counts the whole server tree, the frontend's Java heap included."
    )
    return 0
