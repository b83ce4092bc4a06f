"""The benchmarks' entry point, ``python -m benchmarks``, with fake benchmarks: which run, what they are given, and
what --write-docs changes in a docs file (only what lies between a benchmark's markers). No server starts."""

from __future__ import annotations

import importlib
import mmap
import os
import re
import subprocess
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ is a package at the repository root, never installed
    sys.path.insert(0, str(REPO))

NAMES = ["device_host", "stock", "batching", "pt2", "preload", "hugging_face", "sharing", "reload", "handler"]
NAMED_ONLY = ["gpu", "scale", "lora_generation"]  # run only when named
# Prose around and between two marker pairs: a CRLF line, non-ASCII text and no final newline must all survive.
BEFORE = "# Benchmarks\r\n\nWhat these numbers mean \u2014 and what they do not.\n\n"
BETWEEN = "\n\nProse between the two sections.\n\n"
AFTER = "\n\nThe end, without a final newline."
MACHINE = r"Run on \d{4}-\d{2}-\d{2} on [^\n]+: \d+ cores, \d+\.\d GiB, [^\n]+, torch [^\n]+\."


@pytest.fixture
def entry() -> types.ModuleType:
    return importlib.import_module("benchmarks.__main__")


@pytest.fixture
def calls(entry: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """Replaces the registry with two fake benchmarks, ``one`` and ``two``; returns what each was called with."""
    made: list[tuple[str, list[str]]] = []

    def benchmark(name: str, result: Callable[[], int]) -> str:
        module = types.ModuleType(f"fake_benchmark_{name}")

        def main(argv: Sequence[str]) -> int:
            made.append((name, list(argv)))
            print(f"{name}: measured\n\n| metric | {name} |\n|--------|-----|\n| req/s  | 42  |")
            return result()

        module.main = main  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
        return module.__name__

    monkeypatch.setattr(entry, "BENCHMARKS", {"one": benchmark("one", lambda: 0), "two": benchmark("two", lambda: 0)})
    return made


def docs(path: Path, names: Sequence[str] = ("one", "two")) -> Path:
    sections = [f"<!-- benchmark:{name} -->\nold {name}\n<!-- /benchmark:{name} -->" for name in names]
    path.write_bytes((BEFORE + BETWEEN.join(sections) + AFTER).encode())
    return path


def section(name: str) -> str:
    table = f"\\| metric \\| {name} \\|\n\\|--------\\|-----\\|\n\\| req/s  \\| 42  \\|"
    return f"<!-- benchmark:{name} -->\n{MACHINE}\n\n{name}: measured\n\n{table}\n<!-- /benchmark:{name} -->"


def test_write_docs_replaces_only_what_lies_between_the_markers(
    entry: types.ModuleType, calls: list[tuple[str, list[str]]], tmp_path: Path
) -> None:
    path = docs(tmp_path / "benchmarks.md")

    assert entry.main(["--write-docs", str(path)]) == 0

    assert [name for name, _ in calls] == ["one", "two"]
    written = path.read_bytes().decode()
    expected = re.escape(BEFORE) + section("one") + re.escape(BETWEEN) + section("two") + re.escape(AFTER)
    assert re.fullmatch(expected, written), written
    assert written.startswith(BEFORE) and written.endswith(AFTER)  # the prose, byte for byte


def test_write_docs_leaves_the_sections_of_benchmarks_not_run(
    entry: types.ModuleType, calls: list[tuple[str, list[str]]], tmp_path: Path
) -> None:
    path = docs(tmp_path / "benchmarks.md")

    assert entry.main(["two", "--write-docs", str(path), "--", "--rounds", "1"]) == 0

    assert calls == [("two", ["--rounds", "1"])]
    one = "<!-- benchmark:one -->\nold one\n<!-- /benchmark:one -->"
    written = path.read_bytes().decode()
    assert re.fullmatch(re.escape(BEFORE + one + BETWEEN) + section("two") + re.escape(AFTER), written), written


def test_a_missing_marker_pair_fails_before_anything_runs(
    entry: types.ModuleType,
    calls: list[tuple[str, list[str]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = docs(tmp_path / "benchmarks.md", names=["one"])
    before = path.read_bytes()

    assert entry.main(["--write-docs", str(path)]) == 2

    assert "<!-- benchmark:two --> ... <!-- /benchmark:two -->" in capsys.readouterr().err
    assert calls == []
    assert path.read_bytes() == before


def test_a_failing_benchmark_keeps_its_section_and_the_others_still_run(
    entry: types.ModuleType,
    calls: list[tuple[str, list[str]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def broken(argv: Sequence[str]) -> int:
        raise RuntimeError("server exited early")

    monkeypatch.setattr(sys.modules[entry.BENCHMARKS["one"]], "main", broken)
    path = docs(tmp_path / "benchmarks.md")

    assert entry.main(["--write-docs", str(path)]) == 1

    assert [name for name, _ in calls] == ["two"]
    assert "old one" in path.read_text() and "old two" not in path.read_text()
    assert "failed: one" in capsys.readouterr().err


def test_options_after_the_separator_need_exactly_one_benchmark(
    entry: types.ModuleType, calls: list[tuple[str, list[str]]]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        entry.main(["one", "two", "--", "--rounds", "1"])
    assert exit_.value.code == 2
    assert calls == []


def test_help_lists_every_benchmark() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert all(name in listed for name in [*NAMES, *NAMED_ONLY]), listed


def test_the_registry_runs_the_nine_in_a_fixed_order_and_the_others_only_when_named(entry: types.ModuleType) -> None:
    assert list(entry.BENCHMARKS) == [*NAMES, *NAMED_ONLY]
    assert entry.parse([])[0] == NAMES
    assert entry.parse(["gpu"])[0] == ["gpu"]
    assert entry.parse(["scale"])[0] == ["scale"]


@pytest.mark.parametrize("module", [*NAMES, *NAMED_ONLY, "benchlib", "peers.stock_stack", "peers.torchserve_stack"])
def test_each_module_imports_without_starting_anything(module: str) -> None:
    children = {process.pid for process in psutil.Process().children(recursive=True)}
    imported = importlib.import_module(f"benchmarks.{module}")
    assert {process.pid for process in psutil.Process().children(recursive=True)} <= children
    if module in NAMES or module in NAMED_ONLY:
        assert callable(imported.main)


def test_shared_memory_held_but_not_mapped_counts_until_it_is_mapped() -> None:
    """benchlib adds to PSS the shared-memory files a tree holds open but does not map (PSS cannot see them); once
    mapped, their pages are PSS's to count."""
    from benchmarks.benchlib import unmapped_shared_memory_mib

    me = [psutil.Process()]
    before = unmapped_shared_memory_mib(me)
    fd = os.memfd_create("bench-test")
    try:
        os.write(fd, b"\1" * (4 << 20))
        assert unmapped_shared_memory_mib(me) - before == pytest.approx(4, abs=0.1)
        with mmap.mmap(fd, 4 << 20, mmap.MAP_SHARED, mmap.PROT_READ):
            assert unmapped_shared_memory_mib(me) == pytest.approx(before, abs=0.1)
    finally:
        os.close(fd)
    assert unmapped_shared_memory_mib(me) == pytest.approx(before, abs=0.1)
