"""The one entry point of the benchmarks: runs them, prints their tables, and can write those into
the docs.

    .venv/bin/python -m benchmarks [NAME ...] [--write-docs [PATH]] [-- ARG ...]

    .venv/bin/python -m benchmarks                             # all nine, in the order below
                                                               # (minutes each)
    .venv/bin/python -m benchmarks stock batching              # these two
    .venv/bin/python -m benchmarks handler -- --requests 300   # one, with its own options after --
    .venv/bin/python -m benchmarks stock -- --help             # those options
    .venv/bin/python -m benchmarks pt2 --write-docs            # and its section of
                                                               # docs/benchmarks.md

NAME is one of device_host, stock, batching, pt2, preload, hugging_face, sharing, reload, handler
(none: all of these, in that order), gpu (run only when named: what scripts/gpu-proof measures on a
card), scale (run only when named: thousands of models, issue #37) or lora_generation (run only
when named: LoRA adapters decoding together, issue #36). Options after ``--`` go to the
one benchmark named. The benchmarks run in this process, one after another; each one's stdout (its
results: tables and the lines that say what they measured) is echoed and kept, its progress goes to
stderr.

--write-docs (PATH: docs/benchmarks.md) replaces what lies between ``<!-- benchmark:NAME -->`` and
``<!-- /benchmark:NAME -->`` in PATH with a line saying when and on what machine it ran, then that
output. Nothing else in the file changes. Every pair is checked before anything runs: a missing one
is an error, never appended. A benchmark that fails keeps its old section and does not stop the
others; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import platform
import re
import subprocess
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TextIO

# Name -> module with ``main(argv) -> int``; the order is the order of a full run (the quick handler
# profile last).
BENCHMARKS: dict[str, str] = {
    "device_host": "benchmarks.device_host",
    "stock": "benchmarks.stock",
    "batching": "benchmarks.batching",
    "pt2": "benchmarks.pt2",
    "preload": "benchmarks.preload",
    "hugging_face": "benchmarks.hugging_face",
    "sharing": "benchmarks.sharing",
    "reload": "benchmarks.reload",
    "handler": "benchmarks.handler",
    "gpu": "benchmarks.gpu",
    "scale": "benchmarks.scale",
    "lora_generation": "benchmarks.lora_generation",
}
# Run only when named: the GPU proof's rows (scripts/gpu-proof), which mean something on a card
# alone; scale, 2,000 models loaded and unloaded (about 10 minutes), which answers another question
# than the others; and lora_generation (about 20 minutes), generation over LoRA adapters.
WHEN_NAMED = ("gpu", "scale", "lora_generation")
DEFAULT_DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


class DocsError(Exception):
    """The docs file cannot take a benchmark's output (no such file, or its markers are missing or
    repeated)."""


class _Tee(io.StringIO):
    """Echoes what a benchmark prints and keeps a copy for the docs."""

    def __init__(self, echo: TextIO) -> None:
        super().__init__()
        self.echo = echo

    def write(self, text: str) -> int:
        self.echo.write(text)
        return super().write(text)

    def flush(self) -> None:
        self.echo.flush()

    def fileno(self) -> int:
        # for code that hands stdout to a subprocess: it writes to the terminal, uncaptured
        return self.echo.fileno()

    def isatty(self) -> bool:
        return self.echo.isatty()


@dataclass(frozen=True)
class Result:
    status: int  # 0: success
    output: str  # what it printed on stdout
    # its main returned, rather than raising (an exception, or SystemExit for --help or a bad
    # option)
    returned: bool


def run(name: str, argv: Sequence[str]) -> Result:
    """Runs one benchmark in this process, its stdout echoed and kept; any failure becomes a status,
    never a raise."""
    tee = _Tee(sys.stdout)
    saved = sys.stdout
    sys.stdout = tee
    try:
        main: Callable[[Sequence[str]], int] = importlib.import_module(BENCHMARKS[name]).main
        return Result(main(list(argv)), tee.getvalue(), returned=True)
    except SystemExit as exit_:  # argparse: --help (0) or a bad option (2)
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        return Result(code, tee.getvalue(), returned=False)
    except Exception:
        traceback.print_exc()
        return Result(1, tee.getvalue(), returned=False)
    finally:
        sys.stdout = saved


def machine_line(today: date | None = None) -> str:
    """``Run on YYYY-MM-DD on <CPU>: <cores> cores, <memory> GiB, <GPUs or "no GPU">, torch
    <version>.``"""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "(not installed)"
    when = (today or date.today()).isoformat()
    return f"Run on {when} on {_cpu()}: {cores} cores, {memory:.1f} GiB, {_gpus()}, torch {torch}."


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.partition(":")[2].split())
    except OSError:
        pass
    # ARM's cpuinfo has no model name
    return platform.processor() or platform.machine() or "an unknown CPU"


def _gpus() -> str:
    """What ``nvidia-smi -L`` lists, as "2x NVIDIA H100 80GB HBM3"; "no GPU" without it or with
    nothing listed."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "no GPU"
    lines = [line.strip() for line in listed.splitlines() if line.startswith("GPU")]
    names = Counter(re.sub(r"^GPU \d+: | \(UUID: [^)]*\)$", "", line) for line in lines)
    if not names:
        return "no GPU"
    return ", ".join(name if count == 1 else f"{count}x {name}" for name, count in names.items())


