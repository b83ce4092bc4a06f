"""Every snippet in the README and docs/ runs as printed (issue #22), as a reader would run it from the repository
root with the server of ``make serve`` up:

* each ``sh`` block, in page order, against a server started here the way ``make serve`` starts it (the demo model
  loaded, the model root ``.demo/models``, ``PORT`` and ``MME_METRICS_PORT`` set to free ports), one for the whole
  module as a reader keeps one up; ``curl`` fails on an HTTP error, and a block fails on its first failing command;
* each ``python`` block with the project's interpreter;
* each ``properties`` block as a model's ``serving.properties``, loaded and invoked through that server.

A block the page marks ``*Not run by the tests: <why>*`` (the line before it) is left out, and says so to the reader.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import model_factory
import pytest
from serving import RunningServer, start_server

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_RUN = "*Not run by the tests:"
RUN_LANGUAGES = ("sh", "python", "properties")
FENCE = re.compile(r"^```(\w*)\s*$")
BLOCK_SECONDS = 300
# What the pages assume of their reader's shell: strict, and curl failing on an HTTP error as a person would notice.
SHELL_PRELUDE = """set -euo pipefail
curl() { command curl --silent --show-error --fail-with-body "$@"; }
"""


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    language: str
    text: str
    runs: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    found: list[Snippet] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        before = [line for line in lines[max(0, index - 2) : index] if line.strip()]
        runs = not (before and before[-1].startswith(NOT_RUN))
        found.append(Snippet(page, index + 1, opening.group(1), "\n".join(lines[index + 1 : end]) + "\n", runs))
        index = end + 1
    return found


def _of(language: str) -> list[Snippet]:
    return [s for page in PAGES for s in snippets(page) if s.language == language and s.runs]


def _pages_with(language: str) -> list[Path]:
    return sorted({s.page for s in _of(language)})


@pytest.fixture(scope="module")
def reader_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository as a reader has it after ``make serve``: every top-level entry (links, so nothing is copied or
    written back) and a ``.demo/models`` of its own with the demo model. One for the module, as a reader keeps one:
    the blocks only add model directories, and each UNLOADs what it LOADs."""
    root = tmp_path_factory.mktemp("reader") / "checkout"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".git", ".demo"):
            (root / entry.name).symlink_to(entry)
    model_factory.torchscript_model(root / ".demo" / "models" / "demo")
    return root


@pytest.fixture(scope="module")
def demo_server(reader_checkout: Path) -> Iterator[RunningServer]:
    """One ``make serve`` server for every block of the module, as a reader runs the pages one after another."""
    models = reader_checkout / ".demo" / "models"
    env = {"MME_MODEL_ROOT": str(models), "MME_LOAD_MODELS": f"demo={models / 'demo'}"}
    with start_server(reader_checkout / ".demo", env) as server:
        yield server


def _run(snippet: Snippet, command: list[str], cwd: Path, env: dict[str, str]) -> None:
    try:
        result = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_SECONDS, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{snippet.where}: the {snippet.language} block ran past {BLOCK_SECONDS} s:\n{snippet.text}")
    if result.returncode != 0:
        pytest.fail(
            f"{snippet.where}: the {snippet.language} block failed ({result.returncode}):\n{snippet.text}\n"
            f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
        )


@pytest.mark.parametrize("page", _pages_with("sh"), ids=lambda page: page.name)
def test_shell_blocks_run_against_the_demo_server(
    page: Path, reader_checkout: Path, demo_server: RunningServer
) -> None:
    env = {
        **os.environ,
        "PORT": demo_server.url.rsplit(":", 1)[1],
        "MME_METRICS_PORT": str(demo_server.metrics_port),
    }
    for snippet in _of("sh"):
        if snippet.page == page:
            _run(snippet, ["bash", "-c", SHELL_PRELUDE + snippet.text], reader_checkout, env)


@pytest.mark.parametrize("snippet", _of("python"), ids=lambda snippet: snippet.where)
def test_python_blocks_run(snippet: Snippet, reader_checkout: Path) -> None:
    _run(snippet, [sys.executable, "-c", snippet.text], reader_checkout, dict(os.environ))


@pytest.mark.parametrize("snippet", _of("properties"), ids=lambda snippet: snippet.where)
def test_properties_blocks_load_as_a_models_serving_properties(
    snippet: Snippet, reader_checkout: Path, demo_server: RunningServer
) -> None:
    # A name and directory of its own on the module's server, unloaded after.
    name = "with-properties-" + re.sub(r"[^a-z0-9]+", "-", f"{snippet.page.stem}-{snippet.line}".lower())
    model = reader_checkout / ".demo" / "models" / name
    shutil.copytree(reader_checkout / ".demo" / "models" / "demo", model)
    (model / "serving.properties").write_text(snippet.text)
    loaded = demo_server.load(name, model)
    assert loaded.status_code == 200, f"{snippet.where}: {loaded.text}\n{demo_server.log_text()[-3000:]}"
    try:
        answered = demo_server.invoke(name, "[[1, 2, 3, 4]]")
        assert answered.status_code == 200, f"{snippet.where}: {answered.text}"
    finally:
        demo_server.unload(name)


def test_every_runnable_block_is_found_and_every_skipped_one_says_why() -> None:
    every = [s for page in PAGES for s in snippets(page)]
    assert _of("sh") and _of("properties"), "the README shows shell and serving.properties blocks"
    for snippet in every:
        if not snippet.runs:
            assert snippet.language in RUN_LANGUAGES, f"{snippet.where}: only runnable kinds need the mark"
