"""serving.properties: a model's batching settings over the container's defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models.serving_properties import KNOWN_KEYS, read_settings


def test_without_a_file_the_container_defaults_apply(tmp_path: Path) -> None:
    settings = read_settings(tmp_path, Config.from_env({"MME_BATCH_SIZE": "4", "MME_MAX_BATCH_DELAY_MS": "7"}))
    assert (settings.batch_size, settings.max_batch_delay_ms, settings.source) == (4, 7, "MME_BATCH_SIZE")
    assert read_settings(tmp_path, Config.from_env({})).batching is False


def test_the_file_wins_over_the_defaults_and_load_wins_over_the_file(tmp_path: Path) -> None:
    (tmp_path / "serving.properties").write_text("# comment\n\nbatch_size = 16\nmax_batch_delay=25\nengine=Python\n")
    settings = read_settings(tmp_path, Config.from_env({"MME_BATCH_SIZE": "4"}))
    assert (settings.batch_size, settings.max_batch_delay_ms, settings.source) == (16, 25, "serving.properties")
    assert settings.with_load_batch_size(1) == settings  # MMS sends 1 when LOAD had no batch_size
    assert settings.with_load_batch_size(32).batch_size == 32


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        ("batch_size=1.5\n", "is not an integer"),
        ("batch_size=5000\n", "must be at least 1 and at most 1024"),
        ("max_batch_delay=100000\n", "at most 60000"),
        ("batch_size=2\nbatch_size=4\n", "line 2: batch_size is set twice"),
        ("=3\n", "line 1: '=3' is not key=value"),
        ("compile=maybe\n", "compile='maybe' is not a boolean"),
        ("compile=true\ncompile_mode=fastest\n", "compile_mode='fastest' must be one of default, max-autotune"),
        ("max_concurrency=0\n", "max_concurrency='0' must be at least 1 and at most 256"),
        ("isolation=container\n", "isolation='container' must be one of shared, process"),
        ("batch_size=16   # at most\n", "line 1: batch_size='16   # at most': a comment must be on a line of its own"),
    ],
)
def test_a_malformed_file_names_the_cause(tmp_path: Path, text: str, cause: str) -> None:
    (tmp_path / "serving.properties").write_text(text)
    with pytest.raises(ModelLoadError, match=cause):
        read_settings(tmp_path, Config.from_env({}))


def test_compile_settings_are_read_with_their_mode(tmp_path: Path) -> None:
    (tmp_path / "serving.properties").write_text("compile=true\ncompile_mode=max-autotune\n")
    settings = read_settings(tmp_path, Config.from_env({}))
    assert (settings.compile, settings.compile_mode, settings.batching) == (True, "max-autotune", False)


def test_concurrency_defaults_to_parallel_unbatched_and_one_pass_when_batching(tmp_path: Path) -> None:
    assert read_settings(tmp_path, Config()).concurrency == 4
    assert read_settings(tmp_path, Config(batch_size=8)).concurrency == 1
    assert read_settings(tmp_path, Config(max_concurrency=2)).concurrency == 2
    (tmp_path / "serving.properties").write_text("max_concurrency=6\nisolation=process\n")
    settings = read_settings(tmp_path, Config(max_concurrency=2, batch_size=8))
    assert (settings.concurrency, settings.isolation) == (6, "process")


def test_every_properties_block_in_the_readme_reads_as_a_serving_properties_file(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    blocks = [block for page in pages for block in re.findall(r"```properties\n(.*?)```", page.read_text(), re.DOTALL)]
    assert blocks
    for block in blocks:
        (tmp_path / "serving.properties").write_text(block)
        read_settings(tmp_path, Config())  # raises, naming the line, on anything the server would refuse


def test_the_docs_table_of_every_key_lists_each_key_the_server_reads() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "batching.md").read_text()
    section = page.split("\n## serving.properties\n", 1)[1].split("\n## ", 1)[0]
    assert sorted(re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE)) == sorted(KNOWN_KEYS)