def markers(name: str) -> tuple[str, str]:
    return f"<!-- benchmark:{name} -->", f"<!-- /benchmark:{name} -->"


def _section(text: str, name: str, path: Path) -> tuple[int, int]:
    """Where the text between ``name``'s markers starts and ends."""
    opening, closing = markers(name)
    if (
        text.count(opening) != 1
        or text.count(closing) != 1
        or text.index(opening) > text.index(closing)
    ):
        raise DocsError(
            f"{path} needs exactly one {opening} ... {closing} pair, in that order, where the "
            f"{name} tables belong (the output is written between them, never appended)"
        )
    return text.index(opening) + len(opening), text.index(closing)


def _read(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as file:
            # newline="": keep the prose's line endings as they are
            return file.read()
    except OSError as error:
        raise DocsError(f"cannot read {path}: {error.strerror}") from error


def check_docs(path: Path, names: Sequence[str]) -> None:
    """Raises DocsError unless ``path`` has every marker pair ``names`` need: checked before hours
    of benchmarks."""
    text = _read(path)
    for name in names:
        _section(text, name, path)


def write_section(path: Path, name: str, heading: str, output: str) -> None:
    """Replaces what lies between ``name``'s markers in ``path`` with ``heading`` and ``output``;
    nothing else."""
    text = _read(path)
    start, end = _section(text, name, path)
    results = output.strip("\n")
    body = f"\n{heading}\n\n{results}\n"
    with open(path, "w", encoding="utf-8", newline="") as file:
        file.write(text[:start] + body + text[end:])


def parse(argv: Sequence[str]) -> tuple[list[str], Path | None, list[str]]:
    """The benchmarks to run, the docs file to write (or None) and the options for a single
    benchmark."""
    own, extra = list(argv), []
    if "--" in own:
        extra = own[own.index("--") + 1 :]
        own = own[: own.index("--")]
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        usage="%(prog)s [NAME ...] [--write-docs [PATH]] [-- ARG ...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"one of: {', '.join(BENCHMARKS)} (default: all)"
    )
    parser.add_argument(
        "--write-docs",
        nargs="?",
        const=DEFAULT_DOCS,
        type=Path,
        metavar="PATH",
        help="write each benchmark's output between its markers in PATH (default: "
        "docs/benchmarks.md)",
    )
    args = parser.parse_args(own)
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(
            f"no benchmark named {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}"
        )
    if args.write_docs is not None and str(args.write_docs) in BENCHMARKS:
        parser.error(
            f"--write-docs took {args.write_docs} for its PATH: name the benchmarks before "
            "--write-docs"
        )
    names = list(dict.fromkeys(args.names)) or [
        name for name in BENCHMARKS if name not in WHEN_NAMED
    ]
    if extra and len(names) != 1:
        parser.error("options after -- go to one benchmark: name exactly one")
    return names, args.write_docs, extra


def main(argv: Sequence[str] | None = None) -> int:
    names, docs, extra = parse(sys.argv[1:] if argv is None else argv)
    heading = ""
    if docs is not None:
        try:
            check_docs(docs, names)
        except DocsError as error:
            print(f"python -m benchmarks: {error}", file=sys.stderr)
            return 2
        heading = machine_line()
    failed: list[str] = []
    for name in names:
        print(f"## {name}\n", flush=True)  # stdout alone then reads as one Markdown document
        result = run(name, extra)
        print(flush=True)
        if result.status != 0:
            failed.append(f"{name} (exit status {result.status})")
        elif docs is not None and result.returned and result.output.strip():
            # --setup, say, has no results
            try:
                write_section(docs, name, heading, result.output)
            except DocsError as error:  # the file changed while the benchmark ran
                print(f"python -m benchmarks: {error}", file=sys.stderr)
                failed.append(f"{name} (docs not written)")
    if failed:
        print(f"python -m benchmarks: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
